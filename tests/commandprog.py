"""A training program for command-trial tests (``training.command``), standard library only, so a trial
costs an interpreter start and no torch import.

Its "loss" after epoch ``e`` is ``(x - 0.3)**2 + 1/e``. Each epoch it appends ``e`` to
``$HPOFLOW_TRIAL_DIR/trained_rank<RANK>.txt`` (what it trained, over every run of the trial), saves
``{"epoch": e}`` to ``$HPOFLOW_CHECKPOINT_DIR/prog.json`` (rank 0), then reports: ``--report print``
(``epoch=E val_loss=V``), ``file`` (a JSON line to ``$HPOFLOW_METRICS_FILE``) or ``client``
(``hpoflow.client.report``). It starts after the epoch of the checkpoint it finds. With ``--ask`` every
rank asks ``hpoflow.client.should_stop()`` after each epoch and stops when it is true. ``--env FILE``
writes its environment, argv, ``sys.path[0]`` and whether torch was imported before it as JSON first;
``--fail N`` writes to stderr and exits with code N. ``--color`` prints its lines in ANSI colours (as
``rich`` or ``colorama`` do where forced to). ``--kill-attempts N``: on the trial's attempts before N
(``HPOFLOW_ATTEMPT``) it kills itself with SIGKILL after its first epoch, as the kernel's OOM killer would.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--x", type=float, default=0.5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--report", choices=["print", "file", "client"], default="print")
    p.add_argument("--metric", default="val_loss")
    p.add_argument("--ask", action="store_true")
    p.add_argument("--env", default="")
    p.add_argument("--fail", type=int, default=0)
    p.add_argument("--color", action="store_true")
    p.add_argument("--kill-attempts", type=int, default=0)
    a = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    if a.env:  # what it was started with: a warm start (runpy in a forked worker) has torch imported already
        seen = {"environ": dict(os.environ), "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                "torch_imported": "torch" in sys.modules, "pid": os.getpid(), "pgid": os.getpgrp()}
        Path(a.env.replace("RANK", str(rank))).write_text(json.dumps(seen))
    if a.fail:
        print(f"rank {rank}: something went wrong on purpose", file=sys.stderr)
        return a.fail
    trial_dir = Path(os.environ.get("HPOFLOW_TRIAL_DIR", "."))
    ckpt_dir = os.environ.get("HPOFLOW_CHECKPOINT_DIR")
    ckpt = Path(ckpt_dir) / "prog.json" if ckpt_dir else None
    start = 1
    if ckpt is not None and ckpt.exists():
        start = json.loads(ckpt.read_text())["epoch"] + 1
    from hpoflow import client

    for epoch in range(start, a.epochs + 1):
        time.sleep(a.sleep)
        with open(trial_dir / f"trained_rank{rank}.txt", "a") as f:
            f.write(f"{epoch}\n")
        loss = (a.x - 0.3) ** 2 + 1.0 / epoch
        if rank == 0 and ckpt is not None:
            tmp = ckpt.with_suffix(".tmp")
            tmp.write_text(json.dumps({"epoch": epoch}))
            os.replace(tmp, ckpt)
        if rank == 0:
            if a.report == "print" and a.color:  # a bold name, a green value, a reset after each
                print(f"\x1b[1mepoch\x1b[0m={epoch} \x1b[1;32m{a.metric}={loss:.6f}\x1b[0m", flush=True)
            elif a.report == "print":
                print(f"epoch={epoch} {a.metric}={loss:.6f}", flush=True)
            elif a.report == "file":
                with open(os.environ["HPOFLOW_METRICS_FILE"], "a") as f:
                    f.write(json.dumps({"step": epoch, a.metric: loss}) + "\n")
            else:
                client.report(epoch, **{a.metric: loss})
        if int(os.environ.get("HPOFLOW_ATTEMPT", "0")) < a.kill_attempts:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if a.ask:
            if client.should_stop():
                print(f"rank {rank}: stopping after epoch {epoch} (pausing: {client.pausing()})", flush=True)
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
