#!/bin/bash
# A #PBS line sbatch cannot read is refused, naming it.
#PBS -N ok
#PBS -Y nope
hostname
