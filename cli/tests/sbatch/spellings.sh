#!/bin/bash
# Options spelled every way sbatch accepts them.
#SBATCH -N2 --ntasks-per-node 4
#SBATCH --tasks=8   # a prefix of --tasks-per-node (per node)
#SBATCH --job-name="my job" --err=errors-%j.txt
#SBATCH --time 1-12   # days-hours
#SBATCH --cpus-per-t=4
#SBATCH -G a100:16
#SBATCH --constraint=ib&arch=zen4
#SBATCH --nice
#SBATCH --hold --parsable --open-m=truncate
#SBATCH--comment=no-blank   # applied: any line starting with #SBATCH is a directive

hostname
