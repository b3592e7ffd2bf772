#!/bin/bash
# DAYS- alone is a number of days.
#SBATCH --time=5-
hostname
