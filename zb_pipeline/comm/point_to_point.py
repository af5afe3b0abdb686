"""Point-to-point transfers and the one way to wait for any asynchronous work of the layer.

Every transfer is refused (``CommDeviceError``) when its tensor is not on the group's device: a pipeline hand-off
or a receive buffer on the wrong device means the stage or its boundary spec is wrong, and a silent copy would hide
it (a received tensor would land in the copy).

``wait(work, group=..., timeout=...)``:

- gloo: ``work.wait(timeout)``, a host-side wait that raises once ``timeout`` has passed (``None``: the group's
  timeout, as ``work.wait()``);
- NCCL: ``work.wait()`` with no per-call timeout, whatever the caller passed.  On NCCL a timed wait blocks the CPU
  until the transfer is done; without one it only makes the current (compute) stream wait for the communication
  stream, so the CPU keeps issuing work.  A transfer that never completes is aborted by the NCCL watchdog after the
  process group's timeout (``zb_pipeline.comm.groups``).

A peer that died or stopped raises ``PeerFailedError`` (``zb_pipeline.comm.failures``) naming the call, the group and
the peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from zb_pipeline.comm.backend import current
from zb_pipeline.comm.failures import calling
from zb_pipeline.comm.placement import GroupPlacement, check_devices, placement

__all__ = ["batch_isend_irecv", "irecv", "isend", "recv", "send", "wait"]


def isend(t: torch.Tensor, peer: int, *, group: Any = None, tag: int = 0, where: GroupPlacement | None = None) -> Any:
    """Start sending ``t`` to global rank ``peer``; returns the work.  ``where``: ``group``'s placement if the caller
    holds it (``comm.placement(group)``, resolved once), saving the per-call lookup."""
    check_devices("isend", (t,), group, where)
    with calling("isend", group, (peer,)):
        return current().isend(t, peer, group=group, tag=tag)


def irecv(buf: torch.Tensor, peer: int, *, group: Any = None, tag: int = 0, where: GroupPlacement | None = None) -> Any:
    """Start receiving into ``buf`` from global rank ``peer``; returns the work (``where``: as for ``isend``)."""
    check_devices("irecv", (buf,), group, where)
    with calling("irecv", group, (peer,)):
        return current().irecv(buf, peer, group=group, tag=tag)


def send(t: torch.Tensor, peer: int, *, group: Any = None) -> None:
    """Send ``t`` to global rank ``peer`` and return when it is sent."""
    check_devices("send", (t,), group)
    with calling("send", group, (peer,)):
        current().send(t, peer, group=group)


def recv(buf: torch.Tensor, peer: int, *, group: Any = None) -> None:
    """Receive into ``buf`` from global rank ``peer`` and return when it has arrived."""
    check_devices("recv", (buf,), group)
    with calling("recv", group, (peer,)):
        current().recv(buf, peer, group=group)


def batch_isend_irecv(
    ops: Sequence[tuple[bool, torch.Tensor, int]],
    *,
    group: Any = None,
    tag: int = 0,
    where: GroupPlacement | None = None,
) -> list[Any]:
    """Post ``(is_send, tensor, global peer)`` ops as one group (NCCL matches them as a unit); one work per op
    (``where``: as for ``isend``)."""
    if not ops:
        return []
    check_devices("batch_isend_irecv", (t for _, t, _ in ops), group, where)
    b = current()
    with calling("batch_isend_irecv", group, sorted({peer for _, _, peer in ops})):
        return list(
            b.batch_isend_irecv(
                [b.P2POp(b.isend if s else b.irecv, t, peer, group=group, tag=tag) for s, t, peer in ops]
            )
        )


def wait(
    work: Any,
    *,
    group: Any = None,
    timeout: timedelta | None = None,
    op: str = "wait",
    peers: Sequence[int] | None = None,
    where: GroupPlacement | None = None,
) -> None:
    """Wait for ``work`` of ``group`` (see the module docstring: a host timeout on gloo only; ``where``: as for
    ``isend``).

    ``op`` names the call whose work this is and ``peers`` the global ranks it waits for (default: the group's
    other members), for the ``PeerFailedError`` raised if a peer died or stopped.
    """
    with calling(op, group, peers):
        if timeout is None or (where if where is not None else placement(group)).is_nccl:
            work.wait()
        else:
            work.wait(timeout)
