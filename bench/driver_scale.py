"""Driver at scale: 10,000 trials of a no-op objective, random sampler, default storage.

``optimize`` with the default storage (the fsync-free Optuna journal file in a temporary run
directory) on a ``ThreadEngine`` of 2 slots running a no-op objective, so the wall time per trial is
the driver's own time: ask, suggest, submit, tell, the storage writes and ``result.json``. A listener
stamps every trial's end; the curve is the time per trial in each block of ``--block`` trials. The
driver's own accounting (``DriverSummary.driver_overhead_s``) and the final outputs (``trials.csv``,
``best.yaml``, written once after the last trial) are reported separately.

    python bench/driver_scale.py [--trials 10000] [--block 1000] [--profile FILE.prof]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import emit, median

from hpoflow.trial import TrialResult


def _noop(params: dict[str, Any], reporter: Any) -> float:
    """The objective: nothing, so all that is measured is the driver's own work."""
    return 0.0


class _Stamps:
    """A driver listener that keeps the monotonic time at which each trial's result was handled."""

    def __init__(self) -> None:
        self.started = 0.0
        self.ends: list[float] = []

    def on_start(self, n_total: int, n_done: int) -> None:
        self.started = time.monotonic()

    def on_trial_start(self, number: int, params: dict[str, Any]) -> None:
        pass

    def on_trial_end(self, result: TrialResult, params: dict[str, Any], best: float | None) -> None:
        self.ends.append(time.monotonic())

    def on_finish(self, summary: Any) -> None:
        pass


def curve(started: float, ends: list[float], block: int) -> list[dict[str, float]]:
    """Per block of ``block`` trials: mean ms per trial, and the median gap between two trial ends."""
    out = []
    prev = started
    for lo in range(0, len(ends), block):
        chunk = ends[lo : lo + block]
        gaps = [b - a for a, b in zip([prev, *chunk[:-1]], chunk, strict=True)]
        out.append({"upto": lo + len(chunk), "ms_per_trial": round((chunk[-1] - prev) / len(chunk) * 1000, 3),
                    "median_gap_ms": round(median(gaps) * 1000, 3)})
        prev = chunk[-1]
    return out


@dataclass
class _Run:
    stamps: _Stamps
    wall: float  # optimize(), set-up and final outputs included
    overhead: float  # DriverSummary.driver_overhead_s
    done: int
    waiting_scan_ms: float  # what study.ask() spends looking for WAITING trials, once all trials exist


def waiting_scan_ms(study: Any, repeats: int = 21) -> float:
    """Median time of the storage query ``study.ask()`` makes first (``Study._pop_waiting_trial_id``)."""
    from optuna.trial import TrialState

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        study._storage.get_all_trials(study._study_id, deepcopy=False, states=(TrialState.WAITING,))
        times.append(time.perf_counter() - t0)
    return median(times) * 1000


def run(n: int, slots: int, seed: int) -> _Run:
    from hpoflow.api import optimize
    from hpoflow.engines.threads import ThreadEngine

    spec = {
        "study": {"name": "driver-scale", "metric": "val_loss", "direction": "minimize"},
        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0},
                  "n": {"type": "int", "low": 1, "high": 64, "log": True},
                  "act": {"type": "categorical", "choices": ["relu", "gelu", "tanh"]}},
        "search": {"algorithm": "random", "n_trials": n, "max_concurrent": slots, "seed": seed},
        "training": {"dataset": "synthetic", "epochs": 1},  # unused: the thread engine runs ``_noop``
        "resources": {"processes": 1, "cpus_per_process": 1},
        # The oracle's precheck (built-in trainer only) would start a torch helper process: not the driver.
        "oracle": {"enabled": False},
    }
    stamps = _Stamps()
    engine = ThreadEngine(_noop, slots=slots)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        try:
            res = optimize(spec, Path(d) / "run", engine=engine, listener=stamps, handle_signals=False)
        finally:
            engine.close()
        wall = time.monotonic() - t0
        scan = waiting_scan_ms(res.study)
    return _Run(stamps, wall, res.summary.driver_overhead_s, res.summary.n_complete, scan)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=10_000)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--block", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", metavar="FILE", help="also write a cProfile of the run to FILE (slower)")
    a = ap.parse_args()
    if a.block < 1 or a.trials < a.block:
        raise SystemExit(f"--block must be between 1 and --trials ({a.trials}), but got {a.block}")

    if a.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        r = run(a.trials, a.slots, a.seed)
        prof.disable()
        prof.dump_stats(a.profile)
    else:
        r = run(a.trials, a.slots, a.seed)
    stamps, wall, overhead = r.stamps, r.wall, r.overhead
    if r.done != a.trials:
        raise RuntimeError(f"only {r.done} of {a.trials} trials completed")
    rows = curve(stamps.started, stamps.ends, a.block)
    print(f"{'trials':>8} {'ms/trial':>9} {'median gap ms':>14}")
    for row in rows:
        print(f"{row['upto']:>8} {row['ms_per_trial']:>9.2f} {row['median_gap_ms']:>14.2f}")
    k = min(1000, a.trials)
    ends = [stamps.started, *stamps.ends]
    first = (ends[k] - ends[0]) / k * 1000
    last = (ends[-1] - ends[-1 - k]) / k * 1000
    loop_s = stamps.ends[-1] - stamps.started
    figures = {
        "trials": a.trials, "slots": a.slots, "block": a.block,
        "total_s": round(wall, 2),
        "loop_s": round(loop_s, 2),
        "outputs_s": round(wall - loop_s, 2),
        "driver_overhead_ms_per_trial": round(overhead / a.trials * 1000, 3),
        "ms_per_trial_first_1000": round(first, 3),
        "ms_per_trial_last_1000": round(last, 3),
        "growth_ratio": round(last / first, 2),
        # The median gap between two trial ends ignores stalls (another process taking the cores).
        "growth_ratio_median_gap": round(rows[-1]["median_gap_ms"] / rows[0]["median_gap_ms"], 2),
        "waiting_scan_ms_at_end": round(r.waiting_scan_ms, 3),
        "curve": [[row["upto"], row["ms_per_trial"]] for row in rows],
        "curve_median_gap": [[row["upto"], row["median_gap_ms"]] for row in rows],
    }
    print(f"{a.trials} trials in {wall:.1f} s ({loop_s:.1f} s in the driver loop, {wall - loop_s:.1f} s set-up and "
          f"final outputs); ms per trial: first {k} {first:.2f}, last {k} {last:.2f} "
          f"(x{figures['growth_ratio']}); driver's own accounting {figures['driver_overhead_ms_per_trial']:.2f} ms; "
          f"the WAITING-trial scan every ask() makes takes {r.waiting_scan_ms:.2f} ms at {a.trials} trials")
    emit(figures)


if __name__ == "__main__":
    main()
