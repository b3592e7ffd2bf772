#!/bin/bash
# SBATCH_* variables override directives; the command line overrides them.
# test-env: SBATCH_ACCOUNT=ml SBATCH_TIMELIMIT=30 SBATCH_EXCLUSIVE=
# test-args: --time=10 SCRIPT
#SBATCH --account=other --time=60
hostname
