#!/bin/bash
# ALL anywhere in --export; a quoted value keeps its commas (the directive's own
# quotes are the shell's: the inner ones reach --export).
#SBATCH --export='FOO="a,b"',ALL
hostname
