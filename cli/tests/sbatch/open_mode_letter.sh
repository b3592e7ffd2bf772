#!/bin/bash
# --open-mode reads its first letter, in either case (sbatch truncates by default).
#SBATCH --open-mode=A
hostname
