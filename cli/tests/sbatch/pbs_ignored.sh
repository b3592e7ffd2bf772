#!/bin/bash
# --ignore-pbs: the #PBS lines are comments.
# test-args: --ignore-pbs SCRIPT
#PBS -N not-read
#PBS -l nodes=9
hostname
