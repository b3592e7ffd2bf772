#!/bin/bash
# A list of partitions is not supported yet: said, not misread as one name.
#SBATCH -p gpu,cpu
hostname
