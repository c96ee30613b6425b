"""`hpoflow schema`: the JSON Schema editors use. It is kept in docs/study.schema.json (the examples'
modeline points there), validates every example spec, and rejects a mutated one."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from hpoflow.spec.schema import study_schema

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _errors(data: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(study_schema())
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in validator.iter_errors(data)]


def test_the_committed_schema_is_the_generated_one() -> None:
    r = subprocess.run([sys.executable, "-m", "hpoflow", "schema"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json.loads((ROOT / "docs" / "study.schema.json").read_text()), \
        "regenerate it: hpoflow schema -o docs/study.schema.json"
    jsonschema.Draft202012Validator.check_schema(json.loads(r.stdout))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_validates_and_carries_the_modeline(path: Path) -> None:
    text = path.read_text()
    assert text.splitlines()[0] == "# yaml-language-server: $schema=../docs/study.schema.json"
    assert _errors(yaml.safe_load(text)) == []


@pytest.mark.parametrize(("where", "value"), [
    (("search", "algorithm"), "bayes"),
    (("search", "sampler_options"), {"n_startup": 3}),
    (("search", "pruner"), {"type": "asha", "percentile": 10}),
    (("training", "epochs"), "many"),
    (("study", "direction"), "sideways"),
    (("resources", "processes"), 0),
])
def test_a_mutated_spec_is_rejected(where: tuple[str, str], value: Any) -> None:
    data = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text()))
    data.setdefault(where[0], {})[where[1]] = value
    assert _errors(data), (where, value)
