#!/bin/bash
# A time limit of 0 is no limit, as in Slurm.
#SBATCH --time=00:00:00
hostname
