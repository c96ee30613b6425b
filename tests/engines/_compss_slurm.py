"""The compss engine's task body in a batch job of the namespace SLURM cluster (tests/infra/slurm.py), as a
COMPSs worker runs it on the executing node of a ``@multinode`` task. COMPSs itself cannot run here;
everything after it placed the task does."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hpoflow.engines.compss import CompssOptions
from hpoflow.trial import TrialRequest
from tests.engines._fakes import ROOT
from tests.infra.slurm import SlurmCluster

JOB_WAIT_S = 600  # one short trial of two ranks; bounds a hang


def task_job(cluster: SlurmCluster, shared: Path, hostnames: str) -> dict[str, Any]:
    """The compss task body (``run_task``, what every task variant calls) of a 2-node trial of
    ``trainfns:ddp_identical`` in a 2-node batch job: ``COMPSS_HOSTNAMES`` as given (``$SLURMD_NODENAME``
    is this node), node launchers through srun (compss.launcher's default). Returns the attempt's
    result, with ``_job``: the job's exit status (sbatch's where it refused the job), sbatch's stderr and
    the job's output."""
    trial_dir = shared / "trials" / "0"
    trial_dir.mkdir(parents=True)
    request = TrialRequest(0, {"lr": 0.05}, {"function": "trainfns:ddp_identical", "epochs": 1}, "loss", "minimize",
                           str(trial_dir), processes=2, nodes=2, python_path=(str(ROOT / "tests"),), timeout=300)
    (shared / "request.json").write_text(request.to_json())
    (shared / "options.json").write_text(json.dumps(CompssOptions(launcher="srun").for_task()))
    script = shared / "task.sh"
    script.write_text(
        "#!/bin/bash\n"
        f'export COMPSS_HOSTNAMES="{hostnames}"\n'
        "unset SLURM_JOB_NODELIST  # the hosts come from COMPSs here\n"
        f"exec python -c 'import pathlib, sys; from hpoflow.engines.compss.placement import run_task; "
        f"r = run_task(pathlib.Path(\"{shared}/request.json\").read_text(), "
        f"pathlib.Path(\"{shared}/options.json\").read_text()); print(r[\"status\"])'\n")
    r = cluster.run(["sbatch", "--parsable", "-N2", "-w", "n1,n2", "--exclusive", f"--output={shared}/task.out",
                     str(script)], env={**cluster.env, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}, check=False)
    code = r.returncode
    # the job's exit status once it has left the queue, seen within 0.2 s (``sbatch --wait`` looks at the
    # job every 2 to 32 s, doubling, which made the 10-s job take up to 42 s)
    if code == 0:
        job = r.stdout.strip().split(";")[0]
        end = time.monotonic() + JOB_WAIT_S
        while cluster.run(["squeue", "-h", "-j", job, "-o", "%i"], check=False).stdout.strip():
            if time.monotonic() > end:
                raise AssertionError(f"job {job} did not end within {JOB_WAIT_S} s: {cluster.job_info(job)}")
            time.sleep(0.2)
        code = int(cluster.job_info(job)["ExitCode"].split(":")[0])
    result: dict[str, Any] = json.loads((trial_dir / "attempt-0" / "result.json").read_text())
    result["_job"] = (code, r.stderr, (shared / "task.out").read_text())
    return result
