"""``hpoflow launch SPEC --engine compss|slurm [...] [--dry-run]``: run a study on a cluster.

``--engine compss``: on one machine ``runcompss``; on a batch system (``--nodes`` given, or a SLURM login
node detected) ``enqueue_compss``. The command is built by ``hpoflow.engines.compss.launch.command`` from
typed options, printed with ``--dry-run``, otherwise executed as an argv list (never through a shell).
COMPSs re-splits arguments, so every value is checked or encoded; flags after ``--`` go to
runcompss/enqueue_compss unchanged (checked the same way).

``--engine slurm``: the driver's batch script (``hpoflow.engines.slurm.launch``), written to the run
directory and submitted with ``sbatch``; ``--dry-run`` prints it. ``--drivers N``: a job array of N
drivers on one study storage.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpoflow.cli._args import non_negative_int, positive_int
from hpoflow.errors import EngineError

if TYPE_CHECKING:
    from hpoflow.engines.compss.launch.runtime_xml import NodeConfig
    from hpoflow.engines.compss.shape import TaskShape
    from hpoflow.spec import StudySpec

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "launch", help="run a study on a cluster: under COMPSs, or as a SLURM batch job",
        description="compss: build and run the runcompss/enqueue_compss command of a study; slurm: write and "
                    "submit the driver's batch script (its trials run as job steps). --dry-run prints it.",
    )
    p.add_argument("spec", help="study spec (YAML)")
    p.add_argument("--engine", choices=["compss", "slurm"], default="compss",
                   help="engine to launch with (for the local engine use `hpoflow run`)")
    p.add_argument("--run-dir", help="run directory on a shared file system (default: runs/<study name>)")
    p.add_argument("--nodes", type=positive_int,
                   help="nodes of the batch job (compss: including the COMPSs master node; implies enqueue_compss)")
    p.add_argument("--cpus-per-node", type=positive_int,
                   help="CPU cores per node (enqueue_compss; slurm: default all of them, --exclusive)")
    p.add_argument("--gpus-per-node", type=non_negative_int, help="GPUs per node")
    p.add_argument("--time", type=positive_int, metavar="MIN",
                   help="wall time of the batch job in minutes (default: from the study's budget, see "
                        "docs/cluster.md)")
    p.add_argument("--qos", help="quality of service of the job (compss: refused where the site config drops it)")
    p.add_argument("--sc-cfg", metavar="NAME|FILE",
                   help="enqueue_compss site config (queue system and its flags; COMPSs's default is LSF)")
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
    p.add_argument("--signal", type=positive_int, default=300, metavar="SECONDS",
                   help="slurm: the walltime warning comes this long before the end (--signal=B:USR1@SECONDS); "
                        "the trials stop at their next step with a checkpoint (default 300)")
    p.add_argument("--requeue", action="store_true",
                   help="slurm: after the walltime warning the driver puts its job back in the queue, and the "
                        "study resumes when it runs again")
    p.add_argument("--drivers", type=positive_int, default=1,
                   help="slurm: a job array of N drivers, each with its own allocation, on one study (the spec "
                        "needs a shared storage)")
    p.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    p.set_defaults(func=run, compss_args=[])
    p.usage = "hpoflow launch SPEC [options] [-- COMPSS_FLAG ...]"
    p.epilog = "Flags after -- go to runcompss/enqueue_compss unchanged, before the application."
    p.parse_known_args = _split_at_double_dash(p.parse_known_args)  # type: ignore[method-assign, assignment]


def _split_at_double_dash(parse: Callable[..., tuple[argparse.Namespace, list[str]]]
                          ) -> Callable[..., tuple[argparse.Namespace, list[str]]]:
    """Everything after the first ``--`` becomes ``compss_args`` (argparse alone cannot take a
    pass-through list after a positional in a subcommand: it would report them as unrecognized)."""

    def parse_known_args(args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        items = list(sys.argv[1:] if args is None else args)
        tail: list[str] = []
        if "--" in items:
            cut = items.index("--")
            items, tail = items[:cut], items[cut + 1:]
        ns, extras = parse(items, namespace)
        ns.compss_args = tail
        return ns, extras

    return parse_known_args


def _warn(message: str) -> None:
    print(f"hpoflow: warning: {message}", file=sys.stderr)


def _elastic_slots(spec: StudySpec, batch: bool, nodes: int | None, cpus_per_node: int | None,
                   compss_args: list[str]) -> int | None:
    """``compss.slots`` for a batch job of elastic trials that does not set it: the workers' cores,
    ``(nodes - 1) x cpus_per_node`` (the master node runs no tasks) plus ``--worker_in_master_cpus``
    when given after ``--``; None when not elastic, set already, or the job's size is unknown."""
    if spec.resources.elastic is None or "slots" in spec.engine_option_values() or not batch:
        return None
    if nodes is None or cpus_per_node is None:
        _warn("elastic trials grow onto idle cores only when compss.slots is known; give --nodes and "
              "--cpus-per-node, or set compss.slots in the spec")
        return None
    in_master = 0
    for arg in compss_args:
        if arg.startswith("--worker_in_master_cpus="):
            value = arg.partition("=")[2]
            in_master = int(value) if value.isascii() and value.isdigit() else 0
    return (nodes - 1) * cpus_per_node + in_master


def run(args: argparse.Namespace) -> int:
    if args.engine == "slurm":
        return _slurm(args)
    for flag, given in (("--drivers", args.drivers != 1), ("--requeue", args.requeue)):
        if given:
            raise EngineError(f"{flag} is an option of --engine slurm. Fix: remove it, or launch with --engine slurm")
    return _compss(args)


def _slurm(args: argparse.Namespace) -> int:
    from hpoflow.engines.cluster.jobtime import job_time
    from hpoflow.engines.slurm.launch import SlurmLaunch, batch_script, sbatch_argv
    from hpoflow.spec import load_spec
    from hpoflow.trial import TrialRequest

    for flag, given in (("--sc-cfg", args.sc_cfg), ("--local", args.local), ("--project-xml", args.project_xml),
                        ("--resources-xml", args.resources_xml), ("--generate-resources", args.generate_resources),
                        ("-- FLAGS", args.compss_args)):
        if given:
            raise EngineError(f"{flag} is an option of --engine compss. Fix: remove it (SLURM reads its own config)")
    spec, _ = load_spec(args.spec)
    res = spec.resources
    if spec.engine != "slurm":
        raise EngineError(f"{args.spec} runs its trials on engine {spec.engine!r}; hpoflow launch --engine slurm runs "
                          "a driver whose trials are SLURM job steps. Fix: set engine: slurm in the spec")
    if args.drivers > 1 and spec.search.scheduler.type == "pbt":
        raise EngineError(f"--drivers {args.drivers} runs one study from several drivers, but a PBT study's population "
                          "is owned by one driver (search.scheduler: pbt). Fix: --drivers 1 (for more intervals at "
                          "once: raise search.max_concurrent, and --nodes)")
    if args.drivers > 1 and spec.storage is None and spec.storage_env is None:
        raise EngineError(f"--drivers {args.drivers} runs one study from several drivers, which needs one storage "
                          "they all reach, but the spec keeps the study in each run directory. Fix: set storage: in "
                          "the spec to a journal file on a shared file system (storage: /scratch/me/study.journal) "
                          "or a database URL (with its password in storage_env)")
    nodes = args.nodes or res.nodes
    if res.nodes > nodes:
        raise EngineError(f"a trial spans resources.nodes={res.nodes} node(s), but --nodes is {nodes}. Fix: --nodes "
                          f"{res.nodes} or more")
    if args.cpus_per_node or args.gpus_per_node is not None:
        from hpoflow.engines.slurm.allocation import Allocation

        cpus = args.cpus_per_node or 1 << 20
        alloc = Allocation("(to submit)", tuple(f"node{i}" for i in range(nodes)), (cpus,) * nodes,
                           args.gpus_per_node or 0)
        alloc.check_fit(TrialRequest.shape(res.processes, res.cpus_per_process, res.gpus_per_process, res.nodes))
    jt = job_time(args.time, search_timeout=spec.search.timeout, n_trials=args.n_trials or spec.search.n_trials,
                  max_concurrent=spec.search.max_concurrent, trial_timeout=res.timeout)
    for w in jt.warnings:
        _warn(w)
    if jt.minutes * 60 <= args.signal:
        raise EngineError(f"--signal {args.signal} s asks for the walltime warning before the job even starts "
                          f"(--time {jt.minutes} min). Fix: a smaller --signal or a longer --time")
    run_dir = (Path(args.run_dir) if args.run_dir else Path("runs") / spec.study.name).resolve()
    repo = str(Path(__file__).resolve().parents[2])
    launch = SlurmLaunch(
        spec=str(Path(args.spec).resolve()), run_dir=str(run_dir), python=sys.executable,
        pythonpath=tuple(dict.fromkeys((repo, os.getcwd()))), workdir=os.getcwd(), nodes=nodes,
        cpus_per_node=args.cpus_per_node,
        gpus_per_node=args.gpus_per_node or 0, time_minutes=jt.minutes, partition=args.queue, account=args.account,
        qos=args.qos, job_name=args.job_name or f"hpoflow-{spec.study.name}", signal_s=args.signal,
        requeue=args.requeue, drivers=args.drivers, n_trials=args.n_trials)
    script = batch_script(launch)
    if args.dry_run:
        print(script, end="")
        return 0
    if shutil.which("sbatch") is None:
        raise EngineError("sbatch is not on PATH, so this is not a SLURM login node. Fix: run hpoflow launch where "
                          "SLURM's commands are (module load slurm), or check the script with --dry-run")
    from hpoflow.fileio import write_atomic
    from hpoflow.run.open import LAUNCH_DIR

    path = run_dir / LAUNCH_DIR / "driver.sbatch"
    write_atomic(path, script, mode=0o755)
    output = str(path.parent / ("slurm-%A_%a.out" if args.drivers > 1 else "slurm-%j.out"))
    r = subprocess.run(sbatch_argv(str(path), output), capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise EngineError(f"sbatch refused the driver's job: {(r.stderr or r.stdout).strip()}. The script is {path}")
    print(f"submitted job {r.stdout.strip()} (script {path}; output {output})")
    return 0


def _compss(args: argparse.Namespace) -> int:
    from hpoflow.engines.cluster.jobtime import job_time
    from hpoflow.engines.compss.launch.command import (
        LaunchOptions,
        build_command,
        default_workflow,
        describe,
        is_safe,
        slurm_detected,
    )
    from hpoflow.engines.compss.options import CompssOptions
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
    spec_options = spec.engine_option_values()
    workers = _batch_workers(args, spec_options) if batch else {}
    shape = CompssOptions.from_mapping({**workers, **spec_options}).task_shape(res)  # a node's share fits a worker
    if batch and res.nodes > 1 and "cpus_per_node" not in workers and "cpus_per_node" not in spec_options:
        _warn("the workers' computing units are unknown (no --cpus-per-node, no site config here), so COMPSs may "
              "put two nodes of a trial on one worker (the task then gives them back and is submitted again, up to "
              "compss.placement_retries times). Fix: --cpus-per-node C, so each node of a trial asks for a whole "
              "worker")
    workflow = default_workflow()
    if not workflow.exists():
        raise EngineError(f"{workflow} does not exist; hpoflow launch needs a source checkout installed "
                          "with `pip install -e .`. Fix: run from the hpoflow repository")
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / spec.study.name
    project_xml, resources_xml = args.project_xml, args.resources_xml
    repo = str(workflow.parent.parent)
    # trials import the user's code from the spec's directory and the current one through the trial
    # request; the current directory is also given to COMPSs's workers when it can pass through COMPSs
    pythonpath = (repo, os.getcwd()) if is_safe(os.getcwd()) else (repo,)
    machine = None if batch else _check_local_workers(args, shape, pythonpath)
    time_minutes = args.time
    if batch:
        jt = job_time(args.time, search_timeout=spec.search.timeout, n_trials=args.n_trials or spec.search.n_trials,
                      max_concurrent=spec.search.max_concurrent, trial_timeout=res.timeout)
        time_minutes = jt.minutes
        for w in jt.warnings:
            _warn(w)
    app_args: tuple[str, ...] = ("--n-trials", str(args.n_trials)) if args.n_trials else ()
    slots = _elastic_slots(spec, batch, args.nodes, workers.get("cpus_per_node"), args.compss_args)
    if slots is not None:
        app_args += ("--slots", str(slots))
    for key, value in workers.items():  # what the workflow cannot know of the batch job's workers
        if key not in spec_options:
            app_args += (f"--{key.replace('_', '-')}", str(value))
    opts = LaunchOptions(
        spec=str(Path(args.spec).resolve()), run_dir=str(run_dir.resolve()), workflow=str(workflow),
        batch=batch, nodes=args.nodes, cpus_per_node=args.cpus_per_node, gpus_per_node=args.gpus_per_node,
        time_minutes=time_minutes, qos=args.qos, queue=args.queue, account=args.account,
        job_name=args.job_name or (f"hpoflow-{spec.study.name}" if batch else None), sc_cfg=args.sc_cfg,
        log_level=args.log_level, python=sys.executable, pythonpath=pythonpath,
        project_xml=str(Path(project_xml).resolve()) if project_xml else None,
        resources_xml=str(Path(resources_xml).resolve()) if resources_xml else None,
        extra_args=tuple(args.compss_args), app_args=app_args,
    )
    if args.generate_resources:
        from hpoflow.engines.compss.launch.runtime_xml import detect_node, write_config

        rpath, ppath = write_config(Path(args.generate_resources).resolve(),
                                    [machine or detect_node(pythonpath=pythonpath)])
        print(f"wrote {rpath} and {ppath}", file=sys.stderr)
        if not batch:
            opts = dataclasses.replace(opts, resources_xml=str(rpath), project_xml=str(ppath))
    argv = build_command(opts)
    if args.dry_run:
        print(describe(argv))
        return 0
    if shutil.which(argv[0]) is None:
        raise EngineError(
            f"{argv[0]} is not on PATH, so COMPSs is not installed or not loaded here. Fix: `module load "
            "COMPSs` (or install COMPSs and `pip install -e '.[compss]'`), check with `--dry-run`, or run "
            "the study without COMPSs: `hpoflow run SPEC` / `python workflows/hpo.py SPEC`"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(argv, check=False).returncode


def _batch_workers(args: argparse.Namespace, spec_options: dict[str, Any]) -> dict[str, int]:
    """The batch job's site config checked (a refusal is an ``EngineError``: queue system, account, qos;
    docs/cluster.md) and what each worker node holds: ``--cpus-per-node``/``--gpus-per-node``, else the
    site config's defaults, as ``compss.cpus_per_node``/``gpus_per_node`` (only those known)."""
    from hpoflow.engines.compss.launch.batch import check_site, read_site_config, sc_cfg_file, site_config_dir

    path = sc_cfg_file(args.sc_cfg)
    cfg = read_site_config(path) if path is not None else None
    check = check_site(cfg, sc_cfg=args.sc_cfg, sbatch_here=shutil.which("sbatch") is not None,
                       account=args.account, qos=args.qos, folder=site_config_dir())
    if check.error:
        raise EngineError(check.error)
    for w in check.warnings:
        _warn(w)
    cpus = args.cpus_per_node or (cfg.number("DEFAULT_CPUS_PER_NODE") if cfg else None)
    gpus = args.gpus_per_node if args.gpus_per_node is not None else (
        cfg.number("DEFAULT_GPUS_PER_NODE") if cfg else None)
    workers = {k: v for k, v in (("cpus_per_node", cpus), ("gpus_per_node", gpus)) if v is not None}
    for key, value in workers.items():
        if key in spec_options and spec_options[key] != value:
            flag = f"--{key.replace('_', '-')}"
            raise EngineError(
                f"compss.{key} is {spec_options[key]} in the spec, but the batch job's workers get {value} "
                f"({flag} or the site config's default), and COMPSs places tasks by what they get. Fix: pass "
                f"{flag} {spec_options[key]}, or remove compss.{key} from the spec")
    return workers


def _check_local_workers(args: argparse.Namespace, shape: TaskShape, pythonpath: tuple[str, ...]
                         ) -> NodeConfig | None:
    """runcompss here: the trial's shape must fit the workers of the resources XML it will use (given,
    generated for this machine, or COMPSs's default); refused before anything is written. Returns this
    machine as a COMPSs node when it was detected (for --generate-resources)."""
    from hpoflow.engines.compss.launch.runtime_xml import detect_node, read_resources
    from hpoflow.engines.compss.launch.workers import check_workers, default_resources_file

    smaller = ("lower the trial's resources (resources.processes, cpus_per_process, gpus_per_process; nodes: 1), "
               "or submit a batch job with --nodes N")
    if args.resources_xml and not args.generate_resources:
        try:
            workers = read_resources(Path(args.resources_xml))
        except ValueError as exc:
            raise EngineError(f"--resources-xml: {exc}. Fix: pass a COMPSs resources.xml, or use "
                              "--generate-resources FILE") from None
        check_workers(shape, workers, f"--resources-xml {args.resources_xml}",
                      f"{smaller}, or list compute nodes that hold it in that file")
        return None
    machine = detect_node(pythonpath=pythonpath)
    check_workers(shape, [machine], "this machine", smaller)
    default = None if args.generate_resources else default_resources_file()
    if default is not None:
        try:
            workers = read_resources(default)
        except ValueError:
            return machine
        check_workers(shape, workers, f"COMPSs's default resources.xml ({default}, what runcompss uses without "
                      "--resources)", f"--generate-resources FILE (this machine: {machine.cpus} cores, "
                      f"{machine.gpus} GPUs)")
    return machine
