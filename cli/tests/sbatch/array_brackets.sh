#!/bin/bash
# Array indexes in brackets; %0 is no throttle.
#SBATCH --array=[0-9]%0
hostname
