"""Decoder-only language models for the oracle, at the shapes their authors published.

One builder, :func:`decoder`, covers the GPT-2 family (learned positions, LayerNorm, a GELU MLP of
4 x the width, biases, the output layer tied to the token embedding) and the Llama family (rotary
positions, RMSNorm, a SwiGLU MLP, grouped-query attention, no biases, an untied output layer).
Attention is ``scaled_dot_product_attention`` (causal), which the oracle's trace runs as a fused
kernel. The blocks are ``layers`` (an ``nn.ModuleList``): the units FSDP shards and activation
checkpointing wraps. Input: ``(sequence_length,)`` token ids; output: logits ``(batch,
sequence_length, vocabulary)``.

Presets (:data:`LM_PRESETS`):

* ``megatron-gpt-1.2b``: Shoeybi et al. 2019, *Megatron-LM* (arXiv:1909.08053), Table 1: hidden
  1536, 16 heads, 40 layers, 1.2 billion parameters, on 1 GPU (no model parallelism); sequence
  1024, vocabulary 51,200 (GPT-2's 50,257 padded).
* ``tinyllama-1.1b``: TinyLlama (github.com/jzhang38/TinyLlama, README "Training Details"): 22
  layers, 32 heads, 4 query groups, embedding 2048, SwiGLU intermediate 5632, sequence 2048,
  Llama 2's tokenizer (32,000).
* ``llama3-8b``: Llama 3.1 8B (Meta's model card and ``params.json``): 32 layers, width 4096,
  32 heads, 8 key/value heads, FFN 14,336, vocabulary 128,256; sequence 8192 (torchtitan's
  ``llama3_8b.toml``).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["LM_PRESETS", "LMShape", "decoder"]


@dataclass(frozen=True)
class LMShape:
    """A decoder's published shape."""

    vocab: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    family: str  # "gpt2" | "llama"


LM_PRESETS: dict[str, LMShape] = {
    "megatron-gpt-1.2b": LMShape(vocab=51_200, layers=40, hidden=1536, heads=16, kv_heads=16, ffn=4 * 1536,
                                 seq=1024, family="gpt2"),
    "tinyllama-1.1b": LMShape(vocab=32_000, layers=22, hidden=2048, heads=32, kv_heads=4, ffn=5632, seq=2048,
                              family="llama"),
    "llama3-8b": LMShape(vocab=128_256, layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14_336, seq=8192,
                         family="llama"),
}


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, heads, tokens, head_dim)."""
    d = x.shape[-1]
    inv = 1.0 / (500_000.0 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions[:, None].float() * inv[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _Attention(nn.Module):
    def __init__(self, s: LMShape) -> None:
        super().__init__()
        bias = s.family == "gpt2"
        self.heads, self.kv_heads, self.rope = s.heads, s.kv_heads, s.family == "llama"
        head_dim = s.hidden // s.heads
        self.q = nn.Linear(s.hidden, s.hidden, bias=bias)
        self.kv = nn.Linear(s.hidden, 2 * s.kv_heads * head_dim, bias=bias)
        self.out = nn.Linear(s.hidden, s.hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        d = h // self.heads
        q = self.q(x).view(b, t, self.heads, d).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, d).permute(2, 0, 3, 1, 4)
        if self.rope:
            pos = torch.arange(t, device=x.device)
            q, k = _rotate(q, pos), _rotate(k, pos)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                       enable_gqa=self.kv_heads != self.heads)
        return typing.cast(torch.Tensor, self.out(y.transpose(1, 2).reshape(b, t, h)))


class _SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return typing.cast(torch.Tensor, self.down(nn.functional.silu(self.gate(x)) * self.up(x)))


class _Block(nn.Module):
    def __init__(self, s: LMShape) -> None:
        super().__init__()
        llama = s.family == "llama"
        self.norm1: nn.Module = nn.RMSNorm(s.hidden, eps=1e-5) if llama else nn.LayerNorm(s.hidden)
        self.attn = _Attention(s)
        self.norm2: nn.Module = nn.RMSNorm(s.hidden, eps=1e-5) if llama else nn.LayerNorm(s.hidden)
        self.mlp: nn.Module = _SwiGLU(s.hidden, s.ffn) if llama else nn.Sequential(
            nn.Linear(s.hidden, s.ffn), nn.GELU(), nn.Linear(s.ffn, s.hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return typing.cast(torch.Tensor, x + self.mlp(self.norm2(x)))


class Decoder(nn.Module):
    """Token embedding (+ learned positions for GPT-2), ``layers`` blocks, a final norm, the output
    layer (tied to the token embedding for GPT-2)."""

    def __init__(self, s: LMShape) -> None:
        super().__init__()
        self.shape = s
        self.tokens = nn.Embedding(s.vocab, s.hidden)
        self.positions = nn.Embedding(s.seq, s.hidden) if s.family == "gpt2" else None
        self.layers = nn.ModuleList(_Block(s) for _ in range(s.layers))
        self.norm: nn.Module = nn.RMSNorm(s.hidden, eps=1e-5) if s.family == "llama" else nn.LayerNorm(s.hidden)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)
        if s.family == "gpt2":
            self.head.weight = self.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids)
        if self.positions is not None:
            x = x + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.layers:
            x = block(x)
        return typing.cast(torch.Tensor, self.head(self.norm(x)))


def decoder(input_shape: tuple[int, ...], n_classes: int, preset: str = "tinyllama-1.1b", **shape: int) -> nn.Module:
    """A decoder of ``preset``'s shape; ``shape`` overrides its fields (``layers``, ``hidden``,
    ``heads``, ``kv_heads``, ``ffn``); ``n_classes`` is the vocabulary, ``input_shape`` the
    ``(sequence_length,)`` of one sample (at most the preset's sequence for learned positions)."""
    if preset not in LM_PRESETS:
        raise ValueError(f"decoder preset must be one of {', '.join(LM_PRESETS)}, but got {preset!r}")
    base = LM_PRESETS[preset]
    fields = {**base.__dict__, **shape, "vocab": n_classes}
    if len(input_shape) != 1 or input_shape[0] < 1:
        raise ValueError(f"a decoder's input_shape is (sequence_length,), but got {input_shape}; "
                         f"pass e.g. --input-shape {base.seq}")
    fields["seq"] = max(fields["seq"], input_shape[0]) if base.family == "llama" else fields["seq"]
    s = LMShape(**fields)
    if input_shape[0] > s.seq or s.hidden % s.heads or s.heads % s.kv_heads:
        raise ValueError(f"decoder shape must have sequence_length <= {s.seq} (learned positions), hidden a "
                         f"multiple of heads and heads of kv_heads, but got input_shape {input_shape}, "
                         f"hidden {s.hidden}, heads {s.heads}, kv_heads {s.kv_heads}")
    return Decoder(s)
