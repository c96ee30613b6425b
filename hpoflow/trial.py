"""What a trial is, in plain data shared by every layer that handles one.

``TrialRequest`` (what to run, with what resources), ``TrialReport`` (an intermediate metric),
``TrialResult`` (how it ended) and ``Verdict`` (the oracle's judgement before it runs). The driver
builds requests, engines run them, the rank runner reads them, the report reads results back.
Standard library only: JSON- and pickle-able, safe to import in any process.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.machinery
import json
import os
import re
import signal
import site
import sys
import sysconfig
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

__all__ = ["DEFAULT_GPU_RESERVE_MIB", "GPU_RESERVE_ENV", "GPU_SHARE_ENV", "RANK_DIED", "Event", "RankJob",
           "RankOutcome", "RankStatus", "TrialReport", "TrialRequest", "TrialResult", "TrialStatus", "Verdict",
           "aggregate_usage", "clip_error", "describe_exit", "error_cause", "gpu_reserve_mib", "imports_torch",
           "memory_fraction", "needs_torch", "rank_died", "result_from_ranks"]

TrialStatus = Literal["complete", "failed", "pruned", "cancelled"]

GPU_SHARE_ENV = "HPOFLOW_GPU_SHARE"
"""Set by an engine for a rank that shares its GPU with ranks of other trials: the share it may use
(``0.25``; ``hpoflow.engines.gpushare``); the rank caps itself to it (``hpoflow.train.runner``)."""
GPU_RESERVE_ENV = "HPOFLOW_GPU_SHARE_RESERVE_MIB"
"""Device memory (MiB) that each rank sharing a GPU leaves outside its memory cap, for what the cap does
not count (its CUDA context, NCCL's buffers, memory a library takes past torch's allocator): set by the
user in the driver's environment (default ``DEFAULT_GPU_RESERVE_MIB``), passed to the ranks by the engine."""
DEFAULT_GPU_RESERVE_MIB = 512


def gpu_reserve_mib(environ: Mapping[str, str]) -> int:
    """``GPU_RESERVE_ENV`` of ``environ`` (default ``DEFAULT_GPU_RESERVE_MIB``); ``ValueError`` naming the
    rule and the value where it is no whole number >= 0."""
    text = environ.get(GPU_RESERVE_ENV, "").strip()
    if not text:
        return DEFAULT_GPU_RESERVE_MIB
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{GPU_RESERVE_ENV} must be a whole number of MiB >= 0, but got {text!r}. Fix: set it "
                         f"to e.g. {DEFAULT_GPU_RESERVE_MIB} (the default), or unset it")
    return int(text)


def memory_fraction(share: float, total_mib: float, reserve_mib: float) -> float:
    """The part of a GPU of ``total_mib`` that a rank given ``share`` of it may allocate: its share less
    ``reserve_mib`` (what its CUDA context and the allocations no cap counts take), as a fraction of the
    GPU; 0 or less where the share does not hold the reserve."""
    return (total_mib * share - reserve_mib) / total_mib if total_mib > 0 else 0.0


# How one rank ended: ok / pruned / error (an exception, sent by the rank itself), resized (an elastic
# trial left at an epoch boundary, checkpointed, to be restarted by its engine with another number of
# ranks), paused (the engine asked the trial to stop soon, e.g. before a walltime: it stopped at a step
# with a checkpoint, and a rerun resumes from it), or as its engine saw it from outside: lost (the
# process died before it sent an outcome), killed (the engine stopped it: a peer failed, a timeout, a
# cancel).
RankStatus = Literal["ok", "pruned", "error", "resized", "paused", "lost", "killed"]


@dataclass(frozen=True)
class TrialRequest:
    """Everything a trial needs to run, in plain data (JSON- and pickle-able)."""

    number: int
    params: dict[str, Any]
    train: dict[str, Any]  # a resolved TrainConfig as a dict
    metric: str
    direction: str
    trial_dir: str
    processes: int = 1
    cpus_per_process: int = 1
    gpus_per_process: float = 0  # a whole number, or a share 1/k of one GPU (hpoflow.spec.shares_per_gpu)
    nodes: int = 1
    timeout: float | None = None
    attempt: int = 0
    pruning: bool = False  # rank 0 waits for a decision after each report
    python_path: tuple[str, ...] = ()
    seed: int = 0
    # Where the trial's checkpoints live. A trial rerun after a crash or a stop gets the directory
    # of the trial it replaces, so it resumes from that trial's last checkpoint.
    checkpoint_dir: str = ""
    # An elastic trial (``resources.processes: {min, max}``): the numbers of ranks it may run with,
    # ascending; ``processes`` is the number this run of it has. Empty: a fixed-size trial.
    elastic_sizes: tuple[int, ...] = ()
    elastic_policy: str = "longest_remaining"  # a registered hpoflow.registry.ELASTIC policy
    plugins: tuple[str, ...] = ()  # modules that register plug-ins (spec ``plugins:``), imported first
    memory_gb: float = 0.0  # host memory per rank (``resources.memory_gb``); 0: the engine's default share
    # every metric name the study reads (its objectives, its constraints): what a command trial's output
    # is scanned for (hpoflow.train.command); empty: ``metric`` alone
    metric_names: tuple[str, ...] = ()
    workdir: str = ""  # where a command trial's program runs: the driver's working directory ("": the rank's)

    @property
    def checkpoints(self) -> str:
        return self.checkpoint_dir or f"{self.trial_dir}/checkpoints"

    @property
    def elastic(self) -> bool:
        return len(self.elastic_sizes) > 1

    @property
    def base_processes(self) -> int:
        """The number of ranks the trial's training config is written for (an elastic trial's
        smallest size): its global batch is ``batch_size x base_processes x grad_accum_steps`` on any
        number of ranks."""
        return self.elastic_sizes[0] if self.elastic_sizes else self.processes

    @classmethod
    def shape(cls, processes: int, cpus_per_process: int, gpus_per_process: float, nodes: int = 1, *,
              memory_gb: float = 0.0) -> TrialRequest:
        """A request that only describes a trial's resource shape (for capacity and fit checks)."""
        return cls(-1, {}, {}, "", "", "", processes, cpus_per_process, gpus_per_process, nodes, memory_gb=memory_gb)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrialRequest:
        data = json.loads(text)
        data["python_path"] = tuple(data.get("python_path", ()))
        data["elastic_sizes"] = tuple(int(k) for k in data.get("elastic_sizes", ()))
        data["plugins"] = tuple(data.get("plugins", ()))
        data["metric_names"] = tuple(data.get("metric_names", ()))
        return cls(**data)


def needs_torch(function: str | None, processes: int, gpus_per_process: float,
                python_path: tuple[str, ...] | list[str] = (), *, command: bool = False, warm: bool = False) -> bool:
    """Whether a trial's ranks want a worker with torch already imported: the built-in trainer
    (``function`` None), a process group (several ranks), a GPU, or a user function whose code will
    import torch (``imports_torch``: read from its source, never run). Only a single CPU rank of a
    torch-free user function runs on a light worker; if it imports torch after all (by a name no
    source shows), torch is seeded then (``hpoflow.train.runner``), the import is timed as the trial's
    ``cold_start_s``, and the local engine keeps the function on warm workers from then on.
    A ``command`` trial's rank starts the program in a process of its own and touches no GPU: it needs
    torch for the process group its ranks keep, and where the program runs ``warm`` (a Python program
    forked from a process with torch imported: ``hpoflow.train.command``)."""
    if command:
        return processes > 1 or warm
    if function is None or processes > 1 or gpus_per_process > 0:
        return True
    return imports_torch(function, tuple(python_path))


# Libraries that import torch when imported: a user module importing one needs torch as much.
_TORCH_LIBRARIES = frozenset({"torch", "torchvision", "torchaudio", "torchtext", "lightning", "pytorch_lightning",
                              "timm", "transformers", "accelerate", "deepspeed", "torchmetrics", "functorch"})
_SCAN_LIMIT = 300  # source files read at most per function (a huge project: assume it needs torch)


def imports_torch(function: str, python_path: tuple[str, ...] = ()) -> bool:
    """Whether ``function`` (``module:function``) will import torch, read from source: in its own
    module, the imports at module level and in the function's body and in the bodies of the module's
    functions it names (transitively); in every module those import that is the user's own (a source
    file under a ``python_path`` directory or beside the function's module, and not in a
    ``site-packages``/``dist-packages`` directory, nor the interpreter's or the site directories), all
    their imports, transitively (not under ``if TYPE_CHECKING``). Libraries reached otherwise (on
    ``PYTHONPATH``, through a ``.pth`` file: how HPC modules provide them) are not followed. Nothing is
    imported or run: files are found like the import system finds them (``python_path`` first, then
    ``sys.path``) and parsed. A module that cannot be found answers False (the trial reports the import
    error itself)."""
    module, _, attr = function.partition(":")
    return _imports_torch(module, attr, python_path)


@functools.lru_cache(maxsize=256)
def _imports_torch(module: str, attr: str, python_path: tuple[str, ...]) -> bool:
    search = [*python_path, *(p for p in sys.path if p not in python_path)]
    libraries = _library_dirs()
    seen: set[str] = {module}
    entry = _source_of(module, search)
    if entry is None:
        return False
    roots = tuple(os.path.join(os.path.realpath(d), "") for d in (*python_path, os.path.dirname(entry)) if d)
    todo = _imports_of(entry, module, attr)
    while todo:
        name = todo.pop()
        if name.partition(".")[0] in _TORCH_LIBRARIES:
            return True
        if name in seen or name in sys.builtin_module_names:
            continue
        seen.add(name)
        if len(seen) > _SCAN_LIMIT:
            return True
        origin = _source_of(name, search)
        if origin is None or any(origin.startswith(d) for d in libraries):
            continue  # not found, or a library: only torch's own names count there
        if name.partition(".")[0] == "hpoflow":  # a library too, whose modules that import torch say so at the top
            if any(m.partition(".")[0] in _TORCH_LIBRARIES for m in _imports_of(origin, name, "")):
                return True
            continue
        if not _users_own(origin, roots):
            continue  # a library from elsewhere (PYTHONPATH, a .pth file)
        todo.extend(_imports_of(origin, name))
    return False


def _users_own(origin: str, roots: tuple[str, ...]) -> bool:
    """Whether the source file ``origin`` is under one of ``roots`` and not inside a library directory
    there (a project's ``.venv``, a ``--target`` directory)."""
    return any(origin.startswith(r) and not {"site-packages", "dist-packages"} & set(origin[len(r):].split(os.sep))
               for r in roots)


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sysconfig.get_paths().values()}
    dirs.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


def _source_of(name: str, search: list[str]) -> str | None:
    """The real path of module ``name``'s source file, found without importing anything."""
    locations: list[str] | None = search
    spec = None
    parts = name.split(".")
    for i in range(len(parts)):
        try:
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), locations)
        except (ImportError, ValueError, OSError):
            return None
        if spec is None:
            return None
        locations = list(spec.submodule_search_locations or [])
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return os.path.realpath(spec.origin)


def _reached(tree: ast.Module, attr: str) -> list[ast.AST]:
    """The statements of a module that run when ``attr`` runs: the module level (function bodies
    excepted), ``attr``'s body, and the bodies of the module's functions named there, transitively
    (``attr`` empty: the module level only)."""
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    top: list[ast.AST] = []

    def outside_defs(node: ast.AST) -> None:
        top.append(node)
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                outside_defs(child)

    for stmt in tree.body:
        if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            outside_defs(stmt)
    names, todo = {attr}, [attr]
    out = top
    while todo:
        fn = defs.get(todo.pop())
        if fn is None:
            continue
        for node in ast.walk(fn):
            out.append(node)
            if isinstance(node, ast.Name) and node.id in defs and node.id not in names:
                names.add(node.id)
                todo.append(node.id)
    return out


def _imports_of(path: str, name: str, attr: str | None = None) -> list[str]:
    """The absolute names ``path`` (module ``name``) imports, each with its parent packages; with
    ``attr``, only what running the module and that function reaches (``_reached``)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return []
    package = name if os.path.basename(path) == "__init__.py" else name.rpartition(".")[0]
    skip: set[int] = set()
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` blocks import nothing at run time
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out: list[str] = []
    for node in (ast.walk(tree) if attr is None else _reached(tree, attr)):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - node.level + 1] if node.level > 1 else base
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            if mod:
                out.append(mod)
                out.extend(f"{mod}.{a.name}" for a in node.names if a.name != "*")  # may be submodules
    full: list[str] = []
    for m in out:
        pieces = m.split(".")
        full.extend(".".join(pieces[: i + 1]) for i in range(len(pieces)))
    return full


@dataclass(frozen=True)
class RankJob:
    """One rank's share of a ``TrialRequest``: where it sits and how to reach rank 0."""

    request: TrialRequest
    rank: int
    world_size: int
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    threads: int = 1
    pg_timeout_s: float = 120.0
    store_path: str = ""  # a single-host trial's file store (no rendezvous socket); "" for TCP
    announce_path: str = ""  # where rank 0 announces the TCP store it holds (slurm steps of several nodes)


@dataclass(frozen=True)
class TrialReport:
    """An intermediate result: ``metrics`` at ``step`` (an epoch for the built-in trainer)."""

    number: int
    step: int
    metrics: dict[str, float]
    wants_answer: bool = False


@dataclass(frozen=True)
class TrialResult:
    """How a trial ended. ``value`` is the objective metric when ``status == 'complete'``."""

    number: int
    status: TrialStatus
    value: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    stderr_tail: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    retryable: bool = False  # died by a signal, lost rank or timeout (not an exception in user code)
    system: dict[str, float] = field(default_factory=dict)  # usage over its ranks (hpoflow.train.usage)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class RankOutcome:
    """How one rank of a trial ended; the rank runner builds it, engines carry it (pickle or JSON)."""

    status: RankStatus
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    error_type: str | None = None
    retryable: bool = False
    started_at: float | None = None  # wall clock when training began (after the rendezvous)
    run_s: float | None = None  # time in the training function (a cold torch import in it left out)
    # a torch import the user's code paid inside the trial (its module's import or the function): the
    # trial's duration leaves it out
    cold_start_s: float | None = None
    host: str | None = None
    usage: dict[str, float] = field(default_factory=dict)  # CPU, memory, network, disk (hpoflow.train.usage)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankOutcome:
        """From JSON written by a rank; an unknown status is an error outcome saying so."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in data.items() if k in names}
        if kw.get("status") not in get_args(RankStatus):
            kw = {"status": "error", "error": f"unknown rank status {data.get('status')!r}"}
        kw["metrics"] = {str(k): float(v) for k, v in (kw.get("metrics") or {}).items()}
        usage = kw.get("usage")
        kw["usage"] = {str(k): float(v) for k, v in usage.items() if isinstance(v, int | float)} \
            if isinstance(usage, Mapping) else {}
        return cls(**kw)


def result_from_ranks(req: TrialRequest, outcomes: Mapping[int, RankOutcome], *, timings: dict[str, float],
                      failure: str | None = None, retryable: bool = False, cancelled: str | None = None,
                      stderr_tail: Callable[[], str] = str, submitted_wall: float | None = None) -> TrialResult:
    """The one place a trial's ``TrialResult`` is built from its ranks' outcomes, for every engine.

    ``failure``/``cancelled``: what the engine itself saw (a rank died, a timeout, a cancel); else the
    ranks decide: an error outcome fails the trial (a user error beats "a peer went away"), a rank
    without an outcome fails it as retryable, and rank 0's metrics complete it (or it was pruned).
    """
    timings = dict(timings)
    result = _result_from_ranks(req, outcomes, timings, failure, retryable, cancelled, stderr_tail, submitted_wall)
    usage = [o.usage for _, o in sorted(outcomes.items()) if o.usage]
    if not usage:
        return result
    return dataclasses.replace(result, system=aggregate_usage(usage))


def _result_from_ranks(req: TrialRequest, outcomes: Mapping[int, RankOutcome], timings: dict[str, float],
                       failure: str | None, retryable: bool, cancelled: str | None, stderr_tail: Callable[[], str],
                       submitted_wall: float | None) -> TrialResult:
    chief = outcomes.get(0)
    if chief is not None and chief.started_at is not None and submitted_wall is not None:
        timings["launch_s"] = chief.started_at - submitted_wall  # submit -> training starts
        timings["started_at"] = chief.started_at  # wall clock (epoch seconds) when training started
        if chief.run_s is not None:
            timings["run_s"] = chief.run_s
        if chief.cold_start_s is not None:
            timings["cold_start_s"] = chief.cold_start_s
    if outcomes and all(o.status == "paused" for o in outcomes.values()) and len(outcomes) == req.processes:
        # every rank stopped at one step with a checkpoint: interrupted (rerun from it), never failed
        return TrialResult(req.number, "cancelled", error=f"paused ({cancelled or 'asked to stop'}): checkpointed, "
                           "resumes from there", timings=timings)
    if cancelled is not None:
        return TrialResult(req.number, "cancelled", error=cancelled, stderr_tail=stderr_tail(), timings=timings)
    if failure is not None:
        return TrialResult(req.number, "failed", error=failure, stderr_tail=stderr_tail(), timings=timings,
                           retryable=retryable)
    if any(o.status == "resized" for o in outcomes.values()):  # an engine that restarts resizes never gets here
        return TrialResult(req.number, "failed", error="the trial left its process group to be resized, but was "
                           "not restarted (a rank was lost meanwhile, or the engine does not resize trials); it "
                           "resumes from its checkpoint when rerun", stderr_tail=stderr_tail(), timings=timings,
                           retryable=True)
    errors = {r: o for r, o in outcomes.items() if o.status == "error"}
    if errors:
        r, o = min(errors.items(), key=lambda kv: (kv[1].retryable, kv[0]))
        where = f"rank {r}" + (f" on {o.host}" if o.host else "")
        return TrialResult(req.number, "failed", error=f"{where}: {o.error}", stderr_tail=stderr_tail(),
                           timings=timings, retryable=o.retryable)
    missing = [r for r in range(req.processes) if r not in outcomes or outcomes[r].status in ("lost", "killed")]
    if missing or chief is None:
        return TrialResult(req.number, "failed", error=f"rank(s) {missing} ended without a result: a rank was "
                           "killed, ran out of memory or lost its node", stderr_tail=stderr_tail(),
                           timings=timings, retryable=True)
    status: TrialStatus = "pruned" if chief.status == "pruned" else "complete"
    return TrialResult(req.number, status, value=chief.metrics.get(req.metric), metrics=dict(chief.metrics),
                       timings=timings)


RANK_DIED = "before it finished"  # ends the failure of a trial whose rank died (``rank_died``)


def rank_died(rank: int | str, code: int | None) -> str:
    """The failure of a trial whose rank ended without its result (a signal, an exit): ``rank 1 killed
    by SIGKILL before it finished``. Its other ranks then fail in a collective, which it caused."""
    return f"rank {rank} {describe_exit(code)} {RANK_DIED}"


def describe_exit(code: int | None) -> str:
    """A process's exit code in words: ``killed by SIGKILL``, ``exited with code 1``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


# the line that names an exception, as Python prints it last in a traceback: "OSError: [Errno 9] ..."
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Warning|Failure)\b(?::|$)")


def error_cause(text: str) -> str:
    """The line of a program's stderr that says why it failed: the last line naming an exception (a
    traceback's last line; also one printed by a library after its own traceback), else the last non-empty
    line; '' for no text."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            return line
    return lines[-1] if lines else ""


def clip_error(text: str, limit: int = 2000) -> str:
    """``text`` in at most about ``limit`` characters: its first line (what failed) and its end (the cause:
    a traceback's last lines), joined by ``...``; whole where it fits."""
    if len(text) <= limit:
        return text
    head = text.split("\n", 1)[0][: limit // 4]
    return f"{head}\n...\n{text[-(limit - len(head) - 5):]}"


_USAGE_MEAN = ("cpu_percent", "rss_mean_mb", "gpu_util_percent", "cpu_energy_share", "gpu_energy_share")
_USAGE_MAX = ("rss_peak_mb", "gpu_peak_mem_mb")
_USAGE_TOTALS = ("energy_j", "energy_above_idle_j")  # kept only where every rank reported one


def aggregate_usage(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One trial's usage from its ranks': means of rates, means and energy shares, maxima of peaks, sums
    of bytes and joules (and of the idle powers, each rank's of its own devices). ``energy_j`` and
    ``energy_above_idle_j`` only where every rank reported one (``hpoflow.train.energy``: a rank without
    it had a source it could not read, or no idle power, and a partial sum is no total)."""
    ranks = [u for u in per_rank if u]
    if not ranks:
        return {}
    keys = sorted({k for u in ranks for k in u})
    partial = {k for k in _USAGE_TOTALS if not all(k in u for u in ranks)}
    keys = [k for k in keys if k not in partial]
    out: dict[str, float] = {}
    for k in keys:
        vals = [float(u[k]) for u in ranks if k in u]
        if k in _USAGE_MEAN:
            out[k] = round(sum(vals) / len(vals), 3)
        elif k in _USAGE_MAX:
            out[k] = max(vals)
        else:
            out[k] = round(sum(vals), 3)
    return out


Event = TrialReport | TrialResult




_VERDICT_SUMMARY_KEYS = ("step_s", "epoch_s", "time_to_train_s", "throughput", "memory_per_device_bytes",
                         "memory_available_bytes", "bottleneck", "max_batch_per_device", "cluster")


@dataclass(frozen=True)
class Verdict:
    """Whether a trial can run; ``reason`` says why not with the numbers; ``predicted`` holds
    the oracle's prediction (``Prediction.to_dict()``) or is empty when the oracle could not
    judge the trial."""

    feasible: bool
    reason: str
    predicted: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"feasible": self.feasible, "reason": self.reason, "predicted": self.predicted}

    def summary(self) -> dict[str, Any]:
        """The few predicted figures stored with a trial (user attr ``oracle``)."""
        return {k: self.predicted[k] for k in _VERDICT_SUMMARY_KEYS if k in self.predicted}
