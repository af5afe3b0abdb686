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

__all__ = ["COLLECTIVE_CALLS", "DistError", "ProcessGroup", "current", "is_available", "use"]

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


def is_available() -> bool:
    """Whether this torch build has ``torch.distributed`` at all."""
    return bool(dist.is_available())
