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

``P2PLink(group)``: the same sends, receives and waits over one group, resolved once -- what a caller that transfers
on every step uses (the pipeline's P2P layer).  See the class.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from zb_pipeline.comm.backend import current, direct_group_of
from zb_pipeline.comm.failures import calling, raise_peer_failure
from zb_pipeline.comm.placement import GroupPlacement, check_devices, placement

_Tensor = torch.Tensor

__all__ = ["P2PLink", "batch_isend_irecv", "irecv", "isend", "recv", "send", "wait"]


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


class P2PLink:
    """``isend``, ``irecv`` and ``wait`` over one group, with everything about the group resolved when the link is
    made: its placement, the process group object, and each peer's rank in it (on first use).

    The calls keep the module functions' rules: every tensor is checked against the group's device
    (``CommDeviceError``), a wait has a host timeout on gloo and none on NCCL, and a dead or stopped peer raises
    ``PeerFailedError`` naming the call, the group and the peer.  What they skip is the per-call Python in between:
    with the real ``torch.distributed`` underneath, a transfer calls the process group's own ``send``/``recv``
    (what ``torch.distributed.isend``/``irecv`` end in), not their default-group look-ups, rank translation and
    argument checks.  A tensor subclass goes through ``torch.distributed`` as before (its torch function), and so does
    a complex tensor except on gloo, which moves a tensor's bytes (``torch.distributed`` hands NCCL a real view).
    Under a stand-in backend (``use``) the link calls what the stand-in's ``direct_group`` returns, or else its
    ``isend``/``irecv`` (``backend.direct_group``); a link made under a stand-in keeps it.
    """

    __slots__ = ("_cpu", "_gloo", "_impl", "_nccl", "_pg", "_ranks", "group", "where")

    def __init__(self, group: Any = None, *, where: GroupPlacement | None = None) -> None:
        self.group = group
        self.where = placement(group) if where is None else where
        self._nccl = self.where.is_nccl
        # A CPU group (gloo) accepts exactly the tensors with ``is_cpu``: one attribute read instead of a device
        # object and a comparison.  gloo moves bytes, so a complex tensor needs no real view there.
        self._cpu = self.where.device == torch.device("cpu")
        self._gloo = self.where.backend == "gloo"
        self._impl = current()
        self._pg = direct_group_of(self._impl, group)
        self._ranks: dict[int, int] = {}  # global rank -> rank in the group

    def _group_rank(self, peer: int) -> int:
        rank = self._ranks.get(peer)
        if rank is None:
            rank = peer if self.group is None else int(self._impl.get_group_rank(self.group, peer))
            self._ranks[peer] = rank
        return rank

    def isend(self, t: torch.Tensor, peer: int, tag: int = 0) -> Any:
        """Start sending ``t`` to global rank ``peer``; returns the work."""
        if not (t.is_cpu if self._cpu else self.where.accepts(t.device)):
            check_devices("isend", (t,), self.group, self.where)  # raises, naming the call and both devices
        pg = self._pg
        try:
            if pg is not None and type(t) is _Tensor and (self._gloo or not t.is_complex()):
                rank = self._ranks.get(peer)
                return pg.send([t], self._group_rank(peer) if rank is None else rank, tag)
            return self._impl.isend(t, peer, group=self.group, tag=tag)
        except Exception as err:
            raise_peer_failure(err, op="isend", group=self.group, peers=(peer,))
            raise

    def irecv(self, buf: torch.Tensor, peer: int, tag: int = 0) -> Any:
        """Start receiving into ``buf`` from global rank ``peer``; returns the work."""
        if not (buf.is_cpu if self._cpu else self.where.accepts(buf.device)):
            check_devices("irecv", (buf,), self.group, self.where)
        pg = self._pg
        try:
            if pg is not None and type(buf) is _Tensor and (self._gloo or not buf.is_complex()):
                rank = self._ranks.get(peer)
                return pg.recv([buf], self._group_rank(peer) if rank is None else rank, tag)
            return self._impl.irecv(buf, peer, group=self.group, tag=tag)
        except Exception as err:
            raise_peer_failure(err, op="irecv", group=self.group, peers=(peer,))
            raise

    def irecv_new(self, size: Sequence[Any], dtype: torch.dtype, peer: int, tag: int = 0) -> tuple[Any, torch.Tensor]:
        """Start receiving from global rank ``peer`` into a new ``torch.empty(*size, dtype=dtype)`` on the group's
        device; returns the work and the buffer.  The buffer is made on the right device, so it needs no check."""
        buf = torch.empty(*size, dtype=dtype, device=self.where.device)
        pg = self._pg
        try:
            if pg is not None and (self._gloo or not dtype.is_complex):
                rank = self._ranks.get(peer)
                return pg.recv([buf], self._group_rank(peer) if rank is None else rank, tag), buf
            return self._impl.irecv(buf, peer, group=self.group, tag=tag), buf
        except Exception as err:
            raise_peer_failure(err, op="irecv", group=self.group, peers=(peer,))
            raise

    def wait(
        self, work: Any, timeout: timedelta | None = None, *, op: str = "wait", peers: Sequence[int] | None = None
    ) -> None:
        """``wait(work, group=..., timeout=..., op=..., peers=...)`` for this link's group."""
        try:
            if timeout is None or self._nccl:
                work.wait()
            else:
                work.wait(timeout)
        except Exception as err:
            raise_peer_failure(err, op=op, group=self.group, peers=peers)
            raise
