#!/bin/bash
# --mail-type has no effect here, but a value Slurm refuses is refused.
#SBATCH --mail-type=WHENEVER
hostname
