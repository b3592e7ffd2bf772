#!/bin/bash
# An RLHF recipe's heterogeneous job: a reward model on one GPU node, the
# actor on two; the account and time repeat, the partition carries over.
#SBATCH --job-name=rlhf -A ml -t 4:00:00 -p gpu
#SBATCH -N 1 --gpus-per-node=8 --ntasks-per-node=1
#SBATCH hetjob
#SBATCH -N 2 --gpus-per-node=8 --ntasks-per-node=8 -A ml -t 4:00:00
srun --het-group=0 python reward.py &
srun --het-group=1 python actor.py
