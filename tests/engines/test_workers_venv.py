"""torch from outside the interpreter's prefix, as on a cluster (``module load``, ``PYTHONPATH``, a
``.pth`` file): a venv built here whose packages are this interpreter's site-packages linked into a
directory outside both prefixes. Workers must keep torch loaded from trial to trial (a second import
of it crashed the second trial and killed the third).

The packages are an overlay mount of site-packages (nothing copied or linked; a symlink would resolve
back into the prefix), or hard links where mounting is refused; where neither can be made, or no venv,
the tests skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

RUN3 = '''
import json, sys
from pathlib import Path
from hpoflow.engines import TrialRequest, TrialResult
from hpoflow.engines.local import LocalEngine, prestart
from hpoflow.spec import TrainConfig

code, out = sys.argv[1], Path(sys.argv[2])
train = TrainConfig(function="torchfns:use_torch").model_dump(mode="json")


def three(engine, kind):
    statuses = []
    for n in range(3):
        engine.submit(TrialRequest(n, {}, train, "loss", "minimize", str(out / kind / str(n)), python_path=(code,)))
        res = None
        while res is None:
            res = next((e for e in engine.poll(1.0) if isinstance(e, TrialResult)), None)
        statuses.append([res.status, res.error])
    return statuses


def main():
    prestart(light=1)
    light = LocalEngine(cores=[0], prestart=False)  # a light worker (spawned; no torch until a trial imports it)
    try:
        result = {"light": three(light, "light")}
    finally:
        light.close()
    warm = LocalEngine(cores=[0])  # a warm worker (forked from the forkserver, which preloaded torch)
    warm.wait_warm()
    try:
        result["warm"] = three(warm, "warm")
    finally:
        warm.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
'''

TORCHFNS = '''
import os
import sys


def use_torch(ctx):
    import torch
    import torch.distributions  # a submodule no worker preloads: imported during the trial
    import torch.nn.functional as F
    from torch import nn

    m = nn.Linear(4, 1)
    loss = F.mse_loss(m(torch.randn(8, 4)), torch.zeros(8, 1))
    loss.backward()
    torch.distributions.Normal(0.0, 1.0).sample()
    (ctx.trial_dir / "torch_file.txt").write_text(torch.__file__ + "\\n" + sys.prefix)
    return {"loss": float(loss)}
'''


def _mount_overlay(site: Path, root: Path, pkgs: Path) -> bool:
    """``site`` seen at ``pkgs`` through an overlay mount (its changes, the .pth files hidden below, go to
    ``root/upper``); False where mounting is refused (not root, no overlayfs)."""
    for d in ("upper", "work"):
        (root / d).mkdir()
    pkgs.mkdir()
    options = f"lowerdir={site},upperdir={root / 'upper'},workdir={root / 'work'}"
    try:
        mounted = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(pkgs)],
                                 capture_output=True, timeout=60).returncode == 0
    except OSError:  # no mount program
        mounted = False
    if not mounted:
        pkgs.rmdir()  # (cp -al makes it)
    return mounted


@pytest.fixture(scope="module")
def outside_packages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(a venv's python without any package of its own, a directory holding this interpreter's
    site-packages): torch reached from it lies outside both the venv and its base. The directory is an
    overlay mount of site-packages, unmounted afterwards at once; where mounting is refused, hard links
    (``cp -al``: 83,000 of them here, which took ~30 s of the disk's time to delete again)."""
    root = tmp_path_factory.mktemp("cluster-like")
    site = Path(sysconfig.get_paths()["purelib"])
    pkgs = root / "pkgs"
    mounted = _mount_overlay(site, root, pkgs)
    try:
        if not mounted:
            linked = subprocess.run(["cp", "-al", str(site), str(pkgs)], capture_output=True, text=True)
            if linked.returncode != 0:
                pytest.skip(f"cannot hard-link {site} into {root}: {linked.stderr.strip()}")
        for pth in pkgs.glob("*.pth"):  # only the venv's own .pth (below) is processed (overlay: hidden, not deleted)
            pth.unlink()
        made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")],
                              capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"cannot make a venv here: {made.stderr.strip()}")
        python = root / "venv" / "bin" / "python"
        probe = subprocess.run([str(python), "-c", "import sys; print(sys.prefix, sys.base_prefix)"],
                               capture_output=True, text=True,
                               env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        if probe.returncode != 0:
            pytest.skip(f"the venv's python does not start: {probe.stderr.strip()}")
        yield python, pkgs
    finally:
        if mounted and subprocess.run(["umount", str(pkgs)], capture_output=True, timeout=60).returncode != 0:
            subprocess.run(["umount", "-l", str(pkgs)], capture_output=True, timeout=60)
        if not os.path.ismount(pkgs):  # (never delete through a mount: the files are site-packages' own)
            shutil.rmtree(root, ignore_errors=True)


def _env(how: str, python: Path, pkgs: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if how == "PYTHONPATH":
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{pkgs}"
    else:  # a .pth file in the venv's own site-packages, as `module load` setups and conda envs do
        venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, env=env, check=True).stdout.strip()
        Path(venv_site, "cluster-modules.pth").write_text(f"{ROOT}\n{pkgs}\n")
    return env


@pytest.mark.parametrize("how", ["PYTHONPATH", "pth"])
def test_three_torch_trials_in_a_row_on_a_warm_and_a_light_worker(tmp_path: Path, how: str,
                                                                  outside_packages: tuple[Path, Path]) -> None:
    python, pkgs = outside_packages
    env = _env(how, python, pkgs)
    code = tmp_path / "code"
    code.mkdir()
    (code / "torchfns.py").write_text(TORCHFNS)
    (tmp_path / "run3.py").write_text(RUN3)
    p = subprocess.run([str(python), str(tmp_path / "run3.py"), str(code), str(tmp_path / "out")], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result == {"light": [["complete", None]] * 3, "warm": [["complete", None]] * 3}, p.stderr[-3000:]
    torch_file, prefix = (tmp_path / "out" / "warm" / "2" / "torch_file.txt").read_text().splitlines()
    assert torch_file.startswith(str(pkgs)) and not torch_file.startswith(prefix)  # torch outside the prefix
    assert not torch_file.startswith(sys.base_prefix)


@pytest.mark.parametrize("tests", ["tests/engines/test_local.py", "tests/engines/test_workers.py"])
def test_a_slice_of_the_suite_passes_with_packages_from_outside_the_prefix(outside_packages: tuple[Path, Path],
                                                                          tests: str) -> None:
    """The local engine's own tests (state isolation between trials, light workers importing torch,
    failures, timeouts, cancel) with every package reached through PYTHONPATH; one file per test, so
    neither runs for a minute on a loaded machine."""
    python, pkgs = outside_packages
    env = _env("PYTHONPATH", python, pkgs)
    # one process, as the slice ran before pytest-xdist: no addopts of the project's (-n auto)
    p = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "not slow",
                        tests], capture_output=True, text=True, env=env, cwd=ROOT, timeout=290)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and "failed" not in p.stdout
