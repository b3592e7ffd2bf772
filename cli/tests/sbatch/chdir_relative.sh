#!/bin/bash
# A relative --chdir is under the submit directory.
#SBATCH -D results/run1
hostname
