"""A core listed twice in the local engine's ``cores`` is two slots (how bench/strategies.py runs 4
ranks on 2 cores), and stays two after every trial: releasing a trial's cores gives back each slot it
took, never more of one core than the engine has."""

from __future__ import annotations

from pathlib import Path

from hpoflow.engines.local.engine import LocalEngine
from hpoflow.engines.machine import machine_cores
from tests.engines.test_local import request, run_all


def test_a_core_listed_twice_stays_two_slots_across_trials(tmp_path: Path) -> None:
    core = machine_cores()[0]
    engine = LocalEngine(cores=[core, core], gpus=[], prestart=False)
    try:
        for number in range(3):  # before the fix, the second trial found one slot and was refused
            req = request(tmp_path, number, "trainfns_light:nap", metric="value", processes=2,
                          options={"seconds": 0.0})
            req.params["x"] = 0.5
            assert engine.capacity(req) == 1
            res = run_all(engine, [req])[number]
            assert res.status == "complete", res.error
            assert sorted(engine.free_cores) == [core, core]
    finally:
        engine.close()
