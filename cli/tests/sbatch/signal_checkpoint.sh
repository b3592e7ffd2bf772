#!/bin/bash
#SBATCH --job-name=resumable
#SBATCH --nodes=2 --ntasks-per-node=8 --gpus-per-task=1
#SBATCH --signal=B:USR1@90
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --time=120:00:00
#SBATCH --qos=high

checkpoint() { echo "checkpointing"; kill -USR1 "$TRAIN_PID"; wait "$TRAIN_PID"; scontrol requeue "$SLURM_JOB_ID"; }
trap checkpoint USR1
srun python train.py --resume-latest &
TRAIN_PID=$!
wait "$TRAIN_PID"
