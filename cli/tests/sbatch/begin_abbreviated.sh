#!/bin/bash
# Slurm's offsets spell their unit out (now+1hour): now+1h is refused.
#SBATCH --begin=now+1h
hostname
