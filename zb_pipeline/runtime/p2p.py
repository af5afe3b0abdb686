"""Point-to-point communication of one pipeline rank: one ``CommBatch`` of the lowered plan at a time.

The lowered plan (``zb_pipeline.schedule.lowering``) fixes every transfer, its peer, its batch and its position; this
layer never re-derives any of it.  ``post(batch)`` issues the batch's sends and receives together (one
``batch_isend_irecv`` on NCCL, so the group is matched as a unit; plain ``isend``/``irecv`` in plan order on gloo)
and returns at once.  A receive is waited for only when its data is consumed (``take``); a send is dropped when a later
post finds it done (NCCL), else waited for at the end of the iteration (``finish``; a gloo send reports completion
only once waited for).  Waiting later than the strict model never breaks it: the order in which ops are *posted* is
the plan's on every rank, and on NCCL that is the order the communication stream executes them in, so the stream runs
exactly the strict model while the CPU runs ahead.

Shapes come from the caller: ``boundary_specs[s]`` is the tensor handed from virtual stage ``s`` to ``s + 1`` (the
activation one way, its gradient the other), so no shape handshake is ever needed.

Every transfer and wait goes through ``zb_pipeline.comm``, which refuses a tensor that is not on the group's device.
On gloo every wait has a host timeout; on NCCL a wait only makes the compute stream wait (no per-call timeout) and
the process group's watchdog aborts a transfer that never completes.  Every failure (timeout, a dead peer's closed
socket) raises ``PipelinePeerError`` naming this rank, the peer rank and the action that waited: a
``PipelineCommError`` that is also the communication layer's ``comm.PeerFailedError`` (its ``op`` names the transfer,
its ``peers`` the peer's global rank), so a trainer reports it like any other failed peer.

Checking mode (``check=True``; for gloo tests)
---------------------------------------------
Gloo buffers sends, so a plan that only works with buffering -- and deadlocks on NCCL -- would pass on gloo.  In
checking mode this layer makes gloo behave like the strict model and verifies the per-pair order:

- each posted op must be the next one the plan lists for its (peer, direction); anything else raises
  ``CommOrderError`` at once (a handler that posts off-plan);
- every posted receive sends the sender a small acknowledgement (tag 1) naming the transfer it expects; a send is
  complete only once its acknowledgement has arrived and names the same transfer (the k-th send to a peer meets
  the peer's k-th receive, exactly as untagged NCCL pairs them);
- ``post`` blocks until the whole batch is complete, as the strict model's rank does.  A batch that cannot complete
  within the timeout would deadlock on NCCL: ``CommOrderError`` names the ops that were never matched.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from zb_pipeline import comm
from zb_pipeline.schedule.ir import Action, Kind
from zb_pipeline.schedule.lowering import CommBatch, LoweredStep

_SEND_F, _RECV_F, _SEND_B, _RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
_SEND_PV, _RECV_PV = Kind.SEND_PV, Kind.RECV_PV
_DATA_TAG, _ACK_TAG = 0, 1


class PipelineCommError(RuntimeError):
    """A pipeline transfer failed or timed out; the message names the rank, the peer and the waiting action."""


class PipelinePeerError(PipelineCommError, comm.PeerFailedError):
    """A pipeline transfer failed because its peer died or stopped (``comm.PeerFailedError`` with the transfer)."""


class CommOrderError(PipelineCommError):
    """Checking mode: the posting order differs from the plan's strict per-pair order (would deadlock on NCCL)."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one hand-off tensor (per microbatch)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))


# The post-validation state a SEND_PV/RECV_PV moves: float64 [sum of squared grads, ranks with a pending step, ranks
# that stepped optimistically] (``zb_pipeline.optim.post_validation.local_state``).
POST_VALIDATION_SPEC = TensorSpec((3,), torch.float64)


def transfer_identity(action: Action) -> tuple[int, int, int]:
    """(direction 0 forward / 1 backward, producing stage, microbatch): the same for a send and its receive."""
    kind, s, mb = action.kind, action.stage, action.microbatch
    if kind is _SEND_F:
        return (0, s, mb)
    if kind is _RECV_F:
        return (0, s - 1, mb)
    if kind is _SEND_B:
        return (1, s, mb)
    if kind is _RECV_B:
        return (1, s + 1, mb)
    # Post-validation state: ``stage`` is this pipeline rank, ``microbatch`` the chain (0 forward, 1 back).
    if kind is _SEND_PV:
        return (2 + mb, s, 0)
    if kind is _RECV_PV:
        return (2 + mb, action.peer, 0)
    raise ValueError(f"{action} is not a SEND_F/RECV_F/SEND_B/RECV_B/SEND_PV/RECV_PV action")


def _describe_identity(ident: tuple[int, int, int]) -> str:
    d, s, mb = ident
    if d >= 2:
        return f"rank {s}'s post-validation state ({'partial, forward' if d == 2 else 'fully reduced, back'})"
    return f"{s}{'F' if d == 0 else 'B'}{mb}'s {'output' if d == 0 else 'input gradient'}"


class PipelineP2P:
    """The P2P layer of one pipeline rank (see the module docstring).

    ``pp_rank``: this rank's index in the pipeline (the plan's rank numbers); ``pp_ranks[i]``: the global rank of
    pipeline rank ``i`` (default: the members of ``group``, or ``range(world)``); ``boundary_specs[s]``: the tensor
    between stage ``s`` and ``s + 1``.  ``device``: where hand-offs and receive buffers live (default: the
    group's device, ``comm.device_of``; another device is refused at once).  ``timeout_s`` bounds every host wait on
    gloo; on NCCL waits take no per-call timeout (the process group's watchdog times a transfer out).
    """

    def __init__(
        self,
        *,
        pp_rank: int,
        boundary_specs: Sequence[TensorSpec],
        group: comm.ProcessGroup | None = None,
        pp_ranks: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = 600.0,
        check: bool = False,
        tracer: object | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"{timeout_s=} must be > 0")
        self.pp_rank = pp_rank
        self.group = group
        self.pp_ranks = tuple(pp_ranks) if pp_ranks is not None else comm.group_ranks(group)
        self.specs = tuple(boundary_specs)
        where = comm.placement(group)
        self.device = where.device if device is None else torch.device(device)
        if not where.accepts(self.device):
            raise comm.CommDeviceError(
                f"rank {pp_rank}: the pipeline's {where.backend} group moves tensors on {where.device}, not on "
                f"device={self.device}; pass the ParallelContext's device (or none)"
            )
        # Resolved once (a lookup per transfer was the runtime's largest own cost): the link calls the process
        # group's own send/recv, with the layer's device checks, timeouts and peer errors.
        self._where = where
        self._link = comm.P2PLink(group, where=where)
        self.timeout_s = float(timeout_s)
        self._timeout = timedelta(seconds=timeout_s)
        self.check = check
        self.tracer = tracer
        self._batched = where.backend not in ("gloo",)  # NCCL (and others) need grouped posting to match as a unit
        self._plain = not self._batched and not check  # gloo without the checking mode: ``_post_gloo``
        self._recvs: dict[tuple[Kind, int, int], tuple[object | None, torch.Tensor, Action]] = {}
        self._sends: list[tuple[object, torch.Tensor, Action]] = []
        self._acks: list[tuple[object, torch.Tensor, Action]] = []  # checking mode: acks we sent
        self._expected: dict[tuple[int, bool], deque[Action]] | None = None
        self._preposted: set[Action] = set()  # receives posted ahead of their batch (``prepost``)
        # id(batch) -> (batch, sends, receives) as the gloo path posts them (``_ops``), built once per batch object.
        self._ops_of: dict[int, tuple[CommBatch, tuple, tuple]] = {}

    # -- plan order (checking mode) -------------------------------------------------------------------------
    def expect(self, steps: Sequence[LoweredStep]) -> None:
        """Checking mode: load this rank's per-(peer, direction) op order for the coming iteration."""
        expected: dict[tuple[int, bool], deque[Action]] = {}
        for step in steps:
            if isinstance(step, CommBatch):
                for a in step.actions:
                    is_send = a.kind is _SEND_F or a.kind is _SEND_B or a.kind is _SEND_PV
                    expected.setdefault((a.peer, is_send), deque()).append(a)
        self._expected = expected

    def _check_planned(self, a: Action, is_send: bool) -> None:
        if self._expected is None:
            return
        queue = self._expected.get((a.peer, is_send))
        want = queue[0] if queue else None
        if want != a:
            what = "send to" if is_send else "receive from"
            raise CommOrderError(
                f"rank {self.pp_rank}: posted {a}, but the plan's next {what} rank {a.peer} is {want or 'nothing'}; "
                "the runtime must post transfers in the plan's order (this would deadlock or mix data on NCCL)"
            )
        queue.popleft()

    # -- posting ----------------------------------------------------------------------------------------------
    def spec_of(self, a: Action) -> TensorSpec:
        """The shape/dtype of the tensor ``a`` moves."""
        kind = a.kind
        if kind is _SEND_PV or kind is _RECV_PV:
            return POST_VALIDATION_SPEC
        forward_out = kind is _SEND_F or kind is _RECV_B  # the boundary after a.stage, else the one before it
        return self.specs[a.stage if forward_out else a.stage - 1]

    def post(self, batch: CommBatch, payload: Callable[[Action], torch.Tensor]) -> None:
        """Post every op of ``batch``; ``payload(send_action)`` gives the tensor a send moves."""
        try:
            if self._plain and not self._preposted:  # the hot path (gloo): straight to the batch's op lists
                self._post_gloo(batch, payload)
            else:
                self._post(batch, payload)
        except PipelineCommError:
            raise
        except comm.PeerFailedError as err:
            peers = sorted({a.peer for a in batch.actions})
            raise self._peer_error(
                err,
                f"posting pipeline transfers {batch}",
                peers,
                f"rank {self.pp_rank}: posting {batch} to rank(s) {peers} failed: {err.cause}",
            ) from err

    @property
    def waits_on_stream(self) -> bool:
        """NCCL: a receive completes on the compute stream (``take`` makes the current stream wait for the
        communication stream and returns at once; the host never waits for the device, and the process group's
        watchdog times a transfer out).  Otherwise (gloo) the host waits, with ``timeout_s``."""
        return self._where.is_nccl

    @property
    def can_prepost(self) -> bool:
        """Whether receives may be posted ahead of their batch: gloo (each op matched on its own, in order per peer)
        without the checking mode.  NCCL matches grouped ops as a unit, so its batches stay as planned."""
        return not self._batched and not self.check

    def prepost(self, actions: Sequence[Action]) -> None:
        """Post the receives ``actions`` now, ahead of the batches that hold them (which then skip them).

        gloo moves a message only once its receive is posted (the sender waits for the receiver's ready
        notice), so a receive posted just before its consumer runs pays that extra round trip after the data
        was ready.  Posted ahead (the executor: up to ``PREPOST_AHEAD`` compute actions), the transfer overlaps the
        compute.  The caller keeps the plan's order of receives per peer (every receive of the earlier batches is
        already posted) and never crosses a point where ``drain`` may run.
        """
        if not self.can_prepost:
            raise RuntimeError("prepost needs gloo without the checking mode (see can_prepost)")
        for a in actions:
            if a.kind is not _RECV_F and a.kind is not _RECV_B:
                raise ValueError(f"prepost: {a} is not a forward or backward receive")
        new = tuple(a for a in actions if a not in self._preposted)
        if new:
            self.post(CommBatch(new), _no_payload)
            self._preposted.update(new)

    def _post(self, batch: CommBatch, payload: Callable[[Action], torch.Tensor]) -> None:
        if self._preposted:
            rest = tuple(a for a in batch.actions if a not in self._preposted)
            self._preposted.difference_update(batch.actions)
            if not rest:
                return
            if len(rest) != len(batch.actions):
                batch = CommBatch(rest)
        if self._plain:
            self._post_gloo(batch, payload)
        else:
            self._post_grouped(batch, payload)
            self._reap_sends()

    def _post_gloo(self, batch: CommBatch, payload: Callable[[Action], torch.Tensor]) -> None:
        """gloo matches each op on its own, in order per (peer, direction): the sends go out first -- a peer may be
        waiting for them -- and the receives after them, each in the plan's order.

        This runs between two compute actions, typically with the caches cold (the rank slept or computed), where
        each torch call costs microseconds: the ops come from lists built once per batch (``_ops``), and each op
        makes only the torch calls its checks need.
        """
        hit = self._ops_of.get(id(batch))
        sends, receives = (hit[1], hit[2]) if hit is not None and hit[0] is batch else self._ops(batch)
        link = self._link
        for a, peer, spec in sends:  # ``_send_tensor``, inline
            t = payload(a)
            if t.shape != spec.shape or t.dtype != spec.dtype:
                raise self._spec_error(a, t, spec)
            if t.requires_grad:
                t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            self._sends.append((link.isend(t, peer, _DATA_TAG), t, a))
        if receives:
            recvs, irecv_new = self._recvs, link.irecv_new
            for a, peer, size, dtype, key in receives:
                work, buf = irecv_new(size, dtype, peer, _DATA_TAG)  # a fresh buffer: the consumer keeps it
                recvs[key] = (work, buf, a)
        if self.tracer is not None:
            self.tracer.comm_posted(batch)
        # No ``_reap_sends`` here: a gloo send's work says it is completed only once it has been waited for (torch
        # 2.13: ``is_completed()`` False after the peer received the data, True after ``wait()``), so asking
        # would free nothing; ``finish`` waits for the sends.

    def _ops(self, batch: CommBatch) -> tuple[tuple, tuple]:
        """``batch``'s sends as (action, global peer, spec) and its receives as (action, global peer, size, dtype,
        key in ``_recvs``), each in plan order; kept per batch object (the executor posts the same ones every
        iteration), so a post does no per-op look-up.  ``size``: ``torch.empty``'s positional arguments, the shape
        as separate ints (parsed faster than a tuple or a ``torch.Size``; ``((),)`` for a 0-d tensor); the link
        makes the buffer on the group's device, which is this layer's (checked at construction)."""
        sends, receives = [], []
        for a in batch.actions:
            spec, peer = self.spec_of(a), self.pp_ranks[a.peer]
            if a.kind is _SEND_F or a.kind is _SEND_B or a.kind is _SEND_PV:
                sends.append((a, peer, spec))
            else:
                size = spec.shape if spec.shape else ((),)
                receives.append((a, peer, size, spec.dtype, (a.kind, a.stage, a.microbatch)))
        if len(self._ops_of) >= 4096:  # batches built on the fly (``prepost``, a replay's plan): keep it bounded
            self._ops_of.clear()
        self._ops_of[id(batch)] = (batch, tuple(sends), tuple(receives))
        return tuple(sends), tuple(receives)

    def _recv_buffer(self, a: Action) -> torch.Tensor:
        """A fresh buffer for receive ``a`` (its boundary spec)."""
        spec = self.spec_of(a)
        return torch.empty(spec.shape, dtype=spec.dtype, device=self.device)

    def _send_tensor(self, a: Action, payload: Callable[[Action], torch.Tensor]) -> torch.Tensor:
        """The tensor send ``a`` moves, checked against its boundary spec, detached and contiguous (``_post_gloo``
        does the same inline)."""
        t = payload(a)
        spec = self.spec_of(a)
        # As few torch calls as possible: this runs between the producer's end and the send, often cache-cold
        # (a rank that slept in a bubble); a torch.Size compares equal to a tuple, and only a tensor in the
        # autograd graph needs detaching (so the P2P layer does not hold the graph while the send is in flight).
        if t.shape != spec.shape or t.dtype != spec.dtype:
            raise self._spec_error(a, t, spec)
        if t.requires_grad:
            t = t.detach()
        return t if t.is_contiguous() else t.contiguous()

    def _spec_error(self, a: Action, t: torch.Tensor, spec: TensorSpec) -> PipelineCommError:
        return PipelineCommError(
            f"rank {self.pp_rank}: {a} sends a tensor of shape {tuple(t.shape)} {t.dtype}, but the "
            f"boundary spec says {spec.shape} {spec.dtype}; fix the stage or the boundary_specs"
        )

    def _post_grouped(self, batch: CommBatch, payload: Callable[[Action], torch.Tensor]) -> None:
        """NCCL (one ``batch_isend_irecv`` per batch) and gloo's checking mode: the batch's ops in plan order."""
        ops: list[tuple[bool, torch.Tensor, int, Action]] = []
        new_recvs: list[tuple[tuple[Kind, int, int], object, torch.Tensor, Action]] = []
        check, group, where, link = self.check, self.group, self._where, self._link
        acks_in: list[tuple[object, torch.Tensor, Action]] = []
        for a in batch.actions:
            kind = a.kind
            is_send = kind is _SEND_F or kind is _SEND_B or kind is _SEND_PV
            if check:
                self._check_planned(a, is_send)
            peer = self.pp_ranks[a.peer]
            if is_send:
                ops.append((True, self._send_tensor(a, payload), peer, a))
                if check:
                    ack = torch.empty(3, dtype=torch.int64, device=self.device)
                    acks_in.append((link.irecv(ack, peer, _ACK_TAG), ack, a))
            else:
                ops.append((False, self._recv_buffer(a), peer, a))
                if check:
                    ident = torch.tensor(transfer_identity(a), dtype=torch.int64, device=self.device)
                    self._acks.append((link.isend(ident, peer, _ACK_TAG), ident, a))
        if self._batched:
            works = comm.batch_isend_irecv(
                [(s, t, peer) for s, t, peer, _ in ops], group=group, tag=_DATA_TAG, where=where
            )
        else:
            works = [(link.isend if s else link.irecv)(t, peer, _DATA_TAG) for s, t, peer, _ in ops]
        for (is_send, t, _, a), work in zip(ops, works):
            if is_send:
                self._sends.append((work, t, a))
            else:
                new_recvs.append(((a.kind, a.stage, a.microbatch), work, t, a))
        for key, work, t, a in new_recvs:
            self._recvs[key] = (work, t, a)
        if self.tracer is not None:
            self.tracer.comm_posted(batch)
        if check:
            self._complete_strictly(batch, acks_in, [r[0] for r in new_recvs])

    def _complete_strictly(
        self, batch: CommBatch, acks_in: list[tuple[object, torch.Tensor, Action]], recv_keys: list
    ) -> None:
        """Checking mode: block until every send of ``batch`` is matched and every receive has arrived."""
        deadline = time.monotonic() + self.timeout_s
        for work, ack, a in acks_in:
            if self._wait_until(work, deadline, a) is not None:
                raise CommOrderError(
                    f"rank {self.pp_rank}: batch {batch} could not complete within {self.timeout_s:g} s: rank "
                    f"{a.peer} never posted the receive matching {a} -- the plan relies on buffering and deadlocks "
                    "on NCCL (or that rank is stuck)"
                )
            got = tuple(ack.tolist())
            want = transfer_identity(a)
            if got != want:
                raise CommOrderError(
                    f"rank {self.pp_rank}: {a} is matched (by order) with rank {a.peer}'s receive of "
                    f"{_describe_identity(got)}, not {_describe_identity(want)}: the two ranks post their transfers "
                    "in different orders (deadlock or mixed-up data on NCCL)"
                )
        tracer = self.tracer
        for key in recv_keys:
            work, buf, a = self._recvs[key]
            t0 = time.perf_counter()
            if self._wait_until(work, deadline, a) is not None:
                raise CommOrderError(
                    f"rank {self.pp_rank}: batch {batch} could not complete within {self.timeout_s:g} s: {a} was "
                    f"never sent by rank {a.peer} -- the plan deadlocks under the strict model (or that rank is stuck)"
                )
            if tracer is not None:
                tracer.waited(a, batch, t0, time.perf_counter())
            self._recvs[key] = (None, buf, a)  # done: gloo counts waits, so a work must not be waited twice

    def _wait_until(self, work, deadline: float, a: Action) -> comm.PeerFailedError | None:
        """Wait for transfer ``a``'s ``work`` up to ``deadline``: ``None`` when done, the timeout's error (to report or
        turn into a plan error) when not; ``PipelinePeerError`` if the transfer failed (a dead peer)."""
        left = max(deadline - time.monotonic(), 0.001)
        try:
            self._link.wait(work, timedelta(seconds=left), peers=(self.pp_ranks[a.peer],))
        except comm.PeerFailedError as err:
            if err.timed_out:
                return err
            raise self._peer_error(
                err, f"pipeline transfer {a}", [a.peer], f"rank {self.pp_rank}: transfer {a} failed: {err.cause}"
            ) from err
        return None

    def _peer_error(self, err: comm.PeerFailedError, op: str, peers: Sequence[int], message: str) -> PipelinePeerError:
        """``err`` (from the communication layer) as a ``PipelinePeerError``: ``op`` names the transfer, ``peers``
        the pipeline ranks waited for, ``message`` is the developer's text (``str()``)."""
        return comm.peer_failure(
            err,
            op=op,
            group=self.group,
            peers=[self.pp_ranks[p] for p in peers],
            message=message,
            kind=PipelinePeerError,
        )

    # -- consuming --------------------------------------------------------------------------------------------
    def take(self, kind: Kind, stage: int, microbatch: int, waiter: Action) -> torch.Tensor:
        """Wait for the receive ``(kind, stage, microbatch)`` and return its buffer; ``waiter`` is the consumer."""
        entry = self._recvs.pop((kind, stage, microbatch), None)
        if entry is None:
            raise PipelineCommError(
                f"rank {self.pp_rank}: {waiter} needs {stage}{kind.value}{microbatch}, but the plan posted no such "
                "receive before it"
            )
        work, buf, a = entry
        if work is None:  # already completed (checking mode waits inside post)
            return buf
        tracer = self.tracer
        t0 = time.perf_counter() if tracer is not None else 0.0
        try:
            self._link.wait(work, self._timeout)
        except comm.PeerFailedError as err:
            raise self._peer_error(
                err,
                f"pipeline receive {a} (for {waiter})",
                [a.peer],
                f"rank {self.pp_rank}: {waiter} waited for {a} from rank {a.peer} (global rank "
                f"{self.pp_ranks[a.peer]}) and failed after at most {self.timeout_s:g} s: {err.cause}",
            ) from err
        if tracer is not None:
            tracer.waited(a, waiter, t0, time.perf_counter())
        return buf

    def _reap_sends(self) -> None:
        """Drop (free) the tensors of sends that have completed (NCCL: its works complete by themselves)."""
        sends = self._sends
        if sends and sends[0][0].is_completed():
            self._sends = [s for s in sends if not s[0].is_completed()]

    def finish(self) -> None:
        """End of iteration: wait for every outstanding send (and ack); raise if a receive was never consumed."""
        deadline = time.monotonic() + self.timeout_s
        for work, _, a in self._sends:
            try:
                left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
                self._link.wait(work, left)
            except comm.PeerFailedError as err:
                raise self._peer_error(
                    err,
                    f"pipeline send {a} (end of iteration)",
                    [a.peer],
                    f"rank {self.pp_rank}: end of iteration waited for {a} to rank {a.peer} (global rank "
                    f"{self.pp_ranks[a.peer]}) and failed: {err.cause}",
                ) from err
        for work, _, a in self._acks:
            try:
                left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
                self._link.wait(work, left)
            except comm.PeerFailedError as err:
                raise self._peer_error(
                    err,
                    f"pipeline acknowledgement of {a} (end of iteration)",
                    [a.peer],
                    f"rank {self.pp_rank}: end of iteration: the acknowledgement of {a} to rank {a.peer} failed: "
                    f"{err.cause}",
                ) from err
        self._sends, self._acks = [], []
        self._preposted.clear()
        if self._recvs:
            left = ", ".join(str(e[2]) for e in self._recvs.values())
            raise PipelineCommError(f"rank {self.pp_rank}: receives posted but never consumed: {left}")
        if self._expected is not None and any(self._expected.values()):
            left = ", ".join(str(a) for q in self._expected.values() for a in q)
            raise CommOrderError(f"rank {self.pp_rank}: planned transfers never posted: {left}")

    def drain(self) -> None:
        """Complete every op posted so far and drop the received data (an iteration about to be replayed).

        Only safe at a consistent cut of the plan (every rank drains the same transfers), which is where
        post-validation calls it (``zb_pipeline.schedule.post_validation_pass``).
        """
        deadline = time.monotonic() + self.timeout_s
        pending = [(w, a) for w, _, a in self._sends] + [(w, a) for w, _, a in self._acks]
        pending += [(w, a) for w, _, a in self._recvs.values() if w is not None]
        for work, a in pending:
            timeout = self._wait_until(work, deadline, a)
            if timeout is not None:
                raise self._peer_error(
                    timeout,
                    f"pipeline transfer {a} (draining before a replay)",
                    [a.peer],
                    f"rank {self.pp_rank}: draining the transfers before a replay, {a} with rank {a.peer} did not "
                    f"complete within {self.timeout_s:g} s",
                ) from timeout
        self._sends, self._acks = [], []
        self._recvs.clear()
        self._preposted.clear()
        self._expected = None

    def pending(self) -> list[Action]:
        """Ops posted but not yet consumed or known complete."""
        return [e[2] for e in self._recvs.values()] + [s[2] for s in self._sends if not s[0].is_completed()]

    def abandon(self) -> None:
        """Forget all outstanding ops (after an error)."""
        self._recvs.clear()
        self._sends.clear()
        self._acks.clear()
        self._preposted.clear()


def _no_payload(a: Action) -> torch.Tensor:
    raise AssertionError(f"{a}: a batch of receives has nothing to send")
