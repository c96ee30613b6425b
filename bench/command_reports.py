"""Command trials: what a report costs when a program leaves many behind (issue 66). A program appends N
JSON lines to ``HPOFLOW_METRICS_FILE`` (``{"step": i, "val_loss": ...}``, steps 1..N) and ends; the study
(one trial, the median pruner, the run directory's journal) records every one as an intermediate value.

Per size: ``total_s`` (``optimize``, wall), ``driver_cpu_s`` (this process's CPU time: the driver and its
storage), ``per_line_us`` (the driver's first report -> its last, per line: the reports' own cost, the
trial's start left out) and ``values`` (the intermediate values the study holds: all N). ``ratio``: the
largest size's ``per_line_us`` over the smallest's. Before issue 66 each line was a report the rank
waited on and the journal's replay copied the trial's earlier values at each (100,000 lines: 269 s wall,
170 s of the driver's CPU, 2.7 ms a line against 0.27 ms for 1,000); a report now costs the same however
many came before (100,000: 12 s, 0.12 ms a line; docs/performance.md).

    python bench/command_reports.py [--lines 1000 10000 100000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import BENCH, emit

sys.path.insert(0, str(BENCH.parent))

PROGRAM = """import json, os, sys
with open(os.environ["HPOFLOW_METRICS_FILE"], "a") as f:
    for i in range(1, int(sys.argv[1]) + 1):
        f.write(json.dumps({"step": i, "val_loss": 1.0 / i}) + "\\n")
"""


def one(lines: int, work: Path) -> dict[str, Any]:
    from hpoflow.api import optimize
    from hpoflow.search.summary import DriverListener

    class Span(DriverListener):
        first: tuple[float, float] | None = None
        last: tuple[float, float] | None = None

        def on_trial_report(self, number: int, step: int, metrics: dict[str, float]) -> None:
            now = (time.perf_counter(), time.process_time())
            if self.first is None:
                self.first = now
            self.last = now

    program = work / "append_lines.py"
    program.write_text(PROGRAM)
    spec = {"study": {"name": "reports", "metric": "val_loss", "direction": "minimize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 1, "max_concurrent": 1, "seed": 0,
                       "pruner": {"type": "median"}},
            "training": {"command": [sys.executable, str(program), str(lines)]}, "resources": {"processes": 1}}
    span = Span()
    t0, c0 = time.perf_counter(), time.process_time()
    result = optimize(spec, work / f"run-{lines}", listener=span, handle_signals=False)
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    trial = result.study.trials[0]
    assert span.first is not None and span.last is not None, "no report reached the driver"
    return {"total_s": round(total, 2), "driver_cpu_s": round(cpu, 2), "state": trial.state.name,
            "per_line_us": round((span.last[0] - span.first[0]) / max(1, lines - 1) * 1e6, 1),
            "values": len(trial.intermediate_values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, nargs="+", default=[1000, 10000, 100000])
    args = ap.parse_args()
    sizes = sorted(set(args.lines))
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            out[str(n)] = one(n, Path(tmp))
            print(n, out[str(n)], file=sys.stderr, flush=True)
    small, large = out[str(sizes[0])]["per_line_us"], out[str(sizes[-1])]["per_line_us"]
    emit({"lines": out, "ratio": round(large / small, 2) if small else None})


if __name__ == "__main__":
    main()
