"""runcompss / enqueue_compss commands, the `hpoflow launch` CLI, and the COMPSs XML (generated and shipped)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from hpoflow.cli.main import main
from hpoflow.engines.cluster.jobtime import FLOOR_MINUTES, MARGIN_MINUTES, job_time
from hpoflow.engines.compss.launch.batch import sc_cfg_file
from hpoflow.engines.compss.launch.command import (
    LaunchOptions,
    build_command,
    decode_app_value,
    encode_app_value,
    is_safe,
    slurm_detected,
)
from hpoflow.engines.compss.launch.runtime_xml import (
    NIO_ADAPTOR,
    NodeConfig,
    project_xml,
    resources_xml,
    to_text,
    write_config,
)
from hpoflow.errors import EngineError
from tests.engines._fakes import ROOT

DIGITS = str(ROOT / "examples" / "digits.yaml")


def test_runcompss_command_for_one_machine() -> None:
    o = LaunchOptions(spec="/s.yaml", run_dir="/runs/x", workflow="/repo/workflows/hpo.py", python="/py",
                      pythonpath=("/repo", "/cwd", "/repo"), log_level="debug",
                      project_xml="/c/project.xml", resources_xml="/c/resources.xml")
    assert build_command(o) == [
        "runcompss", "--project=/c/project.xml", "--resources=/c/resources.xml", "--lang=python",
        "--python_interpreter=/py", "--log_level=debug", "--pythonpath=/repo:/cwd",
        "/repo/workflows/hpo.py", "/s.yaml", "--run-dir", "/runs/x",
    ]


def test_enqueue_compss_command_for_a_batch_system() -> None:
    o = LaunchOptions(spec="/s.yaml", run_dir="/runs/x", workflow="/w/hpo.py", batch=True, nodes=5,
                      cpus_per_node=48, gpus_per_node=4, time_minutes=120, qos="debug", queue="acc",
                      account="bsc99", job_name="hpo", python="/py", pythonpath=("/repo",),
                      app_args=("--n-trials", "7"))
    assert build_command(o) == [
        "enqueue_compss", "--job_name=hpo", "--num_nodes=5", "--cpus_per_node=48", "--gpus_per_node=4",
        "--exec_time=120", "--qos=debug", "--queue=acc", "--project_name=bsc99", "--lang=python",
        "--python_interpreter=/py", "--log_level=off", "--pythonpath=/repo",
        "/w/hpo.py", "/s.yaml", "--run-dir", "/runs/x", "--n-trials", "7",
    ]


def test_launch_options_reject_bad_values() -> None:
    with pytest.raises(EngineError, match="log level must be one of off, info"):
        LaunchOptions(spec="s", run_dir="r", workflow="w", log_level="loud")
    with pytest.raises(EngineError, match="nodes must be >= 1"):
        LaunchOptions(spec="s", run_dir="r", workflow="w", nodes=0)
    with pytest.raises(EngineError, match="--sc-cfg configures enqueue_compss"):
        LaunchOptions(spec="s", run_dir="r", workflow="w", sc_cfg="mn5")


NASTY = ["my runs", "it's", 'say "hi"', "$(touch pwned)", "a;b", "`id`", "*", "caf\u00e9", "b64:x", "~x", "a\tb"]


@pytest.mark.parametrize("value", NASTY)
def test_app_values_are_encoded_and_decode_back(value: str) -> None:
    encoded = encode_app_value(f"/data/{value}")
    assert is_safe(encoded) and decode_app_value(encoded) == f"/data/{value}"
    assert encode_app_value("/data/plain-run_1") == "/data/plain-run_1"  # safe values stay readable


@pytest.mark.parametrize("field", ["job_name", "queue", "qos", "account", "sc_cfg", "python", "workflow",
                                   "resources_xml"])
@pytest.mark.parametrize("value", ["my job", "a;b", "$(id)", "x'y", "caf\u00e9"])
def test_values_compss_reads_itself_are_refused(field: str, value: str) -> None:
    kw: dict[str, Any] = {"spec": "/s.yaml", "run_dir": "/r", "workflow": "/w/hpo.py", "batch": True, field: value}
    with pytest.raises(EngineError) as err:
        LaunchOptions(**kw)
    msg = str(err.value)
    assert repr(value) in msg and "split their arguments again" in msg and "Fix:" in msg


def test_cli_run_dir_with_spaces_survives_runcompss_and_enqueue_compss(
        fake_compss: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real CLI (not --dry-run) against stand-ins that re-split arguments as COMPSs does."""
    monkeypatch.setattr("hpoflow.engines.compss.launch.command.slurm_detected", lambda *a, **k: False)
    spec_dir = tmp_path / "my specs; $(touch pwned)"
    spec_dir.mkdir()
    spec = spec_dir / "digits 'v2' \u00e9.yaml"
    spec.write_text(Path(DIGITS).read_text())
    run_dir = tmp_path / 'runs "a b" `id` *'
    workflow = _load_workflow()
    for extra in ([], ["--nodes", "2", "--time", "30"]):
        assert main(["launch", str(spec), "--run-dir", str(run_dir), "--n-trials", "3", *extra]) == 0
        argv = json.loads(fake_compss.read_text())
        app = argv[argv.index(str(ROOT / "workflows" / "hpo.py")) + 1:]
        args = workflow._parse(app)
        assert (args.spec, args.run_dir, args.n_trials) == (str(spec), str(run_dir), 3)
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()
    # the stand-ins are faithful: a quoted value with a space does not survive them
    import subprocess

    subprocess.run(["runcompss", "--lang=python", "app.py", "a b"], check=True)
    assert json.loads(fake_compss.read_text()) == ["app.py", "a", "b"]


def _load_workflow() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("hpo_workflow", ROOT / "workflows" / "hpo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_refuses_a_job_name_with_a_space(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["launch", DIGITS, "--nodes", "2", "--job-name", "my job", "--run-dir", str(tmp_path / "r x"),
                 "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "the job name 'my job' cannot be passed through COMPSs" in err and "Traceback" not in err
    assert not (tmp_path / "r x").exists()


def test_job_time_from_the_study_budget() -> None:
    t = job_time(None, search_timeout=3600, n_trials=None, max_concurrent=1, trial_timeout=600)
    assert t.minutes == 60 + 10 + MARGIN_MINUTES and not t.warnings and "search.timeout" in t.source
    t = job_time(None, search_timeout=None, n_trials=10, max_concurrent=4, trial_timeout=1200)
    assert t.minutes == 3 * 20 + MARGIN_MINUTES and not t.warnings  # three waves of 20 minutes
    assert job_time(None, search_timeout=None, n_trials=2, max_concurrent=2, trial_timeout=60).minutes == FLOOR_MINUTES
    t = job_time(None, search_timeout=None, n_trials=None, max_concurrent=1, trial_timeout=None)
    assert t.minutes == FLOOR_MINUTES and "no time budget" in t.warnings[0]
    t = job_time(20, search_timeout=None, n_trials=5, max_concurrent=1, trial_timeout=3600)
    assert t.minutes == 20 and "shorter than one trial's timeout" in t.warnings[0] and "--time 65" in t.warnings[0]


def test_the_site_config_is_found_as_enqueue_compss_finds_it(tmp_path: Path) -> None:
    site = tmp_path / "site.cfg"
    site.write_text('QUEUE_SYSTEM="slurm"\n')
    assert sc_cfg_file(str(site), env={}) == site
    home = tmp_path / "COMPSs"
    cfgs = home / "Runtime" / "scripts" / "queues" / "supercomputers"
    cfgs.mkdir(parents=True)
    (cfgs / "default.cfg").write_text("DISABLE_QARG_QOS=true\n")
    (cfgs / "mn5.cfg").write_text("DISABLE_QARG_QOS=false\n")
    assert sc_cfg_file(None, env={"COMPSS_HOME": str(home)}) == cfgs / "default.cfg"
    assert sc_cfg_file("mn5", env={"COMPSS_HOME": str(home)}) == cfgs / "mn5.cfg"
    exe = home / "Runtime" / "scripts" / "user" / "enqueue_compss"
    assert sc_cfg_file("mn5", env={}, which=lambda name: str(exe)) == cfgs / "mn5.cfg"
    assert sc_cfg_file("nowhere", env={}, which=lambda name: None) is None


def test_cli_batch_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = tmp_path / "budget.yaml"
    spec.write_text(Path(DIGITS).read_text() + "\n")
    text = Path(DIGITS).read_text()
    spec.write_text(text.replace("resources:\n", "resources:\n  timeout: 1800\n", 1))
    cfg = tmp_path / "site.cfg"
    cfg.write_text('QUEUE_SYSTEM="slurm"\nDISABLE_QARG_QOS=false\n')
    assert main(["launch", str(spec), "--nodes", "2", "--qos", "debug", "--sc-cfg", str(cfg), "--dry-run",
                 "--", "--worker_in_master_cpus=0", "--tracing=false"]) == 0
    out, err = capsys.readouterr()
    assert f"--sc_cfg={cfg}" in out and "--exec_time=" in out and "--qos=debug" in out
    assert "--worker_in_master_cpus=0 --tracing=false " + str(ROOT / "workflows" / "hpo.py") in out
    assert "warning" not in err  # the site config keeps the QoS
    cfg.write_text('QUEUE_SYSTEM="slurm"\nDISABLE_QARG_QOS=true\n')
    assert main(["launch", str(spec), "--nodes", "2", "--qos", "debug", "--sc-cfg", str(cfg), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert not out and "--qos debug would be dropped" in err and "DISABLE_QARG_QOS=false" in err
    assert main(["launch", str(spec), "--nodes", "2", "--time", "10", "--dry-run"]) == 0
    assert "shorter than one trial's timeout (resources.timeout = 1800 s)" in capsys.readouterr().err
    assert main(["launch", str(spec), "--sc-cfg", "mn5", "--local", "--dry-run"]) == 2
    assert "--sc-cfg configures enqueue_compss" in capsys.readouterr().err


def test_slurm_detection() -> None:
    assert slurm_detected({}, lambda name: "/usr/bin/sbatch")
    assert not slurm_detected({"SLURM_JOB_ID": "1"}, lambda name: "/usr/bin/sbatch")  # inside a job
    assert not slurm_detected({}, lambda name: None)


def test_cli_dry_run_prints_the_command(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    monkeypatch.setattr("hpoflow.engines.compss.launch.command.slurm_detected", lambda *a, **k: False)
    monkeypatch.chdir(tmp_path)
    assert main(["launch", DIGITS, "--engine", "compss", "--dry-run"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("runcompss --lang=python ")
    assert f"--python_interpreter={sys.executable}" in line and "--log_level=off" in line
    assert f"{ROOT}/workflows/hpo.py {DIGITS} --run-dir {tmp_path}/runs/digits-cnn" in line
    assert main(["launch", DIGITS, "--nodes", "4", "--gpus-per-node", "4", "--time", "30", "--qos", "debug",
                 "--partition", "gpu", "--account", "proj", "--dry-run"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("enqueue_compss --job_name=hpoflow-digits-cnn --num_nodes=4 --gpus_per_node=4 "
                           "--exec_time=30 --qos=debug --queue=gpu --project_name=proj --lang=python")


def test_cli_checks_nodes_and_generates_resources(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hpoflow.engines.compss.launch.command.slurm_detected", lambda *a, **k: False)
    spec = tmp_path / "multi.yaml"
    spec.write_text(Path(DIGITS).read_text().replace("  processes: 1\n", "  processes: 4\n  nodes: 2\n"))
    assert main(["launch", str(spec), "--nodes", "2", "--dry-run"]) == 2
    assert "--nodes 2 leaves 1 worker node(s)" in capsys.readouterr().err
    out = tmp_path / "cfg" / "resources.xml"
    assert main(["launch", DIGITS, "--generate-resources", str(out), "--dry-run"]) == 0
    line = capsys.readouterr().out
    assert f"--resources={out}" in line and f"--project={out.with_name('project.xml')}" in line
    root = ET.parse(out).getroot()
    assert root.tag == "ResourcesList" and root.find("ComputeNode/Processor/ComputingUnits") is not None
    assert ET.parse(out.with_name("project.xml")).getroot().find("ComputeNode/InstallDir") is not None


def test_cli_without_runcompss_says_how_to_get_it(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no runcompss, no sbatch
    monkeypatch.chdir(tmp_path)
    assert main(["launch", DIGITS]) == 2
    assert "runcompss is not on PATH" in capsys.readouterr().err


def _check_resources(root: ET.Element, gpus: bool) -> None:
    assert root.tag == "ResourcesList"
    nodes = root.findall("ComputeNode")
    assert nodes and all(n.get("Name") for n in nodes)
    for n in nodes:
        procs = n.findall("Processor")
        assert procs[0].get("Name") == "MainProcessor" and int(procs[0].findtext("ComputingUnits", "0")) >= 1
        gpu = [p for p in procs if p.findtext("Type") == "GPU"]
        assert bool(gpu) == gpus
        if gpu:
            assert int(gpu[0].findtext("ComputingUnits", "0")) >= 1
        ad = n.find("Adaptors/Adaptor")
        assert ad is not None and ad.get("Name") == NIO_ADAPTOR
        assert ad.find("SubmissionSystem/Interactive") is not None
        lo, hi = int(ad.findtext("Ports/MinPort", "0")), int(ad.findtext("Ports/MaxPort", "0"))
        assert 0 < lo <= hi
        assert float(n.findtext("Memory/Size", "0")) > 0


def _check_project(root: ET.Element) -> None:
    assert root.tag == "Project" and root.find("MasterNode") is not None
    for n in root.findall("ComputeNode"):
        assert n.findtext("InstallDir") and n.findtext("WorkingDir")
        assert n.findtext("Application/Pythonpath") and int(n.findtext("LimitOfTasks", "0")) >= 1


@pytest.mark.parametrize("name, gpus", [("workstation_cpu", False), ("workstation_4gpu", True),
                                        ("cluster_shared_disk", True)])
def test_shipped_runtime_configs(name: str, gpus: bool) -> None:
    d = ROOT / "runtime_config" / name
    _check_resources(ET.parse(d / "resources.xml").getroot(), gpus)
    _check_project(ET.parse(d / "project.xml").getroot())
    if name == "cluster_shared_disk":
        res = ET.parse(d / "resources.xml").getroot()
        assert [s.get("Name") for s in res.findall("SharedDisk")] == ["gpfs"]
        assert len(res.findall("ComputeNode")) == 2
        for n in res.findall("ComputeNode"):
            assert n.findtext("SharedDisks/AttachedDisk[@Name='gpfs']/MountPoint") == "/gpfs/"
        proj = ET.parse(d / "project.xml").getroot()
        assert proj.findtext("MasterNode/SharedDisks/AttachedDisk/MountPoint") == "/gpfs/"


def test_generated_xml_escapes_values_and_round_trips(tmp_path: Path) -> None:
    node = NodeConfig(name='a<b>&"c', cpus=4, gpus=2, memory_gb=8, pythonpath=("/p&q",))
    text = to_text(resources_xml([node]))
    root = ET.fromstring(text.split("\n", 1)[1])
    assert root.find("ComputeNode").get("Name") == 'a<b>&"c'  # type: ignore[union-attr]
    _check_resources(root, gpus=True)
    assert ET.fromstring(to_text(project_xml([node])).split("\n", 1)[1]).findtext(
        "ComputeNode/Application/Pythonpath") == "/p&q"
    _, p = write_config(tmp_path / "resources.xml", [node])
    _check_project(ET.parse(p).getroot())
    with pytest.raises(ValueError, match="cpus >= 1"):
        NodeConfig(cpus=0)
    assert (ROOT / "runtime_config" / "slurm_job.sh").read_text().count("enqueue_compss") >= 1


def test_cli_gives_elastic_trials_the_batch_jobs_worker_cores_as_slots(capsys: pytest.CaptureFixture[str],
                                                                       tmp_path: Path) -> None:
    spec = tmp_path / "elastic.yaml"
    spec.write_text(Path(DIGITS).read_text().replace("  processes: 1\n", "  processes: {min: 1, max: 4}\n", 1))
    assert main(["launch", str(spec), "--nodes", "3", "--cpus-per-node", "48", "--dry-run"]) == 0
    # 2 worker nodes x 48 cores (the master runs no tasks), and what one worker holds: no trial grows past it
    assert " --slots 96 --cpus-per-node 48" in capsys.readouterr().out
    assert main(["launch", str(spec), "--nodes", "3", "--cpus-per-node", "48", "--dry-run", "--",
                 "--worker_in_master_cpus=8"]) == 0
    assert " --slots 104" in capsys.readouterr().out
    assert main(["launch", str(spec), "--nodes", "3", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "--slots" not in out and "compss.slots" in err  # the job's size is unknown: said, not guessed
    assert main(["launch", str(DIGITS), "--nodes", "3", "--cpus-per-node", "48", "--dry-run"]) == 0
    assert "--slots" not in capsys.readouterr().out  # not elastic


@pytest.mark.parametrize("per_node, grown", [(None, 2), (1, 1)])
def test_the_workflow_gives_slots_to_the_engine_and_an_elastic_trial_grows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_node: int | None, grown: int) -> None:
    """workflows/hpo.py in sequential mode (no COMPSs runtime): ``--slots 2`` becomes compss.slots, so
    the lone elastic trial grows onto the second core (real rank processes); with ``--cpus-per-node 1``
    (workers of one core) it never grows past one worker, however many slots are idle."""
    import importlib.util

    spec = tmp_path / "elastic.yaml"
    spec.write_text(json.dumps({
        "study": {"name": "wf-elastic", "metric": "loss", "direction": "minimize"},
        "space": {"x": {"type": "categorical", "choices": [1]}},
        "search": {"algorithm": "grid", "max_concurrent": 1}, "engine": "compss",
        "training": {"function": "trainfns:elastic_epochs", "epochs": 4, "options": {"epochs": 4, "work_s": 0.6}},
        "resources": {"processes": {"min": 1, "max": 2}}}))
    monkeypatch.chdir(ROOT / "tests")  # training.function is looked up in the current directory
    path = ROOT / "workflows" / "hpo.py"
    module_spec = importlib.util.spec_from_file_location("hpo_workflow", path)
    assert module_spec is not None and module_spec.loader is not None
    hpo = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(hpo)
    extra = ["--cpus-per-node", str(per_node)] if per_node else []
    assert hpo.main([str(spec), "--run-dir", str(tmp_path / "run"), "--slots", "2", *extra]) == 0
    sizes = json.loads((tmp_path / "run" / "trials" / "0" / "sizes.json").read_text())
    assert sizes[0] == 1 and sizes[-1] == grown and len(sizes) == 4, sizes
