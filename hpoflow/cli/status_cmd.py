"""``hpoflow status RUN_DIR [--json]``: where a study stands (works while it runs)."""

from __future__ import annotations

import argparse
import json

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show a study's progress and best trials")
    p.add_argument("run_dir", help="run directory of a study")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--top", type=int, default=10, help="rows of the best-trials table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from hpoflow.api import load_run
    from hpoflow.report import status_dict, trials_table

    study, label = load_run(args.run_dir)
    status = status_dict(study, label)
    if args.json:
        print(json.dumps(status))
        return 0
    console = Console()
    console.print(trials_table(study, top=args.top))
    console.print(", ".join(f"{k}={v}" for k, v in status.items() if k != "best_params"), highlight=False)
    console.print(f"best_params={status['best_params']}", highlight=False)
    return 0
