#!/bin/bash
# A Torque script from a site moving over: sbatch reads its #PBS lines.
#PBS -N md-run
#PBS -l nodes=2:ppn=4,walltime=02:00:00,mem=8gb
#PBS -q batch
#PBS -A chem-lab
#PBS -j oe
#PBS -m ae
#PBS -o logs/md.out
#PBS -V
cd "$PBS_O_WORKDIR"
mpirun ./md
