#!/bin/bash
#SBATCH --priority=-5
hostname
