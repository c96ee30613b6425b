"""CLI (through our own parser and `python -m hpoflow`) and a real 2-process gloo calibration."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpoflow.cli.oracle_cmd import register
from hpoflow.oracle import load_cluster, write_cluster

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hpoflow")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_register_json_has_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code = _run(["oracle", "--model", "resnet50", "--batch-size", "32",
                 "--cluster", "p100-cluster", "--devices", "8", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("step_s", "compute_s", "exposed_comm_s", "throughput", "time_to_train_s",
                "memory_per_device_bytes", "bottleneck", "max_batch_per_device",
                "max_speedup_devices", "scaling_efficiency", "sync_wait_s", "facts"):
        assert key in out
    assert out["devices"] == 8 and out["facts"]["params"] == 25_557_032


def test_register_user_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["oracle", "--model", "nope", "--cluster", "laptop"]) == 2
    err = capsys.readouterr().err
    assert "resnet50" in err and "Traceback" not in err and err.count("\n") == 1
    assert _run(["oracle", "predict", "--model", "mlp", "--cluster", "nowhere"]) == 2


@pytest.mark.parametrize(("flag", "value", "field"), [
    ("--devices", "0", "devices"), ("--batch-size", "0", "batch_size"), ("--epochs", "0", "epochs"),
    ("--devices", "-3", "devices")])
def test_bad_values_are_refused_with_the_value_given(flag: str, value: str, field: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["oracle", "--model", "mlp", "--cluster", "p100-cluster", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{field} must be" in err and f"but got {float(value) if field == 'epochs' else int(value)}" in err
    assert "64" not in err.split("but got")[1]  # the bad value, not the cluster's device count


def test_options_before_predict_are_kept(capsys: pytest.CaptureFixture[str]) -> None:
    code = _run(["oracle", "--model", "cnn", "--cluster", "p100-cluster", "--batch-size", "7", "predict",
                 "--devices", "8", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["model"], out["cluster"], out["batch_per_device"], out["devices"]) == ("cnn", "p100-cluster", 7, 8)


def test_a_plan_that_does_not_fit_exits_3_with_the_largest_batch(capsys: pytest.CaptureFixture[str]) -> None:
    code = _run(["oracle", "--model", "resnet50", "--cluster", "v100-cluster", "--devices", "4",
                 "--batch-size", "512"])
    assert code == 3
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out and "does not fit in memory" in captured.out
    top = int(captured.err.split("the largest batch that fits is ")[1].split()[0])
    assert 100 < top < 512 and "GiB" in captured.err
    assert _run(["oracle", "--model", "resnet50", "--cluster", "v100-cluster", "--devices", "4",
                 "--batch-size", str(top), "--json"]) == 0


def test_help_shows_a_worked_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _run(["oracle", "--help"])
    out = capsys.readouterr().out
    assert "worked example" in out and "hpoflow oracle --model resnet50 --cluster p100-cluster" in out
    assert "exit codes" in out and "3 it does not fit" in out


def test_the_table_says_which_all_reduce_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["oracle", "--model", "resnet50", "--cluster", "p100-cluster", "--devices", "64"]) == 0
    out = capsys.readouterr().out
    assert "hier-hd" in out and "latency steps" in out and "ring" in out


@pytest.mark.slow
def test_python_m_hpoflow_oracle(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: 0\n")
    for argv in (["--model", "resnet51"], ["--model", "mlp", "--cluster", str(bad)]):
        r = subprocess.run([sys.executable, "-m", "hpoflow", "oracle", *argv], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr and "error" in r.stderr
    r = subprocess.run([sys.executable, "-m", "hpoflow", "oracle", "--model", "cnn",
                        "--cluster", "laptop", "--devices", "2", "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["bottleneck"]


@pytest.mark.slow
def test_calibrate_real_gloo_two_processes(tmp_path: Path, calibration_2: tuple[Any, Path]) -> None:
    spec = calibration_2[0]
    assert spec.devices_per_node == 2
    assert spec.device.peak_flops["fp32"] > 1e8
    assert spec.intra_node.bandwidth > 0 and spec.intra_node.latency >= 0
    # the generic memory-bound layer, optimizer and skew probes all landed in the spec
    from hpoflow.oracle.calibration import ELEMENT_GRID, LAYER_KINDS
    assert set(spec.device.layer_cost or {}) == set(LAYER_KINDS)
    assert all(len(rows) == len(ELEMENT_GRID) for rows in (spec.device.layer_cost or {}).values())
    opt = spec.overheads.optimizer_per_param_s
    assert set(opt) == {"sgd", "momentum", "adam"} and opt["adam"] > 0
    waits = spec.overheads.sync_wait
    assert len(waits) == 4 and all(w >= 0 for _, w in waits) and min(w for _, w in waits) == 0.0
    again = load_cluster(write_cluster(spec, tmp_path / "cal.yaml"))
    assert again == spec
