"""Fixtures of the compss engine tests (fake launchers on PATH, network namespaces, the task body on the
namespace SLURM cluster)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engines._compss_slurm import task_job
from tests.engines._fakes import (
    ARGV_PRINTER,
    FAKE_ENQUEUE_COMPSS,
    FAKE_RUNCOMPSS,
    FAKE_SRUN,
    FAKE_SSH,
    NetnsPair,
    write_script,
    write_shell,
)
from tests.infra.slurm import SlurmCluster


@pytest.fixture(scope="session")
def compss_task_on_distinct_slurm_hosts(slurm_session_cluster: SlurmCluster) -> tuple[dict[str, Any], Path]:
    """The compss task body of a 2-node ``trainfns:ddp_identical`` trial run once per session in a
    2-node batch job (``tests.engines._compss_slurm.task_job``), ``COMPSS_HOSTNAMES`` as COMPSs sets it:
    the other node first, the executing node last. The attempt's result and the job's directory (the
    trial in ``trials/0``), for the tests that check what that one job did (test_compss_placement.py,
    slurm/test_cluster.py): one batch job of two torch ranks instead of one per test."""
    slurm_session_cluster.ensure_healthy()
    shared = slurm_session_cluster.shared_dir / "compss-task-distinct-hosts"
    return task_job(slurm_session_cluster, shared, "n2,$SLURMD_NODENAME"), shared


@pytest.fixture
def fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory first on PATH holding a fake ``srun`` and ``ssh`` (they log their argv)."""
    bin_dir = tmp_path / "bin"
    write_script(bin_dir, "srun", FAKE_SRUN)
    write_script(bin_dir, "ssh", FAKE_SSH)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_SRUN_LOG", str(tmp_path / "srun.log"))
    monkeypatch.setenv("FAKE_SSH_LOG", str(tmp_path / "ssh.log"))
    return bin_dir


@pytest.fixture
def fake_compss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``runcompss`` and ``enqueue_compss`` first on PATH that re-split arguments as COMPSs does and
    run a printer instead of the application; returns the JSON file the printer writes its argv to."""
    bin_dir = tmp_path / "compss-bin"
    write_shell(bin_dir, "runcompss", FAKE_RUNCOMPSS)
    write_shell(bin_dir, "enqueue_compss", FAKE_ENQUEUE_COMPSS)
    printer = bin_dir / "printer.py"
    printer.write_text(ARGV_PRINTER)
    out = tmp_path / "app-argv.json"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_PY", sys.executable)
    monkeypatch.setenv("FAKE_PRINTER", str(printer))
    monkeypatch.setenv("FAKE_JOB_DIR", str(bin_dir))
    monkeypatch.setenv("FAKE_ARGV_OUT", str(out))
    return out


@pytest.fixture
def netns_pair() -> Iterator[NetnsPair]:
    """Two namespaces joined by a veth pair; skipped when not root or ``ip netns`` is refused."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    pair = NetnsPair(f"{os.getpid() % 100000}")
    try:
        pair.create()
    except Exception as exc:  # no CAP_NET_ADMIN, no ip binary, no veth support
        pair.destroy()
        detail = getattr(exc, "stderr", "") or ""
        pytest.skip(f"cannot create network namespaces here: {exc} {detail}".strip())
    try:
        yield pair
    finally:
        pair.destroy()
