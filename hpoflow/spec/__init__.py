"""Study specs: YAML or Python mappings validated into typed, frozen objects."""

from __future__ import annotations

from hpoflow.spec._load import (
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
    OracleSpec,
    Param,
    PrunerSpec,
    ResourcesSpec,
    SearchSpec,
    StudySection,
    StudySpec,
    TrainConfig,
)

__all__ = [
    "BUILTIN_METRICS",
    "CategoricalParam",
    "CheckpointSpec",
    "FloatParam",
    "IntParam",
    "OracleSpec",
    "Param",
    "PrunerSpec",
    "ResourcesSpec",
    "SearchSpec",
    "StudySection",
    "StudySpec",
    "TrainConfig",
    "load_spec",
    "outside",
    "placeholders",
    "resolve_training",
    "search_dirs",
    "spec_from_mapping",
]
