"""``hpoflow report RUN_DIR [-o FILE] [--png DIR]``: a self-contained HTML report of a study."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpoflow.cli._args import add_storage_args, storage_arg

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("report", help="write an HTML report of a study (plots; opens offline)",
                       description="Write one self-contained HTML file that shows the study: optimisation "
                                   "history, learning curves, the slot timeline, parameter importances, cost "
                                   "and system usage per trial. Works while the study runs.")
    p.add_argument("run_dir", help="run directory of a study")
    p.add_argument("-o", "--output", help="the HTML file (default: RUN_DIR/report.html)")
    p.add_argument("--png", metavar="DIR", help="also write each figure as a PNG into DIR (needs kaleido)")
    add_storage_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import yaml

    from hpoflow.report.html import write_pngs, write_report
    from hpoflow.run import rundir
    from hpoflow.run.open import load_run, run_budget

    rd = rundir.resolve(args.run_dir, create=False)
    study, label = load_run(rd, storage_arg(args))
    try:
        spec_text = (rd / "spec.yaml").read_text()
        data = yaml.safe_load(spec_text) or {}
    except (OSError, yaml.YAMLError):
        spec_text, data = "", {}
    search = data.get("search") if isinstance(data, dict) else None
    resources = data.get("resources") if isinstance(data, dict) else None
    training = data.get("training") if isinstance(data, dict) else None
    context = {"slots": (search or {}).get("max_concurrent", 1) if isinstance(search, dict) else 1,
               "processes": (resources or {}).get("processes", 1) if isinstance(resources, dict) else 1,
               "strategy": (training or {}).get("strategy", "allreduce") if isinstance(training, dict) else "allreduce",
               "budget": run_budget(rd),
               "metric": (data.get("study") or {}).get("metric", "") if isinstance(data, dict) else ""}
    out = Path(args.output) if args.output else rd / "report.html"
    panels = write_report(study, rd, out, spec_text, label, context)
    drawn = sum(p.figure is not None for p in panels)
    print(f"wrote {out} ({drawn} of {len(panels)} panels drawn"
          + "".join(f"; {p.title}: {p.note}" for p in panels if p.figure is None) + ")")
    if args.png:
        for path in write_pngs(panels, Path(args.png)):
            print(f"wrote {path}")
    return 0
