"""Per-trial bookkeeping stays cheap: one durable write per finished trial, and a usage sampler sized
to the trial (no thread started per trial, no sample before a trial has run a second)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import hpoflow
from hpoflow.engines.threads import ThreadEngine
from hpoflow.train.usage import UsageSampler


def _spec(n: int) -> dict[str, Any]:
    return {
        "study": {"name": "fsyncs", "metric": "value", "direction": "minimize"},
        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "search": {"algorithm": "random", "n_trials": n, "max_concurrent": 1, "seed": 0},
        "training": {"function": "tests.trainfns:behave"}, "oracle": {"enabled": False},
    }


def _fsyncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int) -> int:
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    calls = []
    real = os.fsync

    def counting(fd: Any) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    res = hpoflow.optimize(_spec(n), tmp_path / f"run{n}", engine=ThreadEngine(lambda p, r: p["x"], 1))
    monkeypatch.setattr(os, "fsync", real)
    assert res.summary.n_complete == n
    assert len(list((tmp_path / f"run{n}" / "trials").glob("*/result.json"))) == n  # still written, atomically
    return len(calls)


def test_a_finished_trial_costs_one_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal's append that finishes a trial is its one durable write: result.json is written
    atomically but not fsynced (the run's own files, written once, do not grow with the trials)."""
    monkeypatch.delenv("HPOFLOW_JOURNAL_FSYNC", raising=False)
    assert _fsyncs(tmp_path, monkeypatch, 8) - _fsyncs(tmp_path, monkeypatch, 4) == 4


def test_a_short_trial_is_sampled_once_at_its_end_without_a_thread_of_its_own() -> None:
    UsageSampler().start().stop()  # the process's one sampling thread exists from here on
    threads = threading.active_count()
    for _ in range(20):
        s = UsageSampler().start()
        assert threading.active_count() == threads  # no thread started per trial
        assert s._rss == []  # nothing sampled at the start
        summary = s.stop()
        assert len(s._rss) == 1 and summary["rss_peak_mb"] > 0 and summary["rss_mean_mb"] == summary["rss_peak_mb"]
    assert threading.active_count() == threads


def test_a_long_trial_is_sampled_while_it_runs() -> None:
    s = UsageSampler(interval_s=0.02, quiet_s=0.05).start()
    deadline = time.monotonic() + 30  # generous: a loaded machine delays the thread, never stops it
    while len(s._rss) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    summary = s.stop()
    assert len(s._rss) >= 4  # samples while it ran, and the one at its end
    assert summary["cpu_percent"] >= 0 and summary["rss_peak_mb"] >= summary["rss_mean_mb"] > 0
    n = len(s._rss)
    time.sleep(0.1)
    assert len(s._rss) == n  # a stopped sampler is sampled no more
