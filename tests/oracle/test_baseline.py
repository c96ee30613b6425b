"""A measured baseline calibrates the device time; the rest is extrapolated (docs/oracle.md)."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import pytest

from hpoflow.oracle import OracleError, Plan, load_cluster, model_facts, predict
from hpoflow.oracle.baseline import Baseline, calibrate_scale, read_baseline

# Goyal et al. 2017: Big Basin servers of 8 P100s (NVLink), 50 Gbit/s Ethernet; catalogue device figures
BIG_BASIN = {"name": "big-basin", "nodes": 44, "devices_per_node": 8, "device": "p100", "intra_node": "nvlink1",
             "inter_node": "50gbe"}
GOYAL = Plan(batch_size=32, optimizer="sgd", momentum=0.9, epochs=90, bucket_mb=0)
PER_GPU_AT_8 = 1_281_167 * 90 / (29 * 3600) / 8  # their 8-GPU baseline: 29 h for 90 epochs, ~138 images/s per GPU


def test_goyal_256_gpus_from_their_own_8_gpu_baseline_within_25_percent() -> None:
    f, c = model_facts("resnet50"), load_cluster(BIG_BASIN)
    scale = calibrate_scale(f, c, GOYAL, Baseline(PER_GPU_AT_8, 8))
    assert 1.2 < scale < 2.5  # the 2017 Caffe2 stack ran well below the datasheet's pace
    at8 = predict(f, c, replace(GOYAL, devices=8, compute_scale=scale))
    assert at8.throughput / 8 == pytest.approx(PER_GPU_AT_8, rel=1e-3)  # the baseline is reproduced
    minutes = predict(f, c, replace(GOYAL, devices=256, compute_scale=scale)).time_to_train_s / 60
    assert 0.75 <= minutes / 60 <= 1.25  # "ResNet-50 ... on 256 GPUs in one hour"
    without = predict(f, c, replace(GOYAL, devices=256)).time_to_train_s / 60
    assert without / 60 < 0.75  # from datasheet figures alone it is far too fast


def test_read_baseline_from_a_number_or_a_run_directory(tmp_path: Path) -> None:
    assert read_baseline("138", 8) == Baseline(138.0, 8)
    assert read_baseline("2.5") == Baseline(2.5, 1)
    rows = [("0", "COMPLETE", "400", "2", "64"), ("1", "COMPLETE", "440", "2", "64"), ("2", "FAIL", "", "", ""),
            ("3", "COMPLETE", "700", "4", "128"), ("4", "PRUNED", "999", "2", "64")]
    with (tmp_path / "trials.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["number", "state", "metric_samples_per_s", "metric_world_size", "metric_global_batch"])
        w.writerows(rows)
    b = read_baseline(str(tmp_path))
    # complete trials at the smallest world size (2): samples/s over all ranks / 2, median
    assert b.devices == 2 and b.samples_per_s == pytest.approx(210.0) and b.batch_size == 32
    assert "median of 2 complete trial(s) at world size 2" in b.source


@pytest.mark.parametrize(("text", "devices", "message"), [
    ("0", None, "must be samples/s per device > 0"),
    ("nowhere", None, "neither"),
])
def test_bad_baselines_say_the_rule_and_the_fix(text: str, devices: int | None, message: str) -> None:
    with pytest.raises(OracleError, match=message):
        read_baseline(text, devices)


def test_a_baseline_faster_than_the_network_allows_is_refused() -> None:
    f = model_facts("vgg16")
    slow = load_cluster({**BIG_BASIN, "inter_node": "10gbe", "overlap": 0.0})
    with pytest.raises(OracleError, match="faster than this cluster's communication allows"):
        calibrate_scale(f, slow, Plan(batch_size=2, bucket_mb=25), Baseline(1e6, 64))
