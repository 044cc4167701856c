#!/usr/bin/env bash
# Grade a class as a Slurm job array, one shard of the students per array task, then merge.
#
#   export AUTOGRADE_SEED=...          # the term's secret seed: every shard must draw the same hidden tests
#   submitted=submitted out=grades shards=8
#   mkdir -p "$out"
#   jid=$(sbatch --parsable --array=1-$shards --output="$out/autograde-%A_%a.log" \
#         autograde/deploy/slurm-array.sh "$submitted" "$out")
#   sbatch --dependency=afterany:$jid --job-name=autograde-merge --cpus-per-task=1 --time=00:15:00 \
#         --output="$out/autograde-merge-%j.log" autograde/deploy/slurm-array.sh --merge "$out"
#
# Run from the course's folder, with its virtual environment active. Each task grades
# --cpus-per-task notebooks at once (1 here: `sbatch --cpus-per-task=4 ...` for more). The shard
# count is the array's last index; to grade some shards again (a task that failed or was
# cancelled), say how many there are: `SHARDS=$shards sbatch --array=3 ...` with the rest of the
# command as above. The merge waits for every task, however each ended, and refuses until every
# shard has finished: submit the same merge command again once they have. A task that is
# requeued (preemption, `scontrol requeue`) resumes its shard with --resume: a notebook it was
# grading when stopped is graded again, never recorded half done; its log goes on in the same
# file. Isolation: on nodes where the job runs as an ordinary user, the grader's sandbox needs
# unprivileged user namespaces (see autograde/THREAT_MODEL.md).
#SBATCH --job-name=autograde
#SBATCH --cpus-per-task=1
#SBATCH --time=02:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
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
if [ -z "${SHARDS:-}" ] && [ "${SLURM_ARRAY_TASK_MIN:-1}" != 1 ]; then
    echo "--array=${SLURM_ARRAY_TASK_MIN}-${SLURM_ARRAY_TASK_MAX}: grading some shards again, set SHARDS" \
         "to their number (SHARDS=N sbatch --array=...)" >&2
    exit 2
fi
count=${SHARDS:-${SLURM_ARRAY_TASK_MAX:?submit as a job array: sbatch --array=1-N}}
exec "$PYTHON" -m autograde grade "$submitted" --out "$out/shard-$shard" --shard "$shard/$count" \
    --jobs "${SLURM_CPUS_PER_TASK:-1}" --resume
