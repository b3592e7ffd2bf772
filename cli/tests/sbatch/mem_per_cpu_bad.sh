#!/bin/bash
# A bad --mem-per-cpu is named as such.
#SBATCH --mem-per-cpu=lots
hostname
