"""``hpoflow launch --engine compss`` checks what COMPSs will do with the job before anything is written,
printed or submitted (docs/cluster.md, B2):

- a batch job: the site config ``enqueue_compss`` reads (``--sc-cfg``, else ``default.cfg`` under
  ``COMPSS_HOME``) must be written for SLURM on a SLURM login node, and must keep ``--account`` and
  ``--qos`` (refused with the variable to set or the ``--sc-cfg`` to pass); its default cores and GPUs
  per node reach the workflow;
- ``runcompss`` here (``--local``): a trial's shape must fit the workers of the resources XML it uses.

Stand-in COMPSs installations and site configs are written per test, in the forms COMPSs 3.3's own
configs use (``QUEUE_SYSTEM="lsf" #from queues/``, ``ENABLE_PROJECT_NAME="true"``, ``DISABLE_QARG_QOS=true``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpoflow.cli.main import main
from hpoflow.engines.compss.launch.batch import check_site, read_site_config
from hpoflow.engines.compss.launch.runtime_xml import NodeConfig, read_resources, resources_xml, to_text
from tests.engines._fakes import ROOT

DIGITS = ROOT / "examples" / "digits.yaml"
WORKFLOW = str(ROOT / "workflows" / "hpo.py")

# the lines that matter, as COMPSs 3.3 ships them
DEFAULT_CFG = '''# Generic configuration
QUEUE_SYSTEM="lsf" #from queues/
DEFAULT_CPUS_PER_NODE=32
DEFAULT_GPUS_PER_NODE=0
DISABLE_QARG_QOS=true
'''
MN_CFG = 'QUEUE_SYSTEM="slurm" #from queues/\nDEFAULT_CPUS_PER_NODE=48\nDEFAULT_GPUS_PER_NODE=0\n' \
    'DISABLE_QARG_QOS=false\n'
DARDEL_CFG = 'QUEUE_SYSTEM="slurm" #from queues/\nDEFAULT_CPUS_PER_NODE=128\nDISABLE_QARG_QOS=false\n' \
    'ENABLE_PROJECT_NAME="true"\n'


@pytest.fixture
def compss_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in COMPSs installation (COMPSS_HOME) with default.cfg, mn.cfg and dardel.cfg, on a SLURM
    login node: an ``sbatch`` first on PATH, not inside a job."""
    home = tmp_path / "COMPSs"
    cfgs = home / "Runtime" / "scripts" / "queues" / "supercomputers"
    cfgs.mkdir(parents=True)
    for name, text in (("default", DEFAULT_CFG), ("mn", MN_CFG), ("dardel", DARDEL_CFG)):
        (cfgs / f"{name}.cfg").write_text(text)
    bin_dir = tmp_path / "login-bin"
    bin_dir.mkdir()
    for name in ("sbatch", "enqueue_compss"):  # never run: a refused launch submits nothing
        exe = bin_dir / name
        exe.write_text(f"#!/bin/sh\ntouch {tmp_path}/{name}-ran\n")
        exe.chmod(0o755)
    monkeypatch.setenv("COMPSS_HOME", str(home))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    return home


def _spec(tmp_path: Path, **resources: int) -> Path:
    """examples/digits.yaml with these ``resources``."""
    data = yaml.safe_load(DIGITS.read_text())
    data["resources"].update(resources)
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    return spec


def test_site_configs_are_read_as_the_shell_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "x.cfg"
    path.write_text(DEFAULT_CFG + 'export ENABLE_PROJECT_NAME="true"\nDISABLE_QARG_QOS=false # later wins\n')
    cfg = read_site_config(path)
    assert (cfg.queue_system, cfg.slurm, cfg.project_name_enabled, cfg.qos_disabled) == ("lsf", False, True, False)
    assert cfg.number("DEFAULT_CPUS_PER_NODE") == 32 and cfg.number("NOPE") is None
    path.write_text('QUEUE_SYSTEM="ccc_slurm"\nENABLE_PROJECT_NAME=TRUE\n')  # enqueue_compss tests == "true"
    cfg = read_site_config(path)
    assert cfg.slurm and not cfg.project_name_enabled and not cfg.qos_disabled
    assert read_site_config(tmp_path / "missing.cfg").values == {}


def test_check_site_refuses_what_the_job_would_lose(tmp_path: Path) -> None:
    default, mn, dardel = (tmp_path / n for n in ("default.cfg", "mn.cfg", "dardel.cfg"))
    for path, text in ((default, DEFAULT_CFG), (mn, MN_CFG), (dardel, DARDEL_CFG)):
        path.write_text(text)
    kw: dict[str, Any] = {"sc_cfg": None, "sbatch_here": True, "account": None, "qos": None, "folder": tmp_path}
    err = check_site(read_site_config(default), **kw).error or ""
    assert "sets QUEUE_SYSTEM='lsf', but this is a SLURM login node" in err
    assert "Fix: pass --sc-cfg with your site's SLURM config (there: dardel, mn)" in err
    assert 'QUEUE_SYSTEM="slurm"' in err
    assert check_site(read_site_config(default), **{**kw, "sbatch_here": False}).error is None  # an LSF site
    err = check_site(read_site_config(mn), **{**kw, "account": "bsc99"}).error or ""
    assert err.startswith("--account bsc99 would be dropped") and "ENABLE_PROJECT_NAME=true" in err
    err = check_site(read_site_config(dardel), **kw).error or ""
    assert "ENABLE_PROJECT_NAME=true" in err and "Fix: pass --account NAME" in err
    assert check_site(read_site_config(dardel), **{**kw, "account": "p1", "qos": "debug"}).error is None
    err = check_site(read_site_config(default), **{**kw, "sbatch_here": False, "qos": "debug"}).error or ""
    assert err.startswith("--qos debug would be dropped") and "DISABLE_QARG_QOS=false" in err
    # no config found: a name that is not there is refused where COMPSs is; elsewhere only a warning
    err = check_site(None, **{**kw, "sc_cfg": "mn5"}).error or ""
    assert "no mn5.cfg in" in err and "dardel, default, mn" in err
    found = check_site(None, **{**kw, "folder": None, "qos": "debug"})
    assert found.error is None and "whether --qos will be kept" in found.warnings[0]
    assert not check_site(None, **{**kw, "folder": None, "sbatch_here": False}).warnings


@pytest.mark.usefixtures("compss_home")
def test_launch_refuses_an_lsf_job_on_a_slurm_login_node_before_anything_is_submitted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    for dry in ([], ["--dry-run"]):
        assert main(["launch", str(_spec(tmp_path)), "--nodes", "3", "--run-dir", str(run_dir), *dry]) == 2
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert not out and len(lines) == 1 and "Traceback" not in err, err
        assert "default.cfg sets QUEUE_SYSTEM='lsf', but this is a SLURM login node" in lines[0]
        assert "--sc-cfg with your site's SLURM config (there: dardel, mn)" in lines[0]
    assert not run_dir.exists() and not (tmp_path / "enqueue_compss-ran").exists()


@pytest.mark.usefixtures("compss_home")
def test_launch_refuses_an_account_the_site_config_would_drop(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    spec = str(_spec(tmp_path))
    assert main(["launch", spec, "--nodes", "3", "--sc-cfg", "mn", "--account", "bsc99", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--account bsc99 would be dropped" in err and "ENABLE_PROJECT_NAME=true" in err
    assert main(["launch", spec, "--nodes", "3", "--sc-cfg", "dardel", "--dry-run"]) == 2  # it needs one
    assert "Fix: pass --account NAME" in capsys.readouterr().err
    assert main(["launch", spec, "--nodes", "3", "--sc-cfg", "dardel", "--account", "bsc99", "--qos", "debug",
                 "--time", "30", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "--sc_cfg=dardel" in out and "--project_name=bsc99" in out and "--qos=debug" in out and not err
    # the site's default cores per node reach the workflow (for elastic growth and whole-worker nodes)
    assert out.strip().endswith("--cpus-per-node 128")
    assert main(["launch", spec, "--nodes", "3", "--sc-cfg", "mn", "--cpus-per-node", "40", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--cpus_per_node=40" in out and out.strip().endswith("--cpus-per-node 40 --gpus-per-node 0")


def test_launch_says_once_what_it_cannot_check_without_compss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("COMPSS_HOME", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no enqueue_compss: no site config to read
    spec = _spec(tmp_path, processes=4, nodes=2)
    assert main(["launch", str(spec), "--nodes", "3", "--account", "p", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    warnings = [ln for ln in err.splitlines() if "warning" in ln]
    assert any("whether --account will be kept cannot be checked" in w for w in warnings), err
    # a multi-node trial on workers of unknown size: COMPSs may put two of its nodes on one host
    assert any("Fix: --cpus-per-node C" in w for w in warnings), err
    assert "--cpus-per-node" not in out


def test_launch_refuses_a_spec_that_disagrees_with_the_workers(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    data = yaml.safe_load(DIGITS.read_text())
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({**data, "engine": "compss", "compss": {"cpus_per_node": 64}}, sort_keys=False))
    assert main(["launch", str(spec), "--nodes", "3", "--cpus-per-node", "48", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "compss.cpus_per_node is 64 in the spec, but the batch job's workers get 48" in err


def test_launch_local_refuses_a_trial_no_worker_here_can_hold(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """2 nodes x 2 GPUs per trial: this machine (and a --generate-resources XML of it) is one node."""
    spec = _spec(tmp_path, processes=4, nodes=2, gpus_per_process=1)
    xml = tmp_path / "cfg" / "resources.xml"
    for extra in ([], ["--generate-resources", str(xml)]):
        assert main(["launch", str(spec), "--local", "--run-dir", str(tmp_path / "run"), *extra]) == 2
        out, err = capsys.readouterr()
        assert not out and len(err.strip().splitlines()) == 1, err
        assert "a trial needs 2 worker node(s) of 2 computing units and 2 GPU(s) each, but this machine has 0" in err
        assert "so COMPSs would never place its task. Fix:" in err
    assert not xml.exists() and not (tmp_path / "run").exists()


def test_launch_local_checks_the_resources_xml_it_is_given(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hpoflow.engines.compss.launch.command.slurm_detected", lambda *a, **k: False)
    spec = _spec(tmp_path, processes=4, nodes=2, gpus_per_process=1)
    xml = tmp_path / "resources.xml"
    xml.write_text(to_text(resources_xml([NodeConfig("a", cpus=8, gpus=2), NodeConfig("b", cpus=8, gpus=1)])))
    assert [(n.name, n.cpus, n.gpus) for n in read_resources(xml)] == [("a", 8, 2), ("b", 8, 1)]
    assert main(["launch", str(spec), "--resources-xml", str(xml), "--dry-run"]) == 2
    assert f"but --resources-xml {xml} has 1 that can hold it (a (8 computing units, 2 GPU(s)); b (8" in \
        capsys.readouterr().err
    xml.write_text(to_text(resources_xml([NodeConfig("a", cpus=8, gpus=2), NodeConfig("b", cpus=8, gpus=2)])))
    assert main(["launch", str(spec), "--resources-xml", str(xml), "--dry-run"]) == 0
    assert f"--resources={xml}" in capsys.readouterr().out
    xml.write_text("<Project/>")
    assert main(["launch", str(spec), "--resources-xml", str(xml), "--dry-run"]) == 2
    assert "is not a COMPSs resources.xml" in capsys.readouterr().err


def test_launch_local_checks_compss_default_resources_without_an_xml(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """runcompss without --resources uses COMPSs's default_resources.xml (4 computing units in 3.3): a
    trial of 8 cores is refused there even on a machine of 64."""
    home = tmp_path / "COMPSs"
    default = home / "Runtime" / "configuration" / "xml" / "resources" / "default_resources.xml"
    default.parent.mkdir(parents=True)
    default.write_text(to_text(resources_xml([NodeConfig("localhost", cpus=4)])))
    monkeypatch.setenv("COMPSS_HOME", str(home))
    monkeypatch.setattr("hpoflow.engines.compss.launch.runtime_xml.detect_node",
                        lambda **kw: NodeConfig("localhost", cpus=64, gpus=0, memory_gb=256))
    spec = _spec(tmp_path, processes=2, cpus_per_process=4)
    assert main(["launch", str(spec), "--local", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"COMPSs's default resources.xml ({default}" in err and "has 0 that can hold it" in err
    assert "Fix: --generate-resources FILE (this machine: 64 cores, 0 GPUs)" in err
    out_xml = tmp_path / "gen" / "resources.xml"
    assert main(["launch", str(spec), "--local", "--generate-resources", str(out_xml), "--dry-run"]) == 0
    assert json.dumps(str(out_xml))[1:-1] in capsys.readouterr().out
