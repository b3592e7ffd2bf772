#!/bin/bash
#SBATCH --job-name="unterminated
hostname
