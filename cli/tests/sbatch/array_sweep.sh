#!/bin/bash
#SBATCH -J lr-sweep
#SBATCH -a 0-99:2%8
#SBATCH -o logs/sweep_%A_%a.out
#SBATCH -e logs/sweep_%A_%a.err
#SBATCH --gres=gpu:1
#SBATCH -c 8 --mem-per-cpu=4G
#SBATCH -t 4:00:00
#SBATCH -p gpu -A ml-research

LRS=(1e-5 3e-5 1e-4 3e-4)
python sweep.py --lr "${LRS[$((SLURM_ARRAY_TASK_ID % 4))]}" --seed "$SLURM_ARRAY_TASK_ID"
