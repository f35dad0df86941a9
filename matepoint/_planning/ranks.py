"""The planner across the ranks of a process group: every rank must plan
the same (timings differ per process, and different plans unbalance
DDP/FSDP or hang tensor parallelism), so each measured figure is reduced to
its max over the group before solving.

That makes :func:`matepoint.plan` and :func:`matepoint.apply`
collectives: every rank of the group must call them. On a gloo group a
rank that does not is named in a RuntimeError once the group's timeout
passes (``monitored_barrier``); NCCL has no such barrier, and a missing
rank there ends in NCCL's own watchdog error after the group's timeout.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def group_timeout(group: Optional[Any]) -> Any:
    """The timeout ``group`` (None: the default group) was made with.
    monitored_barrier's own default is the backend's (30 minutes), not the
    group's; torch keeps a group's in its backend's options, a private name
    (tests/test_planner_distributed.py fails on a torch without it)."""
    dist = _dist()
    group = dist.group.WORLD if group is None else group
    return group._get_backend(torch.device("cpu")).options._timeout


def check_group(where: str, group: Any) -> None:
    """TypeError where ``group`` is neither None nor a process group."""
    dist = _dist()
    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"{where}: group must be a torch.distributed process group or None "
                        f"(the default group), got {type(group).__name__}")


def distributed(group: Optional[Any] = None) -> bool:
    """Whether ``group`` (None: the default group) spans more than one rank."""
    dist = _dist()
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def reduce_max(rows: List[List[float]], where: str, group: Optional[Any] = None
               ) -> List[List[float]]:
    """Each value of ``rows`` (float64) replaced by its max over the ranks of
    ``group``; unchanged outside torch.distributed. Every rank of the group
    must call it with rows of the same shape: on gloo a rank that does not
    is named in a RuntimeError within the group's timeout."""
    if not distributed(group):
        return rows
    dist = _dist()
    backend = dist.get_backend(group)
    if backend == "gloo":
        try:
            dist.monitored_barrier(group, timeout=group_timeout(group))
        except RuntimeError as error:
            raise RuntimeError(
                f"{where} is a collective over the process group: every rank of the group "
                f"must call it, with the same blocks (it takes the max of each measured "
                f"figure over the ranks); a rank did not within the group's timeout: "
                f"{error}") from error
    # float64 holds byte counts exactly below 2**53; gloo and NCCL both reduce it
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
        else torch.device("cpu")
    table = torch.tensor(rows, dtype=torch.float64, device=device)
    dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
    return table.cpu().tolist()
