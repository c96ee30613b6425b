"""The oracle service is a process of its own: when it dies, the precheck starts a new one and the
next trial is still judged; when it keeps dying, trials run unchecked (never blocked)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from hpoflow.oracle.precheck import OraclePrecheck
from hpoflow.spec import TrainConfig
from hpoflow.trial import TrialRequest

pytestmark = pytest.mark.slow  # the service imports torch


def _request(tmp_path: Path, batch: int) -> TrialRequest:
    train = TrainConfig(model="mlp", batch_size=batch, epochs=1).model_dump(mode="json")
    return TrialRequest(0, {}, train, "val_accuracy", "maximize", str(tmp_path), processes=1)


def test_a_killed_oracle_service_is_replaced(tmp_path: Path) -> None:
    check = OraclePrecheck(max_restarts=1)
    try:
        first = check(_request(tmp_path, 16))
        assert first is not None and first.feasible and first.predicted
        proc = check._proc
        assert proc is not None and proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        second = check(_request(tmp_path, 32))  # a new shape: the service must answer it
        assert second is not None and second.predicted and check.restarts == 1
        again = check._proc
        assert again is not None and again.pid is not None and again.pid != proc.pid
        os.kill(again.pid, signal.SIGKILL)
        again.join(10)
        third = check(_request(tmp_path, 64))  # past max_restarts: unchecked, never blocked
        assert third is not None and third.feasible and not third.predicted
        assert "trials run unchecked" in third.reason
    finally:
        check.close()
