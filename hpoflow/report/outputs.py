"""The files a run leaves when it ends: ``trials.csv``, ``best.yaml`` and the status snapshot."""

from __future__ import annotations

import logging
from pathlib import Path

import optuna
import yaml

from hpoflow.report.tables import best_rows, status_dict, write_best_yaml, write_trials_csv
from hpoflow.run import rundir
from hpoflow.run.open import run_budget
from hpoflow.run.retry import is_disk_error
from hpoflow.run.rundir import redact
from hpoflow.run.storage import DEFAULT_JOURNAL
from hpoflow.spec import StudySpec

__all__ = ["write_outputs"]

log = logging.getLogger(__name__)


def write_outputs(study: optuna.Study, spec: StudySpec, text: str, run_dir: Path, label: str, *,
                  journal: bool) -> None:
    """trials.csv, best.yaml and, for the run's own journal, the status snapshot (``rundir``).
    ``text`` is the spec as given (its storage password redacted here). A full disk is a warning: the
    study is in its storage, and the next ``hpoflow run`` on the directory writes these again."""
    try:
        write_trials_csv(study, run_dir / "trials.csv")
        if journal:
            rundir.write_status_snapshot(run_dir, run_dir / DEFAULT_JOURNAL,
                                         status_dict(study, label, budget=run_budget(run_dir)), best_rows(study))
        data = yaml.safe_load(text) if text.strip() else spec.model_dump(mode="json")
        if isinstance(data, dict) and data.get("storage"):
            data["storage"] = redact(data["storage"])
        write_best_yaml(study, data, run_dir / "best.yaml")
    except OSError as exc:
        if not is_disk_error(exc):
            raise
        log.warning("trials.csv, best.yaml and status.json not written: cannot write to run directory %s: %s (free "
                    "space and rerun the same command to write them)", run_dir, rundir.disk_why(exc))
