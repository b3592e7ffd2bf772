#!/bin/bash
#SBATCH --ntask=4
hostname
