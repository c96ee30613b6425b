"""``training.precision``: fp32, or mixed precision with bf16 or fp16 autocast on the rank's device.

``bf16`` and ``fp16`` run the forward pass and the loss under ``torch.autocast(device, dtype)``:
matrix multiplications and convolutions take 16-bit inputs, while softmax, norms and the loss stay
fp32 (autocast's op lists); the weights, their gradients and the optimizer state stay fp32. ``fp16``
adds a loss scaler (``torch.amp.GradScaler``, or the strategy's: ``fsdp`` all-reduces its inf check),
which multiplies the loss before backward, unscales the gradients before the step, skips a step whose
gradients hold an inf or NaN and adapts the scale. torch 2.13 supports both dtypes under CPU
autocast and the scaler on the CPU (checked by tests/train/test_transformer.py); ``hpoflow validate``
refuses ``fp16`` with ``parameter_server``, whose workers never step and so would keep a scale their
server no longer uses.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from hpoflow.train.strategies import OptimizerLike, Strategy

__all__ = ["DTYPES", "Precision"]

DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class _Scaled:
    """An optimizer whose ``step()`` goes through the loss scaler (and updates its scale)."""

    def __init__(self, optimizer: OptimizerLike, scaler: torch.amp.GradScaler) -> None:
        self.optimizer = optimizer
        self.scaler = scaler
        self.param_groups = optimizer.param_groups  # the same list: an lr set on either is both's

    def step(self) -> Any:
        out = self.scaler.step(self.optimizer)  # type: ignore[arg-type]  # duck-typed: LARS too
        self.scaler.update()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


class Precision:
    """One rank's autocast and loss scaler for ``precision`` (fp32 | bf16 | fp16)."""

    def __init__(self, precision: str, device: torch.device, strategy: Strategy) -> None:
        if precision not in DTYPES:
            raise ValueError(f"precision must be one of {', '.join(DTYPES)}, but got {precision!r}")
        self.name = precision
        self.device = device
        self.dtype = DTYPES[precision]
        self.scaler = strategy.make_grad_scaler() if precision == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward pass and the loss run inside this."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def optimizer(self, optimizer: OptimizerLike) -> OptimizerLike:
        """What the strategy steps: ``optimizer`` itself, or through the scaler under fp16."""
        if self.scaler is None:
            return optimizer
        return _Scaled(optimizer, self.scaler)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's scale and growth tracker (empty without one), for checkpoints."""
        return dict(self.scaler.state_dict()) if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
