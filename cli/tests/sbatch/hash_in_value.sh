#!/bin/bash
# An unquoted # starts a comment, inside a word too; a quoted one does not.
#SBATCH --job-name=run#3 --comment="issue #42"
hostname
