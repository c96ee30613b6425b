"""A study's storage that waits out outages: ``RetryingStorage`` wraps any Optuna storage.

Every call of Optuna's storage API goes through ``RetryingStorage``. A failure that an outage causes (the
database refuses or drops connections: SQLAlchemy's ``OperationalError``, ``InterfaceError``,
``DisconnectionError``, a pool timeout, a ``DBAPIError`` that invalidated its connection, or Optuna's
``StorageInternalError`` wrapping one of those; a network file system's ``ESTALE``, ``ETIMEDOUT``, ``EIO``,
...) is retried with exponential backoff (0.25 s doubling to 8 s) for up to ``retry_s`` seconds (the spec's
``storage_retry_s``), after one warning line ("storage unreachable, retrying for up to N s: <cause>") and,
once it answers again, a second ("storage reachable again after T s"). Past ``retry_s`` the call raises
``StorageUnavailable`` (exit code 1; the driver stops cleanly), and for the next ``retry_s`` seconds calls
that fail are not waited for again (the driver's last writes as it stops fail at once; a call Optuna answers
from its cache still succeeds, which says nothing about the server). A full disk or a read-only file system
(``ENOSPC``, ``EDQUOT``, ``EROFS``) is not waited for: ``StorageFull`` at once (exit code 2 when raised at
start; mid-study the driver stops cleanly). Any other error is Optuna's and passes unchanged.

Retrying a write is safe when the failed attempt did not commit. Optuna's ``RDBStorage`` runs each call in
one transaction, committed at its end, so a failure before the commit leaves nothing behind; only a
connection lost between the server's commit and its reply is ambiguous. For the writes where a repeat is not
harmless:

- ``create_new_trial``: each new trial carries a unique system attr (``TOKEN_ATTR``); a retry first
  looks for a trial holding it and returns that one instead of creating another. (Optuna's
  ``RDBStorage`` itself retries trial creation up to 5 times inside one call, without such a check;
  that window, a reply lost after a commit, is the one this cannot close.)
- ``set_trial_state_values`` that finishes a trial: a retry that finds the trial already finished
  with exactly the state and values asked for is the first attempt's success, not an error.
- ``set_trial_state_values(RUNNING)`` (taking an enqueued trial): a retry that finds it taken answers
  "taken" as Optuna would; if the lost reply was ours, that trial stays RUNNING without a driver
  until a resume's reconcile reruns it (it is never counted twice).
- Parameters, attributes and intermediate values are set by key: a repeat writes the same value.
"""

from __future__ import annotations

import copy
import errno
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Container, Sequence
from datetime import datetime
from typing import Any, TypeVar

import optuna
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.study import StudyDirection
from optuna.study._frozen import FrozenStudy
from optuna.trial import FrozenTrial, TrialState

from hpoflow.errors import HpoflowError

__all__ = ["DISK_ERRNOS", "TOKEN_ATTR", "RetryingStorage", "StorageFull", "StorageUnavailable", "is_disk_error",
           "transient_cause"]

log = logging.getLogger(__name__)

T = TypeVar("T")

TOKEN_ATTR = "hpoflow_create_token"  # system attr: makes a retried trial creation idempotent
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
_TRANSIENT_ERRNOS = frozenset({errno.ESTALE, errno.ETIMEDOUT, errno.EIO, errno.ENOLCK, errno.EHOSTDOWN,
                               errno.EHOSTUNREACH, errno.ENETDOWN, errno.ENETUNREACH, errno.ECONNRESET,
                               errno.ECONNREFUSED, errno.ECONNABORTED})
_FIRST_DELAY_S = 0.25
_MAX_DELAY_S = 8.0


class StorageUnavailable(HpoflowError):
    """The study's storage did not answer for ``storage_retry_s`` seconds (the study itself is kept);
    ``cause``: the last failure, in one line."""

    exit_code = 1

    def __init__(self, message: str, cause: str = "") -> None:
        super().__init__(message)
        self.cause = cause


class StorageFull(StorageUnavailable):
    """The study's storage cannot be written: the disk is full, over quota or read-only."""

    exit_code = 2


def is_disk_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a write refused for space or a read-only file system."""
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


def _one_line(exc: BaseException, secret: str | None) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if secret:
        text = text.replace(secret, "***")
    return text[:300]


def transient_cause(exc: BaseException, secret: str | None = None) -> str | None:
    """One line naming the outage behind ``exc`` (a lost or refused connection, a network file system
    error), or None when ``exc`` is not one; ``secret`` (a password) is blanked out of it."""
    sa = sys.modules.get("sqlalchemy.exc")  # loaded if and only if a database storage is in use
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return _one_line(e, secret)
        if sa is not None:
            if isinstance(e, sa.OperationalError | sa.InterfaceError | sa.DisconnectionError | sa.TimeoutError):
                return _one_line(e, secret)
            if isinstance(e, sa.DBAPIError) and e.connection_invalidated:
                return _one_line(e, secret)
        e = e.__cause__ or e.__context__
    return None


class RetryingStorage(BaseStorage, BaseHeartbeat):
    """``inner`` with outages waited out (module docstring). ``label`` names the storage in messages
    (password redacted); ``secret`` is blanked out of causes; ``retry_s`` may be changed at any time
    (0: never wait). ``sleep`` and ``clock`` are for tests."""

    def __init__(self, inner: BaseStorage, label: str, retry_s: float, *, secret: str | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.label = label
        self.retry_s = retry_s
        self._secret = secret or None
        self._sleep = sleep
        self._clock = clock
        self._lock = threading.Lock()
        self._gave_up_at: float | None = None  # when a call last gave up; for retry_s after, calls try once
        self._outage_at: float | None = None  # when the outage was announced: one line per outage (from a
        # failure to the next success), however many threads wait it out (the driver's calls and its lease
        # renewals) and however often it is waited out again after a call gave up

    # A pickled storage (joblib, Dask and multiprocessing hand a study's storage to other processes) gets a
    # lock of its own: a lock does not pickle, and a copy shares no thread with the original.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- the retry loop ---------------------------------------------------------------------------
    def _call(self, fn: Callable[[], T], on_retry_error: Callable[[Exception], T] | None = None) -> T:
        """``fn()`` with outages waited out; ``on_retry_error(exc)`` answers for an error raised by a
        retry (a repeat of a write the first attempt may have made), or re-raises it."""
        t0: float | None = None
        delay = _FIRST_DELAY_S
        while True:
            try:
                result = fn()
            except Exception as exc:
                if is_disk_error(exc):
                    raise StorageFull(f"cannot write the study's storage {self.label}: {_disk_why(exc)}. Fix: free "
                                      "space (or fix the file system), then rerun the same command to resume "
                                      "(finished trials are kept)", _disk_why(exc)) from None
                cause = transient_cause(exc, self._secret)
                if cause is None:
                    if t0 is not None and on_retry_error is not None:
                        return on_retry_error(exc)
                    raise
                now = self._clock()
                if t0 is None:
                    t0 = now
                    with self._lock:
                        down = self._gave_up_at is not None and now - self._gave_up_at < self.retry_s
                        announce = not down and self.retry_s > 0 and self._outage_at is None
                        if announce:
                            self._outage_at = now
                    if down or self.retry_s <= 0:
                        raise self._unavailable(cause, None if down else 0.0) from None
                    if announce:
                        log.warning("storage unreachable, retrying for up to %g s: %s", self.retry_s, cause)
                left = self.retry_s - (now - t0)
                if left <= 0:
                    with self._lock:
                        self._gave_up_at = now  # the outage goes on (announced) until a call succeeds
                    raise self._unavailable(cause, now - t0) from None
                self._sleep(min(delay, left))
                delay = min(2 * delay, _MAX_DELAY_S)
                continue
            if t0 is not None:
                with self._lock:
                    since, self._outage_at, self._gave_up_at = self._outage_at, None, None
                if since is not None:  # the first call through announces the end, once
                    log.warning("storage reachable again after %.1f s", self._clock() - since)
            return result

    def _unavailable(self, cause: str, waited: float | None) -> StorageUnavailable:
        how = ("again (it stopped answering earlier)" if waited is None else
               f"for {waited:.0f} s (storage_retry_s: {self.retry_s:g})")
        return StorageUnavailable(f"the study's storage {self.label} did not answer {how}: {cause}. The study is kept: "
                                  "rerun the same command to resume once it answers", cause)

    # -- writes that need care (module docstring) -------------------------------------------------
    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        token = uuid.uuid4().hex
        if template_trial is None:
            template = FrozenTrial(number=-1, state=TrialState.RUNNING, value=None, datetime_start=datetime.now(),
                                   datetime_complete=None, params={}, distributions={}, user_attrs={},
                                   system_attrs={}, intermediate_values={}, trial_id=-1)
        else:
            template = copy.deepcopy(template_trial)
        template.system_attrs = {**template.system_attrs, TOKEN_ATTR: token}
        attempts = 0

        def create() -> int:
            nonlocal attempts
            attempts += 1
            if attempts > 1:  # the failed attempt may have committed: find its trial first
                for t in self.inner.get_all_trials(study_id, deepcopy=False):
                    if t.system_attrs.get(TOKEN_ATTR) == token:
                        return t._trial_id
            return self.inner.create_new_trial(study_id, template)

        return self._call(create)

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        def already_done(exc: Exception) -> bool:
            if isinstance(exc, optuna.exceptions.UpdateFinishedTrialError):
                t = self.inner.get_trial(trial_id)
                if t.state == state and (values is None or t.values == list(values)):
                    return True  # the attempt whose reply was lost did it
            raise exc

        return self._call(lambda: self.inner.set_trial_state_values(trial_id, state, values), already_done)

    # -- everything else: delegated, with outages waited out ---------------------------------------
    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        return self._call(lambda: self.inner.create_new_study(directions, study_name))

    def delete_study(self, study_id: int) -> None:
        self._call(lambda: self.inner.delete_study(study_id))

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call(lambda: self.inner.set_study_user_attr(study_id, key, value))

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call(lambda: self.inner.set_study_system_attr(study_id, key, value))

    def get_study_id_from_name(self, study_name: str) -> int:
        return self._call(lambda: self.inner.get_study_id_from_name(study_name))

    def get_study_name_from_id(self, study_id: int) -> str:
        return self._call(lambda: self.inner.get_study_name_from_id(study_id))

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return self._call(lambda: self.inner.get_study_directions(study_id))

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self._call(lambda: self.inner.get_study_user_attrs(study_id))

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self._call(lambda: self.inner.get_study_system_attrs(study_id))

    def get_all_studies(self) -> list[FrozenStudy]:
        return self._call(self.inner.get_all_studies)

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                        distribution: BaseDistribution) -> None:
        self._call(lambda: self.inner.set_trial_param(trial_id, param_name, param_value_internal, distribution))

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        return self._call(lambda: self.inner.get_trial_id_from_study_id_trial_number(study_id, trial_number))

    def get_trial_number_from_id(self, trial_id: int) -> int:
        return self._call(lambda: self.inner.get_trial_number_from_id(trial_id))

    def get_trial_param(self, trial_id: int, param_name: str) -> float:
        return self._call(lambda: self.inner.get_trial_param(trial_id, param_name))

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        self._call(lambda: self.inner.set_trial_intermediate_value(trial_id, step, intermediate_value))

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._call(lambda: self.inner.set_trial_user_attr(trial_id, key, value))

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._call(lambda: self.inner.set_trial_system_attr(trial_id, key, value))

    def get_trial(self, trial_id: int) -> FrozenTrial:
        return self._call(lambda: self.inner.get_trial(trial_id))

    def get_all_trials(self, study_id: int, deepcopy: bool = True,
                       states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        return self._call(lambda: self.inner.get_all_trials(study_id, deepcopy=deepcopy, states=states))

    def trials_and_changes(self, study_id: int, since: int | None
                           ) -> tuple[list[FrozenTrial], int, list[int] | None] | None:
        """The inner storage's feed of what changed (``hpoflow.run.feed``); None where it has none."""
        ask = getattr(self.inner, "trials_and_changes", None)
        return None if ask is None else self._call(lambda: ask(study_id, since))

    def get_n_trials(self, study_id: int, state: tuple[TrialState, ...] | TrialState | None = None) -> int:
        return self._call(lambda: self.inner.get_n_trials(study_id, state))

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        return self._call(lambda: self.inner.get_best_trial(study_id))

    def get_trial_params(self, trial_id: int) -> dict[str, Any]:
        return self._call(lambda: self.inner.get_trial_params(trial_id))

    def get_trial_user_attrs(self, trial_id: int) -> dict[str, Any]:
        return self._call(lambda: self.inner.get_trial_user_attrs(trial_id))

    def get_trial_system_attrs(self, trial_id: int) -> dict[str, Any]:
        return self._call(lambda: self.inner.get_trial_system_attrs(trial_id))

    def remove_session(self) -> None:
        self.inner.remove_session()

    def check_trial_is_updatable(self, trial_id: int, trial_state: TrialState) -> None:
        self.inner.check_trial_is_updatable(trial_id, trial_state)

    # -- heartbeats (Optuna's RDBStorage has them; other storages answer "off") -------------------
    def record_heartbeat(self, trial_id: int) -> None:
        inner = self.inner
        if isinstance(inner, BaseHeartbeat):
            self._call(lambda: inner.record_heartbeat(trial_id))

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        inner = self.inner
        if not isinstance(inner, BaseHeartbeat):
            return []
        return self._call(lambda: inner._get_stale_trial_ids(study_id))

    def get_heartbeat_interval(self) -> int | None:
        return self.inner.get_heartbeat_interval() if isinstance(self.inner, BaseHeartbeat) else None

    def get_heartbeat_stale_trial_callback(self) -> Callable[[optuna.Study, FrozenTrial], None] | None:
        inner = self.inner
        return inner.get_heartbeat_stale_trial_callback() if isinstance(inner, BaseHeartbeat) else None


def _disk_why(exc: BaseException) -> str:
    return {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
            errno.EROFS: "the file system is read-only"}.get(getattr(exc, "errno", 0) or 0, str(exc))
