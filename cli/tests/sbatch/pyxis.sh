#!/bin/bash
#SBATCH --nodes=2
#SBATCH --gpus-per-node=8
#SBATCH --container-image=nvcr.io#nvidia/pytorch:24.05-py3
srun python train.py
