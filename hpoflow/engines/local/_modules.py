"""Which modules a local worker unloads after a trial, so the next trial imports the user's code
afresh (its module globals start anew) while libraries stay loaded.

Unloaded: the modules the trial imported (absent from ``sys.modules`` before it) whose file lies
under the trial's own code (``code_roots``): its ``python_path`` directories (the spec's directory and
the current one) and the package of its ``training.function`` (the module itself for a top-level
one). Where a file lies under several roots, the deepest decides: a library directory inside the
project (a ``.venv``, a ``--target`` directory on ``PYTHONPATH``) stays a library.

Never unloaded: hpoflow; anything under the interpreter's prefixes and site directories, under the
worker's other ``sys.path`` entries (``PYTHONPATH``, ``.pth`` files, the user site: how torch arrives
from an HPC module), or under a ``site-packages``/``dist-packages`` directory; an extension module
(``.so``/``.pyd``) and every module of a top-level package that has one (torch, numpy: their Python
modules register state in their C parts once, and a second import crashes the process). Such a
package of the user's stays loaded too: its globals carry over from trial to trial.

What a trial imported is what ``sys.modules`` (a dict: insertion-ordered) holds after a marker entry
that ``start_trial`` puts at its end, read backwards up to that marker. A worker never iterates all
of ``sys.modules``: in a worker forked from the forkserver, that would write to the reference count of
each of ~3,000 module names and make ~7 MB of the shared preload private to every worker.
"""

from __future__ import annotations

import importlib.machinery
import os
import site
import stat
import sys
import sysconfig
import tempfile
from collections.abc import Iterable
from types import ModuleType

__all__ = ["ModuleKeeper", "cache_bytecode"]

_HPOFLOW_DIR = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", ".."))
_EXTENSIONS = (*importlib.machinery.EXTENSION_SUFFIXES, ".so", ".pyd")
_LIBRARY_PARTS = ("site-packages", "dist-packages")


def cache_bytecode(base: str | None = None) -> str | None:
    """Where writing bytecode is off (``PYTHONDONTWRITEBYTECODE``, as many container images set it), each
    trial's fresh import of the user's modules compiled their source anew (~1 ms for a 70-line module, far
    more for a training script). This worker writes and reads bytecode in a cache of this user's instead
    (``sys.pycache_prefix``, under ``base``: the temporary directory), never beside the user's code, as
    with the variable set. The cache is used only where it is this user's alone (a directory, not a link,
    owned by this user, mode 0700): another user's could hold planted bytecode. Returns it, or None (left
    as it was: bytecode written as the environment says, or an interpreter's prefix already set)."""
    if not sys.dont_write_bytecode or sys.pycache_prefix is not None or not hasattr(os, "getuid"):
        return None
    path = os.path.join(base or tempfile.gettempdir(), f"hpoflow-pycache-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    sys.pycache_prefix = path
    sys.dont_write_bytecode = False
    return path


def _location(module: ModuleType | None) -> str | None:
    """The real path of a module's file, or of a namespace package's first directory; None for
    built-in, frozen and synthetic modules."""
    if module is None:
        return None
    f = getattr(module, "__file__", None)
    if not f:
        path = getattr(module, "__path__", None)
        try:
            f = next(iter(path)) if path is not None else None
        except (StopIteration, TypeError):
            f = None
    return os.path.realpath(f) if isinstance(f, str) and f else None


def _is_extension(module: ModuleType | None) -> bool:
    f = getattr(module, "__file__", None)
    return isinstance(f, str) and f.endswith(_EXTENSIONS)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _interpreter_dirs() -> set[str]:
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
            *sysconfig.get_paths().values()}
    try:
        dirs.update(site.getsitepackages())
    except AttributeError:  # an old virtualenv's site module
        pass
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    if isinstance(user, str):
        dirs.add(user)
    return {os.path.realpath(d) for d in dirs if d}


# What the forkserver preloaded (``note_preloaded``): module names, and the top-level packages among
# them that hold extension modules. Read, never copied, by the workers forked from it: looking at each
# of ~3,000 module objects again in every worker would write to their pages (reference counts) and
# make ~20 MB of the shared preload private to each worker.
_PRELOADED: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())

# The name of the entry that marks where a trial's imports begin in ``sys.modules`` (see the module
# docstring); the forkserver sets it last, so a warm worker finds what it loaded since the preload.
MARK = "_hpoflow_imports_after_here"


def _mark() -> None:
    """Put the marker at the end of ``sys.modules`` (removing it first moves it there)."""
    sys.modules.pop(MARK, None)
    sys.modules[MARK] = ModuleType(MARK)


def _since_mark() -> list[str] | None:
    """The modules added to ``sys.modules`` after the marker, oldest first; None when the marker is
    gone (something cleared it) or ``sys.modules`` kept changing under a thread's imports."""
    for _ in range(3):
        out: list[str] = []
        try:
            for name in reversed(sys.modules):
                if name == MARK:
                    return out[::-1]
                out.append(name)
        except RuntimeError:  # another thread imported meanwhile: read again
            continue
        return None
    return None


def note_preloaded() -> None:
    """Record what is loaded now, in the forkserver before it forks (``_preload``), and mark the end."""
    global _PRELOADED
    names = frozenset(sys.modules)
    _PRELOADED = (names, frozenset(n.partition(".")[0] for n in names if _is_extension(sys.modules.get(n))))
    _mark()


class ModuleKeeper:
    """Built once per worker from its ``sys.path`` before any trial; ``start_trial`` before each
    trial and ``trial_modules`` after it. Tracks the top-level packages that hold extension modules
    as they load."""

    def __init__(self, base_path: Iterable[str]) -> None:
        self.libraries = _interpreter_dirs() | {os.path.realpath(p) for p in base_path if p}
        self._ext_tops: set[str] = set()
        self._seen: set[str] = set()
        since = _since_mark() if _PRELOADED[0] else None
        # a warm worker: what the forkserver noted, and the few modules loaded since; else all
        self._note_extensions(since if since is not None else list(sys.modules))

    def start_trial(self) -> None:
        """Note where the next trial's imports begin."""
        _mark()

    def _note_extensions(self, names: Iterable[str]) -> None:
        pre_names = _PRELOADED[0]
        for name in names:
            if name not in self._seen and name not in pre_names:
                self._seen.add(name)
                if _is_extension(sys.modules.get(name)):
                    self._ext_tops.add(name.partition(".")[0])

    def _extension_top(self, name: str) -> bool:
        top = name.partition(".")[0]
        return top in self._ext_tops or top in _PRELOADED[1]

    def code_roots(self, python_path: Iterable[str], function: str | None) -> set[str]:
        """The trial's own code: its ``python_path`` directories and its function's package."""
        roots = {os.path.realpath(p) for p in python_path if p}
        if function:
            top = sys.modules.get(function.partition(":")[0].partition(".")[0])
            where = _location(top)
            if where is not None:
                roots.add(os.path.dirname(where) if os.path.basename(where).startswith("__init__.") else where)
        return roots

    def trial_modules(self, python_path: Iterable[str], function: str | None) -> list[str]:
        """The modules imported since ``start_trial`` that are the trial's own code; see the module
        docstring. Were the marker cleared, every module loaded since the preload counts as new."""
        since = _since_mark()
        new = since if since is not None else [n for n in list(sys.modules) if n not in _PRELOADED[0]]
        new = [n for n in new if n != MARK]
        self._note_extensions(new)
        code = self.code_roots(python_path, function)
        roots = [(r, True) for r in code] + [(r, False) for r in self.libraries if r not in code]
        out = []
        for name in new:
            module = sys.modules.get(name)
            if self._extension_top(name) or _is_extension(module):
                continue
            where = _location(module)
            if where is None or _under(where, _HPOFLOW_DIR):
                continue
            if any(part in _LIBRARY_PARTS for part in where.split(os.sep)):
                continue
            deepest = max((r for r in roots if _under(where, r[0])), key=lambda r: len(r[0]), default=None)
            if deepest is not None and deepest[1]:
                out.append(name)
        return out
