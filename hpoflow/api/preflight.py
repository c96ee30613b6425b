"""Preflight: every check ``optimize`` makes before its first trial that needs no run directory, at once
and writing nothing, so ``hpoflow validate`` says what ``hpoflow run`` would refuse."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping

from hpoflow.engines import check_fit
from hpoflow.errors import Issue, SpecError
from hpoflow.run.open import study_url
from hpoflow.run.storage import check_storage_path
from hpoflow.search.preflight import check_search
from hpoflow.spec import (
    StudySpec,
    env_int,
    extremes,
    key_lines,
    parse_constraint,
    placeholders,
    resolve_training,
    shares_per_gpu,
)
from hpoflow.trial import TrialRequest

__all__ = ["check_energy", "check_runnable", "check_share"]


def check_runnable(spec: StudySpec, text: str = "", source: str = "<spec>", *, engine: bool = True) -> None:
    """Every check ``optimize`` makes before its first trial that needs no run directory, made at once
    and writing nothing (``hpoflow validate`` calls it too; ``engine=False``: an engine object is
    given, so the spec's engine is not asked): ``HPOFLOW_N_TRIALS``; the ``storage_env`` variable is
    set and names no in-memory database; a storage file given by an absolute path is no directory or
    device (``check_storage_path``); a trial of the spec's shape fits the engine, and its
    ``engine_options`` name cores and GPUs this machine has (``Engine.check_fit``); the oracle's cluster
    loads; the sampler and the pruner build and propose a trial of this study (``check_search``); the
    warm-start run fits. A ``SpecError`` names the key (and its line when ``text`` is the YAML)."""
    env_int("HPOFLOW_N_TRIALS", minimum=1)
    check_storage_path(study_url(spec), None)  # the storage_env variable is set; the storage's file can work
    lines = key_lines(text) if text and source != "<spec>" else {}
    r = spec.resources
    if engine:
        check_fit(spec.engine, spec.engine_option_values(),
                  TrialRequest.shape(r.processes, r.cpus_per_process, r.gpus_per_process, r.nodes,
                                     memory_gb=r.memory_gb or 0.0))
    if spec.oracle.enabled and spec.oracle.cluster and resolve_training(spec.training, {}).builtin:
        from hpoflow.oracle.cluster import load_cluster
        from hpoflow.oracle.errors import OracleError

        try:
            load_cluster(spec.oracle.cluster)
        except OracleError as exc:
            raise SpecError([Issue("oracle.cluster", str(exc).replace("--cluster", "it"),
                                   lines.get(("oracle", "cluster")), source)]) from None
    check_search(spec, source, lines)
    if engine and spec.engine == "local":  # trials run on this machine: its counters are theirs
        check_energy(spec, source, lines)


_MAX_SHARE_CHECKS = 64  # trials the oracle judges for validate's share check (the extremes of the parameters)


def check_share(spec: StudySpec, text: str = "", source: str = "<spec>") -> None:
    """``hpoflow validate``'s check of a GPU share (a run leaves it to the oracle's precheck, which judges each
    trial in its own process: the driver imports no torch). With a share ``1/k`` of a GPU per rank
    (``resources.gpus_per_process: 0.25``) and the oracle on, some trial of the study must fit the share:
    the oracle judges the trials at the extremes of the parameters the training config uses (its precheck
    then refuses each trial that does not fit, as it runs). A ``SpecError`` at
    ``resources.gpus_per_process`` when none fits. Built-in trainer only."""
    lines = key_lines(text) if text and source != "<spec>" else {}
    r = spec.resources
    if not spec.oracle.enabled or not shares_per_gpu(r.gpus_per_process):
        return
    if not resolve_training(spec.training, {}).builtin:
        return
    from hpoflow.oracle import check_trial, load_cluster

    cluster = load_cluster(spec.oracle.cluster) if spec.oracle.cluster else None
    used = sorted({name for _, name in placeholders(dict(spec.training)) if name in spec.space})
    smallest: tuple[float, str] | None = None
    for values in itertools.islice(itertools.product(*(extremes(spec.space[n]) for n in used)), _MAX_SHARE_CHECKS):
        try:
            config = resolve_training(spec.training, dict(zip(used, values, strict=True))).model_dump(mode="json")
        except ValueError:  # a combination the spec's own checks refuse: no trial is made of it
            continue
        verdict = check_trial({k: v for k, v in config.items() if v is not None}, r.processes, r.gpus_per_process,
                              cluster)
        if verdict.feasible:
            return
        need = float(verdict.predicted.get("memory_per_device_bytes") or 0.0)
        if smallest is None or need < smallest[0]:
            smallest = (need, verdict.reason)
    if smallest is not None:
        raise SpecError([Issue("resources.gpus_per_process", f"no trial of this study fits its share of a GPU; "
                               f"the smallest: {smallest[1]}", lines.get(("resources", "gpus_per_process")), source)])


_ENERGY_SOURCES = {"system_energy_j": ("cpu", "gpu"), "system_cpu_energy_j": ("cpu",), "system_gpu_energy_j": ("gpu",)}
_WHY = {"cpu": "no RAPL package counter is readable (/sys/class/powercap/intel-rapl:*/energy_uj: absent, or root "
               "only on Linux >= 5.10)",
        "gpu": "no NVML energy counter is readable (pynvml not installed, no driver, or a GPU without the counter)"}

_FIX = {"cpu": "make the RAPL energy_uj files readable where site policy allows (a udev rule, chmod a+r)",
        "gpu": "install nvidia-ml-py (pip install hpoflow[nvml]) on a GPU that has the counter (Volta or newer)"}


def check_energy(spec: StudySpec, source: str = "<spec>",
                 lines: Mapping[tuple[str | int, ...], int] | None = None) -> None:
    """Energy (docs/energy.md) on a machine whose counters cannot be read: an objective that needs one is
    refused (``SpecError``: no trial could be told its value); a constraint (every trial infeasible) or
    ``search.energy_budget_kwh`` (never reached) is run with a warning."""
    from hpoflow.train.energy import probe

    lines = lines or {}
    gpus = spec.resources.gpus_per_process > 0
    readable = probe(gpus)

    def missing(name: str) -> list[str]:
        return [s for s in _ENERGY_SOURCES.get(name, ()) if not readable.get(s, s == "gpu" and not gpus)]

    for i, (name, _) in enumerate(spec.study.objectives):
        lacking = missing(name)
        if lacking:
            fixes = " and ".join(_FIX[s] for s in lacking)
            raise SpecError([Issue(f"study.metrics[{i}].name", f"objective {name!r} needs energy counters this "
                                   f"machine does not let hpoflow read: {'; '.join(_WHY[s] for s in lacking)}. Fix: "
                                   f"{fixes}, or drop the objective (docs/energy.md)",
                                   lines.get(("study", "metrics", i, "name"), lines.get(("study", "metrics"))),
                                   source)])
    log = logging.getLogger("hpoflow")
    for text in spec.study.constraints:
        name = parse_constraint(text)[0]
        lacking = missing(name)
        if lacking:
            log.warning("study.constraints: %r: %s, so no trial has %s and every trial counts as infeasible "
                        "(docs/energy.md)", text, "; ".join(_WHY[s] for s in lacking), name)
    lacking = missing("system_energy_j")
    if spec.search.energy_budget_kwh is not None and lacking:
        log.warning("search.energy_budget_kwh: %s, so no trial has a measured energy and the budget is never "
                    "spent: the study runs to its other limits (docs/energy.md)", "; ".join(_WHY[s] for s in lacking))
