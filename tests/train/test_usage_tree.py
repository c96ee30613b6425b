"""A command trial's usage measures its program (``UsageSampler(tree=True)``): the CPU time and peak memory
of the processes below the rank, which the rank's own counters do not see."""

from __future__ import annotations

import subprocess
import sys

from hpoflow.train.usage import UsageSampler

# a child that holds 300 MB resident and burns about 0.5 s of CPU, then exits
CHILD = ("import time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); t = time.process_time(); "
         "exec('while time.process_time() - t < 0.5: pass')")


def _measure(tree: bool) -> dict[str, float]:
    sampler = UsageSampler(interval_s=0.05, quiet_s=0.0, tree=tree).start()
    subprocess.run([sys.executable, "-c", CHILD], check=True)
    return sampler.stop()


def test_the_tree_counts_what_the_program_used_and_the_process_alone_does_not() -> None:
    alone, tree = _measure(False), _measure(True)
    # CPU: the child's 0.5 s over the wall time (>= 0.5 s, a loaded machine makes it longer; the bound says
    # only that the child's CPU is in the figure: at most a few % without it)
    assert tree["cpu_percent"] >= 20.0, tree
    assert alone["cpu_percent"] < 20.0, alone
    # the child's 300 MB (its peak, from the kernel, once it ended) on top of this process's own memory
    assert tree["rss_peak_mb"] >= alone["rss_peak_mb"] + 250.0, (tree, alone)
