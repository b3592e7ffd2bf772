#!/bin/bash
# Slurm's TOP: the highest priority an admin can give.
#SBATCH --priority=top
hostname
