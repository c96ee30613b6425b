"""``hpoflow status RUN_DIR [--json]``: where a study stands (works while it runs; reads only).

Besides the counts and the best trials it lists the trials that were interrupted (a stop, a crashed
driver) with the trial that reran each (they do not count; their directories stay), and the drivers
that worked on the study (several ``hpoflow run`` may share one storage): ``alive``, ``ended``, or
``lost`` (no beat for over its lease; judged by the wall clock, or by the pid for a driver of this
machine)."""

from __future__ import annotations

import argparse
import json

from hpoflow.cli._args import add_storage_args, storage_arg

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help="show a study's progress and best trials")
    p.add_argument("run_dir", help="run directory of a study")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--top", type=int, default=10, help="rows of the best-trials table")
    add_storage_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpoflow.run import rundir

    storage = storage_arg(args)
    snapshot = None
    if storage is None and args.top == 10:  # a finished run's own snapshot, if still current
        snapshot = rundir.read_status_snapshot(rundir.resolve(args.run_dir, create=False))
    if snapshot is not None:
        status, table = snapshot["status"], snapshot["table"]
    else:
        from hpoflow.report.tables import best_rows, status_dict
        from hpoflow.run.open import load_run, run_budget

        study, label = load_run(args.run_dir, storage)
        status = status_dict(study, label, budget=run_budget(args.run_dir))
        table = None if args.json else best_rows(study, top=args.top)
    if args.json:
        print(json.dumps(status))
        return 0
    from hpoflow.term import console as make_console
    from hpoflow.term import render_table

    console = make_console()
    if table is not None:
        console.print(render_table(table))
    console.print(", ".join(f"{k}={v}" for k, v in status.items()
                            if k not in ("best_params", "drivers", "interrupted")), highlight=False)
    console.print(f"best_params={status['best_params']}", highlight=False)
    links = status.get("interrupted") or []
    if links:
        console.print("interrupted, rerun as (not counted; trials/<n> keeps what each wrote): " + ", ".join(
            f"{x['trial']} -> {'?' if x['rerun_as'] is None else x['rerun_as']}" for x in links), highlight=False)
    drivers = status.get("drivers") or []
    if len(drivers) > 1 or any(d["state"] != "ended" for d in drivers):  # several drivers, or one at work
        console.print(render_table({
            "title": "drivers", "columns": ["driver", "state", "running", "last beat", "run dir"],
            "rows": [[f"{d['host']}:{d['pid']}", d["state"], str(d["trials_running"]), d["last_beat"], d["run_dir"]]
                     for d in drivers]}))
    return 0
