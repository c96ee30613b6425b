"""The digits study of ``examples/digits.yaml`` on a machine's GPUs, against the same study on its CPU cores,
in one run: what hpoflow's local engine does on a real GPU (placement, a rank's device, shares of one GPU,
NVML energy per trial).

Three studies of the same trials (``--trials`` TPE trials of ``--epochs`` epochs, seed 42), one after the
other, each through ``hpoflow.api.optimize`` on a ``LocalEngine`` given the machine's GPUs:

- ``cpu``: one core per trial, two trials at a time (``gpus_per_process: 0``: the ranks see no GPU);
- ``gpu``: one whole GPU per trial, one trial at a time per GPU;
- ``share``: a quarter of a GPU per trial (``gpus_per_process: 0.25``), four trials at a time per GPU,
  each capped to its quarter of the GPU's memory.

The trials are the built-in trainer's, as the example runs them. Figures per study: wall, trials complete,
the median trial duration, the best accuracy, how many trials trained on a GPU (their usage summary has
``gpu_peak_mem_mb``, which a rank records only on a CUDA device) and their median peak GPU memory, the median
GPU utilisation, and energy per trial: the GPU's part (NVML; absent where ``nvidia-ml-py`` or the counter
is not there) and the total, present only where the CPU's RAPL counter is readable too.
Ratios: gpu/cpu and share/gpu walls.

``--dry-run`` runs the cpu study only (2 trials of 1 epoch) and validates the two GPU specs, on any
machine: the plumbing, before a GPU's minutes are spent.

    python bench/gpu_check.py [--trials 12] [--epochs 15] [--dry-run]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from _common import BENCH, emit, median

ROOT = BENCH.parent


def _spec(name: str, trials: int, epochs: int, gpus: float, concurrent: int) -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    spec["study"]["name"] = f"gpu-check-{name}"
    spec["search"].update(n_trials=trials, max_concurrent=concurrent)
    spec["training"]["epochs"] = epochs
    spec["resources"].update(processes=1, cpus_per_process=1, gpus_per_process=gpus)
    return spec


def _median(values: list[float]) -> float | None:
    return round(median(values), 4) if values else None


def _study(name: str, spec: dict[str, Any], gpus: list[int], cores: list[int], out: Path) -> dict[str, Any]:
    from hpoflow.api import optimize
    from hpoflow.engines.local import LocalEngine

    engine = LocalEngine(cores=cores, gpus=gpus)
    t0 = time.perf_counter()
    try:
        result = optimize(spec, out / name, engine=engine, handle_signals=False)
    finally:
        engine.close()
    wall = time.perf_counter() - t0
    trials = [t for t in result.study.trials if t.state.name == "COMPLETE"]
    errors = [str(t.user_attrs["error"]) for t in result.study.trials if t.user_attrs.get("error")]
    systems = [t.user_attrs.get("system") or {} for t in trials]
    durations = [t.duration.total_seconds() for t in trials if t.duration is not None]
    return {
        "wall_s": round(wall, 2), "complete": len(trials), "trials": len(result.study.trials),
        "median_trial_s": _median(durations), "best_val_accuracy": result.best_value,
        "trained_on_gpu": sum(1 for s in systems if "gpu_peak_mem_mb" in s),
        "median_gpu_peak_mem_mb": _median([float(s["gpu_peak_mem_mb"]) for s in systems if "gpu_peak_mem_mb" in s]),
        "median_gpu_util_percent": _median([float(s["gpu_util_percent"]) for s in systems if "gpu_util_percent" in s]),
        "median_energy_j": _median([float(s["energy_j"]) for s in systems if "energy_j" in s]),
        "median_gpu_energy_j": _median([float(s["gpu_energy_j"]) for s in systems if "gpu_energy_j" in s]),
        "failed": len(errors), "first_error": errors[0][-600:] if errors else None,
    }


def _environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0],
                           "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        env.update(cuda=torch.version.cuda, device=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                   nccl=".".join(str(v) for v in torch.cuda.nccl.version()))
    return env


def main() -> int:
    from hpoflow.engines.machine import machine_cores

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--dry-run", action="store_true", help="the cpu study only (2 trials, 1 epoch); validate the rest")
    args = ap.parse_args()
    trials, epochs = (2, 1) if args.dry_run else (args.trials, args.epochs)
    env = _environment()
    gpus = list(range(int(env.get("gpus", 0))))
    cores = machine_cores()[:4]
    specs = {"cpu": _spec("cpu", trials, epochs, 0, 2),
             "gpu": _spec("gpu", trials, epochs, 1, max(1, len(gpus))),
             "share": _spec("share", trials, epochs, 0.25, 4 * max(1, len(gpus)))}
    figures: dict[str, Any] = {"environment": env, "trials": trials, "epochs": epochs}
    with tempfile.TemporaryDirectory(prefix="hpoflow-gpu-check-") as tmp:
        out = Path(tmp)
        figures["cpu"] = _study("cpu", specs["cpu"], gpus, cores[:2], out)
        if args.dry_run or not gpus:
            from hpoflow.spec import StudySpec

            for name in ("gpu", "share"):
                StudySpec.model_validate(specs[name])
                figures[name] = None
        else:
            # four core slots for the four shares of one GPU: the GPU, not the cores, is what they share
            figures["gpu"] = _study("gpu", specs["gpu"], gpus, cores, out)
            figures["share"] = _study("share", specs["share"], gpus, cores, out)
    if figures.get("gpu"):
        figures["gpu_vs_cpu_wall"] = round(figures["gpu"]["wall_s"] / figures["cpu"]["wall_s"], 3)
        figures["share_vs_gpu_wall"] = round(figures["share"]["wall_s"] / figures["gpu"]["wall_s"], 3)
    emit(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
