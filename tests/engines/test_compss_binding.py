"""What the COMPSs runtime receives for a study's trial task: literal numbers, never "$VAR".

Two levels, on the same four shapes (1-node CPU, 1-node GPU, 2-node CPU, 2-node GPU):

- always: ``TaskShape.registration()``, the description of what the COMPSs 3.3 binding sends
  (docs/cluster.md, "What reaches the runtime"), derived from the decorator arguments hpoflow applies;
- where the PyCOMPSs binding is importable (a cluster, a COMPSs container, or its sources on
  PYTHONPATH): the real binding's master code, driven by the real ``CompssEngine`` in a fresh
  interpreter. The C extension ``compss`` (the link to the Java runtime, which the binding's
  ``pycompss.runtime.management.COMPSs`` module loads and calls) is replaced by a module that records
  every call; the test asserts exactly what ``register_core_element`` and ``process_task`` received.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from hpoflow.engines.compss import CompssOptions, TaskShape
from hpoflow.engines.compss.shape import Registration
from tests.engines._fakes import ROOT, make_request

GPU = "processors:[{processorType: GPU, computingUnits: %d}];"

# name -> (resources, compss options, what must be registered)
SHAPES: dict[str, tuple[dict[str, Any], dict[str, Any], Registration]] = {
    "1-node-cpu": (dict(processes=2, cpus_per_process=3, nodes=1), {},
                   Registration("computing_units:6;", "METHOD", 1, "IGNORE", 0)),
    "1-node-gpu": (dict(processes=4, cpus_per_process=2, gpus_per_process=1, nodes=1, timeout=60), {},
                   Registration("computing_units:8;" + GPU % 4, "METHOD", 1, "IGNORE", 180)),
    "2-node-cpu": (dict(processes=8, cpus_per_process=4, nodes=2, timeout=100.5), {"time_out_grace_s": 30},
                   Registration("computing_units:16;", "MULTI_NODE", 2, "IGNORE", 131)),
    "2-node-gpu": (dict(processes=8, cpus_per_process=4, gpus_per_process=1, nodes=2, timeout=3600),
                   {"memory_size_gb": 64},
                   Registration("computing_units:16;memory_size:64;" + GPU % 4, "MULTI_NODE", 2, "IGNORE", 3720)),
    # the workers' size known (hpoflow launch --cpus-per-node 48 --gpus-per-node 4): each node asks for a
    # whole worker, so COMPSs can never put two nodes of the trial on one host
    "2-node-gpu-whole-workers": (dict(processes=4, cpus_per_process=2, gpus_per_process=1, nodes=2),
                                 {"cpus_per_node": 48, "gpus_per_node": 4},
                                 Registration("computing_units:48;" + GPU % 2, "MULTI_NODE", 2, "IGNORE", 0)),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_described_registration_is_literal(name: str, tmp_path: Path) -> None:
    resources, options, expected = SHAPES[name]
    shape = CompssOptions(**options).task_shape(make_request(tmp_path, 0, **resources))
    reg = shape.registration()
    assert reg == expected
    assert "$" not in reg.constraints
    assert shape.variant == "trial_" + ("multinode_" if resources["nodes"] > 1 else "") + (
        "gpu" if resources.get("gpus_per_process") else "cpu")


def test_shapes_refuse_uneven_splits_and_compare_by_value(tmp_path: Path) -> None:
    from hpoflow.errors import EngineError

    with pytest.raises(EngineError, match=r"processes must be a multiple of resources\.nodes.*processes=3, nodes=2"):
        CompssOptions().task_shape(make_request(tmp_path, 0, processes=3, nodes=2))
    assert TaskShape.of(4, 2, 1, 2, None) == TaskShape(2, 4, 2)
    assert TaskShape.of(4, 2, 1, 2, None).placement() != TaskShape.of(4, 2, 0, 2, None).placement()


# --- the real binding ---------------------------------------------------------------------------

def _binding_available() -> bool:
    try:
        return importlib.util.find_spec("pycompss.runtime.management.COMPSs") is not None
    except ImportError:
        return False


needs_binding = pytest.mark.skipif(
    not _binding_available(),
    reason="the PyCOMPSs binding is not importable (put its sources on PYTHONPATH to run this; docs/cluster.md)")


class _RecordingLink(types.ModuleType):
    """Stands in for the C extension ``compss``: records each call, answers like an idle runtime."""

    def __init__(self, workdir: str) -> None:
        super().__init__("compss")
        self.calls: list[tuple[str, list[Any]]] = []
        self.workdir = workdir

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args: Any) -> Any:
            self.calls.append((name, [a if isinstance(a, str | int | float | bool | type(None) | list) else repr(a)
                                      for a in args]))
            if name in ("get_master_working_path", "get_logging_path"):
                return self.workdir
            return None

        return call


def drive(spec_json: str) -> None:
    """Run in a fresh interpreter: the binding's master, as runcompss starts it, then the engine."""
    spec = json.loads(spec_json)
    tmp = Path(spec["tmp"])
    link = _RecordingLink(str(tmp / "master"))
    sys.modules["compss"] = link  # what pycompss.runtime.management.link.direct imports
    from pycompss.util.context import CONTEXT

    CONTEXT.set_master()  # as pycompss.runtime.launch.compss_main does, before importing the API
    from pycompss.api.api import compss_start
    from pycompss.runtime.binding import get_tmp_path
    from pycompss.runtime.commons import GLOBALS

    compss_start("off", False, False)
    (tmp / "master").mkdir()
    GLOBALS.set_temporary_directory(get_tmp_path())

    from hpoflow.engines.compss import CompssEngine, CompssOptions, runtime_active
    from hpoflow.errors import EngineError

    out: dict[str, Any] = {"runtime_active": runtime_active()}
    options = spec["options"]
    req = make_request(tmp / "trials" / "0", 0, **spec["resources"])
    try:
        from hpoflow.engines.compss import tasks

        getattr(tasks, "trial_cpu")  # noqa: B009 - in the master, before build: must refuse
    except EngineError as exc:
        out["before_build"] = str(exc)
    # as workflows/hpo.py does: the shape from the spec's resources, before the first task import
    engine = CompssEngine(tmp, shape=CompssOptions(**options).task_shape(req), **options)
    out["sequential"] = engine.sequential
    engine.submit(req)
    other = make_request(tmp / "trials" / "1", 1, processes=1, cpus_per_process=5)
    try:
        engine.submit(other)
    except EngineError as exc:
        out["other_shape"] = str(exc)
    out["calls"] = link.calls
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # the engine would wait for tasks that never run; nothing else to clean up


def drive_placement(tmp_str: str) -> None:
    """The binding's master, then a 2-node trial whose task COMPSs placed twice on one host: the task's
    own body (``run_task``) gives it back, and the engine submits the same attempt again."""
    tmp = Path(tmp_str)
    link = _RecordingLink(str(tmp / "master"))
    sys.modules["compss"] = link
    from pycompss.util.context import CONTEXT

    CONTEXT.set_master()
    from pycompss.api.api import compss_start
    from pycompss.runtime.binding import get_tmp_path
    from pycompss.runtime.commons import GLOBALS

    compss_start("off", False, False)
    (tmp / "master").mkdir()
    GLOBALS.set_temporary_directory(get_tmp_path())

    from hpoflow.engines.compss import CompssEngine, CompssOptions
    from hpoflow.engines.compss.placement import run_task

    req = make_request(tmp / "trials" / "0", 0, processes=2, nodes=2)
    engine = CompssEngine(tmp, shape=CompssOptions().task_shape(req), poll_interval_s=0.02)
    engine.submit(req)
    first = len(link.calls)
    # what the worker's task body does when COMPSS_HOSTNAMES names one host twice
    given_back = run_task(req.to_json(), "{}", env={"COMPSS_HOSTNAMES": "w1,w1"})
    events = engine.poll(5.0)
    out = {"calls": link.calls, "first": first, "events": [repr(e) for e in events],
           "running": engine.running(), "given_back": given_back}
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)


def drive_elastic(tmp_str: str) -> None:
    """The binding's master, then an elastic trial of 1 rank restarted on 2 (the engine's own path)."""
    from dataclasses import replace

    tmp = Path(tmp_str)
    link = _RecordingLink(str(tmp / "master"))
    sys.modules["compss"] = link
    from pycompss.util.context import CONTEXT

    CONTEXT.set_master()
    from pycompss.api.api import compss_start
    from pycompss.runtime.binding import get_tmp_path
    from pycompss.runtime.commons import GLOBALS

    compss_start("off", False, False)
    (tmp / "master").mkdir()
    GLOBALS.set_temporary_directory(get_tmp_path())

    from hpoflow.engines.compss import CompssEngine, CompssOptions

    options = CompssOptions(slots=2)
    req = replace(make_request(tmp / "trials" / "0", 0, processes=1, cpus_per_process=1), elastic_sizes=(1, 2))
    engine = CompssEngine(tmp, shape=options.task_shape(req), slots=2)
    engine.submit(req)
    grown = replace(req, processes=2)
    trial = engine._trials[0]
    assert trial.segments is not None
    trial.segments.restart(trial.submitted + 1.0, 2, [])  # what _restart does
    engine._launch(grown, options.task_shape(grown), prior=trial)
    print("RESULT " + json.dumps({"calls": link.calls}), flush=True)
    os._exit(0)


def drive_worker(variant: str) -> None:
    """A worker imports the task module and looks the task up by name (no build there)."""
    from pycompss.util.context import CONTEXT

    CONTEXT.set_worker()
    module = importlib.import_module("hpoflow.engines.compss.tasks")
    fn = getattr(module, variant)
    print("RESULT " + json.dumps({"name": fn.__name__, "module": fn.__module__}), flush=True)


def _run(code: str, tmp_path: Path) -> dict[str, Any]:
    """``code`` in a fresh ``python -O`` (as runcompss runs the application at its default log level)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-O", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


@needs_binding
@pytest.mark.parametrize("name", list(SHAPES))
def test_the_real_binding_registers_literal_numbers(name: str, tmp_path: Path) -> None:
    resources, options, expected = SHAPES[name]
    spec = json.dumps({"tmp": str(tmp_path), "resources": resources, "options": options})
    out = _run(f"from tests.engines.test_compss_binding import drive; drive({spec!r})", tmp_path)
    assert out["runtime_active"] is True and out["sequential"] is False
    assert "used before build(shape)" in out["before_build"]
    calls = out["calls"]
    names = [c[0] for c in calls]
    assert names[0] == "start_runtime"
    assert names.count("register_core_element") == 1 and names.count("process_task") == 1
    reg = next(args for n, args in calls if n == "register_core_element")
    variant = TaskShape(expected.num_nodes, 1, 1 if "GPU" in expected.constraints else 0).variant
    signature = f"hpoflow.engines.compss.tasks.{variant}"
    assert reg[0] == reg[1] == signature
    assert reg[2] == expected.constraints and "$" not in reg[2]
    assert reg[3] == expected.impl_type
    assert reg[-1] == ["hpoflow.engines.compss.tasks", variant]
    task = next(args for n, args in calls if n == "process_task")
    assert task[1] == signature
    assert (task[2], task[3], task[5]) == (expected.on_failure, expected.time_out, expected.num_nodes)
    # the trial runs in its own task group, without an implicit barrier
    assert ("open_task_group", ["trial-0", False, 0]) in [tuple(c) for c in calls]
    assert names.index("open_task_group") < names.index("process_task") < names.index("close_task_group")
    assert "one COMPSs application runs one shape" in out["other_shape"]


@needs_binding
def test_a_worker_finds_each_task_variant_by_name(tmp_path: Path) -> None:
    for variant in ("trial_cpu", "trial_gpu", "trial_multinode_cpu", "trial_multinode_gpu"):
        out = _run(f"from tests.engines.test_compss_binding import drive_worker; drive_worker({variant!r})",
                   tmp_path)
        assert out == {"name": variant, "module": "hpoflow.engines.compss.tasks"}


@needs_binding
def test_the_real_binding_registers_each_elastic_size_as_its_own_task(tmp_path: Path) -> None:
    out = _run(f"from tests.engines.test_compss_binding import drive_elastic; drive_elastic({str(tmp_path)!r})",
               tmp_path)
    regs = [args for n, args in out["calls"] if n == "register_core_element"]
    tasks = [args for n, args in out["calls"] if n == "process_task"]
    base, grown = "hpoflow.engines.compss.tasks.trial_cpu", "hpoflow.engines.compss.tasks.trial_cpu__1n2u0g"
    assert [(r[0], r[2]) for r in regs] == [(base, "computing_units:1;"), (grown, "computing_units:2;")]
    assert [t[1] for t in tasks] == [base, grown]
    groups = [args[0] for n, args in out["calls"] if n == "open_task_group"]
    assert groups == ["trial-0", "trial-0.s1"]


@needs_binding
def test_a_worker_finds_an_elastic_size_task_by_name(tmp_path: Path) -> None:
    out = _run("from tests.engines.test_compss_binding import drive_worker; drive_worker('trial_cpu__1n2u0g')",
               tmp_path)
    assert out == {"name": "trial_cpu__1n2u0g", "module": "hpoflow.engines.compss.tasks"}


@needs_binding
def test_the_real_binding_submits_a_given_back_placement_again_as_the_same_task(tmp_path: Path) -> None:
    out = _run(f"from tests.engines.test_compss_binding import drive_placement; drive_placement({str(tmp_path)!r})",
               tmp_path)
    calls, first = out["calls"], out["first"]
    assert out["given_back"]["infrastructure"] == "repeated_host"
    assert out["events"] == [] and out["running"] == [0]  # no result reached the driver: the trial runs on
    names = [c[0] for c in calls]
    assert names.count("register_core_element") == 1  # registered once, with the study's shape
    tasks = [args for n, args in calls if n == "process_task"]
    signature = "hpoflow.engines.compss.tasks.trial_multinode_cpu"
    assert [t[1] for t in tasks] == [signature, signature] and [t[5] for t in tasks] == [2, 2]
    assert names[:first].count("process_task") == 1  # the second call came from the engine's poll
    groups = [args[0] for n, args in calls if n == "open_task_group"]
    assert groups == ["trial-0", "trial-0.p1"]
