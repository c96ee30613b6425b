"""``hpoflow launch SPEC --engine compss [...] [--dry-run]``: run a study under COMPSs.

On one machine it runs ``runcompss``; on a batch system (``--nodes`` given, or a SLURM login node
detected) ``enqueue_compss``. The command is built by ``hpoflow.engines.compss.launch`` from typed
options, printed with ``--dry-run``, otherwise executed as an argv list (never through a shell).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from hpoflow.cli._args import non_negative_int, positive_int
from hpoflow.errors import EngineError

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "launch", help="run a study under COMPSs (runcompss here, enqueue_compss on a cluster)",
        description="Build and run the runcompss/enqueue_compss command of a study. --dry-run prints it.",
    )
    p.add_argument("spec", help="study spec (YAML)")
    p.add_argument("--engine", choices=["compss"], default="compss",
                   help="engine to launch with (compss; for the local engine use `hpoflow run`)")
    p.add_argument("--run-dir", help="run directory on a shared file system (default: runs/<study name>)")
    p.add_argument("--nodes", type=positive_int,
                   help="nodes of the batch job, including the COMPSs master node (implies enqueue_compss)")
    p.add_argument("--cpus-per-node", type=positive_int, help="CPU cores per node (enqueue_compss)")
    p.add_argument("--gpus-per-node", type=non_negative_int, help="GPUs per node (enqueue_compss)")
    p.add_argument("--time", type=positive_int, metavar="MIN", help="wall time of the job in minutes")
    p.add_argument("--qos", help="quality of service of the job")
    p.add_argument("--queue", "--partition", dest="queue", help="queue / partition")
    p.add_argument("--project", "--account", dest="account", help="project / account to charge")
    p.add_argument("--job-name", help="batch job name (default: hpoflow-<study name>)")
    p.add_argument("--log-level", default="off", choices=["off", "info", "api", "debug", "trace"],
                   help="COMPSs log level (off runs python -O)")
    p.add_argument("--local", action="store_true", help="use runcompss even on a SLURM login node")
    p.add_argument("--generate-resources", metavar="FILE",
                   help="write resources.xml (and project.xml next to it) for this machine and use them")
    p.add_argument("--project-xml", help="COMPSs project.xml for runcompss")
    p.add_argument("--resources-xml", help="COMPSs resources.xml for runcompss")
    p.add_argument("--n-trials", type=positive_int, help="override search.n_trials")
    p.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpoflow.engines.compss.launch import LaunchOptions, build_command, default_workflow, describe, slurm_detected
    from hpoflow.spec import load_spec

    spec, _ = load_spec(args.spec)
    batch = args.nodes is not None or (not args.local and slurm_detected())
    res = spec.resources
    if args.nodes is not None and res.nodes > args.nodes - 1:
        raise EngineError(
            f"a trial spans resources.nodes={res.nodes} node(s), but --nodes {args.nodes} leaves "
            f"{args.nodes - 1} worker node(s) (the COMPSs master node runs no tasks). Fix: --nodes "
            f"{res.nodes + 1} or more"
        )
    ppn = max(1, res.processes // max(1, res.nodes))
    if args.gpus_per_node is not None and ppn * res.gpus_per_process > args.gpus_per_node:
        raise EngineError(
            f"a trial needs {ppn} x {res.gpus_per_process} = {ppn * res.gpus_per_process} GPUs per node "
            f"(processes per node x resources.gpus_per_process), but --gpus-per-node is "
            f"{args.gpus_per_node}. Fix: raise --gpus-per-node or lower resources.gpus_per_process"
        )
    if args.cpus_per_node is not None and ppn * res.cpus_per_process > args.cpus_per_node:
        raise EngineError(
            f"a trial needs {ppn * res.cpus_per_process} cores per node, but --cpus-per-node is "
            f"{args.cpus_per_node}. Fix: raise --cpus-per-node or lower resources.cpus_per_process"
        )
    workflow = default_workflow()
    if not workflow.exists():
        raise EngineError(f"{workflow} does not exist; hpoflow launch needs a source checkout installed "
                          "with `pip install -e .`. Fix: run from the hpoflow repository")
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / spec.study.name
    project_xml, resources_xml = args.project_xml, args.resources_xml
    repo = str(workflow.parent.parent)
    if args.generate_resources:
        from hpoflow.engines.compss.runtime_xml import detect_node, write_config

        rpath, ppath = write_config(Path(args.generate_resources).resolve(),
                                    [detect_node(pythonpath=(repo, os.getcwd()))])
        print(f"wrote {rpath} and {ppath}", file=sys.stderr)
        if not batch:
            resources_xml, project_xml = str(rpath), str(ppath)
    app_args = ("--n-trials", str(args.n_trials)) if args.n_trials else ()
    opts = LaunchOptions(
        spec=str(Path(args.spec).resolve()), run_dir=str(run_dir.resolve()), workflow=str(workflow),
        batch=batch, nodes=args.nodes, cpus_per_node=args.cpus_per_node, gpus_per_node=args.gpus_per_node,
        time_minutes=args.time, qos=args.qos, queue=args.queue, account=args.account,
        job_name=args.job_name or (f"hpoflow-{spec.study.name}" if batch else None),
        log_level=args.log_level, python=sys.executable, pythonpath=(repo, os.getcwd()),
        project_xml=str(Path(project_xml).resolve()) if project_xml else None,
        resources_xml=str(Path(resources_xml).resolve()) if resources_xml else None, app_args=app_args,
    )
    argv = build_command(opts)
    if args.dry_run:
        print(describe(argv))
        return 0
    import shutil

    if shutil.which(argv[0]) is None:
        raise EngineError(
            f"{argv[0]} is not on PATH, so COMPSs is not installed or not loaded here. Fix: `module load "
            "COMPSs` (or install COMPSs and `pip install -e '.[compss]'`), check with `--dry-run`, or run "
            "the study without COMPSs: `hpoflow run SPEC` / `python workflows/hpo.py SPEC`"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(argv, check=False).returncode
