"""``hpoflow schema [-o FILE]``: the JSON Schema of a study spec, for editors and CI checks."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("schema", help="print the JSON Schema of a study spec (for editors)",
                       description="Print the JSON Schema of a study spec. Point your editor's YAML language "
                                   "server at it: '# yaml-language-server: $schema=PATH' on a spec's first line.")
    p.add_argument("-o", "--output", help="write it to this file instead of stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpoflow.fileio import write_atomic
    from hpoflow.spec.schema import study_schema

    text = json.dumps(study_schema(), indent=1, sort_keys=True) + "\n"
    if args.output:
        write_atomic(Path(args.output), text)
    else:
        print(text, end="")
    return 0
