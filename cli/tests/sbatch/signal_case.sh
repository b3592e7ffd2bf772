#!/bin/bash
# Signal names and the B: flag in any case.
#SBATCH --signal=b:usr1@30
hostname
