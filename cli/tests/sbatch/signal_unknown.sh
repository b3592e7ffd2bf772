#!/bin/bash
# Only the signals Slurm names.
#SBATCH --signal=WINCH@60
hostname
