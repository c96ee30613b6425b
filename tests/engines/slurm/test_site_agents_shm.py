"""Node agents on the "site" profile when one node's ``/dev/shm`` is full (docs/cluster.md, A3, "Faults"):
that node's slurmd, and so its agent and every rank it would start, runs in a mount namespace of its own
whose ``/dev/shm`` is a small tmpfs (``SlurmCluster.private_shm``), filled before the study; the host's is
never touched. A one-node trial of two ranks meets through a file store in a private directory of its
node's ``/dev/shm``, which the node's agent makes before it starts the ranks: on the full node that fails.
Before, the ``OSError`` ended the agent (the driver lost it, and every trial sent to its node); now it
fails that trial, retryable, and the agent serves on. Bounds on time bound a hang, not a speed."""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Iterator
from typing import Any

import optuna
import pytest

from tests.engines.slurm.test_site import STUDY_WAIT_S, _nodes_of, _spec, _study, start_in_salloc
from tests.infra.slurm import SlurmCluster, write_script

pytestmark = pytest.mark.slow

FULL, OTHER = "n2", "n1"  # the node whose /dev/shm is full, and the other node of the allocation
FAILURES = 2  # trials the study sends to the full node: the two it asks while its first holds the other

# The trial's function: it holds its node until the study's other trials have ended (their result files are
# written), so that while it runs on the other node they go to the full node, one after the other.
HOLD_FN = '''\
import time


def hold(ctx):
    deadline = time.monotonic() + float(ctx.options["wait_s"])
    while time.monotonic() < deadline:
        ended = [p for p in ctx.trial_dir.parent.glob("*/result.json") if p.parent != ctx.trial_dir]
        if len(ended) >= int(ctx.options["others"]):
            break
        time.sleep(0.2)
    return {"ok": 1.0}
'''

# engine_options.python: the full node's first agent starts once the other node's agent serves the driver,
# so the study's first trial goes to the other node (agents that start together connect in either order).
# The agents' logs are agents/agent-<node>.out.
GATE = """\
if [ "$SLURMD_NODENAME" = {full} ] && [ ! -e {opened} ]; then
    i=0
    while [ $i -lt 3000 ] && ! cat {agents}/agent-*.out 2>/dev/null | grep -q "serving the driver .* on {other} "; do
        sleep 0.1
        i=$((i + 1))
    done
    touch {opened}
fi
exec {python} "$@"
"""


@pytest.fixture
def full_shm_node(slurm_site_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The site cluster with node ``FULL`` on a /dev/shm of its own (1 MiB, 64 inodes), filled; every node as
    before afterwards, also after a failure."""
    with slurm_site_cluster.private_shm(FULL):
        df = slurm_site_cluster.fill_shm(FULL)
        assert df.count("100%") == 2, df  # no block and no inode left
        yield slurm_site_cluster


def test_an_agent_on_a_full_dev_shm_fails_that_trial_only_and_serves_on(full_shm_node: SlurmCluster) -> None:
    """Three trials of two ranks on one node, two at a time, in ``salloc -N2`` (n1, n2: a trial fills a
    node), on node agents. The first holds n1; n2's /dev/shm is full, so each trial sent there fails at its
    start, retryable, with the disk's error, and its agent, the same process throughout, takes the next. The
    study ends with its three trials: the one on n1 complete, the two on n2 failed."""
    cluster = full_shm_node
    shared = cluster.shared_dir / "site-agents-full-shm"
    shared.mkdir(parents=True, exist_ok=True)
    run_dir = shared / "run"
    agents_dir = run_dir / "agents"
    (shared / "shmfns.py").write_text(HOLD_FN)
    python = write_script(shared / "python.sh", GATE.format(
        full=FULL, other=OTHER, agents=shlex.quote(str(agents_dir)), opened=shlex.quote(str(shared / "gate-opened")),
        python=shlex.quote(sys.executable)))
    spec = _spec(shared / "s.yaml", search={"n_trials": 1 + FAILURES, "max_concurrent": 2},
                 training={"function": "shmfns:hold", "epochs": 1,
                           "options": {"others": FAILURES, "wait_s": 150}},
                 resources={"processes": 2, "max_retries": 0},
                 engine_options={"poll_interval_s": 0.1, "agents": "on", "python": str(python)})
    log = shared / "out.txt"
    proc = start_in_salloc(cluster, ["-N2", f"--nodelist={OTHER},{FULL}", "-c4", "--mem=2000"], spec, run_dir, log)
    try:
        proc.wait(STUDY_WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
    out = log.read_text(errors="replace")
    agents = "".join(p.read_text(errors="replace") for p in sorted(agents_dir.glob("agent-*.out")))
    assert proc.returncode == 0, out
    trials = _study(run_dir).trials
    assert len(trials) == 1 + FAILURES, out  # exactly n_trials
    results: dict[int, dict[str, Any]] = {
        t.number: json.loads((run_dir / "trials" / str(t.number) / "result.json").read_text()) for t in trials}
    failed = sorted(n for n, r in results.items() if r["status"] == "failed")
    complete = [n for n, r in results.items() if r["status"] == "complete"]
    assert len(failed) == FAILURES and len(complete) == 1, (results, out, agents)
    for n in failed:  # failed at its start on the full node: retryable, and the error says why
        error = results[n]["error"]
        assert results[n]["retryable"] is True, results[n]
        assert f"its node agent on {FULL} could not start it" in error and "No space left on device" in error, \
            (error, out, agents)
        assert trials[n].state == optuna.trial.TrialState.FAIL and "No space left" in trials[n].user_attrs["error"]
    # the other node's trial completed there, both ranks on it
    assert trials[complete[0]].state == optuna.trial.TrialState.COMPLETE, out
    assert set(_nodes_of(run_dir / "trials" / str(complete[0])).values()) == {OTHER}, out
    # the full node's agent stayed up: one agent process served both trials, and the driver never lost it
    serving = re.findall(rf"hpoflow-agent\[(\d+)\]: serving the driver .* on {FULL} ", agents)
    starts = re.findall(r"hpoflow-agent\[(\d+)\]: trial (\d+) failed to start: OSError: .*No space left", agents)
    assert len(serving) == 1 and sorted(int(n) for _, n in starts) == failed, agents
    assert {pid for pid, _ in starts} == set(serving), agents  # the same agent process for both
    assert f"node agent on {FULL} lost" not in out and "Traceback" not in agents, (out, agents)
