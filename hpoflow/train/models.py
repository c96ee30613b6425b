"""Built-in models: a small MLP and a small CNN for 8x8 (digits) or 28x28 images.

Every builder takes ``(input_shape, n_classes, **options)`` and returns an ``nn.Module``.
Both are registered in ``hpoflow.registry.MODELS`` (options models in ``hpoflow.train.options``);
``build_model`` looks a name up there and gives an error that lists the valid names.
"""

from __future__ import annotations

from torch import nn

from hpoflow.registry import MODELS

__all__ = ["build_model", "cnn", "mlp"]


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


def build_model(name: str, input_shape: tuple[int, ...], n_classes: int, **options: object) -> nn.Module:
    """Build a model registered in ``hpoflow.registry.MODELS``; unknown names raise ``ValueError``
    listing the valid ones."""
    if name not in MODELS:
        raise ValueError(f"{MODELS.unknown(name)} (or give training.function: 'module:function' for your own)")
    model: nn.Module = MODELS.get(name)(input_shape, n_classes, **options)
    return model
