#!/bin/bash
# Slurm's MM/DD/YY date with a time after it.
#SBATCH --begin=12/24/30-08:00
hostname
