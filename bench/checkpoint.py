"""Checkpoint cost of the built-in trainer: the CNN on digits, one rank, one thread, a checkpoint
every epoch, written synchronously or in a background thread (the default).

Per epoch: the time the training thread spends in ``save_checkpoint`` (the state copy, the RNG
states, the wait for the previous write, and in sync mode the write itself: serialise, SHA-256, write,
fsync, rename, fsync of the directory) over the epoch's wall time (report to report, which includes
the save). Medians over epochs 2..N of several runs (epoch 1 pays one-time costs). Also shown: the
background write's own time, the file size, and the epoch time against a run without checkpoints
(noisy on shared cores: the write thread competes for the GIL and the disk).

    python bench/checkpoint.py [--epochs 10] [--repeats 3]

The last line is one JSON object: ``overhead_fraction`` (async, the default mode),
``overhead_fraction_sync``, ``size_bytes`` and the medians behind them.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import emit, median

from hpoflow.spec import TrainConfig
from hpoflow.train.builtin import train_builtin
from hpoflow.train.context import TrialContext


class TimedContext(TrialContext):
    """Records, at every report, the wall clock and the training thread's checkpoint time so far."""

    marks: list[tuple[float, float]]

    def report(self, step: int, **metrics: float) -> None:
        super().report(step, **metrics)
        self.marks.append((time.perf_counter(), self.checkpoint_s))


def run_once(mode: str, epochs: int, workdir: Path) -> dict[str, Any]:
    every = 0 if mode == "off" else 1
    cfg = TrainConfig(model="cnn", dataset="digits", epochs=epochs, batch_size=64, optimizer="adam", lr=3e-3,
                      seed=0, checkpoint={"every": every, "keep": 2, "async": mode == "async"})
    torch.manual_seed(0)
    ctx = TimedContext(params={}, config=cfg, trial_number=0, trial_dir=workdir)
    ctx.marks = []
    train_builtin(ctx)
    # Interval e -> e+1 holds epoch e's checkpoint (saved after its report) and epoch e+1's training.
    epoch_s, save_s = [], []
    for (t0, c0), (t1, c1) in zip(ctx.marks[:-1], ctx.marks[1:], strict=True):
        epoch_s.append(t1 - t0)
        save_s.append(c1 - c0)
    cp = ctx._checkpointer
    saves = max(1, epochs if every else 1)
    return {"epoch_s": epoch_s, "save_s": save_s, "fractions": [s / e for s, e in zip(save_s, epoch_s, strict=True)],
            "size": cp.last_size if cp else 0, "write_s": (cp.write_s / saves) if cp else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)  # one rank on one core, as the local engine runs it
    results: dict[str, dict[str, list[float]]] = {m: {"epoch_s": [], "save_s": [], "fractions": [], "write_s": []}
                                                  for m in ("off", "sync", "async")}
    size = 0
    for _ in range(args.repeats):
        for mode in ("off", "sync", "async"):  # interleaved: drifts in machine load hit every mode
            with tempfile.TemporaryDirectory() as d:
                r = run_once(mode, args.epochs, Path(d))
            for k in ("epoch_s", "save_s", "fractions"):
                results[mode][k] += r[k]
            results[mode]["write_s"].append(r["write_s"])
            size = max(size, int(r["size"]))
    base = median(results["off"]["epoch_s"])
    print(f"built-in cnn on digits, 1 rank, {args.epochs} epochs x {args.repeats} runs; checkpoint "
          f"{size / 1e3:.0f} kB (model + Adam state + RNG)")
    print(f"{'mode':<6} {'epoch ms':>9} {'vs off':>8} {'train-thread ckpt ms':>21} {'fraction':>9} "
          f"{'write ms':>9}")
    for mode in ("off", "sync", "async"):
        r = results[mode]
        ep = median(r["epoch_s"])
        print(f"{mode:<6} {ep * 1e3:>9.1f} {(ep - base) / base:>+8.1%} {median(r['save_s']) * 1e3:>21.2f} "
              f"{median(r['fractions']):>9.4f} {median(r['write_s']) * 1e3 if mode != 'off' else 0.0:>9.2f}")
    emit({
        "overhead_fraction": round(median(results["async"]["fractions"]), 5),
        "overhead_fraction_sync": round(median(results["sync"]["fractions"]), 5),
        "size_bytes": size,
        "epoch_s": round(base, 4),
        "save_ms_async": round(median(results["async"]["save_s"]) * 1e3, 3),
        "save_ms_sync": round(median(results["sync"]["save_s"]) * 1e3, 3),
        "write_ms_background": round(median(results["async"]["write_s"]) * 1e3, 3),
    })


if __name__ == "__main__":
    main()
