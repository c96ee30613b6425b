"""What the local engine's forkserver does before it forks warm workers (``_preload``,
``_preload_done``, ``_pages``): its warm-up starts no thread, so forking stays safe; it lets go of the
library pages only its imports touched, and torch and NumPy compute the same afterwards; and a warm
worker that trains shares what the warm-up set up instead of making its own copy. Real processes and
real torch throughout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpoflow.engines.local._pool import WorkerPool
from tests.conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _last_json(args: list[str], env: dict[str, str], cwd: Path | None = None) -> dict[str, int]:
    """Run ``python ARGS``; it prints one JSON object as its last line."""
    out = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600,
                         check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _python(code: str, **env: str) -> dict[str, int]:
    """Run ``code`` in a fresh interpreter (see ``_last_json``)."""
    return _last_json(["-c", textwrap.dedent(code)], {**ENV, **env})


def _status_kb(pid: int | str, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def test_the_warm_up_trains_without_starting_a_thread() -> None:
    """The forkserver forks after its warm-up: a thread started there (torch's intra-op pool) would be
    missing, with whatever lock it held, in every worker."""
    got = _python("""
        import json, os, torch
        import hpoflow.engines.local._preload as pre  # HPOFLOW_NO_WARMUP: imported without the warm-up
        before = len(os.listdir("/proc/self/task"))
        threads = torch.get_num_threads()
        pre.warm_up()
        print(json.dumps({"before": before, "after": len(os.listdir("/proc/self/task")),
                          "threads": threads, "threads_after": torch.get_num_threads()}))
    """, HPOFLOW_NO_WARMUP="1")
    assert got["after"] == got["before"]
    assert got["threads_after"] == got["threads"]  # the count a worker's trial starts from is unchanged


def test_dropped_library_pages_come_back_unchanged_and_relocated_data_is_kept() -> None:
    """After ``drop_clean_file_pages`` most of torch's mapped code is gone from the process, and a
    training step computes bit for bit what it computed before: code and read-only data map again from
    the file, and no relocated (written) page was dropped, or the process would crash."""
    got = _python("""
        import json, numpy as np, torch
        from hpoflow.engines.local._pages import drop_clean_file_pages

        def step():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                        torch.nn.Linear(4 * 6 * 6, 3))
            opt = torch.optim.Adam(model.parameters())
            loss = torch.nn.functional.cross_entropy(model(torch.randn(5, 1, 8, 8)), torch.tensor([0, 1, 2, 0, 1]))
            loss.backward()
            opt.step()
            return [float(loss), float(sum(p.sum() for p in model.parameters())),
                    float(np.linalg.svd(np.arange(16.0).reshape(4, 4))[1][0])]

        def rss_file():
            return int([l for l in open("/proc/self/status") if l.startswith("RssFile:")][0].split()[1])

        first = step()
        before = rss_file()
        dropped = drop_clean_file_pages()
        after = rss_file()
        print(json.dumps({"first": first, "again": step(), "before": before, "after": after,
                          "dropped": dropped}))
    """)
    assert got["again"] == got["first"]
    assert got["dropped"] > 0
    # torch's code is most of a process's file pages after its import: well over half of them go
    assert got["after"] < got["before"] / 2, got


def test_the_forkserver_of_a_pool_holds_no_import_only_library_pages() -> None:
    pool = WorkerPool(1)
    try:
        assert pool.wait_warm(600)
        worker = next(iter(pool.workers.values()))
        assert worker.proc.pid is not None
        stat = Path(f"/proc/{worker.proc.pid}/stat").read_text()
        forkserver = int(stat.rsplit(")", 1)[1].split()[1])  # the worker's parent
        # Without the drop the forkserver maps ~120 MB of library pages, against ~280 MB of its own
        # memory; with it, a few MB (what its own loop touched since).
        assert _status_kb(forkserver, "RssFile") < _status_kb(forkserver, "RssAnon") / 4
    finally:
        pool.close()


def test_a_warm_worker_that_trains_makes_little_of_the_preload_its_own(tmp_path: Path) -> None:
    """A forked worker's private memory after a first training step, with the forkserver's warm-up
    against without it (~27 MB against ~135 MB here): what the first optimizer imports (torch._dynamo),
    what torch sets up at its first step and pydantic at its first validation is shared, not copied
    into each worker. It counts pages, not time: load does not change it."""
    (tmp_path / "probe.py").write_text(textwrap.dedent("""
        import json, os, sys, torch
        from hpoflow.spec import TrainConfig

        def private_kb():
            kb = 0
            for line in open("/proc/self/smaps_rollup"):
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    kb += int(line.split()[1])
            return kb

        def train(q):
            torch.set_num_threads(1)
            TrainConfig.model_validate({"function": "probe:train", "options": {"epochs": 1}})
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                        torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 10))
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for _ in range(3):
                opt.zero_grad()
                x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            q.put(private_kb())

        if __name__ == "__main__":
            import multiprocessing as mp
            from hpoflow.engines.local._pool import _preload_list
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(_preload_list(["hpoflow.engines.local._preload"]))
            q = ctx.Queue()
            p = ctx.Process(target=train, args=(q,))
            p.start()
            print(json.dumps({"private_kb": q.get(timeout=600)}))
            p.join()
    """))
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}

    def private_kb(**extra: str) -> int:
        return _last_json([str(tmp_path / "probe.py")], {**env, **extra}, cwd=tmp_path)["private_kb"]

    cold = private_kb(HPOFLOW_NO_WARMUP="1")
    warm = private_kb()
    assert warm < cold / 2, (warm, cold)


def test_a_forkserver_whose_parent_dies_during_its_preload_stops_at_its_next_import() -> None:
    """A driver killed (``kill -9``, the OOM killer) while its forkserver imports torch: the forkserver
    stops at its next import (``_preload_guard``) instead of importing and warming up for seconds more
    for a parent that is gone. A subreaper starts the parent, waits until the forkserver has spent
    0.2 CPU-s (past the interpreter's start and the guard: the first module it preloads), kills the
    parent, and takes the orphaned forkserver's end with its CPU time (``wait4``)."""
    got = _python("""
        import json, os, subprocess, sys, textwrap, time
        import psutil
        from hpoflow.engines.proc import become_subreaper

        assert become_subreaper()
        parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent('''
            import time
            from multiprocessing import forkserver
            from hpoflow.engines.local._forkserver import ensure_forkserver
            from hpoflow.engines.local._pool import use_engine_preload
            use_engine_preload()
            ensure_forkserver()
            print(forkserver._forkserver._forkserver_pid, flush=True)
            time.sleep(600)
        ''')], stdout=subprocess.PIPE, text=True)
        fs = int(parent.stdout.readline())
        cpu = psutil.Process(fs).cpu_times
        deadline = time.monotonic() + 120
        while cpu().user + cpu().system < 0.2 and time.monotonic() < deadline:
            time.sleep(0.005)
        parent.kill()
        parent.wait()
        _, status, usage = os.wait4(fs, 0)  # reparented to this subreaper
        print(json.dumps({"cpu_s": usage.ru_utime + usage.ru_stime, "exit": os.waitstatus_to_exitcode(status)}))
    """)
    assert got["exit"] == 0
    # a whole preload costs 2-2.5 CPU-s here (torch's import alone over 1); stopped at the next import
    # after the parent's death, it costs the 0.2 waited for and a few ms more
    assert got["cpu_s"] < 1.0, got


def test_the_preload_runs_without_the_cyclic_collector_and_the_processes_forked_after_it_have_it(
        tmp_path: Path) -> None:
    """``_preload_guard`` turns the collector off for the preload (its passes over torch's growing heap
    cost ~0.4 CPU-s there); ``_preload_done`` turns it back on, collects and freezes, so a process
    forked afterwards (a warm worker) collects as any process does, over its own objects only. A
    module preloaded between the two records what it saw; a process forked from the forkserver says
    what it has."""
    (tmp_path / "gcprobe.py").write_text(textwrap.dedent("""
        import gc
        DURING_PRELOAD = gc.isenabled()

        def report(conn):
            conn.send({"during_preload": DURING_PRELOAD, "forked": gc.isenabled(), "frozen": gc.get_freeze_count()})
    """))
    got = _last_json(["-c", textwrap.dedent("""
        import gc, json
        import multiprocessing as mp
        import gcprobe
        from hpoflow.engines.local._forkserver import use_preload
        use_preload(["hpoflow.engines.local._preload_guard", "gcprobe", "hpoflow.engines.local._preload_done"])
        ctx = mp.get_context("forkserver")
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=gcprobe.report, args=(theirs,))
        p.start()
        got = mine.recv()
        p.join()
        print(json.dumps({**got, "starter": gc.isenabled()}))
    """)], {**ENV, "PYTHONPATH": f"{ROOT}:{tmp_path}"}, cwd=tmp_path)
    assert got["during_preload"] is False, got
    assert got["forked"] is True and got["starter"] is True, got  # on again after it, and never off here
    assert got["frozen"] > 0, got  # what the preload left is out of the collector's reach
