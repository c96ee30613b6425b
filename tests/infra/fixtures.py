"""Pytest fixtures of the real test infrastructure (loaded by ``pytest_plugins`` in tests/conftest.py).

``slurm_cluster``: a started ``SlurmCluster`` of two nodes of the "site" profile, one per test session (or
per pytest-xdist worker), checked healthy before each test that uses it (``SlurmCluster.ensure_healthy``: every daemon
running, a dead slurmd restarted, slurmctld answering, every node idle again after a test took one
down). ``slurm_env`` (function): its client environment. ``postgres_server`` (session): a started
``PostgresServer``; ``postgres_url`` (session): its URL. Each skips, with the reason, where it cannot
run: not root, a program or the driver missing, network namespaces refused. A daemon that is installed
but does not come up is an error, not a skip. Teardown undoes everything, also after a failed test or
a failed start.

Under pytest-xdist (``--dist loadgroup``, the project's default) every test that uses one of these
servers joins its ``xdist_group`` (``GROUPS``, marked by ``tests/conftest.py``): one worker runs them all,
one after the other, on the one server it started, while the other workers run everything else.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.infra import postgres, slurm
from tests.infra.netns import NetnsError

SLURM_GROUP = "slurm-cluster"
SLURM_SITE_GROUP = "slurm-site-cluster"
POSTGRES_GROUP = "postgres-server"
# fixture -> the xdist_group of the tests that use it (directly, or through a fixture that does)
GROUPS = {"slurm_cluster": SLURM_GROUP, "slurm_env": SLURM_GROUP, "slurm_session_cluster": SLURM_GROUP,
          "slurm_site_cluster": SLURM_SITE_GROUP, "slurm_site_session_cluster": SLURM_SITE_GROUP,
          "postgres_server": POSTGRES_GROUP, "postgres_url": POSTGRES_GROUP}
# for a test that asks for one with ``request.getfixturevalue`` (pytest cannot see that in advance)
USES_SLURM_CLUSTER = pytest.mark.xdist_group(SLURM_GROUP)
USES_POSTGRES = pytest.mark.xdist_group(POSTGRES_GROUP)


@pytest.fixture(scope="session")
def slurm_session_cluster() -> Iterator[slurm.SlurmCluster]:
    """A real two-node SLURM cluster of the "site" profile (slurmctld + munged on the host, slurmd in
    namespaces; memory accounted, two threads per core, GRES GPUs, two networks), started once; tests
    use it through ``slurm_cluster``, which checks it first."""
    yield from _session_cluster("site")


def _session_cluster(profile: str, nodes: int = 2) -> Iterator[slurm.SlurmCluster]:
    reason = slurm.unavailable_reason()
    if reason:
        pytest.skip(f"no SLURM cluster: {reason}")
    cluster = slurm.SlurmCluster(nodes, profile=profile)
    try:
        cluster.start()  # undoes itself if it fails
    except NetnsError as exc:
        pytest.skip(f"no SLURM cluster: cannot create network namespaces: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def slurm_site_session_cluster() -> Iterator[slurm.SlurmCluster]:
    """A real three-node SLURM cluster of the "site" profile (``tests/infra/slurm.py``: memory accounted,
    two threads per core, four GRES GPUs and two networks per node), started once; tests use
    ``slurm_site_cluster``."""
    yield from _session_cluster("site", 3)


@pytest.fixture
def slurm_site_cluster(slurm_site_session_cluster: slurm.SlurmCluster) -> slurm.SlurmCluster:
    """The session's site-profile cluster, healthy (see ``slurm_cluster``)."""
    slurm_site_session_cluster.ensure_healthy()
    return slurm_site_session_cluster


@pytest.fixture
def slurm_cluster(slurm_session_cluster: slurm.SlurmCluster) -> slurm.SlurmCluster:
    """The session's cluster, healthy: an earlier test may have downed a node or killed a slurmd."""
    slurm_session_cluster.ensure_healthy()
    return slurm_session_cluster


@pytest.fixture
def slurm_env(slurm_cluster: slurm.SlurmCluster) -> dict[str, str]:
    """The cluster's client environment (SLURM_CONF set, SLURM_* of any surrounding job removed); a
    copy, so a test may change it."""
    return dict(slurm_cluster.env)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[postgres.PostgresServer]:
    """A real PostgreSQL server on 127.0.0.1 with a login role and a database (see ``postgres_url``)."""
    reason = postgres.unavailable_reason()
    if reason:
        pytest.skip(f"no PostgreSQL server: {reason}")
    server = postgres.PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="session")
def postgres_url(postgres_server: postgres.PostgresServer) -> str:
    """``postgresql+psycopg2://USER:PASSWORD@127.0.0.1:PORT/DB`` of the session's server."""
    return postgres_server.url
