#!/bin/bash
#SBATCH --mail-type=END,FAIL
#SBATCH --mail-user=alice@example.org
#SBATCH --hint=nomultithread --gpu-bind=closest
#SBATCH --wait-all-nodes=1
#SBATCH --comment "ablation 3"
#SBATCH -n 16
./run_all.sh
