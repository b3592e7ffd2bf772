#!/bin/bash
# An LSF script: #BSUB lines, and #PBS ignored when #BSUB is there.
#BSUB -J lsf-job
#BSUB -n 2,8
#BSUB -W 45
#BSUB -o out.%J
#BSUB -q short
#BSUB -x
#PBS -N not-this-one
./run.sh
