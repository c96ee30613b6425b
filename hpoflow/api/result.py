"""What ``optimize`` returns: the run directory, the live Optuna study, the summary and the storage."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from hpoflow.search.driver import DriverSummary

__all__ = ["StudyResult"]


@dataclass(frozen=True)
class StudyResult:
    """What a study produced. ``study`` is the live Optuna study (open on its storage)."""

    run_dir: Path
    study: optuna.Study
    summary: DriverSummary
    storage: str

    @property
    def best_trial(self) -> optuna.trial.FrozenTrial | None:
        """The best complete trial (None before one completes, and with several objectives)."""
        from hpoflow.report.tables import best_trial

        return best_trial(self.study)

    @property
    def best_params(self) -> dict[str, Any] | None:
        best = self.best_trial
        return None if best is None else dict(best.params)

    @property
    def best_value(self) -> float | None:
        best = self.best_trial
        return None if best is None else best.value

    def trials_dataframe(self) -> Any:
        """Optuna's ``trials_dataframe()`` (needs pandas)."""
        return self.study.trials_dataframe()
