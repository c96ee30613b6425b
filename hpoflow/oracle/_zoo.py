"""Reference architectures for the oracle: ResNet-18/50/101, VGG-16, Inception V3, a BERT-base-sized
encoder and decoder language models (:mod:`hpoflow.oracle._zoo_lm`).

Compact definitions written for this project (torchvision is not a dependency). Layer shapes
follow the published architectures so the parameter counts match the usual references:
ResNet-18 11,689,512; ResNet-50 (v1.5, stride on the 3x3 conv) 25,557,032; ResNet-101
44,549,160; VGG-16 138,357,544; Inception V3 without the auxiliary classifier 23,834,568 (input
3x299x299); BERT-base encoder with pooler 109,482,240 (plus the classification head).

Every builder takes ``(input_shape, n_classes, **options)`` like ``hpoflow.train.models``.
The oracle builds them on the meta device, so no weights are ever allocated.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

import torch
from torch import nn

from hpoflow.oracle._zoo_lm import LM_PRESETS, decoder

__all__ = ["ZOO", "ZooEntry", "bert_base", "inception_v3", "resnet18", "resnet50", "resnet101", "vgg16"]


def _conv_bn(c_in: int, c_out: int, k: int, stride: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(c_in, c_out, kernel_size=k, stride=stride, padding=k // 2, bias=False),
        nn.BatchNorm2d(c_out),
    ]


class _Basic(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.body = nn.Sequential(
            *_conv_bn(c_in, width, 3, stride), nn.ReLU(), *_conv_bn(width, c_out, 3)
        )
        self.skip = (
            nn.Sequential(*_conv_bn(c_in, c_out, 1, stride))
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return typing.cast(torch.Tensor, self.act(self.body(x) + self.skip(x)))


class _Bottleneck(_Basic):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__(c_in, width, stride)
        c_out = width * self.expansion
        self.body = nn.Sequential(
            *_conv_bn(c_in, width, 1), nn.ReLU(),
            *_conv_bn(width, width, 3, stride), nn.ReLU(),
            *_conv_bn(width, c_out, 1),
        )


class _ResNet(nn.Module):
    def __init__(self, block: type[_Basic], depths: tuple[int, ...], c_in: int,
                 n_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            *_conv_bn(c_in, 64, 7, 2), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1)
        ]
        channels = 64
        for stage, depth in enumerate(depths):
            width = 64 * 2**stage
            for i in range(depth):
                stride = 2 if stage > 0 and i == 0 else 1
                layers.append(block(channels, width, stride))
                channels = width * block.expansion
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(channels, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return typing.cast(torch.Tensor, self.fc(self.flatten(self.pool(self.features(x)))))


def resnet18(input_shape: tuple[int, ...], n_classes: int) -> nn.Module:
    """ResNet-18: basic blocks (2, 2, 2, 2)."""
    return _ResNet(_Basic, (2, 2, 2, 2), input_shape[0], n_classes)


def resnet50(input_shape: tuple[int, ...], n_classes: int) -> nn.Module:
    """ResNet-50 v1.5: bottleneck blocks (3, 4, 6, 3), stride on the 3x3 convolution."""
    return _ResNet(_Bottleneck, (3, 4, 6, 3), input_shape[0], n_classes)


def resnet101(input_shape: tuple[int, ...], n_classes: int) -> nn.Module:
    """ResNet-101 v1.5: bottleneck blocks (3, 4, 23, 3)."""
    return _ResNet(_Bottleneck, (3, 4, 23, 3), input_shape[0], n_classes)


_VGG16 = (64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0)


def vgg16(input_shape: tuple[int, ...], n_classes: int, dropout: float = 0.5) -> nn.Module:
    """VGG-16 (configuration D, no batch norm); 0 in the layer list marks a 2x2 max-pool."""
    layers: list[nn.Module] = []
    c = input_shape[0]
    for width in _VGG16:
        if width == 0:
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c, width, 3, padding=1), nn.ReLU()]
            c = width
    return nn.Sequential(
        *layers, nn.AdaptiveAvgPool2d(7), nn.Flatten(),
        nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(4096, n_classes),
    )


def _cbr(c_in: int, c_out: int, kernel: int | tuple[int, int], stride: int = 1,
         padding: int | tuple[int, int] = 0) -> nn.Sequential:
    """Inception's basic conv: convolution without bias, batch norm (eps 1e-3), ReLU."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=padding, bias=False),
                         nn.BatchNorm2d(c_out, eps=1e-3), nn.ReLU())


class _Branches(nn.Module):
    """Inception module: branches applied to one input, concatenated along channels."""

    def __init__(self, *branches: nn.Module) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([b(x) for b in self.branches], dim=1)


class _Split(nn.Module):
    """A stem followed by two parallel convolutions (1x3 and 3x1), concatenated (Inception-E)."""

    def __init__(self, stem: nn.Module, c: int, c_out: int) -> None:
        super().__init__()
        self.stem = stem
        self.a = _cbr(c, c_out, (1, 3), padding=(0, 1))
        self.b = _cbr(c, c_out, (3, 1), padding=(1, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return torch.cat([self.a(y), self.b(y)], dim=1)


def _pool_proj(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.AvgPool2d(3, stride=1, padding=1), _cbr(c_in, c_out, 1))


def _inception_a(c: int, pool: int) -> nn.Module:
    return _Branches(_cbr(c, 64, 1), nn.Sequential(_cbr(c, 48, 1), _cbr(48, 64, 5, padding=2)),
                     nn.Sequential(_cbr(c, 64, 1), _cbr(64, 96, 3, padding=1), _cbr(96, 96, 3, padding=1)),
                     _pool_proj(c, pool))


def _inception_c(c7: int) -> nn.Module:
    return _Branches(
        _cbr(768, 192, 1),
        nn.Sequential(_cbr(768, c7, 1), _cbr(c7, c7, (1, 7), padding=(0, 3)), _cbr(c7, 192, (7, 1), padding=(3, 0))),
        nn.Sequential(_cbr(768, c7, 1), _cbr(c7, c7, (7, 1), padding=(3, 0)), _cbr(c7, c7, (1, 7), padding=(0, 3)),
                      _cbr(c7, c7, (7, 1), padding=(3, 0)), _cbr(c7, 192, (1, 7), padding=(0, 3))),
        _pool_proj(768, 192))


def _inception_e(c: int) -> nn.Module:
    return _Branches(_cbr(c, 320, 1), _Split(_cbr(c, 384, 1), 384, 384),
                     _Split(nn.Sequential(_cbr(c, 448, 1), _cbr(448, 384, 3, padding=1)), 384, 384),
                     _pool_proj(c, 192))


def inception_v3(input_shape: tuple[int, ...], n_classes: int, dropout: float = 0.5) -> nn.Module:
    """Inception V3 (Szegedy et al. 2016) as torchvision builds it, without the auxiliary classifier."""
    reduce_b = _Branches(_cbr(288, 384, 3, stride=2),
                         nn.Sequential(_cbr(288, 64, 1), _cbr(64, 96, 3, padding=1), _cbr(96, 96, 3, stride=2)),
                         nn.MaxPool2d(3, stride=2))
    reduce_d = _Branches(nn.Sequential(_cbr(768, 192, 1), _cbr(192, 320, 3, stride=2)),
                         nn.Sequential(_cbr(768, 192, 1), _cbr(192, 192, (1, 7), padding=(0, 3)),
                                       _cbr(192, 192, (7, 1), padding=(3, 0)), _cbr(192, 192, 3, stride=2)),
                         nn.MaxPool2d(3, stride=2))
    return nn.Sequential(
        _cbr(input_shape[0], 32, 3, stride=2), _cbr(32, 32, 3), _cbr(32, 64, 3, padding=1), nn.MaxPool2d(3, stride=2),
        _cbr(64, 80, 1), _cbr(80, 192, 3), nn.MaxPool2d(3, stride=2),
        _inception_a(192, 32), _inception_a(256, 64), _inception_a(288, 64), reduce_b,
        _inception_c(128), _inception_c(160), _inception_c(160), _inception_c(192), reduce_d,
        _inception_e(1280), _inception_e(2048),
        nn.AdaptiveAvgPool2d(1), nn.Dropout(dropout), nn.Flatten(), nn.Linear(2048, n_classes),
    )


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.softmax = nn.Softmax(dim=-1)  # a module so activation hooks see the score matrix
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5
        ctx = self.drop(self.softmax(scores)) @ v
        return typing.cast(torch.Tensor, self.out(ctx.transpose(1, 2).reshape(b, s, h)))


class _EncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.attn = _Attention(hidden, heads, dropout)
        self.norm1 = nn.LayerNorm(hidden, eps=1e-12)
        self.ffn = nn.Sequential(
            nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden), nn.Dropout(dropout)
        )
        self.norm2 = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attn(x))
        return typing.cast(torch.Tensor, self.norm2(x + self.ffn(x)))


class _Bert(nn.Module):
    def __init__(self, n_classes: int, vocab: int, hidden: int, layers: int, heads: int,
                 ffn: int, max_len: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(max_len, hidden)
        self.segments = nn.Embedding(2, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.Sequential(
            *(_EncoderLayer(hidden, heads, ffn, dropout) for _ in range(layers))
        )
        self.pooler = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(pos) + self.segments(torch.zeros_like(ids))
        x = self.layers(self.drop(self.norm(x)))
        return typing.cast(torch.Tensor, self.head(self.pooler(x[:, 0])))


def bert_base(input_shape: tuple[int, ...], n_classes: int, vocab: int = 30522,
              hidden: int = 768, layers: int = 12, heads: int = 12, ffn: int = 3072,
              max_len: int = 512, dropout: float = 0.1) -> nn.Module:
    """BERT-base-sized encoder classifier; ``input_shape`` is ``(sequence_length,)`` of ids."""
    if len(input_shape) != 1 or not 1 <= input_shape[0] <= max_len:
        raise ValueError(
            f"bert input_shape must be (sequence_length,) with 1 <= sequence_length <= {max_len}, "
            f"but got {input_shape}; pass e.g. --input-shape 128"
        )
    return _Bert(n_classes, vocab, hidden, layers, heads, ffn, max_len, dropout)


class ZooEntry:
    """A reference model: its builder, default input shape and class count, and input kind."""

    def __init__(self, builder: Callable[..., nn.Module], input_shape: tuple[int, ...],
                 n_classes: int, token_input: bool = False) -> None:
        self.builder = builder
        self.input_shape = input_shape
        self.n_classes = n_classes
        self.token_input = token_input


def _lm(preset: str) -> Callable[..., nn.Module]:
    def build(input_shape: tuple[int, ...], n_classes: int, **shape: int) -> nn.Module:
        return decoder(input_shape, n_classes, preset=preset, **shape)
    return build


ZOO: dict[str, ZooEntry] = {
    "resnet18": ZooEntry(resnet18, (3, 224, 224), 1000),
    "resnet50": ZooEntry(resnet50, (3, 224, 224), 1000),
    "resnet101": ZooEntry(resnet101, (3, 224, 224), 1000),
    "vgg16": ZooEntry(vgg16, (3, 224, 224), 1000),
    "inception-v3": ZooEntry(inception_v3, (3, 299, 299), 1000),
    "bert-base": ZooEntry(bert_base, (128,), 2, token_input=True),
    **{name: ZooEntry(_lm(name), (s.seq,), s.vocab, token_input=True) for name, s in LM_PRESETS.items()},
}
