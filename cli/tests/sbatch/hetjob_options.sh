#!/bin/bash
# test-args: -N1 : --part=cpu -N2 SCRIPT a : -v
# A later component's options are read as the first's (--part is --partition);
# a ':' after the script is its argument, not a separator.
hostname
