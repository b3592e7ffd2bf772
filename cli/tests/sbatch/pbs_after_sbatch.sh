#!/bin/bash
# #PBS options apply after the #SBATCH ones (as in sbatch); the command line wins over both.
# test-args: -t 10 SCRIPT
#SBATCH -J from-sbatch
#SBATCH -t 5
#PBS -N from-pbs
#PBS -l walltime=1:00:00
hostname
