#!/bin/bash
# test-args: -N1 -p gpu --gpus-per-node=1 : -N2 -c 4 SCRIPT arg1
# Components on the command line, separated by ':' (the script argument stays the job's).
hostname
