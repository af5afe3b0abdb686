"""Record what the communication layer issued, in order, for structural tests (no timings).

``OpRecorder`` wraps ``torch.distributed`` underneath the layer (``with comm.use(OpRecorder(dist)) as rec:``) and
appends one ``CommEvent`` per call -- its name, its group and whether the call itself blocks (a collective without
``async_op``, ``send``/``recv``, the object collectives, ``barrier``) -- and one per wait on the work it returned
(``wait`` of an ``isend``, ``irecv``, or an asynchronous collective).  A test adds its own marks into the same
sequence (``mark``: e.g. from a wrapped action handler, or before the optimizer step) and asserts what stands between
them: ``tests/test_iteration_boundary.py`` shows that nothing waits for another rank between a pipeline rank's last
compute action and its optimizer step.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zb_pipeline.comm.backend import COLLECTIVE_CALLS, direct_group_of

__all__ = ["CommEvent", "OpRecorder"]

_COLLECTIVES = COLLECTIVE_CALLS
_ALWAYS_BLOCKING = frozenset({"send", "recv", "barrier", "all_gather_object", "broadcast_object_list"})
_ASYNC_P2P = frozenset({"isend", "irecv"})


@dataclass(frozen=True)
class CommEvent:
    """One recorded call (``what="call"``), wait (``what="wait"``, ``name`` of the call whose work it waited for)
    or test mark (``what="mark"``, ``name`` chosen by the test)."""

    what: str
    name: str
    group: Any = None
    blocking: bool = False
    detail: Any = None

    @property
    def waits_for_others(self) -> bool:
        """A call that blocks, or a wait on a receive or a collective (a send's completion is not counted)."""
        if self.what == "call":
            return self.blocking
        return self.what == "wait" and self.name != "isend"


class _RecordedWork:
    def __init__(self, work: Any, rec: OpRecorder, name: str, group: Any) -> None:
        self._work, self._rec, self._name, self._group = work, rec, name, group

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._rec.events.append(CommEvent("wait", self._name, self._group, True))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _RecordedGroup:
    """A process group whose ``send``/``recv`` are recorded as ``isend``/``irecv`` calls (``direct_group``)."""

    def __init__(self, rec: OpRecorder, real: Any, group: Any) -> None:
        self._rec, self._real, self._group = rec, real, group

    def send(self, tensors: list[Any], group_peer: int, tag: int) -> Any:
        self._rec.events.append(CommEvent("call", "isend", self._group, False))
        return _RecordedWork(self._real.send(tensors, group_peer, tag), self._rec, "isend", self._group)

    def recv(self, tensors: list[Any], group_peer: int, tag: int) -> Any:
        self._rec.events.append(CommEvent("call", "irecv", self._group, False))
        return _RecordedWork(self._real.recv(tensors, group_peer, tag), self._rec, "irecv", self._group)


class OpRecorder:
    """``torch.distributed`` that records every call and wait (module docstring)."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.events: list[CommEvent] = []

    def mark(self, name: str, detail: Any = None) -> None:
        """Put a test's own event into the sequence."""
        self.events.append(CommEvent("mark", name, detail=detail))

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name in _COLLECTIVES or name in _ALWAYS_BLOCKING or name in _ASYNC_P2P:
            return functools.partial(self._call, name, attr)
        return attr

    def _call(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        blocking = name in _ALWAYS_BLOCKING or (name in _COLLECTIVES and not kwargs.get("async_op", False))
        self.events.append(CommEvent("call", name, group, blocking))
        out = fn(*args, **kwargs)
        return _RecordedWork(out, self, name, group) if out is not None and not blocking else out

    def P2POp(self, op: Any, tensor: Any, peer: int, group: Any = None, tag: int = 0) -> Any:  # noqa: N802
        """torch's ``P2POp`` over the real ``isend``/``irecv`` (torch checks the function's identity)."""
        real_op = op.args[1] if isinstance(op, functools.partial) else op
        return self._real.P2POp(real_op, tensor, peer, group=group, tag=tag)

    def direct_group(self, group: Any = None) -> Any:
        """The process group a ``comm.P2PLink`` calls directly, recorded as ``isend``/``irecv``."""
        real = direct_group_of(self._real, group)
        return None if real is None else _RecordedGroup(self, real, group)

    def batch_isend_irecv(self, ops: Sequence[Any]) -> list[Any]:
        names = ["isend" if op.op is self._real.isend else "irecv" for op in ops]
        for name, op in zip(names, ops):
            self.events.append(CommEvent("call", name, op.group, False))
        works = self._real.batch_isend_irecv(list(ops))
        return [_RecordedWork(w, self, n, op.group) for w, n, op in zip(works, names, ops)]
