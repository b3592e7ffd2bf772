#!/bin/bash
# A directive is any line starting with #SBATCH, with or without a blank after it;
# the old #SLURM prefix is applied too, with a notice.
#SBATCH--time=5
#SLURM --job-name=old-style
hostname
