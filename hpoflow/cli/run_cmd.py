"""``hpoflow run SPEC --run-dir DIR``: run or resume a study on this machine."""

from __future__ import annotations

import argparse
import json
import sys

from hpoflow.cli._args import positive_int

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


def run(args: argparse.Namespace) -> int:
    from hpoflow.api import optimize
    from hpoflow.report import ProgressListener, status_dict, trials_table
    from hpoflow.term import console as make_console

    console = make_console(stderr=True)
    listener = ProgressListener(console, quiet=args.quiet or args.json)
    result = optimize(args.spec, args.run_dir, n_trials=args.n_trials, listener=listener)
    s = result.summary
    status = status_dict(result.study, result.storage, budget=s.n_trials)
    if args.json:
        print(json.dumps({**status, "run_dir": str(result.run_dir), "stopped_by": s.stopped_by}))
    else:
        out = make_console()
        out.print(trials_table(result.study, top=10))
        out.print(
            f"run dir: {result.run_dir}   finished {status['n_complete']} complete, "
            f"{status['n_pruned']} pruned, {status['n_failed']} failed in {s.elapsed_s:.1f} s; "
            f"best {status['best_value']} with {status['best_params']}", highlight=False)
    message = s.outcome_message()
    if message:
        print(f"hpoflow: {message}", file=sys.stderr)
    return s.exit_code
