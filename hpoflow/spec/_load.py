"""Turn YAML text or a mapping into a validated ``StudySpec``; every problem becomes an ``Issue``.

Pydantic checks shapes and ranges; this module adds what needs the whole spec at once: conditions
that name other parameters, ``${param}`` placeholders in ``training`` (each checked with the values
its parameter can take), grid spaces that must be finite, and ``module:function`` that must import.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path as FsPath
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import PydanticCustomError

from hpoflow.errors import HpoflowError, Issue, SpecError, did_you_mean
from hpoflow.registry import MODELS
from hpoflow.spec._command import (
    RUN_PLACEHOLDERS,
    command_argv,
    command_placeholders,
    command_problem,
    substitute_command,
)
from hpoflow.spec._models import (
    PLACEHOLDER,
    CategoricalParam,
    FloatParam,
    IntParam,
    Param,
    StudySpec,
    TrainConfig,
    placeholders,
)
from hpoflow.spec._yaml import MAX_BYTES, MAX_DEPTH, Path, load_yaml_with_lines

__all__ = [
    "BUILTIN_MEASURES",
    "BUILTIN_METRICS",
    "env_int",
    "extremes",
    "import_plugins",
    "key_lines",
    "load_spec",
    "placeholders",
    "prepare_spec",
    "resolve_training",
    "search_dirs",
    "spec_from_mapping",
]

BUILTIN_METRICS = ("val_accuracy", "val_loss", "train_loss", "train_accuracy", "val_perplexity")
# the built-in data sets' tasks (hpoflow.train.data): what a model must predict
DATASET_TASKS = {"digits": "classify", "synthetic": "classify", "chars": "next_token"}
# what the built-in trainer measures at the end of a trial: objectives of a multi-objective study
BUILTIN_MEASURES = ("samples_per_s", "step_time_s", "comm_time_s", "comm_fraction", "bytes_per_step")
_MISSING_FIX = {
    ("study",): "add a study: section with name, metric and direction",
    ("search",): "add a search: section with algorithm and n_trials",
}


def _builtin_trainer_problems(spec: StudySpec, train: TrainConfig) -> list[tuple[tuple[Any, ...], str]]:
    """What the built-in trainer cannot run: a model and a data set of different tasks, perplexity of a
    classifier, FSDP's CPU offload in a trial without GPUs."""
    out: list[tuple[tuple[Any, ...], str]] = []
    task = DATASET_TASKS.get(train.dataset, "classify")
    model_task = getattr(MODELS.options_model(train.model), "task", "classify")
    if model_task != task:
        fits = sorted(n for n, t in DATASET_TASKS.items() if t == model_task)
        out.append((("training", "model"),
                    f"model {train.model!r} learns a {model_task} task, but dataset {train.dataset!r} is a {task} "
                    f"task. Fix: use dataset {' or '.join(fits) or '(none built in)'} with it, or another model"))
    names = [spec.study.metric, *(n for n, _ in spec.study.objectives)]
    if "val_perplexity" in names and task != "next_token":
        out.append((("study", "metric"),
                    f"val_perplexity is the perplexity of a next-token (language) model, but dataset "
                    f"{train.dataset!r} is a {task} task. Fix: use val_loss or val_accuracy, or dataset chars"))
    raw = spec.training.get("strategy_options") or {}
    fsdp: Mapping[str, Any] = raw["fsdp"] if isinstance(raw.get("fsdp"), Mapping) else \
        raw if spec.training.get("strategy") == "fsdp" else {}
    if fsdp.get("cpu_offload") is True and spec.resources.gpus_per_process == 0:
        at = ("training", "strategy_options", *(("fsdp",) if "fsdp" in raw else ()), "cpu_offload")
        out.append((at, "cpu_offload: true keeps FSDP's shards in host memory and computes on an accelerator "
                        "(torch 2.13's CPUOffloadPolicy refuses to run without one), but the trial has no GPU "
                        "(resources.gpus_per_process: 0), so its shards are in host memory already. Fix: set "
                        "cpu_offload: false, or give the trial GPUs"))
    return out


def _line_for(loc: tuple[Any, ...], lines: Mapping[Path, int]) -> tuple[str, int | None]:
    """Map a pydantic ``loc`` onto the YAML: drop union tags, find the deepest known line."""
    path: list[str | int] = []
    line = lines.get(())
    for part in loc:
        candidate = (*path, part)
        if candidate in lines:
            path.append(part)
            line = lines[candidate]
        elif isinstance(part, str) and part in ("float", "int", "categorical", "function-after"):
            continue  # a discriminated-union tag, not a key
        else:
            path.append(part)
    return ".".join(str(p) for p in path), line


def _issues_from_validation(
    exc: ValidationError, lines: Mapping[Path, int], source: str, prefix: tuple[Any, ...] = ()
) -> list[Issue]:
    issues = []
    for err in exc.errors(include_url=False):
        loc = (*prefix, *err["loc"])
        kind = err["type"]
        msg = err["msg"]
        ctx = err.get("ctx") or {}
        if kind == "unknown_key":
            loc = (*loc, ctx.get("key", "?"))
        at = ctx.get("at")
        if isinstance(at, str) and at:
            # a model-level check naming the key below it (strategy_options.easgd.tau): point the
            # path and line there, and say the path once
            loc = (*loc, *at.split("."))
            msg = msg.removeprefix(at).lstrip(": ")
        path, line = _line_for(loc, lines)
        if kind == "missing":
            fix = _MISSING_FIX.get(tuple(loc), f"add {loc[-1]}:")
            msg = f"missing required key {loc[-1]!r}. Fix: {fix}"
        elif kind == "literal_error":
            given = err.get("input")
            expected = str((err.get("ctx") or {}).get("expected", ""))
            choices = [c.strip().strip("'") for c in expected.replace(" or ", ",").split(",") if c.strip()]
            msg = f"{given!r} is not allowed; choose one of: {', '.join(choices)}{did_you_mean(str(given), choices)}"
        elif kind == "union_tag_invalid" or kind == "union_tag_not_found":
            msg = "a parameter needs type: float, int or categorical. Fix: add or correct its type"
        elif kind.startswith(("int_", "float_", "bool_", "string_", "dict_", "list_", "model_")):
            msg = f"{msg}, but got {err.get('input')!r}"
        elif kind.startswith("value_error"):
            msg = msg.removeprefix("Value error, ")
        issues.append(Issue(path, msg, line, source))
    return issues


def _substitute(value: Any, params: Mapping[str, Any]) -> Any:
    """Replace placeholders; a placeholder of an inactive (absent) parameter becomes ``_ABSENT``."""
    if isinstance(value, str):
        m = PLACEHOLDER.match(value.strip())
        if m:
            return params.get(m.group(1), _ABSENT)
        return value
    if isinstance(value, dict):
        out = {k: _substitute(v, params) for k, v in value.items()}
        return {k: v for k, v in out.items() if v is not _ABSENT}
    if isinstance(value, list):
        return [_substitute(v, params) for v in value]
    return value


_ABSENT = object()


def resolve_training(training: Mapping[str, Any], params: Mapping[str, Any]) -> TrainConfig:
    """The concrete training config of one trial: placeholders replaced by the trial's values.

    A placeholder whose parameter is inactive (its condition not met) leaves the key unset, so the
    field takes its default. ``command``'s placeholders may sit inside an argument (``--lr=${lr}``):
    ``hpoflow.spec._command.substitute_command``.
    """
    data = dict(training)
    command = data.pop("command", None)
    out = _substitute(data, params)
    if command is not None:
        try:
            out["command"] = substitute_command(command, params)
        except PydanticCustomError:
            out["command"] = command  # the model says what is wrong with it, at its key
    return TrainConfig.model_validate(out)


def extremes(param: Param) -> list[Any]:
    """Values a parameter can take at its extremes: enough to type-check where it is used (and to find the
    smallest trial of a study: ``hpoflow validate``'s check of a GPU share)."""
    if isinstance(param, CategoricalParam):
        return list(param.choices)
    return [param.low, param.high]


def outside(param: Param, value: Any) -> str:
    """Why ``value`` is not a value ``param`` can take ('' if it is)."""
    if isinstance(param, CategoricalParam):
        return "" if any(value == c and type(value) is type(c) for c in param.choices) else \
            f"choose one of {param.choices}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "it must be a number"
    if isinstance(param, IntParam) and not isinstance(value, int):
        return "it must be a whole number"
    if not param.low <= value <= param.high:
        return f"it must lie in [{param.low}, {param.high}]"
    step = param.step
    if step and abs((value - param.low) / step - round((value - param.low) / step)) > 1e-9:
        return f"it must be low + k x step (step {step})"
    return ""


def _semantic_issues(spec: StudySpec, lines: Mapping[Path, int], source: str,
                     search_dirs: tuple[str, ...]) -> list[Issue]:
    issues: list[Issue] = []

    def add(loc: tuple[Any, ...], msg: str) -> None:
        path, line = _line_for(loc, lines)
        issues.append(Issue(path, msg, line, source))

    names = list(spec.space)
    for i, point in enumerate(spec.search.enqueue):
        for key, value in point.items():
            at = ("search", "enqueue", i, key)
            if key not in spec.space:
                add(at, f"unknown parameter {key!r}{did_you_mean(key, names)}; parameters: {', '.join(names)}")
            elif why := outside(spec.space[key], value):
                add(at, f"{value!r} is not a value of parameter {key!r}: {why}. Fix: use a value the space can "
                        "suggest")
    # Conditions: refer to a parameter defined earlier, with values it can take.
    for i, (name, param) in enumerate(spec.space.items()):
        for parent, values in (param.when or {}).items():
            if parent not in spec.space:
                add(("space", name, "when", parent),
                    f"condition refers to unknown parameter {parent!r}{did_you_mean(parent, names)}; "
                    f"parameters: {', '.join(names)}")
                continue
            if names.index(parent) >= i:
                add(("space", name, "when", parent),
                    f"condition parameter {parent!r} must be defined before {name!r}. Fix: move {name!r} below it")
                continue
            pp = spec.space[parent]
            if isinstance(pp, CategoricalParam):
                bad = [v for v in values if v not in pp.choices]
                if bad:
                    add(("space", name, "when", parent),
                        f"value(s) {bad!r} are not among {parent!r}'s choices {pp.choices!r}")
    # Placeholders: every ${name} is a parameter and its values fit the field.
    used: dict[str, list[tuple[str | int, ...]]] = {}
    for reserved in RUN_PLACEHOLDERS:
        if reserved in spec.space:
            add(("space", reserved), f"${{{reserved}}} is the trial's {reserved.replace('_', ' ')} where the trial "
                f"runs, not a parameter. Fix: give the parameter another name")
    for path, pname in _training_placeholders(spec.training):
        if pname in RUN_PLACEHOLDERS:
            continue  # replaced where the trial runs (hpoflow.spec._command.run_values)
        if pname not in spec.space:
            add(("training", *path),
                f"${{{pname}}} refers to no search parameter{did_you_mean(pname, names)}; "
                f"parameters: {', '.join(names) or '(none)'}")
            continue
        used.setdefault(pname, []).append(path)
    if not any(i.path.startswith("training") for i in issues):
        base: dict[str, Any] = {n: extremes(p)[0] for n, p in spec.space.items()}
        try:
            resolve_training(spec.training, base)
        except ValidationError as exc:
            where = {".".join(str(x) for x in ("training", *path)): n
                     for path, n in _training_placeholders(spec.training) if n not in RUN_PLACEHOLDERS}
            for issue in _issues_from_validation(exc, lines, source, ("training",)):
                found = where.get(issue.path)
                if found is not None:
                    issue = Issue(issue.path, f"${{{found}}} can be {base[found]!r}: {issue.message}",
                                  issue.line, source)
                issues.append(issue)
        else:
            # The base values fit; now each used parameter's other extreme, one at a time.
            for pname in used:
                for value in extremes(spec.space[pname])[1:]:
                    try:
                        resolve_training(spec.training, {**base, pname: value})
                    except ValidationError as exc:
                        for issue in _issues_from_validation(exc, lines, source, ("training",)):
                            issues.append(Issue(issue.path, f"with {pname}={value!r}: {issue.message}",
                                                issue.line, source))
                        break
    if issues:
        return issues
    train = resolve_training(spec.training, {n: extremes(p)[0] for n, p in spec.space.items()})
    if train.command is not None:
        for loc, msg in _command_problems(spec, train.command):
            add(loc, msg)
    elif train.function:
        problem = _check_function(train.function, search_dirs)
        if problem:
            add(("training", "function"), problem)
    elif spec.study.metric not in BUILTIN_METRICS:
        add(("study", "metric"),
            f"the built-in trainer reports {', '.join(BUILTIN_METRICS)}; {spec.study.metric!r} is none of "
            f"them{did_you_mean(spec.study.metric, BUILTIN_METRICS)}")
    elif any(n not in BUILTIN_METRICS + BUILTIN_MEASURES for n, _ in spec.study.objectives):
        odd = next(n for n, _ in spec.study.objectives if n not in BUILTIN_METRICS + BUILTIN_MEASURES)
        known = BUILTIN_METRICS + BUILTIN_MEASURES
        add(("study", "metrics"), f"the built-in trainer reports {', '.join(known)}; {odd!r} is none of them"
                                  f"{did_you_mean(odd, known)}")
    elif train.model not in MODELS:
        add(("training", "model"), f"{MODELS.unknown(train.model)}; or give training.function: 'module:function'")
    else:
        for loc, msg in _builtin_trainer_problems(spec, train):
            add(loc, msg)
    # Grid: finite space.
    if spec.search.algorithm == "grid":
        for name, param in spec.space.items():
            if isinstance(param, FloatParam) and param.step is None:
                add(("space", name),
                    "grid search needs a finite set of values; a float parameter needs step. "
                    "Fix: add step: 0.1, or make it categorical")
            if isinstance(param, IntParam) and param.log:
                add(("space", name), "grid search cannot enumerate a log-scaled int. Fix: use choices")
    if not spec.space:
        add(("space",), "the search space is empty. Fix: add at least one parameter under space:")
    return issues


def _training_placeholders(training: Mapping[str, Any]) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """``placeholders`` of the training section, with ``command``'s found inside its arguments too
    (``--lr=${lr}``; a command written as one line: the path is ``command``)."""
    for path, name in placeholders({k: v for k, v in training.items() if k != "command"}):
        yield path, name
    raw = training.get("command")
    try:
        argv = command_argv(raw)
    except PydanticCustomError:
        return  # the model says why
    for i, name in command_placeholders(argv or []):
        yield ("command", i) if isinstance(raw, list) else ("command",), name


def _command_problems(spec: StudySpec, argv: list[str]) -> list[tuple[tuple[Any, ...], str]]:
    """What keeps ``training.command`` from running: a program that is not there, an elastic trial (a
    program keeps the ranks it started with), a scheduler without ``training.epochs`` (its rungs and
    intervals count epochs)."""
    out: list[tuple[tuple[Any, ...], str]] = []
    found = command_problem(argv, os.getcwd())
    if found is not None:
        i, msg = found
        out.append((("training", "command", *((i,) if isinstance(spec.training.get("command"), list) else ())), msg))
    if spec.resources.elastic is not None:
        out.append((("resources", "processes"), "a command trial keeps the ranks its program started with, but "
                    "processes is elastic ({min, max}). Fix: write processes: N"))
    if spec.search.scheduler.enabled and "epochs" not in spec.training:
        out.append((("training", "command"), f"search.scheduler {spec.search.scheduler.type} counts epochs (the "
                    "step of each report), and hpoflow ends a command trial after its report of training.epochs, "
                    "which is not set. Fix: set training.epochs to the epochs your program trains"))
    return out


def _top_level_names(source: str) -> set[str] | None:
    """Names a module defines at top level (functions, classes, assignments, imports)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _calls(node: ast.AST, names: set[str]) -> bool:
    """Whether ``node`` contains a call of a function or method named in ``names``."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            fn = sub.func
            if (fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else "") in names:
                return True
    return False


def _runs_study_unguarded(source: str, origin: str) -> bool:
    """Whether ``origin`` is the running main script and calls ``optimize`` (or a function of its own
    that does) at top level, outside an ``if __name__ == "__main__":`` block: a trial process importing
    it would run the study again."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if not isinstance(main_file, str) or os.path.realpath(main_file) != os.path.realpath(origin):
        return False
    body = ast.parse(source).body
    starters = {"optimize"} | {n.name for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                               and _calls(n, {"optimize"})}
    return any(_calls(n, starters) for n in body
               if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
               and not (isinstance(n, ast.If) and "__name__" in ast.unparse(n.test)))


def _check_function(ref: str, search_dirs: tuple[str, ...] = ()) -> str | None:
    """Check ``module:function`` without running the module (the driver must not import the user's
    training code, nor torch with it): the module must be findable and, when its source can be
    read, define the name at top level. The trial imports it for real."""
    module_name, _, attr = ref.partition(":")
    if module_name in ("__main__", "__mp_main__"):
        return (f"{ref!r} names the main script, which trial processes never import. Fix: move {attr}() into a "
                f"module (e.g. train.py next to the spec) and set training.function: 'train:{attr}'")
    saved = list(sys.path)
    sys.path[:0] = [d for d in search_dirs if d not in sys.path]
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        found, why = None, str(exc)
    else:
        why = "no such module"
    finally:
        sys.path[:] = saved
    if found is None:
        return (f"cannot import module {module_name!r} ({why}). Fix: put it next to the spec, in the current "
                "directory, or on PYTHONPATH")
    origin = found.origin
    if not origin or not origin.endswith(".py"):
        return None  # an extension or namespace module: the trial will tell
    try:
        source = FsPath(origin).read_text()
    except OSError:
        return None
    names = _top_level_names(source)
    if names is None:
        return f"module {module_name!r} ({origin}) has a syntax error. Fix: run python {origin} to see it"
    if _runs_study_unguarded(source, origin):
        return (f"module {module_name!r} is the script running this study and calls optimize() outside "
                f"if __name__ == \"__main__\": every trial importing {attr}() from it would start the study "
                f"again. Fix: put that call under if __name__ == \"__main__\":, or move {attr}() into its own module")
    if attr not in names:
        public = sorted(n for n in names if not n.startswith("_"))
        return f"module {module_name!r} defines no {attr!r}{did_you_mean(attr, public)}"
    return None


def search_dirs(spec_path: str | os.PathLike[str] | None = None) -> tuple[str, ...]:
    """Where ``training.function`` modules are looked up: the spec's directory, then the current one."""
    dirs = [str(FsPath(spec_path).resolve().parent)] if spec_path is not None else []
    return tuple(dict.fromkeys([*dirs, os.getcwd()]))


def _numbers(value: Any, source: str = "<spec>") -> Iterator[tuple[Path, float]]:
    """Every float in a parsed spec, with its key path; ``SpecError`` for a mapping nested deeper than
    ``MAX_DEPTH`` (a spec built in Python may nest anything, or contain itself). Iterative: no depth
    of input can reach Python's recursion limit here, nor in pydantic after it."""
    stack: list[tuple[Path, Any]] = [((), value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, float):
            yield path, v
        elif isinstance(v, dict | list):
            if len(path) >= MAX_DEPTH:
                raise SpecError([Issue(".".join(str(p) for p in path[:2]), f"the spec nests more than {MAX_DEPTH} "
                                       "levels deep (or contains itself). Fix: flatten it", None, source)])
            items = v.items() if isinstance(v, dict) else enumerate(v)
            stack.extend(reversed([((*path, k), x) for k, x in items]))  # popped in the spec's order


def spec_from_mapping(
    data: Any, lines: Mapping[Path, int] | None = None, source: str = "<spec>",
    dirs: tuple[str, ...] | None = None,
) -> StudySpec:
    """Validate a mapping (parsed YAML or built in Python) into a ``StudySpec``. ``dirs``: where
    ``training.function`` modules are looked up (default: the current directory)."""
    lines = lines or {}
    if not isinstance(data, dict):
        raise SpecError([Issue("", f"a study spec is a mapping of sections, but got {type(data).__name__}. "
                               "Fix: start with study:, space:, search:, training:", 1, source)])
    bad = [(path, v) for path, v in _numbers(data, source) if not math.isfinite(v)]
    if bad:
        raise SpecError([Issue(".".join(str(k) for k in path), f"must be a finite number, but got {v!r} (YAML "
                               "reads numbers beyond 1.8e308 as infinity). Fix: write a finite value",
                               lines.get(path), source) for path, v in bad[:5]])
    dirs = dirs if dirs is not None else search_dirs()
    plugins = data.get("plugins")
    if isinstance(plugins, list) and all(isinstance(p, str) for p in plugins):  # else the model says why
        failed = import_plugins(plugins, dirs)
        if failed:
            raise SpecError([Issue(f"plugins.{i}", msg, lines.get(("plugins", i)), source) for i, msg in failed])
    try:
        spec = StudySpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_issues_from_validation(exc, lines, source)) from None
    issues = _semantic_issues(spec, lines, source, dirs)
    if issues:
        raise SpecError(issues)
    return spec


def load_spec(path: str | os.PathLike[str]) -> tuple[StudySpec, str]:
    """Read and validate a YAML spec file; return the spec and the text as given."""
    p = FsPath(path)
    text = read_spec_text(p)
    data, lines = load_yaml_with_lines(text, str(p))
    return spec_from_mapping(data, lines, str(p), search_dirs(p)), text


def key_lines(text: str) -> dict[Path, int]:
    """Key path -> line of a spec's YAML text (``{}`` when it does not parse): for errors found after
    loading, such as ``hpoflow validate``'s checks of the sampler and the engine."""
    try:
        return load_yaml_with_lines(text)[1]
    except SpecError:
        return {}


def read_spec_text(p: FsPath) -> str:
    """The UTF-8 text of a spec file, read boundedly: at most ``MAX_BYTES`` + 1 bytes are ever read,
    whatever the file is (a huge file, ``/dev/zero``, a pipe), so a wrong path costs nothing."""
    try:
        with p.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise SpecError([Issue("", "no such file. Fix: check the path", None, str(p))]) from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SpecError([Issue("", f"cannot read: {why}", None, str(p))]) from None
    if len(raw) > MAX_BYTES:
        raise SpecError([Issue("", f"the file holds more than {MAX_BYTES} bytes; a spec is read up to {MAX_BYTES} "
                               "(a study spec is a few KB). Fix: check that this is the right file", None, str(p))])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise SpecError([Issue("", f"byte {exc.start} (0x{raw[exc.start]:02x}) is not UTF-8: a spec is UTF-8 text. "
                               "Fix: save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or check that this is "
                               "the right file", line, str(p))]) from None


def prepare_spec(spec: StudySpec | Mapping[str, Any] | str | os.PathLike[str]) -> tuple[StudySpec, str]:
    """Accept a spec object, a mapping in the YAML layout, or a YAML path; return the spec and its YAML
    text (as given, or dumped from the object)."""
    if isinstance(spec, StudySpec):
        return spec, yaml.safe_dump(spec.model_dump(mode="json", exclude_defaults=True), sort_keys=False)
    if isinstance(spec, Mapping):
        parsed = spec_from_mapping(dict(spec))
        return parsed, yaml.safe_dump(json.loads(json.dumps(dict(spec))), sort_keys=False)
    return load_spec(spec)


def env_int(name: str, *, minimum: int = 0) -> int | None:
    """The whole number in environment variable ``name`` (ASCII digits only), or None when it is unset
    or empty; ``HpoflowError`` (rule, value, fix) for anything else or a number below ``minimum``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) < minimum:
        raise HpoflowError(f"{name} must be a whole number >= {minimum}, but got {raw!r}. Fix: unset it or set it "
                           f"to e.g. {max(minimum, 2)}")
    return int(raw)


def import_plugins(modules: Sequence[str], dirs: Sequence[str] = ()) -> list[tuple[int, str]]:
    """Import the plug-in modules of ``plugins:`` (each registers its plug-ins when imported), with
    ``dirs`` in front of ``sys.path``; (index, problem) of each that fails, in one line with the fix."""
    for d in reversed(dirs):
        if d not in sys.path:
            sys.path.insert(0, d)
    failed = []
    for i, name in enumerate(modules):
        try:
            importlib.import_module(name)
        except Exception as exc:  # the plug-in's own code failed: said in one line, never a traceback
            why = str(exc).splitlines()[0][:300] if str(exc) else ""
            failed.append((i, f"cannot import plug-in module {name!r}: {type(exc).__name__}: {why}. Fix: check "
                              "the name, and that it is importable from the spec's directory or the current one"))
    return failed
