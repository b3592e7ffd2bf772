#!/bin/bash
# #SBATCHED makes ED an argument of the directive: refused, as sbatch refuses it.
#SBATCHED a note
hostname
