"""The built-in digits and synthetic data sets: the stored splits are scikit-learn's, and loading
them at the default fraction imports no scikit-learn (~0.7 s of CPU in every rank and forkserver)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from hpoflow.train.data import STORED_SPLITS, _arrays, load_dataset, split_indices

ROOT_CODE = ("import json, sys\n"
             "from hpoflow.train.data import load_dataset\n"
             "sizes = {n: len(load_dataset(n).y_val) for n in ('digits', 'synthetic')}\n"
             "loaded = sorted(m for m in sys.modules if m.startswith('sklearn'))\n"
             "print(json.dumps({'sizes': sizes, 'sklearn': loaded}))\n")


@pytest.mark.parametrize(("name", "fraction"), STORED_SPLITS)
def test_a_stored_split_is_scikit_learns_train_test_split(name: str, fraction: float) -> None:
    from sklearn.model_selection import train_test_split

    x, y = _arrays(name)
    x_tr, x_va, y_tr, y_va = train_test_split(x, y, test_size=fraction, random_state=0, stratify=y)
    d = load_dataset(name, fraction)
    for ours, theirs in ((d.x_train, x_tr), (d.x_val, x_va), (d.y_train, y_tr), (d.y_val, y_va)):
        assert np.array_equal(ours.numpy(), theirs)  # the same samples, in the same order
    if name == "digits":  # scikit-learn's own loader gives the same digits as its CSV read here
        from sklearn.datasets import load_digits

        digits = load_digits()
        assert np.array_equal(x, (digits.images.astype(np.float32) / 16.0)[:, None, :, :])
        assert np.array_equal(y, digits.target)


def test_loading_digits_and_synthetic_imports_no_scikit_learn() -> None:
    p = subprocess.run([sys.executable, "-c", ROOT_CODE], capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"sizes": {"digits": 360, "synthetic": 400}, "sklearn": []}


def test_another_fraction_or_other_labels_are_split_by_scikit_learn() -> None:
    d = load_dataset("digits", 0.3)  # not stored: computed
    _, y = _arrays("digits")
    _, val = split_indices(y, 0.3)
    assert np.array_equal(d.y_val.numpy(), y[val]) and len(val) == 540
    counts = np.bincount(d.y_val.numpy(), minlength=10) / len(val)
    assert np.allclose(counts, np.bincount(y, minlength=10) / len(y), atol=0.01)  # stratified
    from hpoflow.train import data

    assert data._stored_split("digits", y[::-1].copy(), 0.2) is None  # other labels: not the stored split
