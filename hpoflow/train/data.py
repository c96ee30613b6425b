"""Built-in data sets: scikit-learn's digits (real data, shipped with scikit-learn), a synthetic one,
and ``chars``, a character-level text corpus generated here from a fixed grammar.

Each data set says its *task*: ``classify`` (one label per sample: digits, synthetic) or
``next_token`` (a sequence of token ids per sample, the label of each position the next token:
chars); the built-in trainer computes its loss and metrics from it (``hpoflow.train.builtin``).

The validation split is fixed whatever the trial's seed, so every trial is scored on the same
held-out data: digits and synthetic are split stratified with seed 0 (scikit-learn's
``train_test_split(stratify=y, random_state=0)``); chars keeps the first ``1 - val_fraction`` of the
text for training and the rest for validation. Each rank trains on its own shard
(``DistributedSampler``).

Loading digits or synthetic imports no scikit-learn (``import sklearn`` alone takes ~0.7 s of CPU, in
every rank process and every forkserver): digits is read from the CSV scikit-learn ships
(``sklearn/datasets/data/digits.csv.gz``, found without importing the package), and the splits at the
default ``val_fraction`` are the ones scikit-learn computes, stored in ``splits.npz`` beside this module
with a digest of the labels they split (``tests/train/test_data.py`` checks them against
``train_test_split``; ``python -m hpoflow.train.data`` writes them again). Any other split, or labels that
differ from the stored digest, is computed by scikit-learn as before.

``chars`` (``CHARS_LENGTH`` characters, 56 distinct): English-like sentences drawn from a
small grammar (names, places, adjectives, nouns, verbs, numbers, quoted speech, questions,
paragraphs) by ``random.Random(0)``, so the text is the same on every machine and Python version
and nothing is downloaded. A sample is a window of ``sequence_length`` characters (the ``gpt``
model's ``context``, default 64) and its targets the same window shifted by one; windows do not
overlap.
"""

from __future__ import annotations

import hashlib
import importlib.util
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import torch

__all__ = ["CHARS_LENGTH", "DATASETS", "Dataset", "DatasetInfo", "chars_corpus", "dataset_info", "load_dataset"]

Task = Literal["classify", "next_token"]
CHARS_LENGTH = 65_536
DEFAULT_SEQUENCE_LENGTH = 64


@dataclass(frozen=True)
class Dataset:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    input_shape: tuple[int, ...]
    n_classes: int  # classes, or the vocabulary of a next_token data set
    task: Task = "classify"


@dataclass(frozen=True)
class DatasetInfo:
    """What the oracle needs of a built-in data set, without loading it."""

    input_shape: tuple[int, ...]
    n_classes: int
    n_samples: int  # before the validation split (chars: characters of text)
    task: Task = "classify"


DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo((1, 8, 8), 10, 1797),  # scikit-learn's load_digits
    "synthetic": DatasetInfo((1, 8, 8), 10, 2000),
    "chars": DatasetInfo((DEFAULT_SEQUENCE_LENGTH,), 56, CHARS_LENGTH, "next_token"),
}


def dataset_info(name: str, val_fraction: float = 0.2, sequence_length: int | None = None
                 ) -> tuple[tuple[int, ...], int, int]:
    """(input shape, classes, training samples after the split) of a built-in data set: the same
    split as ``load_dataset`` (scikit-learn's ``train_test_split`` rounds the test part up; chars
    counts the windows of ``sequence_length`` characters, default 64, in its training text)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; built-in data sets: {', '.join(DATASETS)}")
    info = DATASETS[name]
    if info.task == "next_token":
        t = sequence_length or DEFAULT_SEQUENCE_LENGTH
        n_train, _ = _chars_split(val_fraction)
        return (t,), info.n_classes, (n_train - 1) // t
    n_val = -(-info.n_samples * val_fraction // 1)  # ceil, as train_test_split does
    return info.input_shape, info.n_classes, info.n_samples - int(n_val)


SPLITS_FILE = Path(__file__).with_name("splits.npz")
STORED_SPLITS = (("digits", 0.2), ("synthetic", 0.2))  # what ``write_splits`` stores


def split_indices(y: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) indices of scikit-learn's ``train_test_split(stratify=y, random_state=0)``."""
    from sklearn.model_selection import train_test_split

    train, val = train_test_split(np.arange(len(y)), test_size=val_fraction, random_state=0, stratify=y)
    return np.asarray(train), np.asarray(val)


def _labels_digest(y: np.ndarray) -> np.ndarray:
    return np.frombuffer(hashlib.sha256(np.ascontiguousarray(y, dtype=np.int64).tobytes()).digest(), dtype=np.uint8)


def _stored_split(name: str, y: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray] | None:
    """The split ``write_splits`` stored for these labels and this fraction, or None."""
    key = f"{name}-{val_fraction:g}"
    try:
        with np.load(SPLITS_FILE) as stored:
            if f"{key}-labels" not in stored or not np.array_equal(stored[f"{key}-labels"], _labels_digest(y)):
                return None
            return stored[f"{key}-train"].astype(np.int64), stored[f"{key}-val"].astype(np.int64)
    except (OSError, ValueError, KeyError):  # not shipped, or unreadable: computed instead
        return None


def write_splits(path: Path = SPLITS_FILE) -> Path:
    """Compute the stored splits (``STORED_SPLITS``) with scikit-learn and write them to ``path``."""
    arrays: dict[str, np.ndarray] = {}
    for name, fraction in STORED_SPLITS:
        y = _arrays(name)[1]
        train, val = split_indices(y, fraction)
        key = f"{name}-{fraction:g}"
        arrays.update({f"{key}-labels": _labels_digest(y), f"{key}-train": train.astype(np.int16),
                       f"{key}-val": val.astype(np.int16)})
    np.savez_compressed(path, **arrays)  # type: ignore[arg-type]
    return path


def _split(name: str, x: np.ndarray, y: np.ndarray, val_fraction: float) -> Dataset:
    train, val = _stored_split(name, y, val_fraction) or split_indices(y, val_fraction)
    shape = tuple(x.shape[1:])
    return Dataset(
        torch.from_numpy(x[train]), torch.from_numpy(y[train]), torch.from_numpy(x[val]), torch.from_numpy(y[val]),
        shape, int(y.max()) + 1,
    )


def _digits_csv() -> Path | None:
    """scikit-learn's copy of the digits (``load_digits`` reads it), found without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def _arrays(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of digits or synthetic: float32 images (N, 1, 8, 8) and int64 labels."""
    if name == "digits":
        path = _digits_csv()
        if path is not None:
            data = np.loadtxt(path, delimiter=",")  # 64 pixels (0-16) and the label, per row, as load_digits
            images, target = data[:, :-1].reshape(-1, 8, 8), data[:, -1]
        else:  # laid out otherwise: ask scikit-learn
            from sklearn.datasets import load_digits

            d = load_digits()
            images, target = d.images, d.target
        return (images.astype(np.float32) / 16.0)[:, None, :, :], target.astype(np.int64)
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(10, 1, 8, 8)).astype(np.float32)
    n = DATASETS["synthetic"].n_samples
    y = rng.integers(0, 10, size=n).astype(np.int64)
    x = centers[y] + 0.8 * rng.normal(size=(n, 1, 8, 8)).astype(np.float32)
    return x, y


def load_dataset(name: str, val_fraction: float = 0.2, sequence_length: int | None = None) -> Dataset:
    """Load a built-in data set: float32 image tensors ``(N, C, H, W)`` and int64 labels, or (chars)
    int64 windows ``(N, sequence_length)`` and their next-character targets of the same shape."""
    if name in ("digits", "synthetic"):
        x, y = _arrays(name)
        return _split(name, x, y, val_fraction)
    if name == "chars":
        return _chars(val_fraction, sequence_length or DEFAULT_SEQUENCE_LENGTH)
    raise ValueError(f"unknown dataset {name!r}; built-in data sets: {', '.join(DATASETS)}")


# -- chars ----------------------------------------------------------------------------------------
_NAMES = ("Ada", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Iris", "Jonas", "Kira",
          "Lucas", "Mara", "Nils", "Olga", "Pavel")
_PLACES = ("the river", "the old mill", "the market", "the harbour", "the forest", "the tower", "the garden",
           "the station", "the library", "the bridge", "the valley", "the square")
_ADJECTIVES = ("small", "quiet", "bright", "heavy", "narrow", "ancient", "green", "cold", "broken", "golden",
               "patient", "crooked", "distant", "warm", "strange", "empty")
_NOUNS = ("lamp", "letter", "horse", "window", "basket", "clock", "boat", "key", "map", "stone", "coat",
          "bell", "door", "candle", "ladder", "wheel", "book", "kettle", "rope", "mirror")
_VERBS = ("found", "carried", "painted", "lost", "mended", "opened", "sold", "watched", "counted", "hid",
          "dropped", "cleaned", "followed", "borrowed", "measured", "kept")
_MOTION = ("walked to", "ran past", "waited near", "sailed under", "climbed over", "returned from",
           "slept beside", "looked at")
_TIMES = ("in the morning", "at noon", "after dark", "before the rain", "on Sunday", "every evening",
          "in winter", "at dawn")
_SAID = ("said", "asked", "whispered", "shouted", "replied")
_NUMBERS = ("two", "three", "four", "seven", "twelve", "19", "40", "365")


def _sentence(r: random.Random) -> str:
    name, other = r.sample(_NAMES, 2)
    adj, noun = r.choice(_ADJECTIVES), r.choice(_NOUNS)
    kind = r.randrange(7)
    if kind == 0:
        return f"{name} {r.choice(_VERBS)} the {adj} {noun} {r.choice(_TIMES)}."
    if kind == 1:
        return f"The {adj} {noun} was near {r.choice(_PLACES)}, and {name} {r.choice(_VERBS)} it."
    if kind == 2:
        return f"{name} {r.choice(_MOTION)} {r.choice(_PLACES)} with {other}."
    if kind == 3:
        return f"\"Where is the {noun}?\" {r.choice(_SAID)} {name}."
    if kind == 4:
        return f"{other} {r.choice(_VERBS)} {r.choice(_NUMBERS)} {noun}s at {r.choice(_PLACES)}."
    if kind == 5:
        return f"Did {name} see the {adj} {noun}? {other} did not."
    return f"\"The {noun} is {adj},\" {r.choice(_SAID)} {other}, \"and {name} {r.choice(_VERBS)} it!\""


@lru_cache(maxsize=1)
def chars_corpus() -> str:
    """The chars text: ``CHARS_LENGTH`` characters, the same on every machine."""
    r = random.Random(0)  # Random's integer draws are stable across Python versions
    parts: list[str] = []
    size = 0
    while size < CHARS_LENGTH:
        paragraph = " ".join(_sentence(r) for _ in range(r.randint(2, 6))) + "\n"
        parts.append(paragraph)
        size += len(paragraph)
    return "".join(parts)[:CHARS_LENGTH]


def _chars_split(val_fraction: float) -> tuple[int, int]:
    """(training characters, validation characters) of the chars text."""
    n_val = max(2, round(CHARS_LENGTH * val_fraction))
    return CHARS_LENGTH - n_val, n_val


def _windows(ids: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = (len(ids) - 1) // t
    if n < 1:
        raise ValueError(f"chars: a text of {len(ids)} characters holds no window of {t + 1}; lower the "
                         "model's context or val_fraction")
    return ids[: n * t].view(n, t), ids[1 : n * t + 1].view(n, t)


def _chars(val_fraction: float, t: int) -> Dataset:
    text = chars_corpus()
    vocab = sorted(set(text))
    if len(vocab) != DATASETS["chars"].n_classes:  # the grammar and the table above must agree
        raise RuntimeError(f"chars: the corpus has {len(vocab)} distinct characters, DATASETS says "
                           f"{DATASETS['chars'].n_classes}")
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
    n_train, _ = _chars_split(val_fraction)
    x_tr, y_tr = _windows(ids[:n_train], t)
    x_va, y_va = _windows(ids[n_train:], t)
    return Dataset(x_tr, y_tr, x_va, y_va, (t,), len(vocab), "next_token")


if __name__ == "__main__":  # python -m hpoflow.train.data: write splits.npz again (scikit-learn computes them)
    print(write_splits())
