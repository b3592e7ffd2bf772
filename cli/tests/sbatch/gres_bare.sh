#!/bin/bash
# --gres=gpu asks for one GPU per node; gres/ before the name is allowed.
#SBATCH --gres=gres/gpu
hostname
