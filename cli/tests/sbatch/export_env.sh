#!/bin/bash
#SBATCH --export=NONE,FOO=bar,HOME
#SBATCH --chdir=/scratch/run1
env
