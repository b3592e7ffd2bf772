#!/bin/bash
# Slurm's time limits are whole minutes: 0:30 (MM:SS) rounds up to one.
#SBATCH --time=0:30 --time-min=0:10
hostname
