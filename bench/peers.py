"""hpoflow against its peers, side by side in one run: the same user code through ``hpoflow run``
(process isolation: warm workers of the local engine) and through plain Optuna with threads
(``study.optimize(n_jobs=slots)``, in-memory, no isolation), and Ray Tune where it is installed
(it is skipped otherwise).

Two studies, each run as a fresh process the way a person starts it, alternating hpoflow and Optuna
in every repeat (medians reported):

- digits: ``--digits-trials`` (12) TPE trials of ``--epochs`` (15) epochs of a digits CNN written as
  user code (``bench/peer_objectives.py``: it imports torch itself; hpoflow runs it as
  ``training.function``), ``--slots`` (2) at a time. The Optuna script's clock starts before it
  imports torch, as a user's script's does: both walls run from the command to its exit.
- short: ``--short-trials`` (100) trials of a 50 ms sleep (``bench_objectives.sleep50``).

Figures: wall; overhead per trial and slot on the short study, ``(span x slots - trials x 50 ms) /
trials``, with span from the first trial's start to the last one's end (the fixed start-up cost, the
rest of the wall, is printed apart); peak summed PSS of the run's processes (the command and every
process below it: hpoflow's driver, forkserver and workers; ``psutil``'s ``memory_full_info().pss``,
sampled every ``--pss-interval`` s); hpoflow's per-trial durations of the digits study (every trial
does the same work: first trial on a slot against the later ones). Ratios are hpoflow / Optuna.

    python bench/peers.py [--digits-trials 12] [--epochs 15] [--short-trials 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml
from _common import BENCH, emit, median
from peer_space import SPACE

ROOT = BENCH.parent
FN_S = 0.05

OPTUNA_SCRIPT = '''
import json, sys, time
import optuna

optuna.logging.set_verbosity(optuna.logging.WARNING)
kind, n, slots, epochs, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
log = []
if kind == "digits":
    from {module} import {factory}  # torch with it: the clock started before

    objective = {factory}(epochs, log)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0))
else:
    def objective(trial):
        t0 = time.time()
        x = trial.suggest_float("x", 0, 1)
        time.sleep({fn_s})
        log.append((t0, time.time()))
        return x
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
study.optimize(objective, n_trials=n, n_jobs=slots)
json.dump(log, open(out, "w"))
'''


def _env() -> dict[str, str]:
    # the user code lives in bench/; hpoflow itself from this checkout
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _role(p: psutil.Process) -> str:
    """A short name for a process of the run: driver, forkserver, worker, ..."""
    try:
        cmd = " ".join(p.cmdline())
        parent = p.parent()
        if "forkserver" in cmd and parent is not None and "forkserver" in " ".join(parent.cmdline()):
            return "warm-worker"  # forked from the forkserver: its command line is the forkserver's
    except psutil.Error:
        return "?"
    for key, name in (("forkserver", "forkserver"), ("resource_tracker", "resource-tracker"),
                      ("spawn_main", "light-worker"), ("hpoflow run", "driver"), ("optuna_study", "optuna")):
        if key in cmd:
            return name
    return str(p.name())


class PeakPss:
    """The peak over time of the summed PSS of a process and everything below it."""

    def __init__(self, pid: int, interval: float) -> None:
        self.pid, self.interval, self.peak = pid, interval, 0
        self.parts: list[tuple[str, int]] = []  # (process, PSS MB) at the peak
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            total, parts = 0, []
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for p in procs:
                try:
                    pss = p.memory_full_info().pss
                    parts.append((_role(p), round(pss / 1e6)))
                    total += pss
                except psutil.Error:  # gone meanwhile
                    pass
            if total > self.peak:
                self.peak, self.parts = total, parts
            self._stop.wait(self.interval)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 1e9  # GB


def run_cmd(cmd: list[str], cwd: Path, pss_interval: float) -> tuple[float, float, list[tuple[str, int]]]:
    """(wall s, peak summed PSS GB, its parts) of a command, from its start to its exit."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    pss = PeakPss(proc.pid, pss_interval)
    _, err = proc.communicate()
    wall = time.perf_counter() - t0
    peak = pss.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {err[-2000:]}")
    return wall, peak, pss.parts


def hpoflow_run(d: Path, kind: str, n: int, slots: int, epochs: int, pss_interval: float) -> dict[str, Any]:
    if kind == "digits":  # the space apart from the user code: this process imports no torch, no scikit-learn
        spec: dict[str, Any] = {
            "study": {"name": "peers-digits", "metric": "val_accuracy", "direction": "maximize"},
            "space": SPACE,
            "search": {"algorithm": "tpe", "n_trials": n, "max_concurrent": slots, "seed": 0},
            "training": {"function": "peer_objectives:digits_cnn", "options": {"epochs": epochs}},
        }
    else:
        spec = {"study": {"name": "peers-short", "metric": "value", "direction": "minimize"},
                "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
                "search": {"algorithm": "random", "n_trials": n, "max_concurrent": slots, "seed": 0},
                "training": {"function": "bench_objectives:sleep50"}}
    spec["resources"] = {"processes": 1, "cpus_per_process": 1}
    path = d / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(spec))
    run_dir = d / f"run-{kind}-{time.monotonic_ns()}"
    wall, pss, parts = run_cmd([sys.executable, "-m", "hpoflow", "run", str(path), "--run-dir", str(run_dir),
                                "--quiet"], BENCH, pss_interval)
    with open(run_dir / "trials.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("state") == "COMPLETE"]
    if len(rows) != n:
        raise RuntimeError(f"hpoflow completed {len(rows)} of {n} trials")
    starts = [float(r["timing_started_at"]) for r in rows]
    ends = [float(r["timing_started_at"]) + float(r["duration_s"]) for r in rows]
    rows.sort(key=lambda r: float(r["timing_started_at"]))
    return {"wall": wall, "pss": pss, "parts": parts, "span": max(ends) - min(starts),
            "durations": [float(r["duration_s"]) for r in rows]}


def optuna_run(d: Path, kind: str, n: int, slots: int, epochs: int, pss_interval: float) -> dict[str, Any]:
    script = d / "optuna_study.py"
    script.write_text(OPTUNA_SCRIPT.format(module="peer_objectives", factory="optuna_objective", fn_s=FN_S))
    out = d / "optuna_log.json"
    wall, pss, parts = run_cmd([sys.executable, str(script), kind, str(n), str(slots), str(epochs), str(out)], BENCH,
                               pss_interval)
    log = json.loads(out.read_text())
    return {"wall": wall, "pss": pss, "parts": parts, "span": max(e for _, e in log) - min(s for s, _ in log)}


def overhead_ms(span: float, n: int, slots: int) -> float:
    return (span * slots - n * FN_S) / n * 1000.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--digits-trials", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--short-trials", type=int, default=100)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pss-interval", type=float, default=0.5)
    a = ap.parse_args()
    if importlib.util.find_spec("ray") is None:
        print("Ray Tune: not installed here, skipped (pip install 'ray[tune]' adds its column)", flush=True)
    load0 = os.getloadavg()[0]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {k: {"hpoflow": [], "optuna": []}
                                                         for k in ("digits", "short")}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for i in range(a.repeats):
            for kind, n in (("digits", a.digits_trials), ("short", a.short_trials)):
                order = ("hpoflow", "optuna") if i % 2 == 0 else ("optuna", "hpoflow")
                for who in order:
                    fn = hpoflow_run if who == "hpoflow" else optuna_run
                    r = fn(d, kind, n, a.slots, a.epochs, a.pss_interval)
                    runs[kind][who].append(r)
                    print(f"repeat {i + 1} {kind:6s} {who:7s}: wall {r['wall']:.2f} s, peak PSS {r['pss']:.3f} GB"
                          + (f", overhead {overhead_ms(r['span'], n, a.slots):.1f} ms per trial and slot"
                             if kind == "short" else "") + f" (MB at the peak: {r['parts']})", flush=True)
    load1 = os.getloadavg()[0]

    def med(kind: str, who: str, key: str) -> float:
        return median([r[key] for r in runs[kind][who]])

    figures: dict[str, Any] = {"load_before": round(load0, 2), "load_after": round(load1, 2), "repeats": a.repeats,
                               "slots": a.slots, "digits_trials": a.digits_trials, "epochs": a.epochs,
                               "short_trials": a.short_trials, "ray": "not installed"}
    for kind in ("digits", "short"):
        n = a.digits_trials if kind == "digits" else a.short_trials
        for who in ("hpoflow", "optuna"):
            figures[f"{kind}_{who}_wall_s"] = round(med(kind, who, "wall"), 2)
            figures[f"{kind}_{who}_peak_pss_gb"] = round(med(kind, who, "pss"), 3)
            if kind == "short":
                figures[f"short_{who}_overhead_ms_per_trial_slot"] = round(
                    median([overhead_ms(r["span"], n, a.slots) for r in runs[kind][who]]), 2)
                figures[f"short_{who}_fixed_s"] = round(median([r["wall"] - r["span"] for r in runs[kind][who]]), 2)
        figures[f"{kind}_wall_ratio"] = round(figures[f"{kind}_hpoflow_wall_s"] / figures[f"{kind}_optuna_wall_s"], 3)
        # a run shorter than the sampling interval (tiny arguments, a loaded machine) may end before a
        # sample: no peak, no ratio (None), rather than a made-up one
        hp, op = figures[f"{kind}_hpoflow_peak_pss_gb"], figures[f"{kind}_optuna_peak_pss_gb"]
        figures[f"{kind}_pss_ratio"] = round(hp / op, 3) if hp > 0 and op > 0 else None
    # every digits trial does the same work: the first trial on each slot against the later ones
    # next to it, the noise floor: how far a typical later trial is from the median of the later ones
    spreads, noise = [], []
    for r in runs["digits"]["hpoflow"]:
        durs = r["durations"]
        first, later = durs[: a.slots], durs[a.slots :]
        if later:
            spreads.append(max(abs(f / median(later) - 1.0) for f in first))
            noise.append(median([abs(x / median(later) - 1.0) for x in later]))
    figures["digits_first_vs_later_duration"] = round(median(spreads), 3) if spreads else None
    figures["digits_later_vs_later_duration"] = round(median(noise), 3) if noise else None
    f = figures
    print(f"digits: wall hpoflow {f['digits_hpoflow_wall_s']} s vs optuna threads {f['digits_optuna_wall_s']} s "
          f"(ratio {f['digits_wall_ratio']}, goal <= 1); peak summed PSS {f['digits_hpoflow_peak_pss_gb']} vs "
          f"{f['digits_optuna_peak_pss_gb']} GB (ratio {f['digits_pss_ratio']}, goal <= 1.2); first trial on a "
          f"slot vs later: {f['digits_first_vs_later_duration']} (goal < 0.10; a later trial's typical distance "
          f"from their median: {f['digits_later_vs_later_duration']})")
    print(f"short: overhead per trial and slot hpoflow {f['short_hpoflow_overhead_ms_per_trial_slot']} ms vs optuna "
          f"threads {f['short_optuna_overhead_ms_per_trial_slot']} ms (goal <= 10); fixed start-up "
          f"{f['short_hpoflow_fixed_s']} vs {f['short_optuna_fixed_s']} s; wall {f['short_hpoflow_wall_s']} vs "
          f"{f['short_optuna_wall_s']} s; peak PSS {f['short_hpoflow_peak_pss_gb']} vs "
          f"{f['short_optuna_peak_pss_gb']} GB; load {f['load_before']} -> {f['load_after']}")
    emit(figures)


if __name__ == "__main__":
    main()
