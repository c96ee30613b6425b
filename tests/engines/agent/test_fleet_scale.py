"""The scale harness, reduced (bench/agent_fleet.py runs the full one: 1,024 agents, 10,000 trials): the real
``AgentFleet`` with many agents per process speaking the real protocol on loopback (tests/engines/agent/swarm.py),
each trial completed exactly once, and past 1,024 descriptors from a soft limit of 1,024."""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engines.agent.swarm import fleet, request, run_trials

# bounds a hang, not a speed: 1,100 agents connect in ~2 s and 2,000 trials of 10 ms run in ~1 s on a
# quiet machine; many times that with other work on both of its cores
LIMIT_S = 300.0


@pytest.fixture
def soft_limit_1024() -> Iterator[None]:
    """The driver's open-files soft limit at 1,024 (``ulimit -n 1024``, a common default)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"the hard open-files limit ({hard}) cannot hold 1,100 agents")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _up(n: int, tmp_path: Path, procs: int):  # type: ignore[no-untyped-def]
    f = fleet(n, tmp_path, procs=procs)
    f.capacity(request(0, tmp_path))
    end = time.monotonic() + LIMIT_S
    while len(f.agents) < n and time.monotonic() < end:
        f.serve(0.1)
    return f


def test_64_agents_run_500_trials_each_once_at_a_bounded_driver_cost(tmp_path: Path) -> None:
    f = _up(64, tmp_path, 2)
    try:
        assert len(f.agents) == 64
        before = _cpu_s()
        done = run_trials(f, 500, tmp_path, slots=64, limit_s=LIMIT_S)
        per_trial_ms = (_cpu_s() - before) / 500 * 1000
        assert done == {n: 1 for n in range(500)}, {n: c for n, c in done.items() if c != 1}
        # the target is 2 ms (0.35 ms measured, bench/agent_fleet.py); 5x for a machine shared with other work
        assert per_trial_ms < 10.0, per_trial_ms
    finally:
        f.close(1.0)


def test_past_1024_descriptors_every_agent_is_admitted_and_runs_trials(tmp_path: Path,
                                                                        soft_limit_1024: None) -> None:
    """Under ``ulimit -n 1024`` the driver admitted no agent past about the 1,000th (``accept`` ran out of
    descriptors and its thread ended; the hello wait's ``select.select`` raised for descriptors >= 1024).
    The fleet raises the soft limit to the hard one, and every agent is admitted over epoll."""
    f = _up(1100, tmp_path, 8)
    try:
        assert f.open_files > 1100
        assert len(f.agents) == 1100, len(f.agents)
        done = run_trials(f, 2000, tmp_path, slots=1100, limit_s=LIMIT_S)
        assert done == {n: 1 for n in range(2000)}, {n: c for n, c in done.items() if c != 1}
        assert max(a.link.fileno() for a in f.agents.values()) >= 1024  # (the case it is about)
    finally:
        f.close(1.0)
