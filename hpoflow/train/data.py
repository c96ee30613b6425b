"""Built-in data sets: scikit-learn's digits (real data, shipped with scikit-learn) and a synthetic one.

The validation split is fixed (stratified, seed 0) whatever the trial's seed, so every trial is
scored on the same held-out images. Each rank trains on its own shard (``DistributedSampler``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["DATASETS", "Dataset", "DatasetInfo", "dataset_info", "load_dataset"]


@dataclass(frozen=True)
class Dataset:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    input_shape: tuple[int, ...]
    n_classes: int


@dataclass(frozen=True)
class DatasetInfo:
    """What the oracle needs of a built-in data set, without loading it."""

    input_shape: tuple[int, ...]
    n_classes: int
    n_samples: int  # before the validation split


DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo((1, 8, 8), 10, 1797),  # scikit-learn's load_digits
    "synthetic": DatasetInfo((1, 8, 8), 10, 2000),
}


def dataset_info(name: str, val_fraction: float = 0.2) -> tuple[tuple[int, ...], int, int]:
    """(input shape, classes, training samples after the split) of a built-in data set: the same
    split as ``load_dataset`` (scikit-learn's ``train_test_split`` rounds the test part up)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; built-in data sets: {', '.join(DATASETS)}")
    info = DATASETS[name]
    n_val = -(-info.n_samples * val_fraction // 1)  # ceil, as train_test_split does
    return info.input_shape, info.n_classes, info.n_samples - int(n_val)


def _split(x: np.ndarray, y: np.ndarray, val_fraction: float) -> Dataset:
    from sklearn.model_selection import train_test_split

    x_tr, x_va, y_tr, y_va = train_test_split(
        x, y, test_size=val_fraction, random_state=0, stratify=y
    )
    shape = tuple(x.shape[1:])
    return Dataset(
        torch.from_numpy(x_tr), torch.from_numpy(y_tr), torch.from_numpy(x_va), torch.from_numpy(y_va),
        shape, int(y.max()) + 1,
    )


def load_dataset(name: str, val_fraction: float = 0.2) -> Dataset:
    """Load a built-in data set as float32 image tensors ``(N, C, H, W)`` and int64 labels."""
    if name == "digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        x = (d.images.astype(np.float32) / 16.0)[:, None, :, :]
        return _split(x, d.target.astype(np.int64), val_fraction)
    if name == "synthetic":
        rng = np.random.default_rng(0)
        centers = rng.normal(size=(10, 1, 8, 8)).astype(np.float32)
        n = DATASETS["synthetic"].n_samples
        y = rng.integers(0, 10, size=n).astype(np.int64)
        x = centers[y] + 0.8 * rng.normal(size=(n, 1, 8, 8)).astype(np.float32)
        return _split(x, y, val_fraction)
    raise ValueError(f"unknown dataset {name!r}; built-in data sets: digits, synthetic")
