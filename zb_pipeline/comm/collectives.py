"""Collectives over one process group, with each tensor on the group's device.

Placement, decided per call:

- ``all_reduce``, ``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter_tensor`` *refuse* a tensor on another
  device (``CommDeviceError``): it is model or gradient data, so a wrong device is a bug that a copy would hide (and
  an in-place result would land in the copy);
- ``all_reduce_values`` takes host numbers (flags, counts, limits) and *stages* them on the group's device itself,
  reduces them there and reads them back with one host transfer;
- ``all_gather_object`` and ``broadcast_object_list`` take picklable objects: torch serialises them onto the group's
  device itself (the current CUDA device on NCCL);
- ``barrier`` takes no tensor (NCCL gets this rank's device id, so torch need not guess it).

A peer that died or stopped during any of them raises ``PeerFailedError`` (``zb_pipeline.comm.failures``) naming the
call, the group and the ranks waited for (every other member of the group).

``group=None`` is the default group (the whole world), as in ``torch.distributed``; callers that treat ``None`` as
"no communication needed" (``ParallelContext``'s size-1 groups) check before calling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zb_pipeline.comm.backend import current
from zb_pipeline.comm.failures import calling
from zb_pipeline.comm.placement import check_devices, placement

__all__ = [
    "REDUCE_OPS",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_values",
    "barrier",
    "broadcast_object_list",
    "reduce_scatter_tensor",
]

REDUCE_OPS = ("sum", "max", "min")


def _reduce_op(op: str) -> Any:
    if op not in REDUCE_OPS:
        raise ValueError(f"{op=} must be one of {', '.join(REDUCE_OPS)}")
    return getattr(current().ReduceOp, op.upper())


def all_reduce(t: torch.Tensor, *, op: str = "sum", group: Any = None, async_op: bool = False) -> Any:
    """Reduce ``t`` in place over ``group``; returns the work when ``async_op`` (wait for it with ``comm.wait``)."""
    check_devices("all_reduce", (t,), group)
    with calling("all_reduce", group):
        return current().all_reduce(t, op=_reduce_op(op), group=group, async_op=async_op)


def all_gather(parts: Sequence[torch.Tensor], t: torch.Tensor, *, group: Any = None) -> None:
    """``parts[i]`` := group rank ``i``'s ``t``."""
    check_devices("all_gather", (t, *parts), group)
    with calling("all_gather", group):
        current().all_gather(list(parts), t, group=group)


def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, *, group: Any = None, async_op: bool = False) -> Any:
    """``out`` := every rank's ``t`` concatenated along dim 0, in group-rank order."""
    check_devices("all_gather_into_tensor", (out, t), group)
    b = current()
    gather = getattr(b, "all_gather_single", None) or b.all_gather_into_tensor
    with calling("all_gather_into_tensor", group):
        return gather(out, t, group=group, async_op=async_op)


def reduce_scatter_tensor(out: torch.Tensor, t: torch.Tensor, *, group: Any = None, async_op: bool = False) -> Any:
    """``out`` := group rank r's equal dim-0 slice of the sum of every rank's ``t``."""
    check_devices("reduce_scatter_tensor", (out, t), group)
    b = current()
    scatter = getattr(b, "reduce_scatter_single", None) or b.reduce_scatter_tensor
    with calling("reduce_scatter_tensor", group):
        return scatter(out, t, group=group, async_op=async_op)


def all_reduce_values(
    values: Sequence[float | int], *, op: str = "sum", group: Any = None, dtype: torch.dtype = torch.float64
) -> list[Any]:
    """Reduce host numbers over ``group`` elementwise; the result on every rank, as Python numbers.

    The numbers are written into a tensor on the group's device by fill kernels (no host-to-device copy, which
    would synchronise), reduced, and read back: one host synchronisation per call.
    """
    t = torch.zeros(len(values), dtype=dtype, device=placement(group).device)
    for i, v in enumerate(values):
        if v:
            t[i] = v
    with calling("all_reduce", group):
        current().all_reduce(t, op=_reduce_op(op), group=group)
    return t.tolist()


def all_gather_object(out: list[Any], obj: Any, *, group: Any = None) -> None:
    """``out[i]`` := group rank ``i``'s picklable ``obj`` (``out`` has the group's size)."""
    with calling("all_gather_object", group):
        current().all_gather_object(out, obj, group=group)


def broadcast_object_list(objs: list[Any], *, src: int, group: Any = None) -> None:
    """``objs`` := global rank ``src``'s ``objs`` (picklable objects, same length on every rank)."""
    with calling("broadcast_object_list", group):
        current().broadcast_object_list(objs, src=src, group=group)


def barrier(*, group: Any = None) -> None:
    """Every rank of ``group`` reaches this point before any leaves it."""
    where = placement(group)
    with calling("barrier", group):
        if where.is_nccl and where.device.index is not None:
            current().barrier(group=group, device_ids=[where.device.index])
        else:
            current().barrier(group=group)
