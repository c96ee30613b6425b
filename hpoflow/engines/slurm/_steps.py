"""The slurm engine's steps mode (``hpoflow.engines.slurm.engine``): the allocation the driver reads
(``read_allocation``), the environment of a step's ``srun`` (``step_environ``), the steps' control listener
(``control_server``), and ``StepsMode``, the engine's part that starts a trial's step, tells when it has ended,
makes its result from its ranks' outcomes and, after a retryable failure, waits for SLURM's word on the step's
nodes (``hpoflow.engines.slurm.replan``)."""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import replace

from hpoflow.engines.base import TrialResult
from hpoflow.engines.cluster.attempt import stderr_tail
from hpoflow.engines.cluster.hostlist import HostlistError, expand
from hpoflow.engines.cluster.layout import export_flags, processes_per_node
from hpoflow.engines.proc import tail
from hpoflow.engines.slurm._core import Core, Trial
from hpoflow.engines.slurm._fleet import listen_host
from hpoflow.engines.slurm.allocation import (
    Allocation,
    config_value,
    job_detail,
    node_hardware,
    whole_cores,
)
from hpoflow.engines.slurm.options import SlurmOptions
from hpoflow.engines.slurm.replan import Settle, run_client
from hpoflow.fileio import read_json
from hpoflow.train.transport import ControlServer
from hpoflow.trial import RankOutcome, result_from_ranks

__all__ = ["StepsMode", "control_server", "read_allocation", "step_environ"]


class StepsMode(Core):
    """The steps mode's part of ``SlurmEngine``: each trial one ``srun --exact`` step of the allocation."""

    def _start_step(self, t: Trial) -> None:
        req, files = t.request, t.files
        argv = ["srun", "--exact", f"--job-name={self._name(req)}", *self._resources(req, per_task=True),
                "--kill-on-bad-exit=1", "--input=none", f"--output={files.dir / 'task%t.out'}",
                *export_flags(self.options.srun_args), self.python, "-m", "hpoflow.engines.cluster.node", "step",
                "--job", str(files.job)]
        if req.timeout:  # a backstop only: the engine stops a trial at its timeout itself
            argv.insert(1, f"--time={math.ceil((req.timeout + 120) / 60)}")
        with open(files.dir / "srun.log", "ab") as log:
            log.write((shlex.join(argv) + "\n").encode())
            log.flush()
            t.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                      start_new_session=True, env=step_environ(os.environ))

    def _step_done(self, t: Trial) -> bool:
        return t.proc is None or t.proc.poll() is not None

    def _step_result(self, t: Trial, timings: dict[str, float]) -> TrialResult:
        """The step's result from its ranks' outcomes; ranks that ended without one fail it as retryable."""
        req = t.request
        outcomes = {}
        for r in range(req.processes):
            data = read_json(t.files.outcome(r))
            if isinstance(data, dict):
                outcomes[r] = RankOutcome.from_dict(data)
        failure, retryable = t.failure, t.retryable
        code = t.proc.returncode if t.proc is not None else None
        if failure is None and t.cancel_reason is None and (len(outcomes) < req.processes or code not in (0, None)):
            if not any(o.status == "error" for o in outcomes.values()):  # else a rank's own error speaks
                missing = [r for r in range(req.processes) if r not in outcomes]
                failure = (f"rank(s) {missing} ended without a result (srun exit {code}; see "
                           f"{t.files.dir / 'srun.log'}): a node failed, or a rank was killed or ran out of memory")
                retryable = True

        def stderr() -> str:
            text = stderr_tail(t.files, req.processes, 0)
            srun = tail(t.files.dir / "srun.log", 1000)
            return "\n".join(x for x in (text, f"--- srun ---\n{srun}" if srun.strip() else "") if x)

        return result_from_ranks(req, outcomes, timings=timings, failure=failure, retryable=retryable,
                                 cancelled=t.cancel_reason if failure is None else None, stderr_tail=stderr,
                                 submitted_wall=t.submitted_wall)

    # -- after a step failed as retryable (hpoflow.engines.slurm.replan) ------------------------------
    def _begin_settle(self, t: Trial, result: TrialResult) -> None:
        if self.allocation is None or self._replan is None:
            return
        req = t.request
        outcomes = [RankOutcome.from_dict(d) for d in (read_json(t.files.outcome(r)) for r in range(req.processes))
                    if isinstance(d, dict)]
        try:
            nodes = set(expand(t.step.get("nodes", ""))) if t.step.get("nodes") else set()
        except HostlistError:
            nodes = set()
        nodes |= {o.host for o in outcomes if o.host}
        step = t.step.get("step", "")
        self._replan.begin(Settle(
            req.number, time.monotonic(), nodes, f"{self.allocation.job_id}.{step}" if step else "", self._name(req),
            processes_per_node(req) * self.allocation.rank_cpus(req), result))

    def _settle(self) -> None:
        """Steps mode: SLURM's newest word on the job applied to the failed steps waiting for it (``Replan``)."""
        if self._replan is None or not self._replan.waiting:
            return
        self._events += self._replan.step()
        self.allocation = self._replan.planned


# what salloc/sbatch export of the job's own request that srun reads as its options (SLURM_GPUS_PER_NODE
# is --gpus-per-node, SLURM_MEM_PER_CPU is --mem-per-cpu...): a step of a job asked with --gpus-per-node=4
# would ask for 4 GPUs per node, or clash with the step's own --gres ("Invalid Trackable RESource
# (TRES) specification"); the engine's flags say what a step needs
_JOB_REQUEST_VARS = ("SLURM_GPUS", "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_SOCKET",
                     "SLURM_CPUS_PER_GPU", "SLURM_MEM_PER_NODE", "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_GPU",
                     "SLURM_GPU_BIND", "SLURM_GPU_FREQ", "SLURM_NTASKS_PER_GPU", "SLURM_TRES_PER_TASK",
                     "SLURM_THREADS_PER_CORE", "SLURM_HINT", "SRUN_CPUS_PER_TASK",
                     # a site-wide --overlap (srun reads SLURM_OVERLAP as the flag): SLURM would stop keeping
                     # the study's steps apart (CPUs oversubscribed, GPUs given twice)
                     "SLURM_OVERLAP")


def control_server(allocation: Allocation | None) -> tuple[ControlServer, str]:
    """The steps' control listener, bound to the address the job's nodes reach this host at (as the agents'
    listener: ``listen_host``), and that address; every address ("") where none is known or it cannot be
    bound. Only a connection that sends a token of a running attempt is kept either way."""
    host = listen_host(allocation.hosts) if allocation is not None else ""
    if host:
        try:
            return ControlServer(host), host
        except OSError:
            pass
    return ControlServer(""), ""


def step_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of a step's ``srun``: the driver's, less the job's own resource request and a
    site's ``SLURM_OVERLAP``."""
    return {k: v for k, v in environ.items() if k not in _JOB_REQUEST_VARS}


def read_allocation(environ: Mapping[str, str], options: SlurmOptions) -> Allocation:
    """The driver's allocation: its environment, refined by what the controller knows (each node's GPUs
    and memory, threads per core, whether SLURM hands out whole cores; ``Allocation.refined``). Where
    ``scontrol`` does not answer, the environment alone, with a warning."""
    alloc = Allocation.from_env(environ)
    detail_text = run_client(["scontrol", "-d", "show", "job", "-o", alloc.job_id])
    nodes_text = run_client(["scontrol", "show", "node", "-o", ",".join(alloc.hosts)])
    config = run_client(["scontrol", "show", "config"]) or ""
    if detail_text is None or nodes_text is None or not config:
        print(f"hpoflow: warning: scontrol did not describe job {alloc.job_id}; the engine plans with what the "
              "environment says (SLURM_JOB_CPUS_PER_NODE, SLURM_MEM_PER_NODE, SLURM_GPUS_PER_NODE)", file=sys.stderr,
              flush=True)
    alloc = alloc.refined(job_detail(detail_text or ""), node_hardware(nodes_text or ""),
                          whole_cores(config_value(config, "SelectTypeParameters") or ""))
    max_steps = config_value(config, "MaxStepCount") or ""
    return replace(alloc, one_thread_per_core=options.threads_per_core == 1,
                   max_step_count=int(max_steps) if max_steps.isascii() and max_steps.isdigit() else 0)
