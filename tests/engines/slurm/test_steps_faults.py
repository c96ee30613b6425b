"""The slurm engine under crash faults: a node whose slurmd and every process die at once (SIGKILL in
its network namespace, not an administrative ``scontrol update state=down``), on the test cluster's
site profile, in steps mode and on node agents. SLURM marks such a node down only ``SlurmdTimeout``
(10 s here) plus a ping period later; bounds on time bound a hang, not a speed (the machine has two
cores, shared). The same without a cluster: tests/engines/slurm/test_steps_replan.py."""

from __future__ import annotations

import optuna
import pytest

from tests.engines.slurm.test_cluster import _paced_spec
from tests.engines.slurm.test_site import (
    STUDY_WAIT_S,
    _down_a_node_of_the_trial_after_epoch_2,
    _nodes_of,
    _study,
    start_in_salloc,
)
from tests.infra.slurm import SlurmCluster

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("agents", ["off", "on"])
def test_a_2_node_trial_whose_node_crashes_resumes_from_its_checkpoint_on_the_nodes_left(
        slurm_site_cluster: SlurmCluster, agents: str) -> None:
    """A 2-node trial (8 paced epochs) in ``salloc -N3 -c4 --no-kill``; its rank 1's node crashes after
    epoch 2. The rerun (attempt 2) resumes from the checkpoint on the two nodes left, and the study ends
    with its one trial complete. In steps mode (agents off) no step of the study asks for ``--overlap``
    (SLURM then stops keeping steps apart) and the rerun starts only once SLURM took the node out of the
    job; with agents, the agent of the crashed node is lost and the rerun goes to the other two."""
    cluster = slurm_site_cluster
    shared = cluster.shared_dir / f"site-node-crash-{agents}"
    spec = _paced_spec(shared / "s.yaml", 1, 8, engine_options={"agents": agents}, processes=2, nodes=2)
    run_dir = shared / "run"
    log = shared / "out.txt"
    proc = start_in_salloc(cluster, ["-N3", "-c4", "--mem=2000", "--no-kill"], spec, run_dir, log)
    try:
        victim = _down_a_node_of_the_trial_after_epoch_2(cluster, run_dir, proc, crash=True)
        proc.wait(STUDY_WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
        cluster.ensure_healthy()  # the crashed node's slurmd started again, the node resumed
    out = log.read_text()
    assert proc.returncode == 0, out
    (trial,) = _study(run_dir).trials
    assert trial.state == optuna.trial.TrialState.COMPLETE, (out, trial.user_attrs)
    assert trial.user_attrs.get("attempts") == 2, trial.user_attrs  # rerun once, as the same trial
    assert trial.user_attrs["metrics"]["resumed_from_epoch"] >= 2, trial.user_attrs  # from its checkpoint
    rerun = _nodes_of(run_dir / "trials" / "0")
    assert len(set(rerun.values())) == 2 and victim not in rerun.values(), (victim, rerun, out)
    if agents == "on":
        assert f"node agent on {victim} lost" in out, out
        return
    assert f"node(s) {victim} left the allocation" in out, out
    srun_logs = "".join(p.read_text() for p in sorted((run_dir / "trials" / "0").glob("attempt-*/srun.log")))
    assert "--overlap" not in srun_logs, srun_logs
