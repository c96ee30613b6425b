"""The end of warm command trials: ``--runs`` (30) 2-rank warm trials of ``tests/warmprog.py``, a DDP
program whose ``DistributedDataParallel`` wrapper outlives ``destroy_process_group()`` (freed as its
``main()`` returns, the last collective a broadcast), that registers an ``atexit`` handler and leaves a
non-daemon thread running 0.3 s past its main code; one study, one trial
at a time, each trial bounded by ``resources.timeout`` (``--timeout``, 60 s), so a hang at a program's end
shows as a failed trial instead of a stuck benchmark. Prints how many trials completed, hung (timed out)
or failed otherwise, how many ranks ran their atexit handler and joined their thread, and the median
trial time.

    python bench/warm_exit.py [--runs 30] [--timeout 60]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from _common import BENCH, emit, median

ROOT = BENCH.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from optuna.trial import TrialState

    from hpoflow.api import optimize

    spec = {"study": {"name": "warm-exit", "metric": "score", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": a.runs, "max_concurrent": 1, "seed": 0},
            "training": {"command": ["python", str(ROOT / "tests" / "warmprog.py")]},
            "resources": {"processes": 2, "timeout": a.timeout, "max_retries": 0}}
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        study = optimize(spec, run).study
        trials = study.trials
        errors = [str(t.user_attrs.get("error", "")) for t in trials if t.state != TrialState.COMPLETE]
        ends = {kind: sum((run / "trials" / str(t.number) / f"{kind}_rank{r}").exists() for t in trials
                          for r in (0, 1)) for kind in ("atexit", "thread")}
        times = [t.duration.total_seconds() for t in trials if t.duration is not None]
    emit({"runs": a.runs, "complete": sum(t.state == TrialState.COMPLETE for t in trials),
          "hung (timed out)": sum("timed out" in e or "timeout" in e for e in errors),
          "failed otherwise": sum(not ("timed out" in e or "timeout" in e) for e in errors),
          "ranks that ran atexit": f"{ends['atexit']} of {2 * a.runs}",
          "ranks that joined their thread": f"{ends['thread']} of {2 * a.runs}",
          "median trial s": round(median(times), 2) if times else None})
    if errors:
        print(json.dumps(sorted(set(errors))[:3], indent=1))


if __name__ == "__main__":
    main()
