#!/bin/bash
# --gres=gpu:TYPE asks for one GPU of that type per node.
#SBATCH --gres=gpu:a100
hostname
