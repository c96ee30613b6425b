"""The COMPSs application of an hpoflow study.

    runcompss --lang=python workflows/hpo.py SPEC --run-dir DIR      (one machine)
    enqueue_compss --num_nodes=N ... workflows/hpo.py SPEC --run-dir DIR   (a batch system)
    hpoflow launch SPEC --engine compss [--nodes N ...] [--dry-run]  (builds those commands)

With plain ``python workflows/hpo.py SPEC --run-dir DIR`` (no runtime, or pycompss not installed)
the same study runs its trials one at a time in this process's sequential fallback. Rerunning the
same command on the same run directory resumes the study. No ``assert`` here: runcompss runs
``python -O`` by default.

SPEC and --run-dir accept ``b64:`` values (``hpoflow launch`` encodes paths that COMPSs would split:
spaces, quotes, ``$``, non-ASCII; see docs/cluster.md). The study's trial shape (computing units,
GPUs, nodes per trial) is derived from the spec *before* the task module is imported and given to
the engine, which builds the PyCOMPSs task with those literal numbers. ``--slots``, ``--cpus-per-node``
and ``--gpus-per-node`` (what ``hpoflow launch`` knows of the batch job) fill in ``compss.slots``,
``compss.cpus_per_node`` and ``compss.gpus_per_node`` where the spec does not set them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    from hpoflow.engines.compss.launch.command import decode_app_value

    p = argparse.ArgumentParser(prog="workflows/hpo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("spec", type=decode_app_value, help="study spec (YAML; a path or b64:<encoded path>)")
    p.add_argument("--run-dir", type=decode_app_value,
                   help="run directory on a shared file system (default: runs/<study name>)")
    p.add_argument("--n-trials", type=int, help="override search.n_trials")
    p.add_argument("--slots", type=int, help="compss.slots when the spec does not set it (hpoflow launch gives "
                   "the batch job's worker cores, for elastic trials)")
    p.add_argument("--cpus-per-node", type=int, help="compss.cpus_per_node when the spec does not set it: one "
                   "worker's computing units (hpoflow launch gives the batch job's; multi-node trials then ask for "
                   "whole workers, and elastic trials never grow past one)")
    p.add_argument("--gpus-per-node", type=int, help="compss.gpus_per_node when the spec does not set it: one "
                   "worker's GPUs")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from hpoflow.api import optimize, prepare_spec
    from hpoflow.engines.compss import CompssEngine, CompssOptions, pycompss_available, runtime_active
    from hpoflow.errors import HpoflowError

    try:
        spec, _ = prepare_spec(args.spec)
        run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / spec.study.name
        in_runtime = runtime_active()
        if not in_runtime:
            why = "no COMPSs runtime" if pycompss_available() else "pycompss is not installed"
            print(f"hpoflow: {why}: running the trials one at a time in this process (sequential "
                  "mode). Launch with runcompss/enqueue_compss (hpoflow launch) to run them as "
                  "COMPSs tasks.", file=sys.stderr, flush=True)
        options = spec.engine_option_values()
        for key in ("slots", "cpus_per_node", "gpus_per_node"):  # what the batch job holds (hpoflow launch)
            value = getattr(args, key)
            if value is not None and key not in options:
                options[key] = value
        shape = CompssOptions.from_mapping(options).task_shape(spec.resources)  # before any task import
        engine = CompssEngine(run_dir=run_dir, sequential=not in_runtime, shape=shape, **options)
        try:
            result = optimize(args.spec, run_dir, n_trials=args.n_trials, engine=engine)
        finally:
            engine.close()
    except HpoflowError as exc:
        print(f"hpoflow: error: {exc}", file=sys.stderr)
        return exc.exit_code
    s = result.summary
    print(f"hpoflow: run dir {result.run_dir}: {s.n_complete} complete, {s.n_pruned} pruned, "
          f"{s.n_failed} failed in {s.elapsed_s:.1f} s (stopped by {s.stopped_by}); best value "
          f"{result.best_value} with {result.best_params}", flush=True)
    message = s.outcome_message()
    if message:
        print(f"hpoflow: {message}", file=sys.stderr, flush=True)
    return s.exit_code


if __name__ == "__main__":
    sys.exit(main())
