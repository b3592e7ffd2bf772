#!/bin/bash
# Slurm's sizes take a B after the unit, in either case: 32GB is 32G.
#SBATCH --mem=32GB
hostname
