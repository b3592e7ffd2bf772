#!/bin/bash
# A later component may repeat a job-wide option, not change it.
#SBATCH -N 1 -t 1:00:00
#SBATCH packjob
#SBATCH -N 2 -t 2:00:00
hostname
