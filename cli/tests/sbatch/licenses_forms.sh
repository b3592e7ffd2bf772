#!/bin/bash
# Licenses with = as well as :, separated by ; as well as ,; a count of 0 is dropped.
#SBATCH -L "matlab=2;wandb,fluent:0"
hostname
