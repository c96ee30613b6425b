"""``hpoflow dashboard RUN_DIR [--port N]``: optuna-dashboard on a run's storage, on 127.0.0.1 only,
read-only (the storage refuses every write, the server every method but GET and HEAD) and answering
only requests addressed to ``127.0.0.1:PORT`` or ``localhost:PORT`` (no DNS rebinding).

Each connection is served on a daemon thread of its own, with a read (and write) timeout on its
socket: a client that connects and then sends nothing more (a browser's preconnect) holds only its
own thread, and only for ``CLIENT_TIMEOUT_S``. The main thread only accepts, and stops on SIGINT or
SIGTERM without waiting for the connections still open (optuna-dashboard's own server is threaded
too: its app is safe to call from several threads)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any, NoReturn

from hpoflow.cli._args import add_storage_args, non_negative_int, storage_arg

__all__ = ["register"]

INSTALL_HINT = ("the dashboard needs optuna-dashboard, which is not installed. Fix: pip install optuna-dashboard "
                "(or pip install -e '.[dashboard]')")
CLIENT_TIMEOUT_S = 10.0  # a connection that sends or takes nothing for this long is closed
POLL_S = 0.05  # the main thread looks at the stop flag at least this often


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("dashboard", help="serve optuna-dashboard on a run's study (127.0.0.1, read-only)",
                       description="Serve optuna-dashboard on a run directory's storage, bound to 127.0.0.1 "
                                   "(reach it from elsewhere through an ssh tunnel: ssh -L PORT:127.0.0.1:PORT). "
                                   "Read-only: the study cannot be changed through it. It answers only requests "
                                   "addressed to 127.0.0.1:PORT or localhost:PORT. Ctrl-C stops it.")
    p.add_argument("run_dir", help="run directory of a study")
    p.add_argument("--port", type=non_negative_int, default=8080, help="TCP port (0: any free one; default 8080)")
    add_storage_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> NoReturn:
    from hpoflow.cli._readonly import ReadOnlyStorage, guard
    from hpoflow.errors import HpoflowError
    from hpoflow.run.open import open_run_storage

    try:
        import optuna_dashboard
    except ImportError:
        raise HpoflowError(INSTALL_HINT) from None
    storage, study_name, label = open_run_storage(args.run_dir, storage_arg(args))

    app, set_port = guard(optuna_dashboard.wsgi(ReadOnlyStorage(storage)))
    try:
        server = make_server(args.port, app)
    except OSError as exc:
        raise HpoflowError(f"cannot listen on 127.0.0.1:{args.port}: {exc.strerror or exc}. Fix: pick another "
                           "--port, or --port 0 for any free one") from None
    set_port(server.server_port)
    print(f"hpoflow: read-only dashboard of study {study_name!r} ({label}) at http://127.0.0.1:{server.server_port}/ "
          "(Ctrl-C to stop)", file=sys.stderr, flush=True)
    serve_until_signalled(server)
    # Closed, and nothing to save (the storage is read-only): leave without the interpreter's teardown,
    # which for the scipy and scikit-learn that optuna-dashboard imports takes 0.2 s on a quiet machine
    # and over a second on a loaded one; a stop takes under a second whatever the open connections do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make_server(port: int, app: Any) -> Any:
    """A WSGI server of ``app`` on 127.0.0.1:``port`` that serves each connection on a daemon thread of
    its own, closes a connection after ``CLIENT_TIMEOUT_S`` without a byte either way, and keeps quiet
    about those and about clients that went away (imported here: ``http.server`` costs every other
    command 16 ms)."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer
    from wsgiref.simple_server import make_server as wsgiref_server

    class Handler(WSGIRequestHandler):
        timeout = CLIENT_TIMEOUT_S  # StreamRequestHandler sets it on the connection's socket

        def log_message(self, format: str, *a: object) -> None:
            pass

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True  # a connection still open does not hold up the exit ...
        block_on_close = False  # ... nor server_close()

        def handle_error(self, request: Any, client_address: Any) -> None:
            if isinstance(sys.exc_info()[1], OSError):
                return  # the client stalled past CLIENT_TIMEOUT_S or went away: nothing to report
            super().handle_error(request, client_address)

    return wsgiref_server("127.0.0.1", port, app, server_class=Server, handler_class=Handler)


def serve_until_signalled(server: Any) -> None:
    """Serve ``server`` (a ``socketserver`` server) until SIGINT or SIGTERM, then close it. The signal
    only sets a flag, which the accepting loop looks at every ``POLL_S``: a KeyboardInterrupt raised
    inside a request (on a server that serves in this thread) would be caught and printed by wsgiref's
    handler, and the server would go on serving."""
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, lambda signum, frame: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    else:
        old = {}
    server.timeout = POLL_S  # handle_request() returns at least this often to look at the flag
    try:
        while not stop.is_set():
            server.handle_request()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        server.server_close()
