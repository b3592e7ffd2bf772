#!/bin/bash
# A generic resource other than GPUs is refused, never misread as a GPU type.
#SBATCH --gres=gpu:2,shard:1
hostname
