#!/bin/bash
# Dependency types in any case; a bare job id means afterany.
#SBATCH --dependency=afterOK:12:14,13
hostname
