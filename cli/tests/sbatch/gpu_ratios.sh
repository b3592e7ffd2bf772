#!/bin/bash
# A fine-tuning job sized per GPU, with a flexible time limit.
#SBATCH --job-name=finetune
#SBATCH --nodes=1 --ntasks-per-node=2
#SBATCH --gpus-per-node=h100:4
#SBATCH --cpus-per-gpu=6
#SBATCH --mem-per-gpu=80G
#SBATCH --time=12:00:00 --time-min=2:00:00
#SBATCH --output=logs/%x-%j.out

srun python finetune.py --config configs/lora.yaml
