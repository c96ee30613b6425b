"""What makes the trials of one study comparable, as plain data a study can store: ``study_fingerprint``.

Several drivers may share one study (``hpoflow.run.shared``): their trials stand side by side in one
sampler's history, and each driver reruns the others' trials from their checkpoints. That holds only
where their specs agree on

- ``study``: the objectives (``metric`` and ``direction``, or ``metrics``) and the ``constraints``;
- ``space``: every parameter, its type, bounds, ``log``, ``step``, ``choices`` and ``when``;
- ``search.scheduler``: its type and options;
- ``training``: all of it. That is what the checkpoint's fingerprint covers
  (``hpoflow.train.builtin.config_fingerprint``) and what it leaves out for one trial's resume
  (``epochs``, ``checkpoint``, ``schedule``, ``lr``, ``momentum``, ``weight_decay``): two trials that
  train for other epochs or with another fixed ``lr`` are not comparable, and a trial rerun by another
  driver must find its checkpoints in the format it wrote them.

Nothing else is compared: budgets and limits (``n_trials``, ``timeout``, ``max_concurrent``,
``max_failures``, ``energy_budget_kwh``, ``fail_fast``, ``lease_s``, ``storage_retry_s``,
``resources.timeout``/``max_retries``),
the sampler, its options and seed (drivers that find each other reseed anyway), the pruner,
``enqueue``, ``warm_start``, ``ask_ahead``, ``resources``, the engine and its options, the storage,
``oracle``, ``tracking`` and ``plugins``.

The fingerprint holds settings, not spellings: values as validated, without those at their defaults
(``TrainConfig.settings``), so a default written out or left out, ``1e-3`` or ``0.001``, compare
equal, and so does a field that a later hpoflow adds. Where ``training`` depends on the trial's
parameters (a key holding a ``${param}``, or one whose validated value changes with a parameter, such
as the options of a searched ``model`` or ``strategy``) it is kept as written.
"""

from __future__ import annotations

import json
from typing import Any

from hpoflow.spec._load import extremes, resolve_training
from hpoflow.spec._models import StudySpec, parse_constraint, placeholders

__all__ = ["study_fingerprint"]


def study_fingerprint(spec: StudySpec) -> dict[str, Any]:
    """What a study's trials have in common, keyed like the spec (``study.direction``, ``space.x.type``,
    ``search.scheduler.population``, ``training.batch_size``), as JSON types."""
    s = spec.study
    study: dict[str, Any] = {"metric": s.metric, "direction": s.direction}
    if s.multi:
        study["metrics"] = [o.model_dump(mode="json") for o in s.metrics]
    if s.constraints:
        study["constraints"] = [list(parse_constraint(c)) for c in s.constraints]
    data = {
        "study": study,
        "space": {name: p.model_dump(mode="json", exclude_defaults=True) for name, p in spec.space.items()},
        "search": {"scheduler": spec.search.scheduler.settings()},
        "training": _training(spec),
    }
    return dict(json.loads(json.dumps(data, sort_keys=True, default=str)))  # what a storage gives back


def _training(spec: StudySpec) -> dict[str, Any]:
    """``training``'s settings, with the keys that depend on the trial's parameters as written. Each
    parameter used takes each of the values the spec's validation tried (``extremes``) in turn."""
    written = spec.training
    base = {name: extremes(p)[0] for name, p in spec.space.items()}
    first = resolve_training(written, base).settings()
    varies = {str(path[0]) for path, _ in placeholders(written)}
    for name in dict.fromkeys(n for _, n in placeholders(written)):
        for value in extremes(spec.space[name])[1:]:
            other = resolve_training(written, {**base, name: value}).settings()
            varies.update(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))
    out = {k: v for k, v in first.items() if k not in varies}
    out.update({k: written[k] for k in varies if k in written})
    return out
