"""The JSON Schema of a study spec, for editors (``hpoflow schema``; the examples' modelines).

It is the pydantic models' schema, completed where the models take an open mapping that the
registries validate: ``training`` (the ``TrainConfig`` fields, each of which may also be a
``"${param}"`` placeholder), ``search.sampler_options``, ``search.pruner``, ``compss`` and
``engine_options`` (one alternative per registered plug-in, from its options model). What the
schema cannot say (cross-field rules, placeholders type-checked against the space) ``hpoflow
validate`` still checks.
"""

from __future__ import annotations

import copy
from typing import Any

from hpoflow.registry import ELASTIC, ENGINES, MODELS, PRUNERS, SAMPLERS, STRATEGIES, Registry
from hpoflow.spec._models import PLACEHOLDER, StudySpec, TrainConfig

__all__ = ["SCHEMA_ID", "study_schema"]

SCHEMA_ID = "https://hpoflow.invalid/schema/study.json"  # a name, never fetched
_PLACEHOLDER = {"type": "string", "pattern": PLACEHOLDER.pattern, "description": "a ${param} of the space"}


def _options(registry: Registry[Any], defs: dict[str, Any], placeholders: bool = False) -> dict[str, Any]:
    """``anyOf`` the options models of every entry of ``registry`` (definitions hoisted into ``defs``);
    with ``placeholders`` every option may also be a ``"${param}"`` (in ``training``)."""
    alternatives = []
    for name in registry.names():
        schema = copy.deepcopy(registry.options_model(name).model_json_schema(ref_template="#/$defs/{model}"))
        defs.update(schema.pop("$defs", {}))
        schema["title"] = f"{registry.kind} {name}"
        if placeholders:
            schema["properties"] = {k: {"anyOf": [v, _PLACEHOLDER]} for k, v in schema.get("properties", {}).items()}
        alternatives.append(schema)
    return {"anyOf": alternatives}


def study_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) that every valid study spec satisfies."""
    schema = StudySpec.model_json_schema(ref_template="#/$defs/{model}")
    defs: dict[str, Any] = schema.setdefault("$defs", {})
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = SCHEMA_ID
    props = schema["properties"]

    train = TrainConfig.model_json_schema(ref_template="#/$defs/{model}")
    defs.update(train.pop("$defs", {}))
    for key, prop in train["properties"].items():
        train["properties"][key] = {"anyOf": [prop, _PLACEHOLDER]}
    train["properties"]["strategy_options"] = {
        "anyOf": [_options(STRATEGIES, defs, placeholders=True), {"type": "object"}],  # or one per strategy
        "description": train["properties"]["strategy_options"]["anyOf"][0].get("description", "")}
    train["properties"]["model_options"] = _options(MODELS, defs, placeholders=True)
    props["training"] = train

    for param in ("FloatParam", "IntParam", "CategoricalParam"):  # when: {p: value} or {p: [values]}
        defs[param]["properties"]["when"] = {
            "anyOf": [{"type": "object", "additionalProperties": True}, {"type": "null"}],
            "description": "Active only when each named parameter has the given value (or one of the values)."}
    search = defs["SearchSpec"]["properties"]
    search["sampler_options"] = _options(SAMPLERS, defs)
    pruners = []
    for name in PRUNERS.names():
        opts = copy.deepcopy(PRUNERS.options_model(name).model_json_schema(ref_template="#/$defs/{model}"))
        defs.update(opts.pop("$defs", {}))
        opts.setdefault("properties", {})["type"] = {"const": name}
        opts["title"] = f"pruner {name}"
        pruners.append(opts)
    search["pruner"] = {"anyOf": pruners, "description": "type: and that pruner's options"}
    props["compss"] = ENGINES.options_model("compss").model_json_schema(ref_template="#/$defs/{model}")
    defs.update(props["compss"].pop("$defs", {}))
    props["engine_options"] = _options(ENGINES, defs)
    props["engine"]["enum"] = ENGINES.names()
    search["algorithm"]["enum"] = SAMPLERS.names()
    # processes: a number, or an elastic range {min, max, policy} (read into ``elastic``)
    resources = defs["ResourcesSpec"]["properties"]
    defs["ElasticRange"]["properties"]["policy"]["enum"] = ELASTIC.names()
    resources["processes"] = {"anyOf": [resources["processes"], {"$ref": "#/$defs/ElasticRange"}],
                              "description": resources["processes"].get("description", "")}
    resources.pop("elastic", None)
    return schema
