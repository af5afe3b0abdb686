"""The one place that imports ``torch.distributed``: the implementation the communication layer talks to.

Every other module of ``zb_pipeline.comm`` reaches ``torch.distributed`` through ``current()``, so a test can put a
recording or checking stand-in underneath the whole layer with ``use(fake)`` (``zb_pipeline.testing.device_checks``
wraps the real module to assert every tensor's device; a fake backend records how each work was waited for).  The
stand-in needs only the attributes the layer calls; anything it lacks is an ``AttributeError`` naming it.

``ProcessGroup`` and ``DistError`` are re-exported for type annotations and ``except`` clauses elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

__all__ = [
    "COLLECTIVE_CALLS",
    "DistError",
    "ProcessGroup",
    "current",
    "direct_group",
    "direct_group_of",
    "is_available",
    "use",
]

# the backend's tensor collectives (names of torch.distributed functions), for wrappers that inspect calls in tests
COLLECTIVE_CALLS = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "broadcast",
        "reduce",
    }
)

ProcessGroup = dist.ProcessGroup
DistError = dist.DistError

_stack: list[Any] = [dist]


def current() -> Any:
    """The ``torch.distributed`` the layer calls now (the real module unless a test installed a stand-in)."""
    return _stack[-1]


@contextmanager
def use(impl: Any) -> Iterator[Any]:
    """Route every call of the layer to ``impl`` inside the block (tests: a checking wrapper or a fake)."""
    _stack.append(impl)
    try:
        yield impl
    finally:
        _stack.remove(impl)


def direct_group(group: Any = None) -> Any | None:
    """The process group object whose own ``send``/``recv`` a transfer over ``group`` may call, skipping
    ``torch.distributed``'s per-call Python (``None``: the default group's).

    With the real module underneath that is the group itself.  A stand-in sees every call as ``isend``/``irecv``
    (``None`` is returned) unless it offers ``direct_group(group)``, whose result (a recording, checking or timing
    wrapper of the process group: ``send(tensors, group_peer, tag)``, ``recv(...)``) is returned instead.
    """
    return direct_group_of(current(), group)


def direct_group_of(impl: Any, group: Any = None) -> Any | None:
    """``direct_group`` with ``impl`` underneath (a wrapping stand-in asks it of what it wraps)."""
    if impl is dist:
        return dist.group.WORLD if group is None else group
    offer = getattr(impl, "direct_group", None)
    return None if offer is None else offer(group)


def is_available() -> bool:
    """Whether this torch build has ``torch.distributed`` at all."""
    return bool(dist.is_available())
