#!/bin/bash
#SBATCH -N1
hostname
