#!/bin/bash
# PBS Pro's chunks: 4 nodes, 4 MPI ranks each, 16 CPUs a node (4 per rank).
#PBS -l select=4:ncpus=16:mpiprocs=4
#PBS -l walltime=12:00:00
#PBS -J 0-9
#PBS -W depend=afterok:7
python train.py --shard "$PBS_ARRAY_INDEX"
