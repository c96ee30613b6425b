"""A Hugging Face ``Trainer`` script, which hpoflow tunes as it is (examples/scripts/hf.yaml):

    torchrun --nproc-per-node 2 examples/scripts/train_hf.py --lr 5e-3 --epochs 3
    hpoflow run examples/scripts/hf.yaml --run-dir runs/script-hf

A tiny BERT (``BertForSequenceClassification`` built from a ``BertConfig``: no weights are downloaded)
learns whether a sequence of random tokens holds more 1s than 2s (generated from the seed), its data read
by two ``DataLoader`` worker processes (``dataloader_num_workers``). Under torchrun, or as a multi-rank
hpoflow trial (which gives each rank torchrun's environment), the Trainer runs DDP over gloo on the CPU by
itself. It evaluates every ``--eval-steps`` optimizer steps (``eval_strategy="steps"``); rank 0 prints
``evaluation: step S, epoch E, eval_loss V`` after each (for people: hpoflow does not read it). Where
hpoflow is installed, ``HpoflowCallback`` reports each evaluation to the trial (step: the evaluation count,
which ``training.epochs`` and a scheduler's rungs count), stops the Trainer when the trial is pruned or
paused, and has the Trainer checkpoint in ``HPOFLOW_CHECKPOINT_DIR`` before a pause; ``resume_path()`` is
that checkpoint, from which ``Trainer.train`` resumes the paused trial's next run (outside a trial the
callback does nothing and there is nothing to resume).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

try:
    from hpoflow.integrations.huggingface import HpoflowCallback, resume_path
except ImportError:  # the script needs nothing of hpoflow
    HpoflowCallback = None  # type: ignore[assignment,misc]

    def resume_path() -> str | None:
        return None

VOCAB, LENGTH = 16, 12


class Counting(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences; the label: more 1s than 2s."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
        self.labels = ((self.ids == 1).sum(1) > (self.ids == 2).sum(1)).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class PrintEvaluations(TrainerCallback):
    """``evaluation: step S, epoch E, eval_loss V`` on rank 0 after each evaluation."""

    def on_evaluate(self, args: TrainingArguments, state: Any, control: Any, metrics: Any = None,
                    **kwargs: Any) -> None:
        if state.is_world_process_zero and metrics:
            print(f"evaluation: step {state.global_step}, epoch {state.epoch:.2f}, "
                  f"eval_loss {metrics['eval_loss']:.6f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-steps", type=int, default=8, help="optimizer steps between evaluations")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=2 * args.hidden, max_position_embeddings=LENGTH, num_labels=2)
    model = BertForSequenceClassification(config)
    # the Trainer's output_dir (it saves nothing here of its own: save_strategy "no"; a pause's checkpoint
    # goes to HPOFLOW_CHECKPOINT_DIR): the trial's directory in a trial, else a temporary one of this
    # rank's, removed at the end
    trial_dir = os.environ.get("HPOFLOW_TRIAL_DIR")
    out = trial_dir or tempfile.mkdtemp(prefix="train_hf-")
    training = TrainingArguments(
        output_dir=os.path.join(out, "hf"), learning_rate=args.lr, num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=256, eval_strategy="steps",
        eval_steps=args.eval_steps, save_strategy="no", logging_strategy="no", report_to=[], disable_tqdm=True,
        use_cpu=True, ddp_backend="gloo", ddp_find_unused_parameters=False, seed=args.seed,
        dataloader_num_workers=args.workers, dataloader_persistent_workers=args.workers > 0)
    callbacks: list[TrainerCallback] = [PrintEvaluations()]
    if HpoflowCallback is not None:
        callbacks.append(HpoflowCallback())
    trainer = Trainer(model=model, args=training, train_dataset=Counting(args.samples, args.seed),
                      eval_dataset=Counting(256, args.seed + 1), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume_path())
    if not trial_dir:
        shutil.rmtree(out, ignore_errors=True)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # the ranks leave together: one tearing its gloo connections down while a peer still uses them
        # aborts now and then ("terminate called without an active exception", 2 CPU ranks under torchrun)
        torch.distributed.barrier()
        # ...and without destructors. With torch 2.13 on gloo, freeing the Trainer's DDP model at the end of
        # main() destroys the process group (the DDP reducer holds it), and its destructor joins gloo's
        # worker threads with the GIL held, while a worker that drops the last hold on a finished
        # collective's tensors waits for the GIL: a rank hung there now and then (py-spy; 4 of ~40 full test
        # runs, under torchrun and as an hpoflow trial alike)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
