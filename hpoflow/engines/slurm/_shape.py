"""The trial shapes the slurm engine never runs (``check_shape``: elastic trials, ranks that do not split
evenly over their nodes, a share of a GPU without node agents) and the one line that refuses a share of a
GPU, which says whether the cluster has ``gres/shard``."""

from __future__ import annotations

from hpoflow.engines.base import TrialRequest
from hpoflow.engines.cluster.layout import processes_per_node
from hpoflow.engines.slurm.allocation import config_value
from hpoflow.engines.slurm.replan import run_client
from hpoflow.errors import EngineError

__all__ = ["check_shape", "gres_types", "share_refusal"]


def check_shape(request: TrialRequest, share_site: bool = False, agents: bool = False) -> None:
    """``EngineError`` for a shape the engine never runs. A share of a GPU runs on node agents only (each
    agent's local engine shares the GPUs its node was given; a step per trial would take whole GPUs).
    ``share_site``: a share's refusal says whether this cluster has ``gres/shard`` (one ``scontrol show
    config``; ``check_fit`` only)."""
    if request.elastic:
        raise EngineError("resources.processes: {min, max} makes trials elastic, which the slurm engine does not "
                          "resize. Fix: give resources.processes a number (or use the local or compss engine)")
    try:
        processes_per_node(request)
    except ValueError as exc:
        raise EngineError(str(exc)) from None
    if not agents and not float(request.gpus_per_process).is_integer():
        raise EngineError(share_refusal(request.gpus_per_process, gres_types() if share_site else None))


def share_refusal(gpus_per_process: float, gres_types: str | None) -> str:
    """The one line refusing a share of a GPU; ``gres_types``: the cluster's ``GresTypes`` (None: unknown)."""
    head = f"resources.gpus_per_process: {gpus_per_process} shares a GPU between trials"
    fix = ("Fix: run the driver inside an allocation with engine_options.agents: auto or on (node agents share "
           "the allocation's GPUs between trials), set gpus_per_process: 1 (whole GPUs), or use the local engine")
    if gres_types is not None and "shard" in gres_types.split(","):
        return (f"{head}; this cluster has gres/shard (GresTypes={gres_types}), but hpoflow's slurm engine does "
                f"not ask SLURM for shards: a step or job per trial gives each rank whole GPUs. {fix}")
    where = " (and this cluster declares none)" if gres_types is not None else ""
    return (f"{head}, but a step or job per trial gives each rank whole GPUs: the slurm engine does not ask "
            f"SLURM for gres/shard{where}. {fix}")


def gres_types() -> str | None:
    """This cluster's ``GresTypes`` (``gpu,shard``; ``""`` where it declares none), None where
    ``scontrol show config`` does not answer."""
    config = run_client(["scontrol", "show", "config"])
    if not config:
        return None
    value = config_value(config, "GresTypes") or ""
    return "" if value == "(null)" else value
