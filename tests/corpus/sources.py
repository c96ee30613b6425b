"""Where the corpus's programs come from: pinned archives of package registries, fetched with ``pip`` (the
only network a CI machine has), checked against their sha256 and unpacked into a cache outside the
repository; and the few packages they import that hpoflow's environment lacks, installed there too.

Nothing of the programs is kept in the repository. The cache is ``$HPOFLOW_CORPUS_CACHE``, else
``${XDG_CACHE_HOME:-~/.cache}/hpoflow-corpus``::

    src/<name>-<version>/      an archive, unpacked (an sdist's folder, or a wheel's contents)
    site/<group>-<hash>/       a group of runtime packages (``pip install --no-deps --target``)
    standins/<kind>-<version>/ stand-in data made by tests/corpus/standins.py

Every download goes through ``pip`` with ``--require-hashes``, so pip refuses an archive whose sha256 is
not the pinned one; the unpacked tree is checked again by the sha256 of each program's file
(``tests/corpus/programs.py``). Whatever cannot be had (no network, a registry that refuses, a hash that
does not match) raises ``Unavailable`` with the reason, which the tests turn into a skip.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

PIP_TIMEOUT_S = 900  # one pip command (the largest group, datasets' with pyarrow and pandas, is ~60 MB)


class Unavailable(Exception):
    """A program, a package or a stand-in cannot be had here; the message says why."""


def cache_root() -> Path:
    env = os.environ.get("HPOFLOW_CORPUS_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hpoflow-corpus"


@dataclass(frozen=True)
class Archive:
    """One file of a registry: ``name==version`` as pip names it, the file pip fetches, its sha256."""

    name: str
    version: str
    filename: str
    sha256: str

    @property
    def sdist(self) -> bool:
        return self.filename.endswith((".tar.gz", ".zip")) and not self.filename.endswith(".whl")

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"

    @property
    def label(self) -> str:
        return f"PyPI {self.name}=={self.version} ({'sdist' if self.sdist else 'wheel'} {self.filename})"


# The archives the programs are taken from (PyPI; each checked by pip against its sha256).
ARCHIVES: dict[str, Archive] = {
    "opacus": Archive("opacus", "1.6.0", "opacus-1.6.0.tar.gz",
                      "20d77252c1e8528cd5826fbaba345cd39ed5c3edb841707eafb6403fe276140a"),
    "pytorch-ignite": Archive("pytorch-ignite", "0.5.5", "pytorch_ignite-0.5.5.tar.gz",
                              "2c14de75c939a3cc06d2e7de00b1e0a261917ef9bd874dac2e69d789dfa9cc64"),
    "trl": Archive("trl", "1.16.0", "trl-1.16.0-py3-none-any.whl",
                   "c4726e139dd40e1a41661511c639c8a68416782b2e3e8c0befebd77bb7ba0396"),
    # torchvision is a runtime package of the MNIST programs; PyPI has only its CUDA build (see programs.py)
    "torchvision": Archive("torchvision", "0.28.0", "torchvision-0.28.0-cp311-cp311-manylinux_2_28_x86_64.whl",
                           "7e80f543b22503d9415e126db5f0ff3917036925e38560ee6b9ae38c571a4002"),
}

# Runtime packages the programs import that hpoflow's environment (requirements-dev.txt) lacks, by group;
# each group is installed with --no-deps, so it lists every package it needs (resolved against that
# environment: Python 3.11, torch 2.13, transformers 5.24, accelerate 1.15, numpy 2.4).
GROUPS: dict[str, tuple[Archive, ...]] = {
    "opacus": (
        Archive("opt-einsum", "3.4.0", "opt_einsum-3.4.0-py3-none-any.whl",
                "69bb92469f86a1565195ece4ac0323943e83477171b91d24c35afe028a90d7cd"),
    ),
    "gym": (
        Archive("gymnasium", "1.4.0", "gymnasium-1.4.0-py3-none-any.whl",
                "1cb947c59e7c72d8eabb2c2274c00cd20948e69f8452a9ef4092223be24fdf0e"),
        Archive("farama-notifications", "0.0.6", "farama_notifications-0.0.6-py3-none-any.whl",
                "f84839188efa1ce5bb361c2a84881b2dc2c0d0d7fb661ff00421820170930935"),
    ),
    "fire": (
        Archive("fire", "0.7.1", "fire-0.7.1-py3-none-any.whl",
                "e43fd8a5033a9001e7e2973bab96070694b9f12f2e0ecf96d4683971b5ab1882"),
        Archive("termcolor", "3.3.0", "termcolor-3.3.0-py3-none-any.whl",
                "cf642efadaf0a8ebbbf4bc7a31cec2f9b5f21a9f726f4ccbb08192c9c26f43a5"),
    ),
    "datasets": (
        Archive("datasets", "5.2.0", "datasets-5.2.0-py3-none-any.whl",
                "4be9e2882caaf5db13eadc39e93f3da2a995187b99acebac1595bf6c58dfa927"),
        Archive("pandas", "3.1.1", "pandas-3.1.1-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
                "4f1602f614bb83f443381dbcbb94c4ac764b2e50c8d6c965614c5cd83e328c47"),
        Archive("pyarrow", "26.0.1", "pyarrow-26.0.1-cp311-cp311-manylinux_2_28_x86_64.whl",
                "39cb0f2418282c24bea6ceda77b03e5a8f0a5766b63a8bf194d4e2a2c423548c"),
        Archive("dill", "0.4.1", "dill-0.4.1-py3-none-any.whl",
                "1e1ce33e978ae97fcfcff5638477032b801c46c7c65cf717f95fbc2248f79a9d"),
        Archive("multiprocess", "0.70.19", "multiprocess-0.70.19-py311-none-any.whl",
                "928851ae7973aea4ce0eaf330bbdafb2e01398a91518d5c8818802845564f45c"),
        Archive("xxhash", "4.1.0",
                "xxhash-4.1.0-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
                "5e713f5db9e1a8aafac59a45cc1ffce11ca507730f5dc12e212ea7b73d9debde"),
        # pandas needs python-dateutil (which needs six): requirements-dev.txt installs neither, so a fresh venv
        # lacks them (pandas: "Unable to import required dependency dateutil") where a machine with them
        # elsewhere did not
        Archive("python-dateutil", "2.9.0.post0", "python_dateutil-2.9.0.post0-py2.py3-none-any.whl",
                "a8b2bc7bffae282281c8140a97d3aa9c14da0b136dfe83f850eea9a5f7470427"),
        Archive("six", "1.17.0", "six-1.17.0-py2.py3-none-any.whl",
                "4721f391ed90541fddacab5acf947aa0d3dc7d27b2e1e8eda2be8970586c3274"),
    ),
}


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """One process at a time fills one cache entry (pytest-xdist workers, a bench beside a test run)."""
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = (root / f".{name}.lock").open("w")
    except OSError as exc:
        raise Unavailable(f"the corpus cache {root} cannot be written: {exc}") from exc
    with lock as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pip(args: list[str], what: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--no-input", "--retries", "1",
           "--timeout", "30", "--quiet"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise Unavailable(f"pip did not fetch {what} in {PIP_TIMEOUT_S} s") from exc
    if r.returncode != 0:
        lines = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if not ln.startswith("WARNING")]
        raise Unavailable(f"pip could not fetch {what}: {' | '.join(lines[-3:]) or f'exit code {r.returncode}'}")


def _requirements(tmp: Path, archives: tuple[Archive, ...]) -> Path:
    req = tmp / "requirements.txt"
    req.write_text("".join(f"{a.requirement}\n" for a in archives))
    return req


def _unpack(archive_file: Path, dest: Path) -> None:
    if archive_file.name.endswith(".whl") or archive_file.name.endswith(".zip"):
        with zipfile.ZipFile(archive_file) as z:
            z.extractall(dest)
    else:
        with tarfile.open(archive_file) as t:
            t.extractall(dest, filter="data")


def filled(dest: Path, lock: str, build: Callable[[Path], str]) -> Path:
    """The cache entry ``dest``, made once: under the lock ``lock``, ``build`` fills an empty staging folder
    beside it and returns the text of its marker; the staging folder then replaces ``dest`` and the marker
    is written. An entry without its marker (a run killed halfway) is made again."""
    marker = dest / ".hpoflow-corpus-ok"
    if marker.exists():
        return dest
    with locked(lock):
        if not marker.exists():
            staging = dest.with_name(dest.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            text = build(staging)
            if dest.exists():
                shutil.rmtree(dest)
            staging.rename(dest)
            marker.write_text(text + "\n")
    return dest


def source(key: str) -> Path:
    """The unpacked archive ``ARCHIVES[key]``: an sdist's top folder (``opacus-1.6.0/``), or the folder a
    wheel was unpacked into (its packages at the top); fetched and checked on first use."""
    a = ARCHIVES[key]
    dest = filled(cache_root() / "src" / f"{a.name}-{a.version}", f"src-{a.name}", lambda d: _fetch_source(a, d))
    if a.sdist:
        tops = [p for p in dest.iterdir() if p.is_dir()]
        if len(tops) != 1:
            raise Unavailable(f"{a.filename} unpacked to {len(tops)} top folders in {dest}, not one")
        return tops[0]
    return dest


def _fetch_source(a: Archive, dest: Path) -> str:
    """Fetch ``a``, check its sha256 and unpack it into ``dest``; the marker's text (its sha256)."""
    with tempfile.TemporaryDirectory(prefix="hpoflow-corpus-") as t:
        tmp = Path(t)
        binary = ["--no-binary", ":all:"] if a.sdist else ["--only-binary", ":all:"]
        _pip(["download", "--no-deps", *binary, "--require-hashes", "-r", str(_requirements(tmp, (a,))),
              "-d", str(tmp / "dl")], a.label)
        got = tmp / "dl" / a.filename
        if not got.exists():
            found = sorted(p.name for p in (tmp / "dl").iterdir())
            raise Unavailable(f"pip fetched {found} for {a.label}, not {a.filename}")
        digest = sha256_of(got)
        if digest != a.sha256:
            raise Unavailable(f"{a.filename} has sha256 {digest}, not the pinned {a.sha256}")
        _unpack(got, dest)
    return a.sha256


def group(name: str) -> Path:
    """The folder (for ``PYTHONPATH``) holding the runtime packages ``GROUPS[name]``, installed on first use."""
    archives = GROUPS[name]
    tag = hashlib.sha256("".join(a.requirement for a in archives).encode()).hexdigest()[:12]
    what = ", ".join(f"{a.name}=={a.version}" for a in archives)

    def install(staging: Path) -> str:
        with tempfile.TemporaryDirectory(prefix="hpoflow-corpus-") as t:
            _pip(["install", "--no-deps", "--only-binary", ":all:", "--require-hashes", "--no-compile",
                  "--target", str(staging), "-r", str(_requirements(Path(t), archives))], what)
        return what

    return filled(cache_root() / "site" / f"{name}-{tag}", f"site-{name}", install)
