#!/bin/bash
# --hold (like --test-only, --wait) is the whole job's: not a component's.
#SBATCH -N1
#SBATCH hetjob
#SBATCH -N2 --hold
hostname
