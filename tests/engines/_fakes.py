"""Fakes for the compss engine tests: ``srun`` and ``ssh`` on PATH, network namespaces, requests.

The fake ``srun`` really starts the processes: for ``--nodes=N --ntasks-per-node=K CMD...`` it
spawns N*K local copies of CMD with ``SLURM_PROCID``/``SLURM_NODEID``/``SLURM_LOCALID`` and
``SLURMD_NODENAME`` (the N-th name of ``SLURM_NODELIST``) set, and waits for them. The fake ``ssh``
joins the remote command into one line as real ssh does and runs it with ``sh -c``, inside the
network namespace mapped to the host (``FAKE_SSH_NETNS=host=ns,...``) via ``ip netns exec``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from hpoflow.spec import TrainConfig
from hpoflow.trial import TrialRequest

ROOT = Path(__file__).resolve().parents[2]
PYPATH = (str(ROOT / "tests"),)

FAKE_SRUN = r'''
import os, signal, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_SRUN_LOG"], "a") as f:
    f.write(repr(args) + "\n")
opts = {}
while args and args[0].startswith("-"):
    key, _, value = args.pop(0).partition("=")
    opts[key] = value
nodes = int(opts.get("--nodes") or os.environ.get("SLURM_NNODES", "1"))
per_node = int(opts.get("--ntasks-per-node", "1"))
names = [n for n in os.environ.get("SLURM_NODELIST", "").split(",") if n] or [f"node{i}" for i in range(nodes)]
if len(names) != nodes:
    sys.exit(f"fake srun: SLURM_NODELIST has {len(names)} names for --nodes={nodes}")
procs = []
for node in range(nodes):
    for local in range(per_node):
        env = dict(os.environ, SLURM_PROCID=str(node * per_node + local), SLURM_NODEID=str(node),
                   SLURM_LOCALID=str(local), SLURMD_NODENAME=names[node], SLURM_STEP_NUM_TASKS=str(nodes * per_node))
        procs.append(subprocess.Popen(args, env=env))
def stop(signum, frame):
    for p in procs:
        p.kill()
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
codes = [p.wait() for p in procs]
bad = [c for c in codes if c != 0]
sys.exit(bad[0] if bad and bad[0] > 0 else (1 if bad else 0))
'''

FAKE_SSH = r'''
import os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_SSH_LOG"], "a") as f:
    f.write(repr(args) + "\n")
while args and args[0].startswith("-"):
    flag = args.pop(0)
    if flag in ("-o", "-p", "-i", "-l", "-F", "-J"):
        args.pop(0)
host, remote = args[0], " ".join(args[1:])  # what real ssh does: one command line for the remote shell
mapping = dict(kv.split("=", 1) for kv in os.environ.get("FAKE_SSH_NETNS", "").split(",") if kv)
argv = ["sh", "-c", remote]
if host in mapping:
    argv = ["ip", "netns", "exec", mapping[host], *argv]
sys.exit(subprocess.call(argv))
'''


def write_script(bin_dir: Path, name: str, body: str) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def make_request(trial_dir: Path, number: int = 0, function: str | None = "trainfns:ddp_identical",
                 metric: str = "loss", **kw: Any) -> TrialRequest:
    options = kw.pop("options", {})
    train = TrainConfig(function=function, options=options, epochs=kw.pop("epochs", 1),
                        model=kw.pop("model", "mlp")).model_dump(mode="json")
    return TrialRequest(number, {}, train, metric, "minimize", str(trial_dir), python_path=PYPATH, **kw)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


class NetnsPair:
    """Two network namespaces joined by a veth pair, 198.18.0.1/24 <-> 198.18.0.2/24 (RFC 2544
    benchmarking space: never routed anywhere), each with ``lo`` up; both ends are named ``hpo0``."""

    ADDRS = ("198.18.0.1", "198.18.0.2")
    IFNAME = "hpo0"

    def __init__(self, tag: str) -> None:
        self.ns = (f"hpfa{tag}", f"hpfb{tag}")
        self.veth = (f"hpva{tag}"[:15], f"hpvb{tag}"[:15])
        self.created: list[str] = []

    def create(self) -> None:
        for ns in self.ns:
            ip("netns", "add", ns)
            self.created.append(ns)
        ip("link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
        for ns, veth, addr in zip(self.ns, self.veth, self.ADDRS, strict=True):
            ip("link", "set", veth, "netns", ns)
            ip("-n", ns, "link", "set", veth, "name", self.IFNAME)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", self.IFNAME)
            ip("-n", ns, "link", "set", self.IFNAME, "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def destroy(self) -> None:
        for veth in self.veth:  # still in the root namespace if create() failed half way
            ip("link", "del", veth, check=False)
        for ns in self.created:
            ip("netns", "del", ns, check=False)
        self.created.clear()


def rank_processes(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions ``marker`` (e.g. a job file path)."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if marker in " ".join(p.info["cmdline"] or []):
                out.append(p.pid)
        except psutil.Error:
            continue
    return [pid for pid in out if pid != os.getpid()]


# COMPSs's own argument handling, reduced to what matters for quoting (see docs/cluster.md): runcompss
# keeps the application's arguments as one string and expands it unquoted (word splitting, globbing);
# enqueue_compss pastes its flags and the application's arguments into a job script a shell runs.
FAKE_RUNCOMPSS = r"""#!/bin/bash
while [ $# -gt 0 ] && [[ "$1" == --* ]]; do shift; done
app=$1; shift
app_args="$*"
exec "$FAKE_PY" "$FAKE_PRINTER" "$app" ${app_args}
"""

FAKE_ENQUEUE_COMPSS = r"""#!/bin/bash
args_pass=""
while [ $# -gt 0 ] && [[ "$1" == --* ]]; do args_pass="$args_pass $1"; shift; done
args_pass="$args_pass $*"
script="$FAKE_JOB_DIR/job.sh"
printf '#!/bin/bash\nexec %s %s %s\n' "$FAKE_PY" "$FAKE_PRINTER" "${args_pass}" > "$script"
exec bash "$script"
"""

ARGV_PRINTER = """\
import json, os, sys
with open(os.environ["FAKE_ARGV_OUT"], "w") as f:
    json.dump(sys.argv[1:], f)
"""


def write_shell(bin_dir: Path, name: str, body: str) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text(body)
    path.chmod(0o755)
    return path
