"""Strategy and large-batch keys in the spec: defaults, per-strategy options, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from hpoflow.errors import SpecError
from hpoflow.spec import TrainConfig, load_spec

SPEC = """\
study: {{name: s, metric: val_accuracy, direction: maximize}}
space:
  strategy: {{type: categorical, choices: [allreduce, easgd, local_sgd]}}
search: {{algorithm: grid}}
training:
  optimizer: sgd
  strategy: "${{strategy}}"
  strategy_options:
{options}
"""


def _write(tmp_path: Path, options: str) -> Path:
    p = tmp_path / "spec.yaml"
    p.write_text(SPEC.format(options=options))
    return p


def test_defaults_are_filled_in_for_the_active_strategy() -> None:
    cfg = TrainConfig()
    assert cfg.strategy == "allreduce"
    assert cfg.strategy_options["bucket_cap_mb"] == 25.0
    cfg = TrainConfig(strategy="local_sgd", strategy_options={"period": 3})
    assert cfg.strategy_options == {"period": 3}
    assert TrainConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # round-trips


def test_per_strategy_mappings_pick_the_active_one() -> None:
    opts = {"easgd": {"tau": 2}, "local_sgd": {"period": 16}}
    assert TrainConfig(strategy="local_sgd", strategy_options=opts).strategy_options == {"period": 16}
    assert TrainConfig(strategy="easgd", strategy_options=opts).strategy_options["tau"] == 2
    assert TrainConfig(strategy="allreduce", strategy_options=opts).strategy_options["compression"] \
        == "none"


def test_searched_strategy_with_per_strategy_options_validates(tmp_path: Path) -> None:
    spec, _ = load_spec(_write(tmp_path, "    easgd: {tau: 2, alpha: 0.3}\n    local_sgd: {period: 4}"))
    assert spec.training["strategy"] == "${strategy}"


def test_unknown_option_names_yaml_path_line_and_valid_options(tmp_path: Path) -> None:
    path = _write(tmp_path, "    easgd: {tau: 2, alhpa: 0.3}")
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    text = str(exc.value)
    # the path and line of the offending key itself, said once
    assert f"{path}:9: training.strategy_options.easgd.alhpa: unknown option of strategy 'easgd'" in text
    assert text.count("alhpa") == 1
    assert "did you mean 'alpha'?" in text
    assert "valid options of easgd: alpha, rho, tau, momentum, momentum_coefficient" in text


def test_bad_value_states_rule_and_value(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"strategy_options.local_sgd.period: must be >= 1, but got 0"):
        load_spec(_write(tmp_path, "    local_sgd: {period: 0}"))
    path = _write(tmp_path, "    local_sgd:\n      period: 0")  # block style: the line of period
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    assert f"{path}:10: training.strategy_options.local_sgd.period: must be >= 1, but got 0" in str(exc.value)


def test_unknown_strategy_lists_the_valid_ones(tmp_path: Path) -> None:
    p = tmp_path / "s.yaml"
    p.write_text(SPEC.format(options="    {}").replace('"${strategy}"', "hogwild")
                 .replace("  strategy: {type: categorical, choices: [allreduce, easgd, local_sgd]}",
                          "  lr: {type: categorical, choices: [0.1]}"))
    with pytest.raises(SpecError, match="valid strategies: allreduce, easgd, fsdp, local_sgd, parameter_server, zero1"):
        load_spec(p)


def test_momentum_easgd_needs_sgd_and_alpha_excludes_rho() -> None:
    with pytest.raises(ValidationError, match="needs optimizer: sgd"):
        TrainConfig(strategy="easgd", optimizer="adam", strategy_options={"momentum": True})
    with pytest.raises(ValidationError, match="alpha or rho"):
        TrainConfig(strategy="easgd", strategy_options={"alpha": 0.1, "rho": 1.0})


def test_large_batch_fields_are_checked() -> None:
    with pytest.raises(ValidationError):
        TrainConfig(grad_accum_steps=0)
    with pytest.raises(ValidationError):
        TrainConfig(lr_scaling="cubic")
    cfg = TrainConfig(lr_scaling="linear", base_batch_size=256, warmup_epochs=5, lars=True)
    assert cfg.lars_trust_coefficient == 0.001
