#!/bin/bash
# A component's node count is fixed.
#SBATCH -N1
#SBATCH hetjob
#SBATCH -N 2-4
hostname
