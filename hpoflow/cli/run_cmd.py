"""``hpoflow run SPEC --run-dir DIR``: run or resume a study on this machine."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from hpoflow.cli._args import positive_int

if TYPE_CHECKING:
    from hpoflow.errors import SpecError
    from hpoflow.run.signals import StopSignals

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("run", help="run or resume a study",
                       description="Run a study; on an existing run directory, resume it.")
    p.add_argument("spec", help="study spec (YAML)")
    p.add_argument("--run-dir", help="run directory (default: runs/<study name>)")
    p.add_argument("--n-trials", type=positive_int, help="override search.n_trials")
    p.add_argument("--quiet", action="store_true", help="no progress, only the final table")
    p.add_argument("--json", action="store_true", help="print the final status as one JSON object")
    p.set_defaults(func=run)


def _prestart(spec_path: str, run_dir: str | None) -> SpecError | None:
    """Boot the local engine's processes first, so they start while the rest of hpoflow imports and
    the study opens: the forkserver's torch preload, and light workers when the trials need no torch
    (``hpoflow.engines.local.prestart_for``). Input the run would refuse starts nothing (an invalid spec,
    ``HPOFLOW_N_TRIALS``, a ``--run-dir`` that cannot be resolved or is a file): ``optimize`` says
    why, and a mistake costs no torch import. A spec that does not load is returned: the first thing
    ``optimize`` would refuse, said by the command without importing the rest of hpoflow (Optuna, the
    driver: half of a refusal's CPU)."""
    from hpoflow.errors import HpoflowError, SpecError
    from hpoflow.run import rundir
    from hpoflow.spec import env_int, load_spec, search_dirs

    try:
        spec, _ = load_spec(spec_path)
        env_int("HPOFLOW_N_TRIALS", minimum=1)
        if run_dir is not None:
            rundir.locate(run_dir)  # the run's own first check of it (RunDirError: an HpoflowError)
    except SpecError as exc:  # (load_spec's; the other two raise other HpoflowErrors)
        return exc
    except (HpoflowError, OSError, RuntimeError, ValueError):
        return None
    spec.storage_url()  # storage_env's variable leaves the environment before any worker process starts
    if spec.engine != "local":
        return None
    from hpoflow.engines.local import prestart_for

    prestart_for(spec, search_dirs(spec_path))
    return None


def run(args: argparse.Namespace) -> int:
    from hpoflow.run.signals import stop_signals

    # Ctrl-C, SIGTERM and SIGUSR1 are recorded, never raised, for the whole command (hpoflow.run.signals,
    # which says why): before the study opens the command ends at its next step, then the driver stops.
    with stop_signals() as stop:
        try:
            refused = _prestart(args.spec, args.run_dir)
            return _run(args, stop, refused)
        finally:
            # what _prestart started is the engine's once it exists; until then (a Ctrl-C or an error
            # before it) it is stopped here, rather than importing torch for seconds after the command ended
            from hpoflow.engines.local import discard_prestarted

            discard_prestarted()


def _interrupted() -> int:
    print("hpoflow: interrupted", file=sys.stderr)
    return 130


def _run(args: argparse.Namespace, stop: StopSignals, refused: SpecError | None) -> int:
    if stop.reason is not None:
        return _interrupted()
    if refused is not None:  # what optimize's first step would raise (load_spec), read once
        raise refused
    if os.environ.get("SLURM_JOB_ID"):  # in a batch job: pause the trials before its walltime, whoever wrote it
        from hpoflow.engines.slurm.walltime import arm_walltime_warning

        arm_walltime_warning()
    from hpoflow.api import optimize
    from hpoflow.report.progress import ProgressListener
    from hpoflow.report.tables import best_line, status_dict, trials_table
    from hpoflow.term import console as make_console

    console = make_console(stderr=True)
    listener = ProgressListener(console, quiet=args.quiet or args.json)
    if stop.reason is not None:  # (before the study opens: nothing is written)
        return _interrupted()
    result = optimize(args.spec, args.run_dir, n_trials=args.n_trials, listener=listener)  # shares ``stop``
    s = result.summary
    if s.stopped_by == "storage":  # the storage stopped answering: nothing to read from it now
        if args.json:
            print(json.dumps({"run_dir": str(result.run_dir), "stopped_by": s.stopped_by, "reason": s.reason}))
        print(f"hpoflow: {s.outcome_message()}", file=sys.stderr)
        return s.exit_code
    status = status_dict(result.study, result.storage, budget=s.n_trials)
    if args.json:
        print(json.dumps({**status, "run_dir": str(result.run_dir), "stopped_by": s.stopped_by}))
    else:
        out = make_console()
        out.print(trials_table(result.study, top=10))
        out.print(
            f"run dir: {result.run_dir}   finished {status['n_complete']} complete, "
            f"{status['n_pruned']} pruned, {status['n_failed']} failed in {s.elapsed_s:.1f} s; {best_line(status)}",
            highlight=False, markup=False)
    message = s.outcome_message()
    if message:
        print(f"hpoflow: {message}", file=sys.stderr)
    if s.stopped_by == "preempted":
        from hpoflow.engines.slurm.walltime import requeue_if_asked

        requeue_if_asked()
    if stop.reason == "signal" and s.exit_code in (0, 3):  # a Ctrl-C after the study ended, as this printed
        return _interrupted()
    return s.exit_code
