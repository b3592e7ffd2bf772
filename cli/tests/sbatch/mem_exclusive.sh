#!/bin/bash
# --mem and --mem-per-cpu are mutually exclusive in Slurm.
#SBATCH --mem=4G --mem-per-cpu=1gb
hostname
