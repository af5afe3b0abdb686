"""Which device a process group's tensors live on, and the check every tensor call of the layer makes.

A group's backend decides its device: NCCL moves CUDA tensors only (this rank's current CUDA device, which
``ParallelContext.initialize`` sets before it creates the groups), gloo moves CPU tensors only.  A CPU tensor handed
to an NCCL group fails deep inside torch ("No backend type associated with device type cpu") -- or, for a tensor on
another GPU, silently talks to the wrong device -- so the layer checks before it calls: ``check_devices`` raises
``CommDeviceError`` naming the call, the group's backend and both devices.

Tests can declare a group's placement without the hardware: ``pretend(group, backend="nccl", device="meta")``
makes the layer resolve that group (any object, e.g. a fake group handed to a fake backend) as NCCL on ``meta``,
so the NCCL-only rules (device checks, waits without a host timeout) run on a CPU machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from zb_pipeline.comm.backend import current

__all__ = ["CommDeviceError", "GroupPlacement", "check_devices", "device_of", "placement", "pretend"]

# Backend name -> the device type its tensors must be on.  A mixed backend ("cpu:gloo,cuda:nccl") counts as NCCL:
# the layer hands it device tensors.
_DEVICE_TYPE = {"nccl": "cuda", "gloo": "cpu", "mpi": "cpu", "xccl": "xpu"}


class CommDeviceError(RuntimeError):
    """A tensor handed to a collective or a transfer is not on the device of the group it goes over."""


@dataclass(frozen=True)
class GroupPlacement:
    """A group's backend and the device its tensors must be on."""

    backend: str
    device: torch.device

    @property
    def is_nccl(self) -> bool:
        """NCCL (also within a mixed backend): waits only make the compute stream wait; the watchdog times out."""
        return "nccl" in self.backend

    def accepts(self, device: torch.device) -> bool:
        want = self.device
        return device.type == want.type and (want.index is None or device.index == want.index)


_pretended: list[tuple[Any, GroupPlacement]] = []


@contextmanager
def pretend(group: Any, *, backend: str, device: torch.device | str) -> Iterator[GroupPlacement]:
    """Inside the block the layer resolves ``group`` (compared by identity) as ``backend`` on ``device``."""
    entry = (group, GroupPlacement(str(backend), torch.device(device)))
    _pretended.append(entry)
    try:
        yield entry[1]
    finally:
        _pretended.remove(entry)


def placement(group: Any = None) -> GroupPlacement:
    """The backend and device of ``group`` (``None``: the default group)."""
    for g, where in reversed(_pretended):
        if g is group:
            return where
    name = str(current().get_backend(group)).lower()
    if "nccl" in name:
        return GroupPlacement(name, torch.device("cuda", torch.cuda.current_device()))
    for part in name.replace(",", ":").split(":"):
        if part in _DEVICE_TYPE:
            return GroupPlacement(name, torch.device(_DEVICE_TYPE[part]))
    raise CommDeviceError(f"process group backend {name!r} is not one the layer knows ({', '.join(_DEVICE_TYPE)})")


def device_of(group: Any = None) -> torch.device:
    """The device ``group``'s tensors must be on: create staging and receive buffers there."""
    return placement(group).device


def check_devices(
    op: str, tensors: Iterable[torch.Tensor], group: Any, where: GroupPlacement | None = None
) -> GroupPlacement:
    """``group``'s placement, after checking that every tensor of call ``op`` is on its device.  ``where``: the
    group's placement as the caller resolved it once (the P2P layer, per transfer), so it is not looked up again."""
    if where is None:
        where = placement(group)
    for t in tensors:
        if not where.accepts(t.device):
            raise CommDeviceError(
                f"{op}: a {tuple(t.shape)} {t.dtype} tensor on {t.device} cannot go over a {where.backend} group, "
                f"whose tensors live on {where.device}; create it on comm.device_of(group) (the ParallelContext's "
                "device)"
            )
    return where
