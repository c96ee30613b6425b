"""Study specs: YAML or Python mappings validated into typed, frozen objects."""

from __future__ import annotations

from hpoflow.spec._load import (
    BUILTIN_MEASURES,
    BUILTIN_METRICS,
    load_spec,
    outside,
    placeholders,
    resolve_training,
    search_dirs,
    spec_from_mapping,
)
from hpoflow.spec._models import (
    CategoricalParam,
    CheckpointSpec,
    FloatParam,
    IntParam,
    Objective,
    OracleSpec,
    Param,
    PrunerSpec,
    ResourcesSpec,
    SearchSpec,
    StudySection,
    StudySpec,
    TrackingSpec,
    TrainConfig,
    parse_constraint,
)

__all__ = [
    "BUILTIN_MEASURES",
    "BUILTIN_METRICS",
    "CategoricalParam",
    "CheckpointSpec",
    "ElasticRange",
    "FloatParam",
    "IntParam",
    "Objective",
    "OracleSpec",
    "Param",
    "PrunerSpec",
    "ResourcesSpec",
    "SearchSpec",
    "StudySection",
    "StudySpec",
    "TrackingSpec",
    "TrainConfig",
    "load_spec",
    "outside",
    "parse_constraint",
    "placeholders",
    "resolve_training",
    "search_dirs",
    "spec_from_mapping",
]
