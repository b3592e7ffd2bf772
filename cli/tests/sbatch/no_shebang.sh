#SBATCH -N1
# Slurm refuses a script whose first line is not #! followed by an interpreter.
hostname
