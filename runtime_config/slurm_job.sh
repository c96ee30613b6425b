#!/usr/bin/env bash
# Example: an hpoflow study as a COMPSs application on a SLURM cluster.
#
# enqueue_compss writes its own SLURM job script and COMPSs XML, so this file is a *submission*
# script, run on the login node (not with sbatch):   SPEC=my.yaml bash runtime_config/slurm_job.sh
# `hpoflow launch SPEC --engine compss --nodes N ... --dry-run` prints the same command for your spec
# and also checks the site config (docs/cluster.md, B2).
#
# Nodes: one node runs the COMPSs master (no trials by default), the others run trials, so a study
# whose trials span resources.nodes=2 needs NUM_NODES >= 3. Keep the run directory on the shared
# file system (results, reports and STOP files travel through it).
#
# Quoting: enqueue_compss pastes its arguments into the job script it generates, unquoted, so no
# quoting survives it. SPEC and RUN_DIR are therefore passed encoded (b64:... when they hold anything
# but letters, digits and . _ - / + , : = @ %; workflows/hpo.py decodes them), and every value
# enqueue_compss or SLURM reads itself (PYTHON, REPO, SC_CFG, QOS, ACCOUNT) is checked to hold only
# those characters before anything is submitted.
#
# Site config: enqueue_compss reads SC_CFG (a name from $COMPSS_HOME/Runtime/scripts/queues/
# supercomputers/ or a file). COMPSs's generic default.cfg is written for LSF and drops --qos and
# --project_name, so QOS and ACCOUNT are refused without SC_CFG: pass your site's config, one that
# sets QUEUE_SYSTEM="slurm" (and ENABLE_PROJECT_NAME=true for ACCOUNT, DISABLE_QARG_QOS=false for QOS).
set -euo pipefail

SPEC=${SPEC:-examples/digits.yaml}
RUN_DIR=${RUN_DIR:-$PWD/runs/digits-cnn}
NUM_NODES=${NUM_NODES:-3}
CPUS_PER_NODE=${CPUS_PER_NODE:-48}
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
EXEC_TIME=${EXEC_TIME:-60}          # minutes
SC_CFG=${SC_CFG:-}                  # your site's enqueue_compss config: needed for QOS and ACCOUNT
QOS=${QOS:-}
ACCOUNT=${ACCOUNT:-}
COMPSS_MODULE=${COMPSS_MODULE-COMPSs}  # site specific: the COMPSs 3.x module ("" when COMPSs is on PATH)
REPO=${REPO:-$(cd "$(dirname "$0")/.." && pwd)}

if [ -n "$COMPSS_MODULE" ] && command -v module >/dev/null 2>&1; then
  module load "$COMPSS_MODULE"
fi
# source /path/to/venv/bin/activate  # the environment with torch (CUDA build) and hpoflow
PYTHON=${PYTHON:-$(command -v python3)}

if { [ -n "$QOS" ] || [ -n "$ACCOUNT" ]; } && [ -z "$SC_CFG" ]; then
  echo "slurm_job.sh: error: QOS and ACCOUNT need SC_CFG: without it enqueue_compss reads COMPSs's default.cfg," \
       "which drops --qos and --project_name (and is written for LSF). Fix: SC_CFG=<your site's config>" >&2
  exit 2
fi

codec=(env "PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m hpoflow.engines.compss.launch.command)
"${codec[@]}" check "PYTHON=$PYTHON" "REPO=$REPO" "SC_CFG=$SC_CFG" "QOS=$QOS" "ACCOUNT=$ACCOUNT"
SPEC_ARG=$("${codec[@]}" encode "$(realpath "$SPEC")")
RUN_DIR_ARG=$("${codec[@]}" encode "$(realpath -m "$RUN_DIR")")

submit=(--job_name=hpoflow --num_nodes="$NUM_NODES" --cpus_per_node="$CPUS_PER_NODE"
        --gpus_per_node="$GPUS_PER_NODE" --exec_time="$EXEC_TIME")
if [ -n "$SC_CFG" ]; then submit=(--sc_cfg="$SC_CFG" "${submit[@]}"); fi
if [ -n "$QOS" ]; then submit+=(--qos="$QOS"); fi
if [ -n "$ACCOUNT" ]; then submit+=(--project_name="$ACCOUNT"); fi

# --cpus-per-node/--gpus-per-node tell the workflow what each worker holds: every node of a multi-node
# trial then asks COMPSs for a whole worker (two nodes of a trial never share a host), and elastic
# trials never grow past one worker
enqueue_compss "${submit[@]}" \
  --lang=python \
  --python_interpreter="$PYTHON" \
  --log_level=off \
  --pythonpath="$REPO" \
  "$REPO/workflows/hpo.py" "$SPEC_ARG" --run-dir "$RUN_DIR_ARG" \
  --cpus-per-node "$CPUS_PER_NODE" --gpus-per-node "$GPUS_PER_NODE"
