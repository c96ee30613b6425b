"""``hpoflow dashboard RUN_DIR [--port N]``: optuna-dashboard on a run's storage, on 127.0.0.1 only."""

from __future__ import annotations

import argparse
import sys

from hpoflow.cli._args import add_storage_args, non_negative_int, storage_arg

__all__ = ["register"]

INSTALL_HINT = ("the dashboard needs optuna-dashboard, which is not installed. Fix: pip install optuna-dashboard "
                "(or pip install -e '.[dashboard]')")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("dashboard", help="serve optuna-dashboard on a run's study (127.0.0.1)",
                       description="Serve optuna-dashboard on a run directory's storage, bound to 127.0.0.1 "
                                   "(reach it from elsewhere through an ssh tunnel). Ctrl-C stops it.")
    p.add_argument("run_dir", help="run directory of a study")
    p.add_argument("--port", type=non_negative_int, default=8080, help="TCP port (0: any free one; default 8080)")
    add_storage_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from wsgiref.simple_server import WSGIRequestHandler, make_server

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

    try:
        server = make_server("127.0.0.1", args.port, optuna_dashboard.wsgi(storage), handler_class=_Quiet)
    except OSError as exc:
        raise HpoflowError(f"cannot listen on 127.0.0.1:{args.port}: {exc.strerror or exc}. Fix: pick another "
                           "--port, or --port 0 for any free one") from None
    print(f"hpoflow: dashboard of study {study_name!r} ({label}) at http://127.0.0.1:{server.server_port}/ "
          "(Ctrl-C to stop)", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
