"""The built-in trainer: a built-in model on a built-in data set, data-parallel across the trial's
ranks with the spec's strategy (``hpoflow.train.strategies``) and large-batch control
(``hpoflow.train.largebatch``).

Each rank trains on its shard of the training set (``DistributedSampler``, reshuffled per epoch
with the trial's seed, padded so every rank takes the same number of steps). One optimizer step is
``grad_accum_steps`` micro-batches. The loss follows the data set's task (``hpoflow.train.data``):
cross-entropy of one label per sample (``classify``), or of the next token at every position,
averaged over the positions (``next_token``: a language model's logits ``(batch, length, vocab)``).
``training.precision`` (fp32 | bf16 | fp16) runs forward and loss under autocast, with a loss scaler
for fp16 (``hpoflow.train.precision``). After each epoch the strategy makes the model to evaluate
identical on every rank (``end_epoch``), every rank evaluates the whole validation set (in the
training precision), rank 0 reports ``val_accuracy``, ``val_loss``, ``train_loss``,
``train_accuracy`` (per token for ``next_token``, which also reports ``val_perplexity`` =
exp(val_loss) and ``tokens_per_s``) and the measurements (``samples_per_s``, ``step_time_s``,
``comm_time_s``, ``comm_fraction``, ``bytes_per_step``, ``peak_memory_mb`` and ``startup_memory_mb``
(the largest over the ranks, ``hpoflow.train.memory``), ...), and every rank asks ``should_stop()`` at the same
point. At the end every rank writes the SHA-256
of its final evaluated weights to ``weights_rank<r>.sha256`` in the trial directory (and the
``state_dict`` to ``final_state_rank<r>.pt`` when ``HPOFLOW_SAVE_FINAL_STATE=1``); rank 0 reports
``ranks_identical`` (1.0 when every rank ended with the same weights).

Rank 0 prints one line per epoch to its rank log (``trials/<n>/rank0.log``): the epoch, the
validation and training metrics, the learning rate and the epoch's time (``epoch_line``).

Checkpoints (``training.checkpoint.every: K``): every K epochs, at the epoch boundary (after the
report, before ``should_stop()``), every rank saves its model, optimizer, strategy state, step and
epoch, RNG states and progress counters (``hpoflow.train.checkpoint``; the format,
``training.checkpoint.format``, decides what is written: ``rank0`` and ``dcp`` keep rank 0's state once
and each rank's RNG states; ``zero1`` and ``fsdp`` keep their model and optimizer sharded, each rank
its part, through ``dcp``, their format). At the start, a trial whose
checkpoint directory holds a checkpoint valid on every rank restores all of it and continues with
the next epoch: on CPU the result is bitwise the uninterrupted run's (docs/checkpointing.md). The
metrics carry ``resumed_from_epoch`` (0: a fresh start) and ``checkpoint_s`` (time the training
thread spent checkpointing).

Elastic trials (``resources.processes: {min, max}``, docs/elastic.md): the global batch is
``batch_size x min x grad_accum_steps`` on any number of ranks (each rank takes its share); when
``should_stop()`` sets ``resize_to``, every rank checkpoints at that epoch boundary and returns, and
the engine restarts the trial on the new number of ranks, which resumes from that checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hpoflow.errors import NonFiniteLoss
from hpoflow.spec import SCHEDULABLE, TrainConfig
from hpoflow.train.context import TrialContext
from hpoflow.train.data import load_dataset
from hpoflow.train.largebatch import LARS, LrSchedule
from hpoflow.train.memory import PeakMemory
from hpoflow.train.models import build_model
from hpoflow.train.precision import Precision
from hpoflow.train.strategies import OptimizerLike, Strategy, StrategyEnv, make_strategy

if TYPE_CHECKING:
    from hpoflow.train.strategies import ShardedTemplate

log = logging.getLogger(__name__)

__all__ = ["NonFiniteLoss", "epoch_line", "evaluate", "make_optimizer", "train_builtin", "weights_digest"]

_LOGGED = ("val_accuracy", "val_loss", "val_perplexity", "train_loss", "train_accuracy", "lr")  # in this order


def epoch_line(epoch: int, epochs: int, metrics: dict[str, float], seconds: float) -> str:
    """The rank log's line for an epoch: ``epoch 3/15  val_accuracy=0.9583 val_loss=0.1432 ...  1.21 s``
    (4 significant digits, as the tables show them)."""
    values = " ".join(f"{k}={metrics[k]:.4g}" for k in _LOGGED if k in metrics)
    return f"epoch {epoch}/{epochs}  {values}  {seconds:.2f} s"


def optimizer_spec(name: str, lr: float, momentum: float, weight_decay: float
                   ) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """(optimizer class, its keyword arguments) of ``training.optimizer``."""
    if name == "sgd":
        return torch.optim.SGD, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
    if name == "adam":
        return torch.optim.Adam, {"lr": lr, "weight_decay": weight_decay}
    if name == "adamw":
        return torch.optim.AdamW, {"lr": lr, "weight_decay": weight_decay}
    raise ValueError(f"unknown optimizer {name!r}; choose sgd, adam or adamw")


def make_optimizer(name: str, params: object, lr: float, momentum: float, weight_decay: float
                   ) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_spec(name, lr, momentum, weight_decay)
    return cls(params, **kwargs)  # type: ignore[arg-type]


def task_loss(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``out`` against ``y``: one label per sample (``out`` (N, C)), or one per
    position (``out`` (N, T, C), ``y`` (N, T): a next-token loss over every position)."""
    if out.dim() > 2:
        return nn.functional.cross_entropy(out.flatten(0, -2), y.flatten(), reduction=reduction)
    return nn.functional.cross_entropy(out, y, reduction=reduction)


def _correct(out: torch.Tensor, y: torch.Tensor) -> int:
    """Right predictions in a batch: samples, or positions of a sequence."""
    return int((out.argmax(-1) == y).sum())


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device,
             batch: int = 512, autocast: Any = None) -> tuple[float, float]:
    """(mean loss, accuracy) of ``model`` on ``(x, y)``, per sample or (sequences) per position;
    ``batch`` counts predictions (sequences of T positions go ``batch // T`` at a time, so evaluation
    never holds more activations than a training step of that many); ``autocast``: a callable giving
    the training precision's autocast context."""
    model.eval()
    batch = max(1, batch // max(1, y[0].numel())) if len(y) else batch
    loss_sum, correct = 0.0, 0
    for i in range(0, len(x), batch):
        xb, yb = x[i : i + batch].to(device), y[i : i + batch].to(device)
        with autocast() if autocast is not None else contextlib.nullcontext():
            out = model(xb)
            loss_sum += float(task_loss(out, yb, reduction="sum"))
        correct += _correct(out, yb)
    model.train()
    n = y.numel()
    return loss_sum / n, correct / n


def _full(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's whole value (``DTensor.full_tensor()``: a collective), else ``t``."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def weights_digest(model: nn.Module) -> str:
    """SHA-256 of the model's parameters and buffers, in ``state_dict`` order (whole tensors: with a
    sharded model every rank must call it)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(_full(t).detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass
class EpochStats:
    """What one epoch of training on this rank saw."""

    loss_sum: float = 0.0
    correct: int = 0
    seen: int = 0
    seconds: float = 0.0


def train_epoch(ctx: TrialContext, net: nn.Module, strategy: Strategy, opt: OptimizerLike,
                loader: DataLoader[tuple[torch.Tensor, ...]], schedule: LrSchedule, first_step: int,
                start_batch: int = 0, stats: EpochStats | None = None, on_resume: Any = None,
                amp: Precision | None = None) -> tuple[EpochStats, int, int | None]:
    """One pass over this rank's shard from micro-batch ``start_batch`` (a resume in the middle of the
    epoch: ``stats`` so far, and ``on_resume()`` called once the data is in place); returns the epoch's
    stats, the next step number, and the micro-batch it paused before (``None``: the epoch ended).
    After each optimizer step every rank passes a pause point (``TrialContext.pause_point``).
    ``amp``: the precision (autocast and loss scaler; default fp32). ``stats.correct`` counts right
    predictions: per sample, or per position of a sequence."""
    amp = amp or Precision("fp32", ctx.device, strategy)
    stepped = amp.optimizer(opt)
    accum = ctx.config.grad_accum_steps
    n = len(loader)
    stats = stats or EpochStats()
    step = first_step
    group = 0
    t0 = time.perf_counter()
    batches = iter(loader)
    for _ in range(start_batch):  # the sampler's order is a function of the epoch: skip what was done
        next(batches)
    if on_resume is not None:
        on_resume()
    for i, (xb, yb) in enumerate(batches, start=start_batch):
        pos = i % accum
        if pos == 0:  # a new optimizer step: the last one of an epoch may have fewer micro-batches
            group = min(accum, n - i)
            strategy.meter.begin_step()
            schedule.apply(opt, step)
            opt.zero_grad(set_to_none=True)
            strategy.before_step()
        last = pos == group - 1
        xb, yb = xb.to(ctx.device), yb.to(ctx.device)
        with strategy.no_sync() if not last else contextlib.nullcontext():
            with amp.autocast():
                out = net(xb)
                loss = task_loss(out, yb)
            amp.backward(loss / group)
        stats.loss_sum += float(loss.detach()) * len(xb)
        stats.correct += _correct(out, yb)
        stats.seen += len(xb)
        if last:
            strategy.after_backward()
            strategy.step(stepped)
            strategy.meter.end_step()
            step += 1
            if i + 1 < n and ctx.pause_point():
                stats.seconds += time.perf_counter() - t0
                return stats, step, i + 1
    ctx.pause_point(last=True)  # the epoch ends here anyway: should_stop() decides with the rest
    stats.seconds += time.perf_counter() - t0
    return stats, step, None


def _peak_memory(ctx: TrialContext, memory: PeakMemory, startup: float | None) -> dict[str, float]:
    """``peak_memory_mb`` and ``startup_memory_mb`` (the peak until the model was built and wrapped):
    the largest over the ranks (one collective in a distributed trial)."""
    mine = memory.mb()
    values = [-1.0 if mine is None else mine, -1.0 if startup is None else startup]
    if ctx.distributed:
        t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        values = [float(v) for v in t.tolist()]
    return {k: v for k, v in zip(("peak_memory_mb", "startup_memory_mb"), values, strict=True) if v >= 0}


def _ranks_identical(ctx: TrialContext, digest: str) -> bool:
    if not ctx.distributed:
        return True
    digests: list[str | None] = [None] * ctx.world_size
    dist.all_gather_object(digests, digest)
    return all(d == digests[0] for d in digests)


def _finish(ctx: TrialContext, model: nn.Module) -> float:
    """Record this rank's final weights (digest file, optional state_dict); 1.0 if ranks agree."""
    digest = weights_digest(model)
    final = ({k: _full(v) for k, v in model.state_dict().items()}
             if os.environ.get("HPOFLOW_SAVE_FINAL_STATE") == "1" else None)  # whole tensors: on every rank
    try:
        ctx.trial_dir.mkdir(parents=True, exist_ok=True)
        (ctx.trial_dir / f"weights_rank{ctx.rank}.sha256").write_text(digest + "\n")
        if final is not None:
            torch.save(final, ctx.trial_dir / f"final_state_rank{ctx.rank}.pt")
    except OSError as exc:  # the weights are a by-product: never fail a trial over them
        log.warning("rank %d could not write its final weights: %s", ctx.rank, exc)
    return 1.0 if _ranks_identical(ctx, digest) else 0.0


def config_fingerprint(cfg: TrainConfig) -> str:
    """SHA-256 of what determines a trial's trajectory: the config without ``epochs`` (a resume may
    train longer), ``checkpoint`` (how often to save does not change the result), and the optimizer
    values a resume may change (``SCHEDULABLE`` and ``schedule``: a PBT member resumes with new ones)."""
    data = cfg.model_dump(mode="json", exclude={"epochs", "checkpoint", "schedule", *SCHEDULABLE})
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


@dataclass
class Progress:
    """Where the training loop is: epochs done, optimizer steps done, and the throughput totals."""

    epoch: int = 0
    step: int = 0
    t_train: float = 0.0
    samples: int = 0


def _checkpoint_state(progress: Progress, model: nn.Module, optimizer: torch.optim.Optimizer,
                      strategy: Strategy, metrics: dict[str, float], fingerprint: str, batch: int = 0,
                      stats: EpochStats | None = None, amp: Precision | None = None) -> dict[str, Any]:
    """Everything to resume after ``progress.epoch`` epochs and ``batch`` micro-batches of the next
    (a pause in the middle of an epoch, with that epoch's ``stats`` so far); RNG states are added by
    the context. Data order is a function of the epoch (``DistributedSampler`` seeded by the trial's
    seed and ``set_epoch``), so the position is the epoch and the micro-batch. The model and the
    optimizer are the strategy's to save (``training_state``; nothing for zero1 and fsdp, whose shards go
    by name beside it: ``Strategy.sharded_state``); ``amp`` the fp16 loss scaler's state."""
    partial = stats or EpochStats()
    return {
        "epoch": progress.epoch, "step": progress.step,
        **strategy.training_state(model, optimizer), "strategy": strategy.state_dict(),
        "amp": amp.state_dict() if amp is not None else {},
        "data": {"epoch": progress.epoch, "batch": batch},
        "epoch_stats": {"loss_sum": partial.loss_sum, "correct": partial.correct, "seen": partial.seen,
                        "seconds": partial.seconds},
        "progress": {"t_train": progress.t_train, "samples": progress.samples},
        "metrics": dict(metrics), "config": fingerprint,
    }


def _restore(ctx: TrialContext, saved: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
             strategy: Strategy, fingerprint: str,
             template: ShardedTemplate | None = None) -> tuple[Progress, dict[str, float]]:
    if saved.get("config") != fingerprint:
        raise ValueError(
            f"checkpoint: the checkpoint in {ctx.checkpoints.directory} (step {ctx.resumed_step}) was written "
            "by a trial with a different training config (only epochs, checkpoint, schedule and "
            f"{', '.join(SCHEDULABLE)} may change on a resume). Fix: delete that directory to start over, or "
            "resume with the same config")
    if template is not None:  # a sharded strategy's model and optimizer, read into it already
        template.apply()
    else:
        strategy.load_training_state(saved, model, optimizer)
    strategy.load_state_dict(saved["strategy"])
    p = saved["progress"]
    progress = Progress(int(saved["epoch"]), int(saved["step"]), float(p["t_train"]), int(p["samples"]))
    return progress, {k: float(v) for k, v in saved["metrics"].items()}


def _partial_epoch(saved: dict[str, Any] | None) -> tuple[int, EpochStats | None]:
    """Where a checkpoint written in the middle of an epoch (a pause) left it: (micro-batch, stats)."""
    batch = int((saved or {}).get("data", {}).get("batch", 0))
    if saved is None or batch == 0:
        return 0, None
    e = saved.get("epoch_stats") or {}
    return batch, EpochStats(float(e.get("loss_sum", 0.0)), int(e.get("correct", 0)), int(e.get("seen", 0)),
                             float(e.get("seconds", 0.0)))


def at_epoch(cfg: TrainConfig, epoch: int) -> TrainConfig:
    """``cfg`` with the values ``training.schedule`` gives from ``epoch`` on (the last point at or before it)."""
    update = {}
    for key, points in cfg.schedule.items():
        values = [v for e, v in points if e <= epoch]
        if values:
            update[key] = values[-1]
    return cfg.model_copy(update=update) if update else cfg


def _set_hyperparams(opt: torch.optim.Optimizer, cfg: TrainConfig) -> None:
    """``momentum`` and ``weight_decay`` of ``cfg`` on every param group that has them (a restored
    optimizer state brings its own; lr is set at every step by the ``LrSchedule``)."""
    for group in opt.param_groups:
        for key in ("momentum", "weight_decay"):
            if key in group:
                group[key] = getattr(cfg, key)


def _batch_for(ctx: TrialContext, world: int) -> tuple[int, int]:
    """(ranks the config is written for, per-rank batch on ``world`` ranks). An elastic trial keeps its
    global batch ``batch_size x base x grad_accum_steps`` on every size: ``DistributedSampler`` deals
    the shuffled epoch out rank by rank, so step ``j`` of any world trains on the same samples."""
    cfg = ctx.config
    if not ctx.elastic:
        return world, cfg.batch_size
    base = ctx.base_world
    if (cfg.batch_size * base) % world:
        raise ValueError(f"an elastic trial of global batch {cfg.batch_size * base} (batch_size x "
                         f"{base} ranks) cannot run on {world} ranks: it does not divide")
    return base, cfg.batch_size * base // world


def train_builtin(ctx: TrialContext) -> dict[str, float]:
    cfg = ctx.config
    torch.manual_seed(cfg.seed)
    data = load_dataset(cfg.dataset, cfg.val_fraction, sequence_length=cfg.model_options.get("context"))
    world = ctx.world_size if ctx.distributed else 1
    env = StrategyEnv(rank=ctx.rank if ctx.distributed else 0, world_size=world, lr=cfg.lr,
                      device=ctx.device)
    strategy = make_strategy(cfg.strategy, cfg.strategy_options, env)
    memory = PeakMemory(ctx.device)  # from here: what training adds (hpoflow.train.memory)
    try:
        # the strategy builds the model (fsdp: only this rank's shard of it) from the seed set above
        net = strategy.build(lambda: build_model(cfg.model, data.input_shape, data.n_classes, **cfg.model_options))
        model = strategy.model
        if model is None:
            raise RuntimeError(f"strategy {cfg.strategy!r} built no model")
        startup = memory.mb()  # the start-up's peak: the model built and wrapped (before a resume's load)
        train_set = TensorDataset(data.x_train, data.y_train)
        sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
            train_set, num_replicas=world, rank=env.rank, shuffle=True, seed=cfg.seed,
            drop_last=False)
        base, local_batch = _batch_for(ctx, world)
        loader = DataLoader(train_set, batch_size=local_batch, sampler=sampler)
        steps_per_epoch = math.ceil(len(loader) / cfg.grad_accum_steps)
        schedule = LrSchedule.from_config(cfg, base, steps_per_epoch)
        opt_class, opt_kwargs = optimizer_spec(cfg.optimizer, schedule.lr_at(0), cfg.momentum, cfg.weight_decay)
        opt_base = strategy.build_optimizer(model.parameters(), opt_class, **opt_kwargs)
        opt: OptimizerLike = LARS(opt_base, cfg.lars_trust_coefficient) if cfg.lars else opt_base
        strategy.prepare_optimizer(opt)
        amp = Precision(cfg.precision, ctx.device, strategy)
        per_sample = max(1, data.y_train[0].numel())  # predictions per sample: positions of a sequence
        metrics: dict[str, float] = {}
        every = cfg.checkpoint.every
        fingerprint = config_fingerprint(cfg)
        progress = Progress()
        # resume from the newest checkpoint valid on every rank (a collective; none: a fresh start), also
        # when checkpoints are off: a paused trial saved one to resume from
        template = strategy.sharded_template(model, opt_base) if strategy.sharded else None
        saved = ctx.load_checkpoint(restore_rng=False, sharded=template.items if template is not None else None)
        if saved is None and template is not None:
            template.discard()  # nothing was read into it: the optimizer starts fresh
        if saved is not None:
            progress, metrics = _restore(ctx, saved, model, opt_base, strategy, fingerprint, template)
            amp.load_state_dict(saved.get("amp") or {})
        start_batch, partial = _partial_epoch(saved)
        if not start_batch:
            ctx.restore_checkpoint_rng()  # at an epoch boundary: before the next epoch's data iterator
        resumed = float(progress.epoch)

        def save(step: int, batch: int = 0, stats: EpochStats | None = None) -> None:
            """Checkpoint as ``step`` (a sharded strategy's model and optimizer by name, sharded)."""
            sharded = strategy.sharded_state(model, opt_base) if strategy.sharded else None
            ctx.save_checkpoint(_checkpoint_state(progress, model, opt_base, strategy, metrics, fingerprint, batch,
                                                  stats, amp), step=step, sharded=sharded)

        for epoch in range(progress.epoch, cfg.epochs):
            t_epoch = time.perf_counter()
            sampler.set_epoch(epoch)
            now = at_epoch(cfg, epoch)  # training.schedule; a resumed PBT member's new values
            schedule = LrSchedule.from_config(now, base, steps_per_epoch)
            _set_hyperparams(opt_base, now)
            stats, step, paused = train_epoch(ctx, net, strategy, opt, loader, schedule, progress.step,
                                              start_batch, partial, ctx.restore_checkpoint_rng if start_batch else None,
                                              amp)
            start_batch, partial = 0, None
            if paused is not None:  # stop at this step with a checkpoint; the trial resumes from it
                progress.step = step  # (the epoch's time so far travels in its stats)
                # keyed as the end of this epoch, which it stands for until that epoch's own checkpoint
                save(epoch + 1, paused, stats)
                break
            t_sync = time.perf_counter()
            strategy.end_epoch()
            progress.t_train += stats.seconds + time.perf_counter() - t_sync
            progress.samples += stats.seen * world  # global samples (the world may change: elastic)
            progress.epoch, progress.step = epoch + 1, step
            t_train, samples = progress.t_train, progress.samples
            train_loss = stats.loss_sum / max(stats.seen, 1)
            if not math.isfinite(train_loss):
                raise NonFiniteLoss(f"training loss is {train_loss} at epoch {epoch + 1} "
                                    f"(lr={schedule.target_lr:g}, strategy={cfg.strategy})")
            val_loss, val_acc = evaluate(strategy.eval_module(), data.x_val, data.y_val, ctx.device,
                                         autocast=amp.autocast)
            metrics = {
                "val_accuracy": val_acc,
                "val_loss": val_loss,
                "train_loss": train_loss,
                "train_accuracy": stats.correct / max(stats.seen * per_sample, 1),
                "epoch": float(epoch + 1),
                "samples_per_s": samples / t_train if t_train > 0 else 0.0,
                "lr": schedule.lr_at(max(step - 1, 0)),
                "global_batch": float(local_batch * world * cfg.grad_accum_steps),
                "world_size": float(world),
                "resumed_from_epoch": resumed,
                **strategy.comm_stats(),
                **_peak_memory(ctx, memory, startup),
            }
            if data.task == "next_token":
                metrics["val_perplexity"] = math.exp(min(val_loss, 700.0))
                metrics["tokens_per_s"] = metrics["samples_per_s"] * per_sample
            if env.rank == 0:  # the rank's stdout is its rank log
                print(epoch_line(epoch + 1, cfg.epochs, metrics, time.perf_counter() - t_epoch), flush=True)
            ctx.report(epoch + 1, **metrics)
            # Epoch boundary: every rank is consistent here. Checkpoints are keyed by epochs done.
            saved_here = every > 0 and (epoch + 1) % every == 0
            if saved_here:
                save(epoch + 1)
            stop = ctx.should_stop()
            if not stop and ctx.resize_to:  # elastic: checkpoint here, leave, resume on resize_to ranks
                save(epoch + 1)
                stop = ctx.should_stop()
            if stop and ctx.pausing and not saved_here and epoch + 1 < cfg.epochs:  # paused at this boundary
                save(epoch + 1)
            if stop:
                break
        ctx.flush_checkpoints()
        if ctx.pausing and progress.epoch >= cfg.epochs:
            ctx.pausing = False  # asked to pause as it finished: it is complete
        if ctx.resizing or ctx.pausing:
            return metrics
        metrics["resumed_from_epoch"] = resumed
        metrics["checkpoint_s"] = ctx.checkpoint_s
        metrics["ranks_identical"] = _finish(ctx, strategy.eval_module())
        return metrics
    finally:
        ctx.flush_checkpoints()
        strategy.close()
