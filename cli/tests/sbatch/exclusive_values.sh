#!/bin/bash
# --exclusive=exclusive is the bare flag; a value Slurm does not know is refused.
#SBATCH --exclusive=exclusive
hostname
