"""What a study leaves for people as tables: ``trials.csv``, ``best.yaml``, status and the best trials.

Everything here reads the study from its Optuna storage, so it works on a finished run, a
running one (from another process) and an interrupted one alike.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState
from rich.table import Table

from hpoflow.fileio import write_atomic
from hpoflow.run.energy import spent_j
from hpoflow.run.lease import LeaseInfo, lease_rows, read_leases
from hpoflow.run.ledger import (
    ATTR_DRIVER,
    ATTR_IMPORTED,
    ATTR_LINEAGE,
    ATTR_PAUSED,
    ATTR_RUNGS,
    ATTR_SEGMENTS,
    is_counted,
    reruns,
)
from hpoflow.search.pbt import lineage_chain, schedule_of
from hpoflow.spec import SCHEDULABLE
from hpoflow.term import render_table

__all__ = [
    "best_line",
    "best_rows",
    "best_trial",
    "energy_split",
    "fmt",
    "objective_names",
    "pareto_front",
    "status_dict",
    "study_energy_kwh",
    "trials_table",
    "write_best_yaml",
    "write_trials_csv",
]


def _counted(study: optuna.Study) -> list[FrozenTrial]:
    trials = study.get_trials(deepcopy=False)
    counted = is_counted(trials)
    return [t for t in trials if counted(t)]


def _timings(t: FrozenTrial) -> dict[str, float]:
    """A trial's timings (user attr ``timings``; runs written before it kept them in ``metrics``)."""
    timings = t.user_attrs.get("timings")
    if isinstance(timings, dict):
        return timings
    legacy = t.user_attrs.get("metrics") or {}
    return {k: v for k, v in legacy.items() if k.endswith("_s") and k in _TIMING_KEYS}


_TIMING_KEYS = ("duration_s", "to_first_report_s", "launch_s", "run_s")


def _multi(study: optuna.Study) -> bool:
    return len(study.directions) > 1


def objective_names(study: optuna.Study) -> list[str]:
    """The objectives' names (Optuna's metric names; ``value`` / ``value_i`` when unnamed)."""
    names = study.metric_names
    if names:
        return list(names)
    n = len(study.directions)
    return ["value"] if n == 1 else [f"value_{i}" for i in range(n)]


def pareto_front(study: optuna.Study) -> list[dict[str, Any]]:
    """The Pareto-optimal complete trials of a study (one objective: its best trial), as plain data:
    ``number``, ``params`` and ``values`` by objective name; feasible ones only when constrained."""
    names = objective_names(study)
    trials = [t for t in study.best_trials if ATTR_IMPORTED not in t.user_attrs]
    return [{"number": t.number, "params": t.params, "values": dict(zip(names, t.values or [], strict=False))}
            for t in sorted(trials, key=lambda t: t.number)]


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    """The best complete trial of a single-objective study (None with several objectives: see
    ``pareto_front``)."""
    if _multi(study):
        return None
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.value is not None and ATTR_IMPORTED not in t.user_attrs]  # imported: prior knowledge only
    if not done:
        return None
    pick = max if study.direction == optuna.study.StudyDirection.MAXIMIZE else min
    return pick(done, key=lambda t: (t.value, -t.number) if pick is max else (t.value, t.number))


def _driver(t: FrozenTrial) -> str | None:
    value = t.user_attrs.get(ATTR_DRIVER)
    return value if isinstance(value, str) else None


def write_trials_csv(study: optuna.Study, path: Path) -> None:
    """One row per trial that counts (``hpoflow.run.ledger``); ``driver`` is the host:pid of the driver
    that ran it (several drivers may share a study). With a scheduler (docs/schedulers.md): ``rungs``
    (``step:value`` at each rung reached), ``pauses`` (how often it paused) and ``paused_at`` (its last
    pause's step)."""
    trials = _counted(study)
    leases = read_leases(study)
    params = sorted({k for t in trials for k in t.params})
    metrics = sorted({k for t in trials for k in (t.user_attrs.get("metrics") or {})} - set(_TIMING_KEYS))
    timings = sorted({k for t in trials for k in _timings(t)} - {"duration_s"})
    system = sorted({k for t in trials for k in (t.user_attrs.get("system") or {})})
    split = any(k.endswith("_energy_share") for k in system)
    sched = any(ATTR_RUNGS in t.user_attrs for t in trials)
    pbt = any(isinstance(t.user_attrs.get(ATTR_LINEAGE), dict) for t in trials)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["number", "state", "value", *[f"param_{p}" for p in params],
                *[f"metric_{m}" for m in metrics], "duration_s", *[f"timing_{k}" for k in timings],
                *[f"system_{k}" for k in system], *(["energy_split"] if split else []), "driver", "error",
                *(["rungs", "pauses", "paused_at"] if sched else []),
                *(["member", "interval", "parent"] if pbt else [])])
    for t in trials:
        m = t.user_attrs.get("metrics") or {}
        tm = _timings(t)
        sy = t.user_attrs.get("system") or {}
        w.writerow([t.number, t.state.name, t.values[0] if t.values and len(t.values) == 1 else "",
                    *[t.params.get(p, "") for p in params], *[m.get(k, "") for k in metrics],
                    tm.get("duration_s", ""), *[tm.get(k, "") for k in timings], *[sy.get(k, "") for k in system],
                    *([energy_split(sy)] if split else []), _driver_label(_driver(t), leases),
                    t.user_attrs.get("error", ""), *(_sched(t) if sched else []), *(_lineage_cols(t) if pbt else [])])
    write_atomic(path, buf.getvalue())


def _sched(t: FrozenTrial) -> list[Any]:
    """A trial's rungs, pauses and last pause (a scheduler's attrs, ``hpoflow.run.ledger``)."""
    rungs = t.user_attrs.get(ATTR_RUNGS) or {}
    text = " ".join(f"{k}:{v:.6g}" for k, v in sorted(rungs.items(), key=lambda kv: int(kv[0])))
    paused = t.user_attrs.get(ATTR_PAUSED)
    return [text, len(t.user_attrs.get(ATTR_SEGMENTS) or []), "" if paused is None else paused]


def _lineage_cols(t: FrozenTrial) -> list[Any]:
    """A PBT trial's member, interval and parent (``hpoflow_lineage``); blanks for any other trial."""
    lin = t.user_attrs.get(ATTR_LINEAGE)
    if not isinstance(lin, dict):
        return ["", "", ""]
    parent = lin.get("parent")
    return [lin.get("member", ""), lin.get("interval", ""), "" if parent is None else parent]


def _driver_label(driver_id: str | None, leases: Mapping[str, LeaseInfo]) -> str:
    if driver_id is None:
        return ""
    info = leases.get(driver_id)
    return info.label if info is not None else driver_id


def write_best_yaml(study: optuna.Study, spec_data: Mapping[str, Any], path: Path) -> None:
    """Best params and value, and a spec that reruns exactly that configuration (one trial)."""
    if _multi(study):
        front = pareto_front(study)
        if front:
            write_atomic(path, yaml.safe_dump({"study": study.study_name, "objectives": objective_names(study),
                                               "pareto": front}, sort_keys=False))
        return
    best = best_trial(study)
    if best is None:
        return
    rerun = json.loads(json.dumps(dict(spec_data)))  # deep copy of plain data
    space = {k: {"type": "categorical", "choices": [v]} for k, v in best.params.items()}
    rerun["space"] = space
    rerun.setdefault("study", {})["name"] = f"{rerun.get('study', {}).get('name', 'study')}-best"
    rerun["search"] = {"algorithm": "grid", "n_trials": 1}
    rerun.pop("storage", None)
    lineage = _replay(study, best, rerun)
    doc = {
        "study": study.study_name,
        "best_trial": best.number,
        "best_value": best.value,
        "best_params": best.params,
        "metrics": best.user_attrs.get("metrics", {}),
        **lineage,
        "rerun_spec": rerun,
    }
    write_atomic(path, yaml.safe_dump(doc, sort_keys=False))


def _replay(study: optuna.Study, best: FrozenTrial, rerun: dict[str, Any]) -> dict[str, Any]:
    """A PBT study's best trial (``hpoflow_lineage``): its lineage from the root, each explored value's
    schedule, and in ``rerun`` the whole run as one trial: ``training.schedule`` of every optimizer key
    fed by a parameter, the lineage's seed and the final ``epochs`` (docs/schedulers.md, "Replay")."""
    lin = best.user_attrs.get(ATTR_LINEAGE)
    if not isinstance(lin, dict):
        return {}
    chain = lineage_chain({t.number: t for t in study.get_trials(deepcopy=False)}, best.number)
    schedules = schedule_of(chain, sorted({k for t in chain for k in t.params}))
    training = rerun.setdefault("training", {})
    replay = {}
    for key in SCHEDULABLE:
        value = training.get(key)
        name = value[2:-1] if isinstance(value, str) and value.startswith("${") and value.endswith("}") else None
        if name in schedules:
            replay[key] = schedules[name]
    if replay:
        training["schedule"] = replay
    training["seed"] = int(lin["seed"])
    training["epochs"] = int(lin["end"])
    return {"lineage": [t.number for t in chain], "schedules": {k: v for k, v in schedules.items() if len(v) > 1}}


def status_dict(study: optuna.Study, storage_label: str, budget: int | None = None) -> dict[str, Any]:
    """Where the whole study stands: ``n_trials`` is the budget (when known), ``n_total`` the trials that
    count so far (interrupted-and-rerun trials do not: ``n_interrupted`` of them, and ``interrupted``
    says which trial reran each, ``[{"trial": 0, "rerun_as": 4}]``; their ``trials/<n>`` directories
    keep what they wrote); ``storage`` is already redacted; ``drivers`` the drivers that worked on it
    (``hpoflow.run.lease.lease_rows``). Reads only."""
    chain = reruns(study.get_trials(deepcopy=False))
    trials = _counted(study)
    running: dict[str, int] = {}
    for t in trials:
        driver = _driver(t)
        if t.state == TrialState.RUNNING and driver is not None:
            running[driver] = running.get(driver, 0) + 1
    by = {s: sum(1 for t in trials if t.state == s) for s in TrialState}
    best = best_trial(study)
    multi = _multi(study)
    extra: dict[str, Any] = {}
    if multi:
        extra = {"objectives": objective_names(study), "directions": [d.name.lower() for d in study.directions],
                 "pareto": pareto_front(study)}
    return {
        "study_name": study.study_name,
        "storage": storage_label,
        "direction": study.directions[0].name.lower(),
        "n_trials": budget,
        "n_total": len(trials),
        "n_complete": by[TrialState.COMPLETE],
        "n_running": by[TrialState.RUNNING],
        "n_waiting": by[TrialState.WAITING],
        "n_failed": by[TrialState.FAIL],
        "n_pruned": by[TrialState.PRUNED],
        "n_interrupted": len(chain),
        "interrupted": [{"trial": old, "rerun_as": new} for old, new in chain.items()],
        "best_value": None if best is None else best.value,
        "best_params": None if best is None else best.params,
        "best_trial": None if best is None else best.number,
        "energy_kwh": study_energy_kwh(trials),
        **extra,
        "drivers": lease_rows(study, running),
    }


def _energy_j(t: FrozenTrial) -> float | None:
    """A trial's measured energy (``system_energy_j``, docs/energy.md), None where not measured."""
    system = t.user_attrs.get("system")
    value = system.get("energy_j") if isinstance(system, dict) else None
    return float(value) if isinstance(value, int | float) else None


def energy_split(system: Mapping[str, Any]) -> str:
    """How a trial's energy figures were split from shared counters (docs/energy.md), in words:
    ``cpu: core_share 0.25; gpu: time_share 0.5`` (``gpu: whole_device`` where it had its GPUs alone)."""
    parts = []
    cpu, gpu = system.get("cpu_energy_share"), system.get("gpu_energy_share")
    if isinstance(cpu, int | float):
        parts.append(f"cpu: core_share {cpu:.4g}")
    if isinstance(gpu, int | float):
        parts.append("gpu: whole_device" if gpu >= 1.0 else f"gpu: time_share {gpu:.4g}")
    return "; ".join(parts)


def study_energy_kwh(trials: list[FrozenTrial]) -> float | None:
    """The energy every run of the study's ``trials`` spent, in kWh: finished, paused, retried and cancelled
    runs (``hpoflow.run.energy.spent_j``; what ``search.energy_budget_kwh`` counts); None where no trial has
    one (no readable counter: docs/energy.md)."""
    values = [e for t in trials if (e := spent_j(t.user_attrs)) is not None]
    return sum(values) / 3.6e6 if values else None


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def best_line(status: Mapping[str, Any]) -> str:
    """The best trial in words, with 4 significant digits as the tables show them (best.yaml keeps the
    exact values): ``best 0.9889 (trial 7) with batch_size=64 lr=0.003001``."""
    if status.get("pareto") is not None:
        return f"{len(status['pareto'])} trial(s) on the Pareto front"
    if status.get("best_value") is None:
        return "no trial complete yet"
    params = " ".join(f"{k}={fmt(v)}" for k, v in (status.get("best_params") or {}).items())
    return f"best {fmt(status['best_value'])} (trial {status['best_trial']})" + (f" with {params}" if params else "")


def best_rows(study: optuna.Study, top: int = 10, title: str | None = None) -> dict[str, Any]:
    """The ``top`` best complete trials, best first, as plain strings: ``{"title", "columns",
    "rows"}`` (what ``trials_table`` draws and the status snapshot stores)."""
    if _multi(study):
        names = objective_names(study)
        front = pareto_front(study)[:top]
        params = sorted({k for f in front for k in f["params"]})
        trials = study.get_trials(deepcopy=False)
        by_number = {t.number: t for t in trials}
        energy = ("system_energy_j" not in names
                  and any(_energy_j(by_number[f["number"]]) is not None for f in front if f["number"] in by_number))
        return {"title": title or f"Pareto front of {study.study_name}",
                "columns": ["trial", *names, *params, *(["energy J"] if energy else [])],
                "rows": [[str(f["number"]), *[fmt(f["values"].get(n)) for n in names],
                          *[fmt(f["params"].get(p, "-")) for p in params],
                          *([_fmt_energy(by_number.get(f["number"]))] if energy else [])] for f in front]}
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    rev = study.direction == optuna.study.StudyDirection.MAXIMIZE
    done.sort(key=lambda t: t.value if t.value is not None else 0.0, reverse=rev)
    params = sorted({k for t in done for k in t.params})
    energy = any(_energy_j(t) is not None for t in done[:top])
    rows = []
    for t in done[:top]:
        dur = _timings(t).get("duration_s")
        rows.append([str(t.number), fmt(t.value), *[fmt(t.params.get(p, "-")) for p in params],
                     "" if dur is None else f"{dur:.1f}", *([_fmt_energy(t)] if energy else [])])
    return {"title": title or f"best trials of {study.study_name}",
            "columns": ["trial", "value", *params, "time s", *(["energy J"] if energy else [])], "rows": rows}


def _fmt_energy(t: FrozenTrial | None) -> str:
    """A table cell: the trial's energy in J, empty where it was not measured (never an estimate)."""
    value = None if t is None else _energy_j(t)
    return "" if value is None else fmt(value)


def trials_table(study: optuna.Study, top: int = 10, title: str | None = None) -> Table:
    """The ``top`` best complete trials, best first."""
    return render_table(best_rows(study, top, title))
