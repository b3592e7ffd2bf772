#!/bin/bash
# test-args: -N 1 --time=10 -p debug SCRIPT extra-arg --not-an-option
#SBATCH -N 4
#SBATCH -t 60
#SBATCH -p gpu
echo "args: $@"
