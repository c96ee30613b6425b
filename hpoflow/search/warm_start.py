"""``search.warm_start``: the completed trials of an earlier run as the sampler's prior knowledge."""

from __future__ import annotations

import logging

import optuna
import yaml
from optuna.trial import TrialState, create_trial

from hpoflow.errors import RunDirError
from hpoflow.run import rundir
from hpoflow.run.ledger import ATTR_IMPORTED
from hpoflow.run.open import load_run
from hpoflow.search.space import distribution
from hpoflow.spec import StudySpec, outside

log = logging.getLogger(__name__)

__all__ = ["check_warm_start", "warm_start"]


def check_warm_start(spec: StudySpec) -> tuple[optuna.Study, str]:
    """The run ``search.warm_start`` names, opened for reading, and its label; ``RunDirError`` (one
    line, with the fix) when it is not a run, or optimised another metric or direction. Changes
    nothing: ``hpoflow validate`` and ``optimize`` call it before anything is written."""
    source = str(spec.search.warm_start)
    try:
        other, label = load_run(source)
    except RunDirError as exc:
        raise RunDirError(f"search.warm_start: {exc}".replace("pass the --run-dir of", "point warm_start at")) \
            from None
    try:
        other_spec = yaml.safe_load((rundir.resolve(source, create=False) / "spec.yaml").read_text()) or {}
        other_metric = (other_spec.get("study") or {}).get("metric")
    except (OSError, yaml.YAMLError, AttributeError):
        other_metric = None
    directions = [optuna.study.StudyDirection[d.upper()] for _, d in spec.study.objectives]
    if other_metric != spec.study.metric or spec.study.multi or other.directions != directions:
        raise RunDirError(f"search.warm_start: {source} optimised {other_metric!r} "
                          f"({', '.join(d.name.lower() for d in other.directions)}), "
                          f"this study {spec.study.metric!r} ({spec.study.direction}); only a study of the same "
                          "metric and direction can warm-start it. Fix: point warm_start at such a run, or remove it")
    return other, label


def warm_start(study: optuna.Study, spec: StudySpec) -> None:
    """Import the completed trials of the run in ``search.warm_start`` into ``study`` (which holds no
    trial yet): same metric and direction required; values outside this space are dropped (said
    once); imported trials never count against ``n_trials`` and are never the best trial."""
    other, label = check_warm_start(spec)
    source = str(spec.search.warm_start)
    dists = {name: distribution(p) for name, p in spec.space.items()}
    imported, dropped = [], 0
    for t in other.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        params = {k: v for k, v in t.params.items() if k in dists and not outside(spec.space[k], v)}
        dropped += len(t.params) - len(params)
        if params and t.value is not None:
            imported.append(create_trial(params=params, distributions={k: dists[k] for k in params}, value=t.value,
                                         user_attrs={ATTR_IMPORTED: f"{label}#{t.number}"}))
    study.add_trials(imported)
    log.warning("warm start: imported %d completed trial(s) of %s%s", len(imported), source,
                f"; dropped {dropped} parameter value(s) outside this space" if dropped else "")


