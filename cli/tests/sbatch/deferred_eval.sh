#!/bin/bash
# A nightly evaluation: starts after 02:00, four A100s with 80 GB of host memory each.
#SBATCH --job-name=nightly-eval
#SBATCH --begin=2030-01-01T02:00
#SBATCH --gpus-per-node=a100:4 --mem-per-gpu=80G
#SBATCH --comment="nightly regression eval"
python eval.py --suite nightly
