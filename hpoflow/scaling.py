"""Scaling runs: the same training configuration at several world sizes on this machine.

``run_scaling`` trains the spec's ``training`` with fixed parameters (``fixed_params``: the first
choice or the low end of every active parameter, overridden by the caller) through the local
engine at each world size, twice when asked for both modes:

- weak scaling: the per-rank batch stays ``batch_size``; the global batch grows with the ranks.
  Efficiency ``E_weak(w) = X(w) / (w / w0 * X(w0))`` with ``X`` the throughput in samples/s.
- strong scaling: the global batch stays ``batch_size * w0`` and is split over the ranks.
  Efficiency ``E_strong(w) = X(w) / (w / w0 * X(w0))`` over these runs (the epoch is the same work).

World sizes above the cores this process may use are refused unless ``oversubscribe=True``; then
ranks share cores round-robin and the report says so (the numbers then measure contention, not
scaling). No argparse here: the CLI (``hpoflow scaling``) builds the arguments.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from hpoflow.errors import EngineError, Issue, SpecError, did_you_mean
from hpoflow.spec import CategoricalParam, StudySpec, resolve_training

__all__ = ["ScalingPoint", "ScalingReport", "fixed_params", "run_scaling"]

_REPORTED = ("samples_per_s", "step_time_s", "comm_time_s", "comm_fraction", "bytes_per_step",
             "theory_bytes_per_step", "val_accuracy")


@dataclass(frozen=True)
class ScalingPoint:
    """One run: a world size in one mode, and what it measured."""

    mode: str  # "weak" | "strong"
    world_size: int
    batch_size: int  # per rank
    global_batch: int
    status: str
    cores: tuple[int, ...] = ()
    duration_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    speedup: float | None = None
    efficiency: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class ScalingReport:
    strategy: str
    params: dict[str, Any]
    machine_cores: int
    oversubscribed: bool
    points: list[ScalingPoint]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fixed_params(spec: StudySpec, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One value per active parameter: the override, else the first choice or ``low``."""
    overrides = dict(overrides or {})
    unknown = [k for k in overrides if k not in spec.space]
    if unknown:
        raise SpecError([Issue("space", f"params names {unknown[0]!r}, which is no search "
                               f"parameter{did_you_mean(unknown[0], list(spec.space))}; parameters: "
                               f"{', '.join(spec.space) or '(none)'}")])
    chosen: dict[str, Any] = {}
    for name, p in spec.space.items():
        if p.when and not all(chosen.get(k) in vals for k, vals in p.when.items()):
            continue  # inactive under the values chosen so far
        if name in overrides:
            chosen[name] = overrides[name]
        elif isinstance(p, CategoricalParam):
            chosen[name] = p.choices[0]
        else:
            chosen[name] = p.low
    return chosen


def _efficiencies(points: list[ScalingPoint]) -> list[ScalingPoint]:
    out = []
    for mode in ("weak", "strong"):
        runs = [p for p in points if p.mode == mode]
        base = next((p for p in runs if p.status == "complete"), None)
        for p in runs:
            x = p.metrics.get("samples_per_s")
            if base is None or p.status != "complete" or not x:
                out.append(p)
                continue
            speedup = x / base.metrics["samples_per_s"]
            eff = speedup / (p.world_size / base.world_size)
            out.append(_replace(p, speedup=speedup, efficiency=eff))
    return out


def _replace(p: ScalingPoint, **changes: Any) -> ScalingPoint:
    return ScalingPoint(**{**asdict(p), **changes, "cores": p.cores})


def run_scaling(
    spec: StudySpec,
    world_sizes: Sequence[int],
    *,
    params: Mapping[str, Any] | None = None,
    modes: Sequence[str] = ("weak", "strong"),
    run_dir: str | Path | None = None,
    oversubscribe: bool = False,
    cores: Sequence[int] | None = None,
    on_point: Callable[[ScalingPoint], None] | None = None,
) -> ScalingReport:
    """Train the fixed configuration at each world size (ascending) and measure it."""
    from hpoflow.engines.local import LocalEngine
    from hpoflow.engines.machine import machine_cores
    from hpoflow.trial import TrialRequest, TrialResult

    sizes = sorted(set(int(w) for w in world_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"world sizes must be >= 1, but got {list(world_sizes)}")
    bad_modes = [m for m in modes if m not in ("weak", "strong")]
    if bad_modes or not modes:
        raise ValueError(f"unknown scaling mode {bad_modes}; valid: weak, strong")
    avail = list(cores) if cores is not None else machine_cores()
    over = sizes[-1] > len(avail)
    if over and not oversubscribe:
        raise EngineError(
            f"world size {sizes[-1]} needs {sizes[-1]} cores (one per rank), but this process may "
            f"use {len(avail)}; scaling numbers from ranks sharing cores measure contention. Fix: "
            f"use --world-sizes up to {len(avail)}, or pass --oversubscribe to run anyway (flagged)")
    chosen = fixed_params(spec, params)
    try:
        train = resolve_training(spec.training, chosen)
    except ValidationError as exc:
        raise SpecError([Issue("training", f"with params {chosen}: {e['msg']}")
                         for e in exc.errors(include_url=False)]) from exc
    w0, b = sizes[0], train.batch_size
    root = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="hpoflow-scaling-"))
    plan: list[tuple[str, int, int]] = []
    for w in sizes:
        if "weak" in modes:
            plan.append(("weak", w, b))
        if "strong" in modes and not ("weak" in modes and w == w0):
            plan.append(("strong", w, max(1, (b * w0) // w)))
    points: list[ScalingPoint] = []
    for number, (mode, w, per_rank) in enumerate(plan):
        run_cores = [avail[i % len(avail)] for i in range(w)]
        cfg = train.model_copy(update={"batch_size": per_rank})
        req = TrialRequest(
            number=number, params=chosen, train=cfg.model_dump(mode="json"),
            metric=spec.study.metric, direction=spec.study.direction,
            trial_dir=str(root / f"{mode}-w{w}"), processes=w, cpus_per_process=1,
            timeout=spec.resources.timeout, seed=cfg.seed,
        )
        t0 = time.monotonic()
        engine = LocalEngine(cores=run_cores, gpus=[])
        result: TrialResult | None = None
        try:
            engine.submit(req)
            while result is None:
                for ev in engine.poll(None):
                    if isinstance(ev, TrialResult):
                        result = ev
        finally:
            engine.close()
        point = ScalingPoint(
            mode=mode, world_size=w, batch_size=per_rank, global_batch=per_rank * w,
            status=result.status, cores=tuple(run_cores), duration_s=time.monotonic() - t0,
            metrics={k: float(result.metrics[k]) for k in _REPORTED if k in result.metrics},
            error=result.error,
        )
        points.append(point)
        if on_point is not None:
            on_point(point)
    if "strong" in modes and "weak" in modes:  # the w0 run is the base of both modes
        points += [_replace(p, mode="strong") for p in points if p.mode == "weak" and
                   p.world_size == w0]
    ordered = sorted(points, key=lambda p: (p.mode != "weak", p.world_size))
    return ScalingReport(train.strategy, chosen, len(avail), over, _efficiencies(ordered))
