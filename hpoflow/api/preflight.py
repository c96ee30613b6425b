"""Preflight: every check ``optimize`` makes before its first trial that needs no run directory, at once
and writing nothing, so ``hpoflow validate`` says what ``hpoflow run`` would refuse."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from hpoflow.engines import check_fit
from hpoflow.errors import Issue, SpecError
from hpoflow.run.open import study_url
from hpoflow.run.storage import check_storage_path
from hpoflow.search.preflight import check_search
from hpoflow.spec import StudySpec, env_int, key_lines, parse_constraint, resolve_training
from hpoflow.trial import TrialRequest

__all__ = ["check_energy", "check_runnable"]


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
