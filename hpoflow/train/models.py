"""Built-in models: a small MLP and a small CNN for 8x8 (digits) or 28x28 images, and a small
GPT-style decoder for character-level language modelling.

Every builder takes ``(input_shape, n_classes, **options)`` and returns an ``nn.Module``: for the
image models ``input_shape`` is ``(C, H, W)`` and the output ``(batch, n_classes)``; for ``gpt``
``input_shape`` is ``(sequence_length,)`` of token ids, ``n_classes`` the vocabulary, and the output
the next-token logits ``(batch, sequence_length, n_classes)``. All are registered in
``hpoflow.registry.MODELS`` (options models in ``hpoflow.train.options``); ``build_model`` looks a
name up there and gives an error that lists the valid names.
"""

from __future__ import annotations

import torch
from torch import nn

from hpoflow.registry import MODELS

__all__ = ["GPT", "build_model", "cnn", "gpt", "mlp"]


def mlp(
    input_shape: tuple[int, ...], n_classes: int, hidden: int = 128, depth: int = 2,
    dropout: float = 0.0,
) -> nn.Module:
    """Fully connected network: ``depth`` hidden layers of ``hidden`` units with ReLU."""
    n_in = 1
    for d in input_shape:
        n_in *= d
    layers: list[nn.Module] = [nn.Flatten()]
    width = n_in
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = hidden
    layers.append(nn.Linear(width, n_classes))
    return nn.Sequential(*layers)


def cnn(
    input_shape: tuple[int, ...], n_classes: int, channels: int = 32, hidden: int = 128,
    dropout: float = 0.0,
) -> nn.Module:
    """Two 3x3 convolutions (``channels/2``, ``channels``), a 2x2 max-pool and two linear layers."""
    c_in, h, w = input_shape
    c1 = max(1, channels // 2)
    features = nn.Sequential(
        nn.Conv2d(c_in, c1, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(c1, channels, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )
    flat = channels * (h // 2) * (w // 2)
    head: list[nn.Module] = [nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU()]
    if dropout > 0:
        head.append(nn.Dropout(dropout))
    head.append(nn.Linear(hidden, n_classes))
    return nn.Sequential(features, *head)


class _Block(nn.Module):
    """Pre-norm decoder block: causal multi-head self-attention, then a 4x MLP, each residual."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, w))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """A GPT-style decoder: token and learned position embeddings, ``layers`` pre-norm blocks (in
    ``blocks``: the unit FSDP shards), a final layer norm and an untied linear head."""

    def __init__(self, vocab: int, layers: int, heads: int, width: int, context: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(width, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() >= 2:
                std = 0.02 / (2 * layers) ** 0.5 if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.context:
            raise ValueError(f"gpt: a sequence of {t} tokens is longer than the model's context "
                             f"({self.context})")
        pos = torch.arange(t, device=ids.device)
        x = self.drop(self.tokens(ids) + self.positions(pos))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


def gpt(input_shape: tuple[int, ...], n_classes: int, layers: int = 2, heads: int = 4, width: int = 128,
        context: int = 64, dropout: float = 0.0) -> nn.Module:
    """A GPT-style decoder over a vocabulary of ``n_classes`` tokens; ``input_shape`` is
    ``(sequence_length,)`` with ``sequence_length <= context``."""
    if len(input_shape) != 1 or not 1 <= input_shape[0] <= context:
        raise ValueError(f"gpt: input_shape must be (sequence_length,) with 1 <= sequence_length <= context "
                         f"({context}), but got {input_shape}; the gpt model trains on a token dataset "
                         "(dataset: chars)")
    if width % heads:
        raise ValueError(f"gpt: width must be a multiple of heads, but got width={width}, heads={heads}")
    return GPT(n_classes, layers, heads, width, context, dropout)


def build_model(name: str, input_shape: tuple[int, ...], n_classes: int, **options: object) -> nn.Module:
    """Build a model registered in ``hpoflow.registry.MODELS``; unknown names raise ``ValueError``
    listing the valid ones."""
    if name not in MODELS:
        raise ValueError(f"{MODELS.unknown(name)} (or give training.function: 'module:function' for your own)")
    model: nn.Module = MODELS.get(name)(input_shape, n_classes, **options)
    return model
