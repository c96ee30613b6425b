"""`hpoflow dashboard` serves optuna-dashboard on a run's storage, on 127.0.0.1 only; its HTTP API
lists the study; Ctrl-C (SIGINT) stops it cleanly."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

import hpoflow
from hpoflow.engines.threads import ThreadEngine

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("optuna_dashboard")


def test_the_dashboard_serves_the_study_on_loopback_and_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    monkeypatch.chdir(ROOT)
    spec = {"study": {"name": "dash", "metric": "x", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 3, "seed": 0},
            "training": {"function": "tests.trainfns:behave"}, "oracle": {"enabled": False}}
    hpoflow.optimize(spec, tmp_path / "run", engine=ThreadEngine(lambda p, r: p["x"], 1))
    proc = subprocess.Popen([sys.executable, "-m", "hpoflow", "dashboard", str(tmp_path / "run"), "--port", "0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=tmp_path)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert m, line
        port = int(m.group(1))
        listening = [c.laddr for c in psutil.Process(proc.pid).net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
        body = b""
        for _ in range(50):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as r:
                    body = r.read()
                break
            except OSError:
                time.sleep(0.1)
        studies = json.loads(body)["study_summaries"]
        assert [s["study_name"] for s in studies] == ["dash"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
