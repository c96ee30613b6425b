"""``strategy: fsdp`` on a torch without FSDP2's collectives (pyproject allows torch>=2.2; the strategy
imports ``torch.distributed.fsdp._fully_shard._fsdp_collectives``): refused by ``hpoflow validate`` with
the rule and the fix, exit 2, and the strategy's module says the same if imported anyway."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import RUN_ENV

HIDE = "import sys; sys.modules['torch.distributed.fsdp._fully_shard._fsdp_collectives'] = None; "


def test_a_torch_without_fsdp2_is_refused_at_validate_time_with_the_fix(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "study": {"name": "f", "metric": "val_accuracy", "direction": "maximize"},
        "space": {"lr": {"type": "float", "low": 0.01, "high": 0.1, "log": True}},
        "search": {"algorithm": "random", "n_trials": 1},
        "training": {"model": "mlp", "dataset": "synthetic", "epochs": 1, "lr": "${lr}", "strategy": "fsdp"},
        "resources": {"processes": 2}, "oracle": {"enabled": False}}))
    code = HIDE + f"from hpoflow.cli.main import main; sys.exit(main(['validate', {str(spec)!r}]))"
    r = subprocess.run([sys.executable, "-c", code], env=RUN_ENV, capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 2, r.stderr
    assert "training.strategy_options: strategy fsdp needs FSDP2" in r.stderr and "Fix:" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    ok = subprocess.run([sys.executable, "-m", "hpoflow", "validate", str(spec)], env=RUN_ENV, capture_output=True,
                        text=True, timeout=120, check=False)
    assert ok.returncode == 0, ok.stderr  # this torch has it


def test_importing_the_strategy_on_such_a_torch_says_what_is_missing() -> None:
    code = HIDE + "import hpoflow.train.strategies._fsdp"
    r = subprocess.run([sys.executable, "-c", code], env=RUN_ENV, capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 1 and "ImportError: strategy fsdp needs FSDP2" in r.stderr and "Fix:" in r.stderr, r.stderr
