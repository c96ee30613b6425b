"""Which errors of a rank of a multi-rank trial say that a peer, not the trial, failed.

When a node crashes, or a rank on it is killed, the ranks on the other nodes fail in their next
collective with an error of their own: gloo's ``Connection closed by peer``, NCCL's ``remote process
exited``, a watchdog's timeout. Such an error is worth a retry (the trial reruns from its checkpoint
on the nodes left); an exception of the user's code is not. ``collective_lost`` tells them apart by
the exception's type (torch's ``DistNetworkError``, ``DistStoreError``, ``DistBackendError``) and
its text. Standard library only: the runner uses it in every engine's rank process.
"""

from __future__ import annotations

import re

__all__ = ["collective_lost"]

# torch.distributed's own error types for a broken link, a lost store and a backend's failure
_TYPES = frozenset({"DistNetworkError", "DistStoreError", "DistBackendError"})
# what gloo, NCCL, the c10d stores and their watchdogs write when a peer went away (lower case)
_TEXT = re.compile("|".join((
    r"\bgloo\b", r"connection (closed|reset|refused|timed out|lost|aborted)", r"timed out", r"broken pipe",
    r"socket timeout",
    r"\bnccl\b[^\n]{0,200}(remote process exited|network error|system error|communicator was aborted|timeout)",
    r"ncclremoteerror|ncclsystemerror|ncclinternalerror",
    r"watchdog caught collective operation timeout",
)), re.IGNORECASE)


def collective_lost(error_type: str, text: str) -> bool:
    """Whether an exception of ``error_type`` (its class name) with message ``text``, raised in a rank
    of a trial of several ranks, says that a peer or the link to it failed (retryable)."""
    return error_type in _TYPES or bool(_TEXT.search(text))
