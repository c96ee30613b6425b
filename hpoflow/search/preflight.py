"""What the search needs before its first trial, checked before anything is written.

``hpoflow validate`` and ``optimize`` both call ``check_search``, so a spec that validates does not
fail in the driver's first ask: the pruner and the sampler are built exactly as the study builds them
(``make_pruner``, ``make_sampler``: a class path's option *values* are checked here, its names by
the spec), and the sampler then proposes two configurations of this space for a study of these
objectives, in memory (a sampler that optimises one objective, Optuna's ``CmaEsSampler`` or a user's
class, says so here; a missing optional dependency too). ``search.warm_start`` must name a run of
the same metric and direction.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import optuna

from hpoflow.errors import HpoflowError, Issue, SpecError
from hpoflow.search.samplers import make_pruner, make_sampler
from hpoflow.search.space import suggest
from hpoflow.search.warm_start import check_warm_start
from hpoflow.spec import StudySpec

__all__ = ["check_search"]

MULTI_OBJECTIVE_SAMPLERS = "tpe, nsga2, nsga3, gp or random"


def check_search(spec: StudySpec, source: str = "<spec>", lines: Mapping[tuple[str | int, ...], int] | None = None
                 ) -> None:
    """``SpecError`` (the key, its line when ``lines`` has it, the rule and the fix) when the study's
    sampler or pruner cannot be built or cannot propose a trial; ``RunDirError`` for a warm start
    that cannot be used. Creates nothing."""
    lines = lines or {}

    def problem(path: tuple[str, ...], message: str) -> SpecError:
        return SpecError([Issue(".".join(path), message, lines.get(path), source)])

    search = spec.search
    n = len(spec.study.objectives)
    with _quiet():
        try:
            pruner = make_pruner(search.pruner, spec.training.get("epochs"))
        except Exception as exc:  # the class's own check of its option values
            raise problem(("search", "pruner"), f"the pruner {search.pruner.type} cannot be built with these options: "
                                                f"{_why(exc)}. Fix: correct its options") from None
        try:
            sampler = make_sampler(search)
        except Exception as exc:
            raise problem(("search", "algorithm"), f"the sampler {search.algorithm} cannot be built with these "
                                                   f"options: {_why(exc)}. Fix: correct search.sampler_options") \
                from None
        study = optuna.create_study(
            directions=[optuna.study.StudyDirection[d.upper()] for _, d in spec.study.objectives],
            sampler=sampler, pruner=pruner)
        try:
            for _ in range(2):  # the second ask sees a finished trial (relative sampling, after_trial)
                trial = study.ask()
                suggest(trial, spec.space)
                study.tell(trial, [0.0] * n if n > 1 else 0.0)
        except HpoflowError:
            raise
        except Exception as exc:  # ValueError("... multi-objective ... CmaEsSampler cannot be used"), ImportError
            if n > 1 and "objective" in str(exc).lower():
                fix = (f"use a sampler that optimises several objectives ({MULTI_OBJECTIVE_SAMPLERS}), or keep one "
                       "metric")
                rule = f"the sampler {search.algorithm} optimises one objective, but study.metrics has {n}"
            else:
                fix = "use another sampler, or give it what it needs (a missing package: pip install it)"
                rule = f"the sampler {search.algorithm} cannot propose a trial of this study"
            raise problem(("search", "algorithm"), f"{rule} ({_why(exc)}). Fix: {fix}") from None
    if search.warm_start:
        check_warm_start(spec)


def _why(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


@contextlib.contextmanager
def _quiet() -> Iterator[Any]:
    """No Optuna log lines or experimental warnings from the probe (the run says them when it runs)."""
    logger = logging.getLogger("optuna")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
