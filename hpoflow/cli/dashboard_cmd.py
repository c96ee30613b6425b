"""``hpoflow dashboard RUN_DIR [--port N]``: optuna-dashboard on a run's storage, on 127.0.0.1 only,
read-only (the storage refuses every write, the server every method but GET and HEAD) and answering
only requests addressed to ``127.0.0.1:PORT`` or ``localhost:PORT`` (no DNS rebinding)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from hpoflow.cli._args import add_storage_args, non_negative_int, storage_arg

__all__ = ["register"]

INSTALL_HINT = ("the dashboard needs optuna-dashboard, which is not installed. Fix: pip install optuna-dashboard "
                "(or pip install -e '.[dashboard]')")


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


def run(args: argparse.Namespace) -> int:
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from hpoflow.cli._readonly import ReadOnlyStorage, guard
    from hpoflow.errors import HpoflowError
    from hpoflow.run.open import open_run_storage

    try:
        import optuna_dashboard
    except ImportError:
        raise HpoflowError(INSTALL_HINT) from None
    storage, study_name, label = open_run_storage(args.run_dir, storage_arg(args))

    class _Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *a: object) -> None:
            pass

    app, set_port = guard(optuna_dashboard.wsgi(ReadOnlyStorage(storage)))
    try:
        server = make_server("127.0.0.1", args.port, app, handler_class=_Quiet)
    except OSError as exc:
        raise HpoflowError(f"cannot listen on 127.0.0.1:{args.port}: {exc.strerror or exc}. Fix: pick another "
                           "--port, or --port 0 for any free one") from None
    set_port(server.server_port)
    print(f"hpoflow: read-only dashboard of study {study_name!r} ({label}) at http://127.0.0.1:{server.server_port}/ "
          "(Ctrl-C to stop)", file=sys.stderr, flush=True)
    serve_until_signalled(server)
    return 0


def serve_until_signalled(server: Any) -> None:
    """Serve ``server`` (a ``socketserver`` server) until SIGINT or SIGTERM, then close it. The signal
    only sets a flag: a KeyboardInterrupt raised inside a request would be caught and printed by
    wsgiref's handler, and the server would go on serving."""
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, lambda signum, frame: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    else:
        old = {}
    server.timeout = 0.2  # handle_request() returns at least this often to look at the flag
    try:
        while not stop.is_set():
            server.handle_request()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        server.server_close()
