"""SLURM host lists: ``n[1-3,7],gpu-a[01-02]`` <-> ``["n1", "n2", "n3", "n7", "gpu-a01", "gpu-a02"]``.

SLURM writes node sets (``SLURM_JOB_NODELIST``, ``SLURM_STEP_NODELIST``) in its compressed hostlist
syntax: comma-separated items, each a name with bracketed ranges, zero padding kept (``[08-10]``),
several bracket groups multiplied out (``r[1-2]n[1-2]``). ``expand`` is a pure-Python version of
``scontrol show hostnames`` (no subprocess, no call to slurmctld), in SLURM's order.
"""

from __future__ import annotations

import itertools
import re

__all__ = ["HostlistError", "expand"]

_MAX_HOSTS = 1_000_000  # far beyond any cluster; a typo such as n[1-999999999] is refused, not expanded


class HostlistError(ValueError):
    """A host list SLURM would not write."""


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested brackets in host list {text!r}")
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in host list {text!r}")
        elif c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"unbalanced '[' in host list {text!r}")
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def _range(spec: str, text: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not (lo.isascii() and lo.isdigit()) or (sep and not (hi.isascii() and hi.isdigit())):
            raise HostlistError(f"bad range {part!r} in host list {text!r}")
        if not sep:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a or b - a >= _MAX_HOSTS:
            raise HostlistError(f"bad range {part!r} in host list {text!r}")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(k).zfill(width) for k in range(a, b + 1))
    return out


def expand(text: str) -> list[str]:
    """The host names of a SLURM host list, in order, duplicates kept as SLURM keeps them."""
    hosts: list[str] = []
    for item in _split_top(text or ""):
        pieces = re.split(r"\[([^\]]*)\]", item)  # text, range, text, range, ..., text
        choices = [[p] if i % 2 == 0 else _range(p, text) for i, p in enumerate(pieces)]
        total = 1
        for c in choices:
            total *= len(c)
        if len(hosts) + total > _MAX_HOSTS:
            raise HostlistError(f"host list {text!r} names more than {_MAX_HOSTS} hosts")
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts
