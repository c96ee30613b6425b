"""Training code that starts processes the way real training code does: ``DataLoader(num_workers=2)``,
``torch.multiprocessing.spawn``, a ``multiprocessing.Pool`` and ``mp.Process``. Both a training function
(``procprog:trial``) and a program (``python procprog.py``, a command trial). Every process it starts
writes its pid to ``<trial dir>/pids/``, so a test can check that none outlives the trial.

``hold`` (a parameter; ``--hold`` for the program) > 0: before it returns, it leaves processes running
(a DataLoader iterator with persistent workers, an ``mp.Process`` and a ``subprocess`` sleeper; the
program's ``mp.Process`` is daemonic, as a program's end would otherwise wait for it) and sleeps ``hold``
seconds, writing ``<trial dir>/holding`` first. The program also opens 16 files before its first
spawn-context primitive (``torch.multiprocessing.spawn``'s queue, which starts a resource tracker) and
checks that multiprocessing wrote nothing into them (a stale resource-tracker descriptor would).
Score: the DataLoader's sum + the spawned ranks' + the pool's (2016 + 3 + 30).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.spawn import spawn as mp_spawn
from torch.utils.data import DataLoader, TensorDataset


def _note(out: Path, what: str) -> None:
    (out / "pids").mkdir(exist_ok=True)
    (out / "pids" / f"{what}-{os.getpid()}").write_text(str(os.getpid()))


def _worker_init(_: int) -> None:
    _note(Path(os.environ["PROCPROG_OUT"]), "dataloader")


def _spawned(i: int, out: str) -> None:
    _note(Path(out), "spawn")
    Path(out, f"spawned{i}").write_text(str(i + 1))


def _pooled(x: int) -> int:
    _note(Path(os.environ["PROCPROG_OUT"]), "pool")
    return x * x


def _sleep(seconds: float) -> None:
    _note(Path(os.environ["PROCPROG_OUT"]), "process")
    time.sleep(seconds)


def work(out: Path, hold: float, *, daemon: bool) -> dict[str, float]:
    os.environ["PROCPROG_OUT"] = str(out)  # what the started processes read (fork and spawn alike)
    ds = TensorDataset(torch.arange(64, dtype=torch.float32))
    total = sum(float(b.sum()) for (b,) in DataLoader(ds, batch_size=8, num_workers=2, worker_init_fn=_worker_init))
    mp_spawn(_spawned, args=(str(out),), nprocs=2, join=True)  # torch.multiprocessing.spawn
    total += sum(float(Path(out, f"spawned{i}").read_text()) for i in range(2))
    with mp.Pool(2) as pool:
        total += sum(pool.map(_pooled, range(5)))
    if hold > 0:
        it = iter(DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True, worker_init_fn=_worker_init))
        next(it)
        p = mp.Process(target=_sleep, args=(600.0,), daemon=daemon)
        p.start()
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        _note_pid(out, "subprocess", sleeper.pid)
        while len(list((out / "pids").glob("process-*"))) < 1:
            time.sleep(0.05)
        (out / "holding").write_text("1")
        time.sleep(hold)
    return {"score": total}


def _note_pid(out: Path, what: str, pid: int) -> None:
    (out / "pids" / f"{what}-{pid}").write_text(str(pid))


def trial(ctx: Any) -> dict[str, float]:
    result = work(Path(ctx.trial_dir), float(ctx.params.get("hold", 0.0)), daemon=False)
    ctx.report(1, **result)
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hold", type=float, default=0.0)
    a = p.parse_args()
    out = Path(os.environ["HPOFLOW_TRIAL_DIR"])
    files = [open(out / f"open{i}.txt", "w") for i in range(16)]  # held open on purpose
    result = work(out, a.hold, daemon=True)  # torch.multiprocessing.spawn's queue: its first spawn-context primitive
    for f in files:
        f.close()
    written = sum((out / f"open{i}.txt").stat().st_size for i in range(16))
    print(json.dumps({"written_into_open_files": written}), file=sys.stderr)
    print(f"score={result['score'] if written == 0 else -1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
