#!/bin/bash
# The next component's options go on the lines after the hetjob line.
#SBATCH -N1
#SBATCH hetjob -N2
hostname
