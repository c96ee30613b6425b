"""What keeps ``hpoflow dashboard`` read-only and answering only its own host.

``ReadOnlyStorage`` wraps an Optuna storage: every read passes through, every write raises
``PermissionError``, so no route of optuna-dashboard (or any code handed the storage) can change the
study. Its list of studies (``get_all_studies``, optuna-dashboard's study list) leaves out the claims
companion studies hpoflow keeps beside a study (``hpoflow.run.claims.is_companion``): bookkeeping, not
a search; a companion is still read by its id or name.

``guard`` wraps a WSGI application: a request whose ``Host`` header is not ``127.0.0.1:PORT`` or
``localhost:PORT`` is refused with 421 (a page elsewhere reaching 127.0.0.1 through DNS rebinding sends
its own host name), and any method but GET and HEAD with 405.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.study import StudyDirection
from optuna.study._frozen import FrozenStudy
from optuna.trial import FrozenTrial, TrialState

from hpoflow.run.claims import is_companion

__all__ = ["ReadOnlyStorage", "guard"]

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
READ_METHODS = ("GET", "HEAD")


class ReadOnlyStorage(optuna.storages.BaseStorage):
    """``inner``'s reads, its study list without claims companions; each write raises ``PermissionError``
    (nothing is ever passed on)."""

    def __init__(self, inner: optuna.storages.BaseStorage) -> None:
        self._inner = inner

    @staticmethod
    def _refuse(what: str) -> PermissionError:
        return PermissionError(f"hpoflow dashboard is read-only: {what} refused")

    # -- writes: refused ------------------------------------------------------------------------
    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        raise self._refuse("create_new_study")

    def delete_study(self, study_id: int) -> None:
        raise self._refuse("delete_study")

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        raise self._refuse("set_study_user_attr")

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        raise self._refuse("set_study_system_attr")

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        raise self._refuse("create_new_trial")

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                        distribution: BaseDistribution) -> None:
        raise self._refuse("set_trial_param")

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None
                               ) -> bool:
        raise self._refuse("set_trial_state_values")

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        raise self._refuse("set_trial_intermediate_value")

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        raise self._refuse("set_trial_user_attr")

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        raise self._refuse("set_trial_system_attr")

    # -- reads: passed on -----------------------------------------------------------------------
    def get_study_id_from_name(self, study_name: str) -> int:
        return self._inner.get_study_id_from_name(study_name)

    def get_study_name_from_id(self, study_id: int) -> str:
        return self._inner.get_study_name_from_id(study_id)

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return self._inner.get_study_directions(study_id)

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self._inner.get_study_user_attrs(study_id)

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self._inner.get_study_system_attrs(study_id)

    def get_all_studies(self) -> list[FrozenStudy]:
        studies = self._inner.get_all_studies()
        names = {s.study_name for s in studies}
        return [s for s in studies if not is_companion(s, names)]

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        return self._inner.get_trial_id_from_study_id_trial_number(study_id, trial_number)

    def get_trial_number_from_id(self, trial_id: int) -> int:
        return self._inner.get_trial_number_from_id(trial_id)

    def get_trial(self, trial_id: int) -> FrozenTrial:
        return self._inner.get_trial(trial_id)

    def get_all_trials(self, study_id: int, deepcopy: bool = True, states: Container[TrialState] | None = None
                       ) -> list[FrozenTrial]:
        return self._inner.get_all_trials(study_id, deepcopy=deepcopy, states=states)

    def get_n_trials(self, study_id: int, state: tuple[TrialState, ...] | TrialState | None = None) -> int:
        return self._inner.get_n_trials(study_id, state)

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        return self._inner.get_best_trial(study_id)

    def remove_session(self) -> None:
        self._inner.remove_session()


def guard(app: WSGIApp) -> tuple[WSGIApp, Callable[[int], None]]:
    """``app`` behind the host and method checks, and the function that sets the port once the server
    is bound (until then every request is refused)."""
    allowed: set[str] = set()

    def set_port(port: int) -> None:
        allowed.clear()
        allowed.update({f"127.0.0.1:{port}", f"localhost:{port}"})
        if port == 80:  # a client leaves the default port out of Host
            allowed.update({"127.0.0.1", "localhost"})

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        host = str(environ.get("HTTP_HOST", "")).strip().lower()
        if host not in allowed:
            return _refuse(start_response, "421 Misdirected Request",
                           "this hpoflow dashboard answers only http://127.0.0.1:PORT/ and http://localhost:PORT/ "
                           "(through an ssh tunnel, forward the same port: ssh -L PORT:127.0.0.1:PORT host)")
        if environ.get("REQUEST_METHOD", "GET").upper() not in READ_METHODS:
            return _refuse(start_response, "405 Method Not Allowed", "this hpoflow dashboard is read-only",
                           [("Allow", ", ".join(READ_METHODS))])
        return app(environ, start_response)

    return guarded, set_port


def _refuse(start_response: Callable[..., Any], status: str, text: str,
            headers: list[tuple[str, str]] | None = None) -> list[bytes]:
    body = f"{status}: {text}\n".encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
                            ("Cache-Control", "no-store"), *(headers or [])])
    return [body]
