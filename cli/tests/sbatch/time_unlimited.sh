#!/bin/bash
# UNLIMITED (any case), INFINITE, -1 and 0 mean no time limit: Gangway's longest.
#SBATCH --time=unlimited
hostname
