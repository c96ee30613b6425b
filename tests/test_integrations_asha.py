"""The Lightning and Hugging Face callbacks (``hpoflow.integrations``) as their users run them, under promotion
ASHA: the example scripts (examples/scripts/train_lightning.py with its progress bar on, several validations
an epoch and ``DataLoader`` workers; train_hf.py evaluating every few steps), unchanged, as 2-rank trials.
The callbacks report the validation count as the step (the rungs and ``training.epochs`` count it), and at
a pause have the framework save its checkpoint in ``HPOFLOW_CHECKPOINT_DIR``; the promoted trial's next run
resumes from it (``resume_path()``): its first report is past the rung, no validation is trained twice,
and the reported steps are exactly the validations.

And in-process, outside a trial: what each callback counts (sanity checks, ``trainer.validate()`` and
``trainer.evaluate()`` outside the fit, several eval datasets), and that the count comes back with the
framework's checkpoint."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from optuna.trial import FrozenTrial, TrialState

from hpoflow.run.ledger import ATTR_PAUSED, ATTR_RUNGS, ATTR_SEGMENTS
from tests.conftest import ROOT, RUN_ENV

pytestmark = pytest.mark.slow  # real frameworks: a Lightning or transformers import per rank and run

RUNS = re.compile(r"^hpoflow: command: rank 0 runs ", re.M)  # a run of the trial starts (its rank 0 log)
VALIDATED = re.compile(r"^(?:validation|evaluation): step (\d+), epoch ", re.M)  # printed by the scripts


def _validations_per_run(run_dir: Path, number: int, steps_per_validation: int) -> list[list[int]]:
    """The validations (1, 2, ...: from the global step each was made at) of each run of trial ``number``,
    as its rank 0 printed them."""
    log = (run_dir / "trials" / str(number) / "rank0.log").read_text()
    runs = RUNS.split(log)[1:]
    return [[int(s) // steps_per_validation for s in VALIDATED.findall(run)] for run in runs]


def _study(name: str, command: list[str], metric: str, good: dict[str, Any], bad: dict[str, Any]) -> dict[str, Any]:
    """One slot, two configurations, the good first: rung 3 of 4 validations (``min_resource: 3``,
    ``reduction_factor: 2``). The good one reaches it alone and pauses, the bad one joins it and pauses,
    and the good one is promoted and resumes from its checkpoint to its 4th validation."""
    return {"study": {"name": name, "metric": metric, "direction": "minimize"},
            "space": {"lr": {"type": "float", "low": 1e-4, "high": 1.0, "log": True},
                      "hidden": {"type": "categorical", "choices": [16, 32, 64]}},
            "search": {"algorithm": "random", "n_trials": 2, "max_concurrent": 1, "seed": 0, "enqueue": [good, bad],
                       "scheduler": {"type": "asha", "min_resource": 3, "reduction_factor": 2, "anchor": "min"}},
            "training": {"command": command, "epochs": 4, "stop_grace_s": 30},
            "resources": {"processes": 2, "cpus_per_process": 1}}


def _check_promoted(run_dir: Path, trials: list[FrozenTrial], steps_per_validation: int) -> None:
    good, bad = trials
    states = [(t.number, t.state, t.user_attrs.get(ATTR_RUNGS), t.user_attrs.get(ATTR_SEGMENTS)) for t in trials]
    assert good.state == TrialState.COMPLETE and bad.state == TrialState.PRUNED, states
    # paused once at rung 3, at its 3rd validation, and promoted
    assert [(s["step"], s["reported"]) for s in good.user_attrs[ATTR_SEGMENTS]] == [(3, 3)], states
    assert bad.user_attrs[ATTR_PAUSED] == 3, states
    # the reported steps are exactly the validations: nothing from the lines the programs printed (the
    # progress bar's ``val_loss: ...``, the Trainer's log dicts)
    assert sorted(good.intermediate_values) == [1, 2, 3, 4]
    assert sorted(bad.intermediate_values) == [1, 2, 3]
    # its second run resumed from the checkpoint of its first: its first validation is past the rung, and
    # none was trained twice
    assert _validations_per_run(run_dir, 0, steps_per_validation) == [[1, 2, 3], [4]]
    assert _validations_per_run(run_dir, 1, steps_per_validation) == [[1, 2, 3]]
    for number in (0, 1):
        for rank in (0, 1):  # every rank's program ended by itself
            log = (run_dir / "trials" / str(number) / f"rank{rank}.log").read_text()
            assert "warm (runpy" in log and "SIGTERM" not in log, log[-3000:]
            assert log.count("the program exited with code 0") == log.count(f"command: rank {rank} runs "), log[-3000:]


def _optimize(data: dict[str, Any], run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[FrozenTrial]:
    from hpoflow.api import optimize

    monkeypatch.chdir(ROOT)  # the command's paths are relative to the repository root
    monkeypatch.setenv("PYTHONPATH", RUN_ENV["PYTHONPATH"])
    return optimize(data, run_dir).study.trials


def test_lightning_with_its_progress_bar_resumes_a_promoted_trial_from_its_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """1280 samples, 1024 to train, 512 a rank in batches of 64: 8 steps an epoch, validated every 4
    (``--val-check-interval 0.5``); 2 epochs are the 4 validations. The pause at rung 3 is in the middle of
    the 2nd epoch, where Lightning resumes."""
    pytest.importorskip("lightning")
    command = ["python", "examples/scripts/train_lightning.py", "--lr", "${lr}", "--hidden", "${hidden}",
               "--samples", "1280", "--val-check-interval", "0.5", "--epochs", "2"]
    trials = _optimize(_study("lightning-asha", command, "val_loss", {"lr": 0.3, "hidden": 64},
                              {"lr": 0.001, "hidden": 16}), tmp_path / "run", monkeypatch)
    _check_promoted(tmp_path / "run", trials, steps_per_validation=4)
    log = (tmp_path / "run" / "trials" / "0" / "rank0.log").read_text()
    second = RUNS.split(log)[2]
    assert "Restored all states from the checkpoint" in second and "lightning.ckpt" in second, second[-3000:]
    assert [p.name for p in (tmp_path / "run" / "trials" / "0").glob("checkpoints*/*")] == ["lightning.ckpt"]


def test_a_hugging_face_trainer_evaluating_every_few_steps_resumes_a_promoted_trial_from_its_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """384 samples, 192 a rank in batches of 32: 6 optimizer steps an epoch, evaluated every 3
    (``--eval-steps 3``: the global steps 3, 6, 9, 12 are the evaluations 1 to 4). The pause at rung 3 is
    at step 9, in the middle of the 2nd epoch, where the Trainer resumes (skipping the batches trained)."""
    pytest.importorskip("transformers")
    command = ["python", "examples/scripts/train_hf.py", "--lr", "${lr}", "--hidden", "${hidden}",
               "--samples", "384", "--eval-steps", "3", "--epochs", "2"]
    trials = _optimize(_study("hf-asha", command, "eval_loss", {"lr": 0.006, "hidden": 32},
                              {"lr": 1.0, "hidden": 16}), tmp_path / "run", monkeypatch)
    _check_promoted(tmp_path / "run", trials, steps_per_validation=3)
    # the Trainer's checkpoints went to the checkpoint directory, the older one removed once the newer was in:
    # the good trial's at its end (training.epochs: a pause too, for PBT), the bad one's at its rung
    for number, step in ((0, 12), (1, 9)):
        saved = sorted(p.name for p in (tmp_path / "run" / "trials" / str(number)).glob("checkpoints*/*"))
        assert saved == [f"checkpoint-{step}"], saved
        assert (next((tmp_path / "run" / "trials" / str(number)).glob("checkpoints*")) / f"checkpoint-{step}" /
                "rng_state_1.pth").is_file()  # every rank's RNG state: each rank saved


# -- in-process, outside a trial: what the callbacks count -------------------------------------------------------


def test_the_lightning_callback_counts_validations_of_the_fit_and_restores_its_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lightning")
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from hpoflow.integrations.lightning import HpoflowCallback, resume_path

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
            self.log("val_loss", self.net(batch[0]).pow(2).mean())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=4)  # 4 steps an epoch

    def trainer(epochs: int, cb: HpoflowCallback) -> pl.Trainer:
        return pl.Trainer(max_epochs=epochs, val_check_interval=0.5, num_sanity_val_steps=2, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[cb], accelerator="cpu", devices=1)

    cb = HpoflowCallback()
    t = trainer(2, cb)
    t.fit(Tiny(), data, data)
    assert cb.validations == 4  # twice an epoch; the sanity check not counted
    t.validate(t.lightning_module, data, verbose=False)
    assert cb.validations == 4  # a validation outside the fit is not counted
    t.save_checkpoint(tmp_path / "c.ckpt")
    again = HpoflowCallback()
    trainer(3, again).fit(Tiny(), data, data, ckpt_path=tmp_path / "c.ckpt")
    assert again.validations == 6  # restored from the checkpoint, and counted on
    monkeypatch.delenv("HPOFLOW_CHECKPOINT_DIR", raising=False)
    assert resume_path() is None  # outside a trial
    monkeypatch.setenv("HPOFLOW_CHECKPOINT_DIR", str(tmp_path))
    assert resume_path() is None  # nothing paused yet
    (tmp_path / "c.ckpt").rename(tmp_path / "lightning.ckpt")
    assert resume_path() == str(tmp_path / "lightning.ckpt")


def test_the_hugging_face_callback_counts_evaluations_of_training_and_restores_its_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    import torch
    from transformers import Trainer, TrainingArguments

    from hpoflow.integrations.huggingface import HpoflowCallback, resume_path

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(2, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": (self.w(x).squeeze(1) - labels).pow(2).mean()}

    class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __init__(self, n: int) -> None:
            self.x = torch.randn(n, 2, generator=torch.Generator().manual_seed(n))

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": self.x[i], "labels": self.x[i].sum()}

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)

    def trainer(epochs: int, cb: HpoflowCallback) -> Trainer:
        args = TrainingArguments(output_dir=str(tmp_path / "out"), num_train_epochs=epochs,
                                 per_device_train_batch_size=4, eval_strategy="steps", eval_steps=2,
                                 save_strategy="steps", save_steps=4, logging_strategy="no", report_to=[],
                                 disable_tqdm=True, use_cpu=True, dataloader_num_workers=0)
        # two eval datasets: an evaluation calls on_evaluate once for each, at one global step
        return Trainer(model=Model(), args=args, train_dataset=Data(16), eval_dataset={"a": Data(8), "b": Data(4)},
                       callbacks=[cb])

    cb = HpoflowCallback()
    t = trainer(1, cb)  # 4 steps: evaluations at 2 and 4, a checkpoint at 4
    t.train()
    assert cb.evaluations == 2
    t.evaluate()
    assert cb.evaluations == 2  # an evaluation outside train() is not counted
    again = HpoflowCallback()
    trainer(2, again).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    assert again.evaluations == 4  # restored from the checkpoint's trainer state, and counted on
    monkeypatch.delenv("HPOFLOW_CHECKPOINT_DIR", raising=False)
    assert resume_path() is None  # outside a trial
    monkeypatch.setenv("HPOFLOW_CHECKPOINT_DIR", str(tmp_path / "out"))
    (tmp_path / "out" / "checkpoint-12").mkdir()  # a save cut short: no trainer_state.json
    assert resume_path() == str(tmp_path / "out" / "checkpoint-8")
