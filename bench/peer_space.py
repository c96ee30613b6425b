"""The search space of ``bench/peers.py``'s digits study, apart from its user code
(``peer_objectives``, which imports torch and scikit-learn): ``peers.py`` writes hpoflow's spec from
it without importing either, and ``peer_objectives.optuna_objective`` suggests the same parameters.

The searched parameters (learning rate, momentum, weight decay) do not change a trial's cost.
"""

from __future__ import annotations

from typing import Any

# hpoflow's spec form: every parameter a float, some on a log scale
SPACE: dict[str, dict[str, Any]] = {
    "lr": {"type": "float", "low": 1e-3, "high": 0.3, "log": True},
    "momentum": {"type": "float", "low": 0.5, "high": 0.99},
    "weight_decay": {"type": "float", "low": 1e-6, "high": 1e-3, "log": True},
}
