"""What the slurm engine's two modes share (``hpoflow.engines.slurm.engine``): the record of one trial attempt
(``Trial``); ``Core``, the engine's state as the parts of both modes (``_steps``, ``_jobs``) read it and what a
trial asks SLURM for (the job file its ranks or its attempt read, its resource flags, its name); and the
helpers that name a study for SLURM and clear an attempt's directory."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hpoflow.engines.base import Event, TrialRequest
from hpoflow.engines.cluster.layout import default_pythonpath, processes_per_node
from hpoflow.engines.slurm.allocation import Allocation
from hpoflow.engines.slurm.options import SlurmOptions
from hpoflow.engines.slurm.replan import Replan
from hpoflow.train.transport import ReportReader, TrialFiles

__all__ = ["Core", "Trial", "fresh_attempt_dir", "safe_name"]


@dataclass
class Trial:
    request: TrialRequest
    files: TrialFiles
    reader: ReportReader
    submitted: float
    submitted_wall: float
    deadline: float | None
    proc: subprocess.Popen[bytes] | None = None  # steps: the step's srun
    job_id: str | None = None  # jobs: the trial's batch job
    pending_answer: int | None = None
    first_report: float | None = None
    cancel_reason: str | None = None
    failure: str | None = None
    retryable: bool = False
    stop_time: float | None = None
    paused_at: float | None = None  # pause(): when the engine asked the ranks to stop at a step
    signalled_at: float = 0.0
    gone_since: float | None = None
    started: bool = False  # steps: its srun runs (False: waiting for room in the allocation)
    token: str = ""  # steps: how rank 0's connection to the engine's ControlServer is known
    step: dict[str, str] = field(default_factory=dict)  # steps: rank 0's hello (step id, nodes)
    seen: set[int] = field(default_factory=set)  # report seqs passed on (each arrives by socket and file)
    extra: dict[str, Any] = field(default_factory=dict)


class Core:
    """The slurm engine's state that the parts of its modes read and write (``SlurmEngine.__init__`` sets
    it), and what a trial asks SLURM for."""

    options: SlurmOptions
    run_dir: Path | None
    mode: Literal["steps", "jobs"]
    allocation: Allocation | None
    python: str
    _trials: dict[int, Trial]
    _events: list[Event]
    _replan: Replan | None  # steps mode: the plan across failed steps
    _queued: dict[str, str]  # jobs mode: job id -> state, from the last squeue
    _last_squeue: float

    # -- starting a trial ---------------------------------------------------------------------------
    def _job(self, request: TrialRequest, files: TrialFiles) -> dict[str, Any]:
        """What the rank processes (steps) or the attempt (jobs) read: the request and the options."""
        env = dict(self.options.env)
        env.setdefault("PYTHONPATH", default_pythonpath())
        a = self.allocation
        return {
            "request": json.loads(request.to_json()), "ppn": processes_per_node(request),
            "world_size": request.processes, "pg_timeout_s": self.options.pg_timeout_s,
            "answer_timeout_s": self.options.answer_timeout_s, "env": env, "rendezvous_id": os.urandom(8).hex(),
            "socket_ifname": self.options.socket_ifname, "master_addr": "", "master_port": 0, "store": "",
            "deadline": time.time() + request.timeout + 30.0 if request.timeout else None,
            # where SLURM says nothing of a step's GPUs (--gpu-bind=none), ranks claim theirs among these
            "node_gpus": dict(zip(a.hosts, (list(g) for g in a.gpu_ids), strict=True)) if a and a.gpu_ids else {},
        }

    def _resources(self, request: TrialRequest, *, per_task: bool) -> list[str]:
        """The trial's resource flags: per task (a step: one task per rank) or per node (a trial job).

        A step asks for its GPUs per node (``--gres=gpu:N``) and binds them itself, by local rank (see
        ``hpoflow.engines.cluster.node``): SLURM binds ``--gpus-per-task`` on some versions and sites and
        not on others. It always asks for memory: where memory is a consumable resource, a step without
        ``--mem`` takes all of the job's memory on its nodes, and the next step waits for it."""
        ppn = processes_per_node(request)
        out = [f"--nodes={request.nodes}"]
        o = self.options
        if per_task:
            out += [f"--ntasks={request.processes}", f"--ntasks-per-node={ppn}",
                    f"--cpus-per-task={request.cpus_per_process}"]
            if o.threads_per_core == 1:
                out.append("--hint=nomultithread")
            # no GPU flag would give the step every GPU of the job on its nodes (and the next step waits)
            out.append(f"--gres=gpu:{ppn * request.gpus_per_process}" if request.gpus_per_process else "--gres=none")
            # memory is SLURM's to give back after a failed step (replan): planned on the job's whole nodes
            a = self._replan.job if self._replan is not None else None
            rank_mb = a.rank_memory_mb(request) if a is not None else 0
            if rank_mb:
                out.append(f"--mem={ppn * rank_mb}M")
            if not any(a == "--mpi" or a.startswith("--mpi=") for a in o.srun_args):
                out.append("--mpi=none")  # a site whose default is PMIx would set it up for every step
            return out
        out += ["--ntasks-per-node=1", f"--cpus-per-task={ppn * request.cpus_per_process}"]
        if o.threads_per_core == 1:
            out.append("--hint=nomultithread")
        if request.gpus_per_process:
            out.append(f"--gpus-per-node={ppn * request.gpus_per_process}")
        if request.memory_gb:
            out.append(f"--mem={math.ceil(ppn * request.memory_gb * 1024)}M")
        elif o.memory_gb:
            out.append(f"--mem={o.memory_gb}G")
        return out

    def _name(self, request: TrialRequest) -> str:
        return f"hpoflow.{safe_name(self.run_dir.name if self.run_dir is not None else 'study')}.t{request.number}"


def safe_name(study: str) -> str:
    """A study's name as a job name may hold it."""
    return "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in study)[:40]


def fresh_attempt_dir(files: TrialFiles) -> None:
    """A new attempt starts with no protocol files (a resumed study may reuse a directory)."""
    files.dir.mkdir(parents=True, exist_ok=True)
    for p in files.dir.iterdir():
        if p.is_file():
            with contextlib.suppress(OSError):
                p.unlink()
