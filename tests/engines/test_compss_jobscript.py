"""``runtime_config/slurm_job.sh``, the example that calls ``enqueue_compss`` itself, passes what it is
given intact: run for real by ``sbatch`` on the namespace SLURM cluster (tests/infra/slurm.py), with a
stand-in ``enqueue_compss`` that records its argv and then does what the real one does with it (its
flags and the application's arguments pasted, unquoted, into a generated job script that a shell runs).

The spec path and the run directory hold spaces, quotes, ``$(...)``, backticks, ``*`` and non-ASCII:
the script encodes them as the application's arguments are encoded (``encode_app_value``), and
``workflows/hpo.py`` reads them back unchanged. ``QOS``/``ACCOUNT`` need ``SC_CFG`` (COMPSs's generic
``default.cfg`` drops both), and a value COMPSs reads itself that it would split is refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.infra.slurm import SlurmCluster

SCRIPT = ROOT / "runtime_config" / "slurm_job.sh"

# enqueue_compss: record the argv, then re-split it as COMPSs does (see the module docstring)
STANDIN_ENQUEUE = r"""#!/bin/bash
"$STANDIN_PY" - "$@" <<'EOF'
import json, os, sys
json.dump(sys.argv[1:], open(os.environ["STANDIN_OUT"] + ".enqueue.json", "w"))
EOF
args_pass=""
while [ $# -gt 0 ] && [[ "$1" == --* ]]; do args_pass="$args_pass $1"; shift; done
args_pass="$args_pass $*"
printf '#!/bin/bash\nexec %s %s %s\n' "$STANDIN_PY" "$STANDIN_PRINTER" "${args_pass}" > "$STANDIN_DIR/job.sh"
exec bash "$STANDIN_DIR/job.sh"
"""
PRINTER = """\
import json, os, sys
json.dump(sys.argv[1:], open(os.environ["STANDIN_OUT"] + ".app.json", "w"))
"""


def _workflow() -> Any:
    spec = importlib.util.spec_from_file_location("hpo_workflow", ROOT / "workflows" / "hpo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _standin(base: Path) -> dict[str, str]:
    """A stand-in enqueue_compss first on PATH; the environment the script needs to find it."""
    bin_dir = base / "standin-bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "enqueue_compss"
    exe.write_text(STANDIN_ENQUEUE)
    exe.chmod(0o755)
    (bin_dir / "printer.py").write_text(PRINTER)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "STANDIN_PY": sys.executable,
            "STANDIN_PRINTER": str(bin_dir / "printer.py"), "STANDIN_DIR": str(bin_dir),
            "STANDIN_OUT": str(base / "argv"), "REPO": str(ROOT), "PYTHON": sys.executable, "COMPSS_MODULE": "",
            "PYTHONPATH": str(ROOT)}


def _nasty_paths(base: Path) -> tuple[Path, Path]:
    spec_dir = base / "my specs; $(touch pwned) 'q' \u00e9"
    spec_dir.mkdir(parents=True)
    spec = spec_dir / 'digits "v2" \u00e9.yaml'
    spec.write_text((ROOT / "examples" / "digits.yaml").read_text())
    return spec, base / 'runs "a b" `id` * \u00fc'


@pytest.mark.slow
def test_slurm_job_sh_run_by_sbatch_passes_paths_and_flags_intact(slurm_cluster: SlurmCluster) -> None:
    base = slurm_cluster.shared_dir / "jobscript"
    env = _standin(base)
    spec, run_dir = _nasty_paths(base)
    env.update(SPEC=str(spec), RUN_DIR=str(run_dir), NUM_NODES="3", CPUS_PER_NODE="16", GPUS_PER_NODE="0",
               SC_CFG="mn", QOS="debug", ACCOUNT="bsc99")
    r = slurm_cluster.run(["sbatch", "--parsable", "--wait", "-N1", f"--output={base}/job.out", "--chdir",
                           str(base), str(SCRIPT)], env=env, timeout=300, check=False)
    out = (base / "job.out").read_text() if (base / "job.out").exists() else ""
    assert r.returncode == 0, (r.stdout, r.stderr, out)
    flags = json.loads((base / "argv.enqueue.json").read_text())
    assert flags[:6] == ["--sc_cfg=mn", "--job_name=hpoflow", "--num_nodes=3", "--cpus_per_node=16",
                         "--gpus_per_node=0", "--exec_time=60"]
    assert "--qos=debug" in flags and "--project_name=bsc99" in flags
    app = json.loads((base / "argv.app.json").read_text())  # what the application got after re-splitting
    args = _workflow()._parse(app[app.index(str(ROOT / "workflows" / "hpo.py")) + 1:])
    assert (args.spec, args.run_dir) == (str(spec), str(run_dir))
    assert (args.cpus_per_node, args.gpus_per_node) == (16, 0)  # multi-node trials ask for whole workers
    assert not list(base.rglob("pwned")) and not (Path.cwd() / "pwned").exists()


def test_slurm_job_sh_refuses_qos_and_account_without_a_site_config_and_values_compss_would_split(
        tmp_path: Path) -> None:
    env = {**os.environ, **_standin(tmp_path)}
    spec, run_dir = _nasty_paths(tmp_path)
    env.update(SPEC=str(spec), RUN_DIR=str(run_dir))
    for extra, message in (({"QOS": "debug"}, "QOS and ACCOUNT need SC_CFG"),
                           ({"ACCOUNT": "bsc99"}, "QOS and ACCOUNT need SC_CFG"),
                           ({"SC_CFG": "my site.cfg", "QOS": "debug"}, "SC_CFG 'my site.cfg' cannot be passed"),
                           ({"REPO": f"{tmp_path}/my repo"}, "cannot be passed through COMPSs")):
        r = subprocess.run(["bash", str(SCRIPT)], env={**env, **extra}, capture_output=True, text=True, timeout=120,
                           check=False)
        assert r.returncode == 2 and message in r.stderr, (extra, r.stderr)
        assert not (tmp_path / "argv.enqueue.json").exists()  # nothing was submitted
    # without QOS/ACCOUNT it needs no site config, and the paths arrive intact
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    flags = json.loads((tmp_path / "argv.enqueue.json").read_text())
    assert not any(f.startswith(("--sc_cfg", "--qos", "--project_name")) for f in flags)
    app = json.loads((tmp_path / "argv.app.json").read_text())
    args = _workflow()._parse(app[app.index(str(ROOT / "workflows" / "hpo.py")) + 1:])
    assert (args.spec, args.run_dir) == (str(spec), str(run_dir))
