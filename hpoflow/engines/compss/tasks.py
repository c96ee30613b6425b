"""The PyCOMPSs task of a compss study, built from the study's ``TaskShape`` (imported only with pycompss).

``build(shape)`` applies ``@constraint`` / ``@multinode`` / ``@on_failure`` / ``@task`` to a fresh
function with the shape's *literal* values (``TaskShape.decorator_kwargs``) and binds it in this
module under ``shape.variant`` (``trial_cpu``, ``trial_gpu``, ``trial_multinode_cpu``,
``trial_multinode_gpu``). The binding registers the core element at the first call, with those
numbers; its body is ``placement.run_task`` (a multi-node task COMPSs put twice on one host is given
back at once, else one attempt of the trial). One COMPSs application registers one shape: a second,
different shape raises ``EngineError`` (a core element's constraints cannot change once registered),
except for an elastic trial restarted on another number of ranks: each of its sizes is a task of its own, named
``<variant>__<nodes>n<units>u<gpus>g`` (``elastic_name``), registered at its first call.

Workers: the runtime imports this module and looks the function up by name. ``__getattr__`` builds
the named variant (the part of the name before ``__``) there with the same decorator stack (the
worker never registers, so the numbers do not matter; ``on_failure`` does, and is the same). In the
master, using a variant before ``build`` is an error, so nothing is ever registered with a made-up
shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pycompss.api.constraint import constraint
from pycompss.api.multinode import multinode
from pycompss.api.on_failure import on_failure
from pycompss.api.task import task

from hpoflow.engines.compss._api import runtime_active
from hpoflow.engines.compss.placement import run_task
from hpoflow.engines.compss.shape import TaskShape
from hpoflow.errors import EngineError

__all__ = ["FAILED_DEFAULT", "VARIANTS", "build", "built_shape", "elastic_name"]

FAILED_DEFAULT: dict[str, Any] = {
    "number": -1, "status": "failed", "retryable": True, "compss_default": True,
    "error": "the COMPSs task failed (worker crash, COMPSs time_out or cancellation); see the COMPSs "
             "job logs (.COMPSs/<app>/jobs) and the trial's rank logs",
}

# variant -> a shape with that decorator stack, for worker-side look-ups only
VARIANTS: dict[str, TaskShape] = {
    s.variant: s for s in (TaskShape(1, 1), TaskShape(1, 1, 1), TaskShape(2, 1), TaskShape(2, 1, 1))
}

_built: TaskShape | None = None


def built_shape() -> TaskShape | None:
    """The shape this application registered its task with (None before ``build``)."""
    return _built


def _decorated(shape: TaskShape, name: str | None = None) -> Callable[..., Any]:
    def trial(request_json: str, options_json: str) -> dict[str, Any]:
        return run_task(request_json, options_json)  # a wrong placement given back, else the attempt

    # the runtime's signature: <module>.<name>
    trial.__name__ = trial.__qualname__ = name or shape.variant
    kw = shape.decorator_kwargs()
    fn: Callable[..., Any] = task(**(kw["task"] or {}))(trial)
    fn = on_failure(**(kw["on_failure"] or {}), returns=FAILED_DEFAULT)(fn)
    if kw["multinode"] is not None:
        fn = multinode(**kw["multinode"])(fn)
    built: Callable[..., Any] = constraint(**(kw["constraint"] or {}))(fn)
    return built


_elastic: dict[TaskShape, str] = {}  # further shapes of elastic trials -> their task's name


def elastic_name(shape: TaskShape) -> str:
    """The task name of an elastic trial's size other than the study's first shape: its own core
    element (its constraints are its own), ``<variant>__<nodes>n<units>u<gpus>g``."""
    return f"{shape.variant}__{shape.nodes}n{shape.computing_units}u{shape.gpus}g"


def build(shape: TaskShape, *, elastic: bool = False) -> Callable[..., Any]:
    """The task function of ``shape`` (built once per application; see the module docstring). With
    ``elastic``, a shape other than the first gets a task of its own (an elastic trial restarted on
    another number of ranks) instead of the error."""
    global _built
    if _built is None:
        globals()[shape.variant] = _decorated(shape)
        _built = shape
    elif _built != shape:
        if not elastic:
            raise EngineError(
                f"this COMPSs application registered its trial task for {_built.describe()}, but a trial asks "
                f"for {shape.describe()}; COMPSs cannot change a registered task's constraints. Fix: give every "
                "trial of a study the same resources (and run another shape as another study)")
        name = _elastic.get(shape)
        if name is None:
            name = _elastic[shape] = elastic_name(shape)
            globals()[name] = _decorated(shape, name)
        elastic_fn: Callable[..., Any] = globals()[name]
        return elastic_fn
    fn: Callable[..., Any] = globals()[shape.variant]
    return fn


def __getattr__(name: str) -> Any:
    variant = name.split("__", 1)[0]
    if variant not in VARIANTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if runtime_active():
        raise EngineError(f"{__name__}.{name} used before build(shape): the task would be registered without "
                          "the study's resources. Fix: call build(TaskShape) first (CompssEngine does)")
    fn = _decorated(VARIANTS[variant], name)  # a worker: the runtime looks the task up by name
    globals()[name] = fn
    return fn
