"""Preflight: every check ``optimize`` makes before its first trial that needs no run directory, at once
and writing nothing, so ``hpoflow validate`` says what ``hpoflow run`` would refuse."""

from __future__ import annotations

from hpoflow.engines import check_fit
from hpoflow.errors import Issue, SpecError
from hpoflow.run.open import study_url
from hpoflow.run.storage import check_storage_path
from hpoflow.search.preflight import check_search
from hpoflow.spec import StudySpec, env_int, key_lines, resolve_training
from hpoflow.trial import TrialRequest

__all__ = ["check_runnable"]


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
