"""`hpoflow dashboard` serves optuna-dashboard on a run's storage, on 127.0.0.1 only; its HTTP API
lists the study; Ctrl-C (SIGINT) stops it cleanly. It is read-only and answers only its own host: a
DNS-rebinding request (another Host) and every write method are refused, and the journal is unchanged."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import importlib.util
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

import hpoflow
from hpoflow.engines.threads import ThreadEngine

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("optuna_dashboard") is None:  # (the tests run it in a subprocess: no import here,
    pytest.skip("could not import 'optuna_dashboard'", allow_module_level=True)  # 1.2 CPU-s per xdist worker)


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


def _start(run_dir: Path, cwd: Path) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-m", "hpoflow", "dashboard", str(run_dir), "--port", "0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=cwd)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
    assert m, line
    return proc, int(m.group(1))


def _request(port: int, method: str, path: str, host: str | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"Host": host if host is not None else f"127.0.0.1:{port}"}
        body = b"{}" if method in ("POST", "PUT") else None
        conn.request(method, path, body=body, headers={**headers, "Content-Type": "application/json"}
                     if body else headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _finished_study(tmp_path: Path) -> Path:
    """The run directory of a finished 3-trial study (threads engine) for the dashboard to serve."""
    spec = {"study": {"name": "dash", "metric": "x", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 3, "seed": 0},
            "training": {"function": "tests.trainfns:behave"}, "oracle": {"enabled": False}}
    run = tmp_path / "run"
    hpoflow.optimize(spec, run, engine=ThreadEngine(lambda p, r: p["x"], 1))
    return run


def test_the_dashboard_is_read_only_and_answers_only_its_own_host(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    run = _finished_study(tmp_path)
    journal = run / "study.journal"
    before = hashlib.sha256(journal.read_bytes()).hexdigest()
    proc, port = _start(run, tmp_path)
    try:
        for _ in range(50):  # the server answers once it has bound (it has: the line is printed after)
            try:
                status, body = _request(port, "GET", "/api/studies")
                break
            except OSError:
                time.sleep(0.1)
        assert status == 200 and [s["study_name"] for s in json.loads(body)["study_summaries"]] == ["dash"]
        # the DNS-rebinding request of issue 25: a page of attacker.example resolved to 127.0.0.1
        status, body = _request(port, "DELETE", "/api/studies/0", host="attacker.example")
        assert status == 421 and b"answers only" in body, (status, body)
        for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1", f"127.0.0.1:{port + 1}",
                     f"localhost.attacker.example:{port}", ""):
            assert _request(port, "GET", "/api/studies", host=host)[0] == 421, host
        for method, path in [("DELETE", "/api/studies/0"), ("POST", "/api/studies"),
                             ("POST", "/api/studies/0/rename"), ("PUT", "/api/studies/0/note"),
                             ("POST", "/api/trials/0/tell"), ("POST", "/api/trials/0/user-attrs"),
                             ("PATCH", "/api/studies/0"), ("POST", "/incompatible-rdb-schema")]:
            for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
                status, body = _request(port, method, path, host=host)
                assert status == 405 and b"read-only" in body, (method, path, status, body)
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}"):
            assert _request(port, "GET", "/api/studies", host=host)[0] == 200, host
        status, body = _request(port, "GET", "/dashboard")
        assert status == 200 and b"<html" in body.lower()
        status, body = _request(port, "GET", "/api/studies/0")
        assert status == 200 and len(json.loads(body)["trials"]) == 3
        assert _request(port, "HEAD", "/api/studies")[0] == 200
        # a signal that lands inside a request stops it too (wsgiref's handler once caught the
        # KeyboardInterrupt, printed it and served on): requests keep coming while it is sent
        stop = threading.Event()

        def hammer() -> None:
            while not stop.is_set():
                with contextlib.suppress(OSError, http.client.HTTPException):
                    _request(port, "GET", "/api/studies/0")

        workers = [threading.Thread(target=hammer, daemon=True) for _ in range(2)]
        for w in workers:
            w.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0  # generous: a loaded machine slows the request in hand
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=30)
        assert proc.stderr is not None and "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert hashlib.sha256(journal.read_bytes()).hexdigest() == before  # not a byte appended
    shown = subprocess.run([sys.executable, "-m", "hpoflow", "status", str(run), "--json"], capture_output=True,
                           text=True, timeout=60, cwd=tmp_path)
    assert shown.returncode == 0 and json.loads(shown.stdout)["n_complete"] == 3, shown.stderr


def test_the_dashboards_storage_refuses_every_write(tmp_path: Path) -> None:
    """Even a route that wrote on a GET could not change the study: the storage it is given refuses."""
    import optuna

    from hpoflow.cli._readonly import ReadOnlyStorage

    inner = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=inner, study_name="s")

    def objective(trial: optuna.Trial) -> float:
        return trial.suggest_float("x", 0, 1)

    study.optimize(objective, n_trials=2)
    ro = ReadOnlyStorage(inner)
    sid = ro.get_study_id_from_name("s")
    tid = ro.get_all_trials(sid)[0]._trial_id
    assert ro.get_study_name_from_id(sid) == "s" and len(ro.get_all_trials(sid)) == 2
    assert ro.get_best_trial(sid).number in (0, 1) and ro.get_n_trials(sid) == 2
    writes: list[Callable[[], object]] = [lambda: ro.create_new_study([optuna.study.StudyDirection.MINIMIZE], "t"),
              lambda: ro.delete_study(sid), lambda: ro.set_study_user_attr(sid, "k", 1),
              lambda: ro.set_study_system_attr(sid, "k", 1), lambda: ro.create_new_trial(sid),
              lambda: ro.set_trial_param(tid, "x", 0.5, optuna.distributions.FloatDistribution(0, 1)),
              lambda: ro.set_trial_state_values(tid, optuna.trial.TrialState.FAIL),
              lambda: ro.set_trial_intermediate_value(tid, 1, 0.5), lambda: ro.set_trial_user_attr(tid, "k", 1),
              lambda: ro.set_trial_system_attr(tid, "k", 1)]
    for write in writes:
        with pytest.raises(PermissionError, match="read-only"):
            write()
    with pytest.raises(PermissionError):
        optuna.load_study(study_name="s", storage=ro).set_user_attr("k", 1)
    assert len(inner.get_all_studies()) == 1 and inner.get_study_user_attrs(sid) == {}


def test_a_stalled_client_neither_holds_up_other_clients_nor_the_stop(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 38, item 6: a client that sends a request line and then nothing (a browser's preconnect does)
    once held the one serving thread: no other client got an answer, and SIGTERM waited for it to leave."""
    monkeypatch.chdir(ROOT)
    run = _finished_study(tmp_path)
    proc, port = _start(run, tmp_path)
    stalled: list[socket.socket] = []
    try:
        assert _request(port, "GET", "/api/studies")[0] == 200  # started and warm: the app has read the study
        server = psutil.Process(proc.pid)
        for _ in range(2):  # two: the second waits in the listen queue, ahead of the requests below
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"GET / HTTP/1.1\r\n")  # then nothing: no headers, no blank line, socket held open
            stalled.append(s)
            if len(stalled) == 1:  # wait until the server has taken the first in hand (not a fixed sleep)
                deadline = time.monotonic() + 30
                while not any(c.status == psutil.CONN_ESTABLISHED for c in server.net_connections(kind="tcp")):
                    assert time.monotonic() < deadline, "the server never accepted the stalled client"
                    time.sleep(0.02)
        for path in ("/api/studies", "/api/studies/0"):
            t0 = time.monotonic()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            try:
                conn.request("GET", path, headers={"Host": f"127.0.0.1:{port}"})
                resp = conn.getresponse()
                status, body = resp.status, resp.read()
            finally:
                conn.close()
            elapsed = time.monotonic() - t0
            assert status == 200 and body, (path, status)
            assert elapsed < 1.0, f"{path} answered after {elapsed:.2f} s beside a stalled client"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
        assert code == 0 and elapsed < 1.0, f"exit {code} {elapsed:.2f} s after SIGTERM, stalled clients connected"
        assert proc.stderr is not None and "Traceback" not in proc.stderr.read()
    finally:
        for s in stalled:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
