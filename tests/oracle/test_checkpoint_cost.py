"""The oracle's checkpoint-cost term and its Young/Daly advice, on given figures; the CLI's --mtbf-hours."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from hpoflow.cli.oracle_cmd import register
from hpoflow.oracle import OracleError, load_cluster
from hpoflow.oracle._checkpoint import advise, checkpoint_cost, expected_overhead, filesystem_of, young_daly_interval
from hpoflow.oracle._filesystem import measure_filesystem
from hpoflow.oracle.catalog import PRESETS
from hpoflow.oracle.facts import ModelFacts

FS = {"name": "test-fs", "bandwidth": 10e9, "node_bandwidth": 4e9, "stream_bandwidth": 2e9, "latency": 0.01,
      "staging_bandwidth": 8e9}


def _facts(params: int) -> ModelFacts:
    return ModelFacts(name="m", input_shape=(3,), n_classes=2, precision="fp32", params=params, param_tensors=1,
                      forward_flops=1.0, conv_flops_fraction=0.0, activation_bytes=0, boundary_bytes=0,
                      ops_per_step=1, conv_layers=0)


def test_young_daly_on_given_figures() -> None:
    """A checkpoint of 60 s and a failure a day: Young's interval sqrt(2 x 60 x 86,400) = 3,219.9 s, where
    the time lost to checkpoints (60 / 3,219.9) equals the work redone after failures (3,219.9 / 2 / 86,400),
    together sqrt(2 x 60 / 86,400) = 3.727 %."""
    tau = young_daly_interval(60.0, 86_400.0)
    assert tau == pytest.approx(3219.938, abs=1e-3)
    ckpt, lost = expected_overhead(tau, 60.0, 86_400.0)
    assert ckpt == pytest.approx(lost) and ckpt + lost == pytest.approx(math.sqrt(2 * 60 / 86_400))
    assert ckpt + lost == pytest.approx(0.03727, abs=1e-5)
    # Young's interval is the minimum of the expected loss
    for other in (0.5 * tau, 0.9 * tau, 1.1 * tau, 2 * tau):
        assert sum(expected_overhead(other, 60.0, 86_400.0)) > ckpt + lost
    # a restart and an async write's lag add per failure
    assert expected_overhead(tau, 60.0, 86_400.0, restore_s=120.0, lag_s=30.0)[1] == \
        pytest.approx((tau / 2 + 150.0) / 86_400)
    with pytest.raises(OracleError, match="MTBF > 0"):
        young_daly_interval(60.0, 0.0)


def test_the_bytes_and_seconds_of_each_format_on_given_figures() -> None:
    """100 M parameters with momentum SGD: 800 MB of state; 8 devices on 2 nodes of 4."""
    cluster = load_cluster({**PRESETS["p100-cluster"], "nodes": 2, "filesystem": FS})
    facts = _facts(100_000_000)
    s = 800e6
    replica = checkpoint_cost(facts, cluster, 8, "sgd", 0.9, "replica", async_save=False)
    assert (replica.state_bytes, replica.bytes_written, replica.writers) == (s, 8 * s, 8)
    # 6.4 GB: the file system (0.64 s) vs a node's 4 x 800 MB (0.8 s) vs one stream's 800 MB (0.4 s)
    assert replica.write_s == pytest.approx(0.01 + 0.8) and replica.blocking_s == replica.write_s
    rank0 = checkpoint_cost(facts, cluster, 8, "sgd", 0.9, "rank0", async_save=False)
    assert (rank0.bytes_written, rank0.writers) == (s, 1)
    assert rank0.write_s == pytest.approx(0.01 + s / 2e9)  # one stream
    dcp = checkpoint_cost(facts, cluster, 8, "sgd", 0.9, "dcp", async_save=False)
    assert (dcp.bytes_written, dcp.writers, dcp.bytes_per_writer) == (s, 8, s / 8)
    assert dcp.write_s == pytest.approx(0.01 + max(s / 10e9, 4 * s / 8 / 4e9, s / 8 / 2e9))
    assert dcp.write_s < rank0.write_s < replica.write_s
    async_ = checkpoint_cost(facts, cluster, 8, "sgd", 0.9, "dcp", async_save=True)
    assert async_.blocking_s == pytest.approx(s / 8e9)  # the staging copy of the rank's state
    assert replica.restore_s == pytest.approx(0.01 + max(8 * s / 10e9, 4 * s / 4e9, s / 2e9))
    assert checkpoint_cost(facts, cluster, 8, "adam", 0.0, "replica").state_bytes == 1.2e9
    with pytest.raises(OracleError, match="checkpoint format must be one of replica, rank0, dcp, safetensors"):
        checkpoint_cost(facts, cluster, 8, fmt="pickle")


def test_the_advice_divides_a_nodes_mtbf_by_the_job_s_nodes() -> None:
    cluster = load_cluster({**PRESETS["p100-cluster"], "nodes": 2, "filesystem": FS})
    cost = checkpoint_cost(_facts(100_000_000), cluster, 8, "sgd", 0.9, "replica", async_save=False)
    advice = advise(cost, node_mtbf_hours=24.0, step_s=0.5)
    assert advice.job_mtbf_s == pytest.approx(43_200.0)  # two nodes: one failure every 12 h
    assert advice.interval_s == pytest.approx(math.sqrt(2 * cost.blocking_s * 43_200.0))
    assert advice.interval_steps == pytest.approx(advice.interval_s / 0.5)
    assert advice.overhead == pytest.approx(advice.overhead_checkpoints + advice.overhead_failures)
    assert advice.overhead_failures == pytest.approx((advice.interval_s / 2 + cost.restore_s) / 43_200.0)
    with pytest.raises(OracleError, match="--mtbf-hours must be > 0"):
        advise(cost, 0.0, 0.5)


def test_the_default_file_system_and_a_catalogue_name_in_a_cluster_file(tmp_path: Path) -> None:
    assert filesystem_of(load_cluster("laptop")).name == "local NVMe SSD"
    assert filesystem_of(load_cluster("p100-cluster")).name.startswith("parallel file system")
    path = tmp_path / "c.yaml"
    path.write_text("nodes: 2\ndevices_per_node: 4\ndevice: v100\nintra_node: nvlink2\ninter_node: ib-edr\n"
                    "filesystem: parallel-fs-fast\n")
    assert filesystem_of(load_cluster(path)).bandwidth == 100e9
    path.write_text(path.read_text().replace("parallel-fs-fast", "nfs"))
    with pytest.raises(OracleError, match="unknown file system 'nfs'"):
        load_cluster(path)


def test_measuring_a_directory(tmp_path: Path) -> None:
    fs = measure_filesystem(tmp_path, size=8 << 20, repeats=1)
    assert fs["bandwidth"] > 1e6 and fs["latency"] > 0 and fs["staging_bandwidth"] > 1e7
    assert list(tmp_path.iterdir()) == []  # nothing left behind
    assert load_cluster({**PRESETS["laptop"], "filesystem": fs}).filesystem is not None


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hpoflow")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_the_cli_prints_the_interval_and_the_overhead(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["oracle", "--model", "mlp", "--cluster", "p100-cluster", "--devices", "8", "--mtbf-hours",
                 "8760", "--checkpoint-format", "dcp", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)["checkpoint"]
    assert c["format"] == "dcp" and c["nodes"] == 2 and c["job_mtbf_s"] == pytest.approx(8760 * 3600 / 2)
    assert c["interval_s"] == pytest.approx(max(math.sqrt(2 * c["blocking_s"] * c["job_mtbf_s"]), c["write_s"]))
    assert 0 < c["overhead"] < 0.01
    assert _run(["oracle", "--model", "mlp", "--cluster", "laptop", "--mtbf-hours", "100",
                 "--checkpoint-sync"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint every (Young/Daly)" in out and "expected overhead" in out and "(blocking)" in out
    assert _run(["oracle", "--model", "mlp", "--cluster", "laptop", "--mtbf-hours", "0"]) == 2
    assert "--mtbf-hours must be > 0" in capsys.readouterr().err
