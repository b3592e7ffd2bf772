#!/bin/bash
#SBATCH --nodes=1 --gpus-per-node=8
#SBATCH hetjob
#SBATCH --nodes=4 --cpus-per-task=32
srun --het-group=0,1 ./coupled_app
