"""Cluster spec loading/validation and the driver's check_trial hook."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpoflow.oracle import OracleError, check_trial, load_cluster
from hpoflow.oracle.catalog import PRESETS


def test_every_preset_loads_and_is_frozen() -> None:
    for name in PRESETS:
        spec = load_cluster(name)
        assert spec.total_devices >= 1 and spec.device.source
    with pytest.raises(Exception):  # noqa: B017 - pydantic frozen instance error
        spec.nodes = 3  # type: ignore[misc]


def test_yaml_errors_name_key_and_line(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("nodes: 2\ndevices_per_node: 4\ndevice: v100\nintra_node: nvlink2\n"
                 "inter_node: ib-edr\nextra_key: 1\n")
    with pytest.raises(OracleError, match=r"extra_key.*line 6"):
        load_cluster(f)
    f.write_text("nodes: [1\n")
    with pytest.raises(OracleError, match="not valid YAML"):
        load_cluster(f)
    with pytest.raises(OracleError, match="p100-cluster"):
        load_cluster("no-such-preset")


def test_check_trial_infeasible_reason_has_numbers() -> None:
    tiny = load_cluster({**PRESETS["laptop"], "device": {
        "name": "tiny", "peak_flops": {"fp32": 1e10}, "memory_bytes": 2e6,
        "memory_bandwidth": 1e9}})
    train = {"model": "cnn", "model_options": {}, "dataset": "digits", "batch_size": 64,
             "optimizer": "adam", "momentum": 0.0, "epochs": 2}
    v = check_trial(train, processes=2, gpus_per_process=0, cluster=tiny)
    assert not v.feasible
    assert len(re.findall(r"\d+\.\d+ GiB", v.reason)) == 2  # needed and available
    assert "largest batch that fits" in v.reason
    assert v.predicted["max_batch_per_device"] < 64
    ok = check_trial({**train, "batch_size": 4}, processes=1, gpus_per_process=0, cluster=None)
    assert ok.feasible and ok.predicted["devices"] == 1
