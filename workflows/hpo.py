"""The COMPSs application of an hpoflow study.

    runcompss --lang=python workflows/hpo.py SPEC --run-dir DIR      (one machine)
    enqueue_compss --num_nodes=N ... workflows/hpo.py SPEC --run-dir DIR   (a batch system)
    hpoflow launch SPEC --engine compss [--nodes N ...] [--dry-run]  (builds those commands)

With plain ``python workflows/hpo.py SPEC --run-dir DIR`` (no runtime, or pycompss not installed)
the same study runs its trials one at a time in this process's sequential fallback. Rerunning the
same command on the same run directory resumes the study. No ``assert`` here: runcompss runs
``python -O`` by default.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workflows/hpo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("spec", help="study spec (YAML)")
    p.add_argument("--run-dir", help="run directory on a shared file system (default: runs/<study name>)")
    p.add_argument("--n-trials", type=int, help="override search.n_trials")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from hpoflow.api import optimize, prepare_spec
    from hpoflow.engines.compss import CompssEngine, pycompss_available, runtime_active
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
        engine = CompssEngine(run_dir=run_dir, sequential=not in_runtime, **spec.engine_option_values())
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
