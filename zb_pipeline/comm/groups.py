"""Process groups: joining the default group, creating subgroups, and asking about them.

Timeouts (why a dead peer becomes an error, not a hang):

- **gloo**: every group gets ``timeout`` at creation, and host-side waits of the layer pass a per-call timeout
  (``zb_pipeline.comm.point_to_point.wait``), as the P2P layer's error messages promise.
- **NCCL**: the CPU must not block on a transfer (a wait only makes the compute stream wait), so the timeout is the
  process group's: the NCCL watchdog aborts a collective that runs longer than ``timeout``.  Asynchronous error
  handling must be on for that abort to reach the process: ``init_process_group`` sets
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (abort the communicators, then tear the process down) unless the
  environment already chose a mode.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from zb_pipeline.comm.backend import current, is_available

__all__ = [
    "NCCL_ASYNC_ERROR_HANDLING",
    "backend_name",
    "destroy",
    "group_ranks",
    "init_process_group",
    "is_initialized",
    "new_group",
    "rank",
    "world_size",
]

NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def is_initialized() -> bool:
    """Whether the default process group exists (``False`` without ``torch.distributed`` at all)."""
    return is_available() and bool(current().is_initialized())


def init_process_group(backend: str, *, rank: int, world_size: int, timeout: timedelta) -> None:
    """Join the default group (rendezvous from the torchrun environment); NCCL gets asynchronous error handling."""
    if "nccl" in backend:
        os.environ.setdefault(NCCL_ASYNC_ERROR_HANDLING, "1")
    current().init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)


def new_group(ranks: Sequence[int], *, timeout: timedelta, name: str | None = None) -> Any:
    """A subgroup of ``ranks`` with its own ``timeout`` (collective over the whole world: every rank calls it).

    ``name`` (e.g. ``"dp"``) becomes the group's ``group_desc``, which ``PeerFailedError`` messages name."""
    if name is None:
        return current().new_group(list(ranks), timeout=timeout)
    return current().new_group(list(ranks), timeout=timeout, group_desc=name)


def destroy() -> None:
    """Destroy the default group and every subgroup."""
    current().destroy_process_group()


def backend_name(group: Any = None) -> str:
    """The backend of ``group`` (``None``: the default group), e.g. ``"gloo"`` or ``"nccl"``."""
    return str(current().get_backend(group))


def world_size(group: Any = None) -> int:
    """Number of ranks in ``group`` (``None``: the default group)."""
    return int(current().get_world_size(group))


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (``None``: its global rank)."""
    return int(current().get_rank(group))


def group_ranks(group: Any = None) -> tuple[int, ...]:
    """Global ranks of ``group``'s members, in group-rank order (``None``: the whole world)."""
    if group is None:
        return tuple(range(world_size()))
    return tuple(current().get_process_group_ranks(group))
