"""A real PostgreSQL server (Debian's binaries) in a private temp dir, for Optuna's RDBStorage.

``PostgresServer().start()`` runs ``initdb`` into ``ROOT/data`` (ROOT in the system temp dir, never
under the repo), then ``postgres`` in the foreground as our child, listening only on 127.0.0.1 at a
port that was free, with its Unix socket in ``ROOT/sock``; it creates a login role with a random
password and a database owned by it, and ``url`` is
``postgresql+psycopg2://USER:PASSWORD@127.0.0.1:PORT/DB`` (SQLAlchemy's URL, which Optuna's
``RDBStorage`` takes). PostgreSQL refuses to run as root: as root the server runs as the ``postgres``
system user (``setpriv``), which then owns ROOT; as anyone else, as that user.

``stop()`` shuts the server down (fast shutdown: clients are disconnected, data kept) and ``start()``
brings it back on the same port and data, so a test can simulate a database outage. ``destroy()``
stops it and deletes ROOT; it is idempotent. Every command is an argv list (no shell).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.infra.slurm import KEEP_ENV, sweep_stale_sessions, tail, temp_root

SERVER_USER = "postgres"  # the system user Debian's postgresql package makes; used only when we are root
DRIVER = "psycopg2"  # SQLAlchemy's default PostgreSQL driver (PyPI: psycopg2-binary)


class PostgresError(RuntimeError):
    """The server did not initialise, start or stop; the message ends with its log's tail."""


def find_bindir() -> Path | None:
    """The directory holding initdb, postgres and psql: Debian's newest /usr/lib/postgresql/N/bin, else
    wherever ``initdb`` is on PATH; None if there is none."""
    def version(path: Path) -> int:
        name = path.parent.name
        return int(name) if name.isdigit() else -1

    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    for bindir in candidates:
        if all((bindir / tool).is_file() for tool in ("initdb", "postgres", "psql")):
            return bindir
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def unavailable_reason() -> str | None:
    """Why a server cannot be run here (no binaries, no driver, root without a ``postgres`` user), or None."""
    if find_bindir() is None:
        return "PostgreSQL is not installed (Debian: apt-get install postgresql)"
    if importlib.util.find_spec(DRIVER) is None:
        return f"the {DRIVER} driver is not installed (pip install psycopg2-binary)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return f"running as root and there is no {SERVER_USER!r} user to run the server as"
        if shutil.which("setpriv") is None:
            return "running as root and setpriv (util-linux) is missing"
    return None


def free_local_port() -> int:
    """A TCP port that nothing listens on at 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PostgresServer:
    """One PostgreSQL cluster (data dir) and its server process; see the module docstring."""

    def __init__(self, *, user: str = "hpoflow", database: str = "hpoflow") -> None:
        for name in (user, database):
            if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
                raise ValueError(f"{name!r}: use a plain lower-case identifier")
        self.user = user
        self.database = database
        self.password = secrets.token_hex(16)
        self.host = "127.0.0.1"
        self.port = 0
        self.root = Path()
        self.proc: subprocess.Popen[bytes] | None = None
        self.bindir = find_bindir() or Path("/nonexistent")
        self.initialised = False

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (``initdb -D``)."""
        return self.root / "data"

    @property
    def socket_dir(self) -> Path:
        """Where the server puts its Unix socket (``unix_socket_directories``)."""
        return self.root / "sock"

    @property
    def log_path(self) -> Path:
        """The server's stdout and stderr."""
        return self.root / "postgres.log"

    def url_for(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` on this server, as the login role."""
        return f"postgresql+{DRIVER}://{self.user}:{self.password}@{self.host}:{self.port}/{database}"

    @property
    def url(self) -> str:
        """``postgresql+psycopg2://USER:PASSWORD@127.0.0.1:PORT/DB``."""
        return self.url_for(self.database)

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self.proc is not None and self.proc.poll() is None

    # -- processes ---------------------------------------------------------------------------------
    def _as_server_user(self, argv: Sequence[str]) -> list[str]:
        tool = str(self.bindir / argv[0]) if (self.bindir / argv[0]).is_file() else argv[0]
        if os.geteuid() != 0:
            return [tool, *argv[1:]]
        return ["setpriv", f"--reuid={SERVER_USER}", f"--regid={SERVER_USER}", "--init-groups",
                "--pdeathsig=TERM", "--", tool, *argv[1:]]

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(HOME=str(self.root), LC_ALL="C", LANG="C")
        return env

    def _run(self, argv: Sequence[str], *, input: str | None = None, timeout: float = 120) -> str:
        proc = subprocess.run(self._as_server_user(argv), input=input, capture_output=True, text=True,
                              env=self._env(), cwd=self.root, timeout=timeout, check=False)
        if proc.returncode != 0:
            raise PostgresError(f"{argv[0]} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def _psql(self, database: str, sql: str, variables: Mapping[str, str] | None = None) -> str:
        """Run ``sql`` (read from stdin, so ``:'var'`` quoting applies) as the superuser over the socket."""
        argv = ["psql", "-X", "-q", "-h", str(self.socket_dir), "-p", str(self.port), "-U", "postgres",
                "-d", database, "-v", "ON_ERROR_STOP=1"]
        for key, value in (variables or {}).items():
            argv += ["-v", f"{key}={value}"]
        return self._run(argv, input=sql)

    # -- life cycle --------------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> None:
        """Initialise (first call only) and start the server; wait until it accepts connections.

        ``timeout`` is generous: on a loaded 2-core machine initdb alone can take tens of seconds."""
        reason = unavailable_reason()
        if reason:
            raise PostgresError(reason)
        if self.running:
            return
        try:
            if not self.initialised:
                self._init()
            self._start_server(timeout)
            if not self.initialised:
                self._psql("postgres", "CREATE ROLE :\"user\" LOGIN PASSWORD :'password';\n"
                                       "CREATE DATABASE :\"db\" OWNER :\"user\";\n",
                           {"user": self.user, "password": self.password, "db": self.database})
                self.initialised = True
        except BaseException:
            if not self.initialised:
                self.destroy()
            else:
                self.stop()
            raise

    def _init(self) -> None:
        sweep_stale_sessions()
        self.root = temp_root(f"hpoflow-pg-{os.getpid()}-")
        self.socket_dir.mkdir(mode=0o700)
        if os.geteuid() == 0:
            info = pwd.getpwnam(SERVER_USER)
            for path in (self.root, self.socket_dir):
                os.chown(path, info.pw_uid, info.pw_gid)
        self.port = free_local_port()
        self._run(["initdb", "-D", str(self.data_dir), "--username=postgres", "--auth-local=trust",
                   "--auth-host=scram-sha-256", "--encoding=UTF8", "--no-locale", "--no-sync"], timeout=300)

    def _start_server(self, timeout: float) -> None:
        argv = self._as_server_user([
            "postgres", "-D", str(self.data_dir),
            "-c", f"listen_addresses={self.host}", "-c", f"port={self.port}",
            "-c", f"unix_socket_directories={self.socket_dir}",
            "-c", "fsync=off", "-c", "full_page_writes=off",  # a test server: no power loss to survive
            "-c", "max_connections=100", "-c", "shared_buffers=32MB"])
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=self._env(), cwd=self.root, start_new_session=True)
        isready = [str(self.bindir / "pg_isready"), "-q", "-h", self.host, "-p", str(self.port), "-t", "5"]
        end = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise PostgresError(f"postgres exited ({self.proc.returncode}) at start\n{tail(self.log_path)}")
            if subprocess.run(isready, env=self._env(), check=False, timeout=30).returncode == 0:
                return
            if time.monotonic() > end:
                raise PostgresError(f"postgres did not accept connections in {timeout:.0f} s\n{tail(self.log_path)}")
            time.sleep(0.2)

    def stop(self, timeout: float = 60.0, *, checkpoint: bool = True) -> None:
        """Fast shutdown (SIGINT: sessions are disconnected, data is checkpointed); SIGQUIT then SIGKILL if
        it takes longer than ``timeout`` s. The data directory stays for ``start()``. Without
        ``checkpoint``, an immediate shutdown (SIGQUIT: no checkpoint, which on a loaded machine's disk
        can take tens of seconds) for a server whose data is about to be deleted."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        steps = ((signal.SIGINT, timeout),) if checkpoint else ()
        for sig, wait in (*steps, (signal.SIGQUIT, 10.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def destroy(self) -> None:
        """Stop the server and delete its directory; idempotent."""
        self.stop(checkpoint=False)
        if self.root != Path() and self.root.is_dir() and os.environ.get(KEEP_ENV) != "1":
            shutil.rmtree(self.root, ignore_errors=True)
        self.initialised = False

    def create_database(self, name: str) -> str:
        """A new empty database owned by the login role; returns its URL."""
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            raise ValueError(f"{name!r}: use a plain lower-case identifier")
        self._psql("postgres", "CREATE DATABASE :\"db\" OWNER :\"user\";\n", {"db": name, "user": self.user})
        return self.url_for(name)

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()
