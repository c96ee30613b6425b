"""A program that writes files under fixed names in its working directory, as real training scripts do
(``model.pt``; ``lightning_logs/version_N/``, N the first free number, as Lightning picks it), then
``--save``'s path; it reads ``--data`` (a file that must exist) first. Standard library only. Prints
``score=1``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--save", required=True)
    p.add_argument("--x", type=float, default=0.0)
    a = p.parse_args()
    Path(a.data).read_text()  # an input named relative to where hpoflow runs
    me = {"x": a.x, "pid": os.getpid(), "cwd": os.getcwd(), "argv": sys.argv}
    Path("model.pt").write_text(json.dumps(me))
    n = 0
    while Path("lightning_logs", f"version_{n}").exists():
        n += 1
    Path("lightning_logs", f"version_{n}").mkdir(parents=True)
    time.sleep(0.5)  # the two trials overlap
    Path("lightning_logs", f"version_{n}", "hparams.json").write_text(json.dumps(me))
    Path(a.save).write_text(json.dumps(me))
    print("score=1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
