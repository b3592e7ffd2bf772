#!/bin/bash
#SBATCH --nodes=2
#SBATCH --partitoin=gpu
srun hostname
