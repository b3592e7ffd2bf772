#!/bin/bash
# A pretraining run in a reservation, with tracker seats, a deadline and a
# shorter acceptable limit.
#SBATCH --reservation=pretrain --licenses=wandb:2,matlab
#SBATCH --deadline=2027-01-01T00:00:00 --time=1-00:00:00 --time-min=12:00:00
#SBATCH -N 2 --gpus-per-node=8 --requeue=expedite
srun python train.py
