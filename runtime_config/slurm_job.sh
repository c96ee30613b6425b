#!/usr/bin/env bash
# Example: an hpoflow study as a COMPSs application on a SLURM cluster.
#
# enqueue_compss writes its own SLURM job script and COMPSs XML, so this file is a *submission*
# script, run on the login node (not with sbatch):   bash runtime_config/slurm_job.sh
# `hpoflow launch SPEC --engine compss --nodes N ... --dry-run` prints the same command for your spec.
#
# Nodes: one node runs the COMPSs master (no trials by default), the others run trials, so a study
# whose trials span resources.nodes=2 needs NUM_NODES >= 3. Keep the run directory on the shared
# file system (results, reports and STOP files travel through it).
#
# enqueue_compss pastes these values into the job script it generates, unquoted: the quotes below
# do not survive it. Paths and names here must hold only letters, digits and . _ - / + , : = @ %;
# `hpoflow launch` checks that, and encodes a spec path or run directory that does not qualify
# (docs/cluster.md, "Arguments and COMPSs"). Add --sc_cfg=<your site> where COMPSs is installed
# with its generic config (LSF, no --qos).
set -euo pipefail

SPEC=${SPEC:-examples/digits.yaml}
RUN_DIR=${RUN_DIR:-$PWD/runs/digits-cnn}
NUM_NODES=${NUM_NODES:-3}
CPUS_PER_NODE=${CPUS_PER_NODE:-48}
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
EXEC_TIME=${EXEC_TIME:-60}          # minutes
QOS=${QOS:-debug}
REPO=$(cd "$(dirname "$0")/.." && pwd)

module load COMPSs                   # site specific: the COMPSs 3.x module
# source /path/to/venv/bin/activate  # the environment with torch (CUDA build) and hpoflow

enqueue_compss \
  --job_name=hpoflow \
  --num_nodes="$NUM_NODES" \
  --cpus_per_node="$CPUS_PER_NODE" \
  --gpus_per_node="$GPUS_PER_NODE" \
  --exec_time="$EXEC_TIME" \
  --qos="$QOS" \
  --lang=python \
  --python_interpreter="$(command -v python3)" \
  --log_level=off \
  --pythonpath="$REPO" \
  "$REPO/workflows/hpo.py" "$(realpath "$SPEC")" --run-dir "$RUN_DIR"
