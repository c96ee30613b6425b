"""Elastic trials on the local engine, with real processes and process groups: a trial grows onto an
idle core at an epoch boundary, gives it back when a new trial needs it, resumes from its checkpoint
each time, and a grown built-in trial ends where the fixed-size one does."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hpoflow.engines import Engine, TrialReport, TrialRequest, TrialResult
from hpoflow.engines.elastic import ElasticBook
from hpoflow.engines.local import LocalEngine
from hpoflow.spec import TrainConfig
from tests.conftest import ROOT

PYPATH = (str(ROOT / "tests"),)


def elastic_request(tmp_path: Path, number: int, epochs: int = 6, work_s: float = 0.6,
                    sizes: tuple[int, ...] = (1, 2)) -> TrialRequest:
    train = TrainConfig(function="trainfns:elastic_epochs", options={"epochs": epochs, "work_s": work_s},
                        epochs=epochs).model_dump(mode="json")
    return TrialRequest(number, {}, train, "loss", "minimize", str(tmp_path / str(number)), python_path=PYPATH,
                        processes=sizes[0], elastic_sizes=sizes)


def drive(engine: Engine, submit_at: dict[int, list[TrialRequest]] | None = None,
          limit: float = 120.0) -> tuple[dict[int, TrialResult], list[TrialReport]]:
    """Poll like the driver: answer every report (never prune); submit ``submit_at[k]`` once ``k``
    reports have arrived."""
    submit_at = dict(submit_at or {})
    results: dict[int, TrialResult] = {}
    reports: list[TrialReport] = []
    t0 = time.monotonic()
    while engine.running() or submit_at:
        if time.monotonic() - t0 > limit:
            raise TimeoutError(f"not finished: {results}")
        for ev in engine.poll(0.5):
            if isinstance(ev, TrialReport):
                reports.append(ev)
                if ev.wants_answer:
                    engine.answer(ev.number, False)
            else:
                results[ev.number] = ev
        for k in sorted(submit_at):
            if len(reports) >= k:
                for r in submit_at.pop(k):
                    engine.submit(r)
    return results, reports


@pytest.fixture
def engine() -> Any:
    eng = LocalEngine(cores=[0, 1])
    yield eng
    eng.close()


def test_a_lone_elastic_trial_grows_onto_the_idle_core_and_resumes_where_it_left(engine: LocalEngine,
                                                                                  tmp_path: Path) -> None:
    req = elastic_request(tmp_path, 0)
    engine.submit(req)
    results, reports = drive(engine)
    res = results[0]
    assert res.status == "complete", res
    sizes = json.loads((tmp_path / "0" / "sizes.json").read_text())
    assert sizes[0] == 1 and sizes[-1] == 2, sizes  # started alone, grew at an epoch boundary
    assert len(sizes) == 6  # every epoch once: resumed from the checkpoint, nothing repeated or lost
    assert [r.step for r in reports] == [1, 2, 3, 4, 5, 6]
    assert res.metrics["epochs_done"] == 6.0
    # the all-reduce summed over the real group of each epoch (1 per epoch whatever the world size)
    assert res.metrics["total"] == pytest.approx(6.0)
    assert res.timings["resizes"] == 1.0 and res.timings["max_ranks"] == 2.0
    log = [json.loads(line) for line in (tmp_path / "0" / "elastic.jsonl").read_text().splitlines()]
    assert [(e["from"], e["to"]) for e in log] == [(1, 2)]
    # system usage covers both sizes: the 1-rank segment's rank and the 2-rank segment's two
    assert res.system["rss_peak_mb"] > 0 and "cpu_percent" in res.system


def test_a_grown_trial_gives_the_core_back_when_a_new_trial_is_submitted(engine: LocalEngine,
                                                                          tmp_path: Path) -> None:
    a = elastic_request(tmp_path, 0, epochs=12)
    b = replace(elastic_request(tmp_path, 1, epochs=2, work_s=0.3), elastic_sizes=())  # a fixed 1-rank trial
    engine.submit(a)
    results, reports = drive(engine, submit_at={3: [b]})  # after A's 3rd report: A holds both cores
    assert results[0].status == "complete" and results[1].status == "complete", results
    sizes = json.loads((tmp_path / "0" / "sizes.json").read_text())
    assert len(sizes) == 12 and 2 in sizes, sizes
    log = [(e["from"], e["to"]) for e in map(json.loads, (tmp_path / "0" / "elastic.jsonl").read_text().splitlines())]
    assert log[:2] == [(1, 2), (2, 1)], log  # grew, then shrank for B
    assert (1, 2) in log[2:], log  # and grew again once B had finished
    # B started only after A shrank: its first report follows A's shrink
    first_b = next(i for i, r in enumerate(reports) if r.number == 1)
    assert sizes.index(2) < first_b


def test_a_grow_that_does_not_pay_is_undone_and_not_tried_again(engine: LocalEngine, tmp_path: Path) -> None:
    # the work does not split over ranks: 2 ranks take twice as long as 1 (a margin load cannot hide)
    req = elastic_request(tmp_path, 0, epochs=8, work_s=0.2)
    req = replace(req, train={**req.train, "options": {"epochs": 8, "work_s": 0.2, "split": False}})
    engine.submit(req)
    results, _ = drive(engine)
    assert results[0].status == "complete", results[0]
    log = [(e["from"], e["to"]) for e in map(json.loads, (tmp_path / "0" / "elastic.jsonl").read_text().splitlines())]
    assert log == [(1, 2), (2, 1)], log


def test_the_book_hands_idle_cores_out_in_the_policy_order() -> None:
    book = ElasticBook("minimize", "loss")
    book.add(0, (1, 2, 3, 4), 1, "longest_remaining", 1, 10, 0.0)
    book.add(1, (1, 2, 3, 4), 1, "longest_remaining", 1, 20, 0.0)
    for now in (1.0, 2.0):  # one whole epoch timed at the current size
        book.on_report(0, {"loss": 0.5}, now)
        book.on_report(1, {"loss": 0.4}, now)
    # 2 idle cores: trial 1 has more work left, so it takes both; trial 0 none
    assert book.decide(0, free_cores=2, demand_cores=0) == 0
    assert book.decide(1, free_cores=2, demand_cores=0) == 3
    assert book.promised() == 2
    # most_promising ranks by the last value (minimize: trial 1's 0.4 first) the same here; a demand shrinks
    book.on_restart(1, 3, 2.0)
    assert book.decide(1, free_cores=0, demand_cores=1) == 2  # gives back just what is needed
    assert book.fit(1, free_cores=5) == 2


def _digits_study(processes: Any, epochs: int = 6) -> dict[str, Any]:
    return {
        "study": {"name": "elastic-digits", "metric": "val_accuracy", "direction": "maximize"},
        "space": {"lr": {"type": "categorical", "choices": [0.003]}},
        "search": {"algorithm": "grid", "max_concurrent": 1},
        "training": {"model": "cnn", "dataset": "digits", "epochs": epochs, "batch_size": 64, "optimizer": "adam",
                     "lr": "${lr}"},
        "resources": {"processes": processes},
        "oracle": {"enabled": False},
    }


@pytest.mark.slow
def test_a_grown_builtin_trial_ends_within_half_a_percent_of_the_fixed_size_run(tmp_path: Path) -> None:
    from hpoflow.api import optimize

    fixed = optimize(_digits_study(1), tmp_path / "fixed", handle_signals=False)
    grown = optimize(_digits_study({"min": 1, "max": 2}), tmp_path / "elastic", handle_signals=False)
    result = json.loads((tmp_path / "elastic" / "trials" / "0" / "result.json").read_text())
    assert result["timings"]["resizes"] >= 1 and result["timings"]["max_ranks"] == 2.0, result["timings"]
    assert fixed.best_value is not None and grown.best_value is not None
    assert abs(grown.best_value - fixed.best_value) <= 0.005, (grown.best_value, fixed.best_value)
    # the global batch stayed 64: 64 per rank on one rank, 32 on two
    assert result["metrics"]["global_batch"] == 64.0


def test_on_the_compss_engine_an_elastic_trial_grows_as_a_task_of_the_new_size(tmp_path: Path) -> None:
    """The compss engine in sequential mode (the task body in a thread, ranks as real processes): the
    trial's task ends at an epoch boundary, and the engine submits its next segment with 2 ranks
    because ``compss.slots`` says 2 cores are the study's and 1 is idle."""
    from hpoflow.engines.compss import CompssEngine

    eng = CompssEngine(run_dir=tmp_path, sequential=True, slots=2, poll_interval_s=0.05)
    try:
        eng.submit(elastic_request(tmp_path, 0, epochs=5, work_s=0.8))
        results, reports = drive(eng)
    finally:
        eng.close()
    res = results[0]
    assert res.status == "complete", res
    sizes = json.loads((tmp_path / "0" / "sizes.json").read_text())
    assert sizes[0] == 1 and sizes[-1] == 2 and len(sizes) == 5, sizes
    assert [r.step for r in reports] == [1, 2, 3, 4, 5]
    assert res.timings["resizes"] == 1.0 and res.metrics["total"] == pytest.approx(5.0)
    assert res.system.get("rss_peak_mb", 0) > 0  # the task's system usage reaches the result


def test_on_the_compss_engine_without_slots_an_elastic_trial_keeps_its_size(tmp_path: Path) -> None:
    from hpoflow.engines.compss import CompssEngine

    eng = CompssEngine(run_dir=tmp_path, sequential=True, poll_interval_s=0.05)
    try:
        eng.submit(elastic_request(tmp_path, 0, epochs=3, work_s=0.3))
        results, _ = drive(eng)
    finally:
        eng.close()
    assert results[0].status == "complete"
    assert json.loads((tmp_path / "0" / "sizes.json").read_text()) == [1, 1, 1]


@pytest.mark.slow
def test_a_grown_trial_that_loses_a_rank_is_rerun_from_the_checkpoint_its_two_ranks_wrote(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpoflow.api import optimize

    spec = {
        "study": {"name": "elastic-crash", "metric": "loss", "direction": "minimize"},
        "space": {"x": {"type": "categorical", "choices": [1]}},
        "search": {"algorithm": "grid", "max_concurrent": 1},
        "training": {"function": "trainfns:elastic_epochs", "epochs": 6,
                     "options": {"epochs": 6, "work_s": 0.6, "kill_rank1_at": 4}},
        "resources": {"processes": {"min": 1, "max": 2}, "max_retries": 1},
    }
    monkeypatch.chdir(ROOT / "tests")  # training.function is looked up in the current directory
    res = optimize(spec, tmp_path / "run", handle_signals=False)
    assert res.summary.n_complete == 1, res.summary
    trial = res.study.trials[0]
    assert trial.user_attrs["attempts"] == 2  # the lost rank made it retryable; it was rerun once
    sizes = json.loads((tmp_path / "run" / "trials" / "0" / "sizes.json").read_text())
    # epochs 1-2 on one rank, 3 on two (saved by both), 4 lost with rank 1; the rerun starts on one
    # rank from epoch 3's checkpoint, then grows again: every epoch counted once
    assert len(sizes) == 6 and sizes[:3] == [1, 1, 2] and sizes[3] == 1, sizes


def test_a_trial_queued_for_lent_cores_can_be_cancelled_before_it_starts(engine: LocalEngine,
                                                                         tmp_path: Path) -> None:
    a = elastic_request(tmp_path, 0, epochs=6, work_s=0.4)
    b = replace(elastic_request(tmp_path, 1, epochs=2, work_s=0.1), elastic_sizes=())
    engine.submit(a)
    results: dict[int, TrialResult] = {}
    reports = 0
    t0 = time.monotonic()
    while engine.running():
        assert time.monotonic() - t0 < 60
        for ev in engine.poll(0.5):
            if isinstance(ev, TrialReport):
                reports += 1
                engine.answer(ev.number, False)
            else:
                results[ev.number] = ev
        if reports == 3 and 1 not in engine.running() and 1 not in results:
            engine.submit(b)  # A holds both cores: B waits for one
            assert 1 in engine.running()
            engine.cancel(1, "changed my mind")
    assert results[1].status == "cancelled" and results[1].error == "changed my mind"
    assert results[0].status == "complete"
    assert not (tmp_path / "1" / "rank0.log").exists()  # it never started
