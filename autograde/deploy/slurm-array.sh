#!/usr/bin/env bash
# Grade a class as a Slurm job array, one shard of the students per array task, then merge.
#
#   export AUTOGRADE_SEED=...          # the term's secret seed: every shard must draw the same hidden tests
#   jid=$(sbatch --parsable --array=1-8 autograde/deploy/slurm-array.sh submitted grades)
#   sbatch --dependency=afterok:$jid autograde/deploy/slurm-array.sh --merge grades
#
# Run from the course's folder, with its virtual environment active. A task that is requeued
# resumes its shard (--resume). Isolation: on nodes where the job runs as an ordinary user, the
# grader's sandbox needs unprivileged user namespaces (see autograde/THREAT_MODEL.md).
#SBATCH --job-name=autograde
#SBATCH --cpus-per-task=4
#SBATCH --time=02:00:00
#SBATCH --output=autograde-%A_%a.log
set -euo pipefail
PYTHON=${PYTHON:-python}

if [ "${1:-}" = "--merge" ]; then
    out=${2:?usage: slurm-array.sh --merge OUT}
    exec "$PYTHON" -m autograde merge "$out"/shard-* --out "$out/class"
fi

submitted=${1:?usage: slurm-array.sh SUBMITTED OUT}
out=${2:?usage: slurm-array.sh SUBMITTED OUT}
: "${AUTOGRADE_SEED:?set AUTOGRADE_SEED: every shard must grade with the same seed}"
shard=${SLURM_ARRAY_TASK_ID:?submit as a job array: sbatch --array=1-N}
count=${SLURM_ARRAY_TASK_COUNT:?submit as a job array: sbatch --array=1-N}
exec "$PYTHON" -m autograde grade "$submitted" --out "$out/shard-$shard" --shard "$shard/$count" \
    --jobs "${SLURM_CPUS_PER_TASK:-1}" --resume
