#!/bin/sh
# Evaluate after both training shards succeed; only one eval of this name at a time.
#SBATCH --job-name=eval
#SBATCH --dependency=afterok:1234:1235,singleton
#SBATCH --kill-on-invalid-dep=yes
#SBATCH --gpus=1
#SBATCH --time=30

python eval.py --ckpt "checkpoints/$1"
