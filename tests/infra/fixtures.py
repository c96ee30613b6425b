"""Pytest fixtures of the real test infrastructure (loaded by ``pytest_plugins`` in tests/conftest.py).

``slurm_cluster`` (session): a started ``SlurmCluster`` of two nodes, all nodes idle. ``slurm_env``
(function): the cluster's client environment after waiting for all nodes to be idle again (an earlier
test may have taken one down). ``postgres_server`` (session): a started ``PostgresServer``;
``postgres_url`` (session): its URL. Each skips, with the reason, where it cannot run: not root, a
program or the driver missing, network namespaces refused. A daemon that is installed but does not come
up is an error, not a skip. Teardown undoes everything, also after a failed test or a failed start.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.infra import postgres, slurm
from tests.infra.netns import NetnsError


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[slurm.SlurmCluster]:
    """A real two-node SLURM cluster (slurmctld + munged on the host, slurmd in namespaces)."""
    reason = slurm.unavailable_reason()
    if reason:
        pytest.skip(f"no SLURM cluster: {reason}")
    cluster = slurm.SlurmCluster(2)
    try:
        cluster.start()  # undoes itself if it fails
    except NetnsError as exc:
        pytest.skip(f"no SLURM cluster: cannot create network namespaces: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm_env(slurm_cluster: slurm.SlurmCluster) -> dict[str, str]:
    """The cluster's client environment (SLURM_CONF set, SLURM_* of any surrounding job removed), once
    every node is idle; a copy, so a test may change it."""
    slurm_cluster.wait_idle()
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
