#!/bin/bash
#SBATCH --nodes=1
#SBATCH --time=10:00
echo "generating a follow-up job"
cat > next.sh <<'INNER'
#!/bin/bash
#SBATCH --nodes=100
#SBATCH --partitoin=ignored-because-not-a-directive
INNER
#SBATCH --exclusive
sbatch next.sh
