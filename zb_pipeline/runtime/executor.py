"""The pipeline executor: runs one rank's lowered action list, one iteration at a time.

    executor = PipelineExecutor(lowered, rank, {stage: module, ...}, p2p=p2p, store=store,
                                input_fn=lambda mb: tokens[mb], loss_fn=lambda out, mb: criterion(out, mb))
    losses = executor.run()          # per-microbatch losses on the rank that holds the last stage

Dispatch is by ``Kind`` through the handler table: ``set_handler(kind, fn)`` registers a new kind (e.g. an
overlapped F-and-B action) or replaces one, ``wrap_handler(kind, wrapper)`` wraps one; the other extension points
are the named hook lists in ``executor.hooks`` (``zb_pipeline.runtime.hooks``).  A compute handler is
``fn(executor, action) -> None``; a communication handler is called for every op of a ``CommBatch`` when the batch
is posted and returns the tensor a send moves (``None`` for receives, whose buffers the P2P layer allocates from the
boundary specs and which are consumed by ``take``).  ``PipelineRuntime`` (``zb_pipeline.runtime.runtime``) is the
entry point built on this executor.

What the built-in handlers do (stage ``s``, microbatch ``mb``, ``S`` stages):

- **F**: the input is the loaded microbatch (``input_fn(mb)``) on stage 0, the output of stage ``s - 1`` handed over
  locally when that stage lives on this rank (V placement), else the received activation (waited for here).  Run
  the chunk (``forward_fn``, default ``module(x)``).  On the last stage ``loss_fn(output, mb)`` gives the loss.  Keep
  only what backward needs: the input leaf and the output's autograd edge (the output tensor itself is dropped as
  soon as it has been sent, so its memory goes with the send unless the graph saved it).
- **B**: the output gradient is received, handed over locally, or (last stage) the loss's own.  Backward runs inside
  ``store.defer(s, mb)``: deferrable layers compute the input gradient only and enqueue their weight-gradient work;
  the input gradient is sent or handed over; the input is freed.  Stages without deferrable layers (or with
  ``split="generic"``) go through ``GenericSplit``, which defers every parameter gradient through autograd.
- **W**: ``store.run(s, mb)``: the deferred weight-gradient work, accumulated into ``param.main_grad`` (or ``.grad``).
- **BW**: the full backward (weight gradients immediately).
- **F+BW** (an overlapped pair, ``ir.PairAction``): its F, then its BW, each through ``run_compute`` (so through the
  current F and BW handlers, traced as two compute events tagged with the pair); both inputs were received before it
  and both outputs are sent after it (lowering).  Two CUDA streams would overlap them: a replacement pair handler.

Gradient accumulation order: every stage's weight gradients are accumulated in the order of its W/BW actions, which
for all built-in schedules is microbatch order -- so results match a sequential single-process run bit for bit.

Replay (optimizer post-validation, ``zb_pipeline.optim.post_validation``): a handler may call ``request_replay``
before the rank reaches its replay point (right after its last ``SEND_PV``/``RECV_PV`` batch, a consistent cut of
the plan placed before any backward action).  There the executor completes every transfer posted so far (``drain``),
drops the iteration's state, restores the RNG state captured when the iteration started and runs the iteration again
from its first action, without the post-validation ops.  Every rank must request it alike.

At the end of ``run`` the executor runs its ``iteration_end`` hooks and asserts that nothing is left: no saved
activation, no local hand-off, no deferred weight-gradient work, no outstanding send or unconsumed receive.  Nothing on
the hot path grows with the model (a dict lookup and a few attribute accesses per action) and nothing synchronises
that the plan does not ask for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from zb_pipeline.runtime.compute_handlers import DEFAULT_HANDLERS
from zb_pipeline.runtime.generic_split import GenericSplit
from zb_pipeline.runtime.hooks import ExecutorHooks, Handler, HandlerWrap
from zb_pipeline.runtime.p2p import PipelineCommError, PipelineP2P
from zb_pipeline.runtime.weight_grad_store import WeightGradStore, bind_weight_grad_store
from zb_pipeline.schedule.ir import Action, Kind, PairAction
from zb_pipeline.schedule.lowering import CommBatch, LoweredSchedule
from zb_pipeline.schedule.post_validation_pass import replay_point, without_post_validation

_PAIR, _W, _BW, _RECV_F, _RECV_B = Kind.PAIR, Kind.W, Kind.BW, Kind.RECV_F, Kind.RECV_B
_BUILTIN_SEND = DEFAULT_HANDLERS[Kind.SEND_F]

InputFn = Callable[[int], torch.Tensor]
LossFn = Callable[[torch.Tensor, int], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]
ForwardFn = Callable[[torch.nn.Module, torch.Tensor, int, int], torch.Tensor]

SPLIT_MODES = ("auto", "deferrable", "generic")
# gloo moves a message only once its receive is posted, and a receive posted late has blocked the poster for
# milliseconds on a busy host.  One action ahead left 1F1B's last stage posting the next forward's receive only in
# its own batch (the batch after a BW is two compute actions after the one before F); two ahead made our 1F1B 6.7%
# faster (median of five alternated launches, pp = 2, m = 8) and changed ZB-H2 by -0.9% (noise).  Each extra action
# ahead can hold one more received activation per peer before its consumer runs.
PREPOST_AHEAD = 2


def _default_forward(module: torch.nn.Module, x: torch.Tensor, stage: int, microbatch: int) -> torch.Tensor:
    return module(x)


def _has_deferrable_layers(module: torch.nn.Module) -> bool:
    # A recompute wrapper holds a store only to report to it and to follow the generic split: not a layer.
    return any(hasattr(sub, "weight_grad_store") and not getattr(sub, "store_only", False) for sub in module.modules())


class PipelineExecutor:
    """Executes rank ``rank``'s part of ``lowered`` (see the module docstring)."""

    def __init__(
        self,
        lowered: LoweredSchedule,
        rank: int,
        stages: Mapping[int, torch.nn.Module],
        *,
        p2p: PipelineP2P | None,
        store: WeightGradStore | None = None,
        input_fn: InputFn | None = None,
        loss_fn: LossFn | None = None,
        forward_fn: ForwardFn | None = None,
        split: str = "auto",
        tracer: Any = None,
    ) -> None:
        sched = lowered.schedule
        if not 0 <= rank < sched.num_ranks:
            raise ValueError(f"{rank=} is outside the plan's ranks 0..{sched.num_ranks - 1}")
        mine = sched.stages_of(rank)
        if split not in SPLIT_MODES:
            raise ValueError(f"{split=} must be one of {SPLIT_MODES}")
        if 0 in mine and input_fn is None:
            raise ValueError(f"rank {rank} holds stage 0: give input_fn(microbatch) -> the stage's input")
        if sched.num_stages - 1 in mine and loss_fn is None:
            raise ValueError(f"rank {rank} holds the last stage: give loss_fn(output, microbatch) -> loss")
        needs_p2p = any(isinstance(step, CommBatch) for step in lowered.ranks[rank])
        if needs_p2p and p2p is None:
            raise ValueError(f"rank {rank}'s plan communicates: give a PipelineP2P")
        self.lowered, self.rank = lowered, rank
        self.steps = lowered.ranks[rank]
        self.num_stages, self.num_microbatches = sched.num_stages, sched.num_microbatches
        self.owner = sched.stage_to_rank
        self.p2p, self.tracer = p2p, tracer
        self.store = store if store is not None else WeightGradStore()
        self.input_fn, self.loss_fn = input_fn, loss_fn
        self.forward_fn = forward_fn or _default_forward
        self._split_mode = split
        self.stages: dict[int, torch.nn.Module] = {}
        # Per stage: None = deferrable layers + plain backward inside store.defer; else a GenericSplit.
        self._split: dict[int, GenericSplit | None] = {}
        self._bind_stages(stages)
        self.handlers: dict[Kind, Handler] = dict(DEFAULT_HANDLERS)
        # kind -> its handler under the wrappers, and each wrapper (innermost first) with what it built: wrap_handler
        self._wraps: dict[Kind, tuple[Handler, list[tuple[HandlerWrap, Handler]]]] = {}
        self.hooks = ExecutorHooks()
        # Iteration state, keyed by stage * m + microbatch.
        self._saved: dict[int, tuple[torch.Tensor | None, Any]] = {}  # F -> B: (input leaf, output root)
        self._local_act: dict[int, torch.Tensor] = {}  # input of stage s handed over from s - 1 on this rank
        self._local_grad: dict[int, torch.Tensor] = {}  # output gradient of stage s from s + 1 on this rank
        self._to_send: dict[tuple[Kind, int], torch.Tensor] = {}  # (SEND_F/SEND_B, key) -> tensor
        self._pending_w: set[int] = set()
        self._w_done: dict[int, int] = {}  # stage -> W/BW actions run this iteration (stage_grads_final)
        self.losses: list[torch.Tensor | None] = []
        self.iteration = 0
        self.replay_requested = False
        self.replays = 0  # iterations replayed (post-validation changed the weights their first forwards used)
        self._replay_cache: tuple[Any, int | None] = (None, None)
        # (id(steps), ahead, first ahead) -> (steps, what to post at each step): the batches as posted on gloo.
        self._post_plans: dict[tuple[int, int, int], tuple[tuple, tuple[CommBatch | None, ...]]] = {}
        # On gloo, receives are posted up to this many compute actions before their own batch (``post_plan``).
        self.prepost_ahead = PREPOST_AHEAD

    # -- extension interface ----------------------------------------------------------------------------------
    def set_handler(self, kind: Kind, handler: Handler) -> None:
        """Run ``handler(executor, action)`` for actions of ``kind`` (a new kind, or replacing a built-in one)."""
        self.handlers[kind] = handler

    def wrap_handler(self, kind: Kind, wrapper: Callable[[Handler], Handler]) -> HandlerWrap:
        """Replace the handler of ``kind`` by ``wrapper(current_handler)``; ``remove()`` on the result takes the
        wrapper out again (``zb_pipeline.runtime.hooks.HandlerWrap``)."""
        if kind not in self.handlers:
            raise KeyError(f"no handler for action kind {kind} to wrap; register one with set_handler")
        current = self.handlers[kind]
        base, wraps = self._wraps.get(kind, (current, []))
        if (wraps[-1][1] if wraps else base) is not current:  # replaced since: its wrappers went with it
            base, wraps = current, []
        wrap = HandlerWrap(wrapper, lambda w: self._unwrap(kind, w))
        self.handlers[kind] = wrapper(current)
        self._wraps[kind] = (base, [*wraps, (wrap, self.handlers[kind])])
        return wrap

    def _unwrap(self, kind: Kind, wrap: HandlerWrap) -> None:
        base, wraps = self._wraps.get(kind, (None, []))
        at = next((i for i, (w, _) in enumerate(wraps) if w is wrap), None)
        if at is None or self.handlers.get(kind) is not wraps[-1][1]:  # removed, or replaced with its handler
            return
        handler = wraps[at - 1][1] if at else base
        rebuilt = wraps[:at]
        for w, _ in wraps[at + 1 :]:  # the wrappers added after it, anew over what remains
            handler = w.wrapper(handler)
            rebuilt.append((w, handler))
        self.handlers[kind] = handler
        self._wraps[kind] = (base, rebuilt)

    def load_plan(self, lowered: LoweredSchedule) -> None:
        """Run ``lowered`` from the next iteration on (between iterations).  It must keep this rank's stages; the
        microbatch count may change.  Calls the ``plan_changed`` hooks."""
        sched = lowered.schedule
        if sched.num_ranks != self.lowered.schedule.num_ranks or tuple(sched.stage_to_rank) != tuple(self.owner):
            old = self.lowered.schedule
            raise ValueError(
                f"cannot switch from {old.name!r} to {sched.name!r}: the new plan must keep p={old.num_ranks} and "
                f"the placement {list(old.stage_to_rank)}"
            )
        self.lowered = lowered
        self.steps = lowered.ranks[self.rank]
        self.num_microbatches = sched.num_microbatches
        for hook in self.hooks.plan_changed:
            hook(lowered)

    def use_steps(self, steps: tuple) -> None:
        """Run ``steps`` (a variant of this rank's part of the loaded plan, e.g. with the post-validation chain
        placed elsewhere) from the next iteration on."""
        self.steps = steps

    def replace_stages(self, stages: Mapping[int, torch.nn.Module]) -> None:
        """Run other modules for this rank's stages from the next iteration on (between iterations)."""
        self._bind_stages(stages)

    def _bind_stages(self, stages: Mapping[int, torch.nn.Module]) -> None:
        mine = self.lowered.schedule.stages_of(self.rank)
        if set(stages) != set(mine):
            raise ValueError(
                f"rank {self.rank} holds virtual stages {list(mine)} in plan {self.lowered.schedule.name!r}, but "
                f"stage modules were given for {sorted(stages)}"
            )
        self.stages = dict(stages)
        self._split = {}
        for s, module in self.stages.items():
            bind_weight_grad_store(module, self.store)
            mode = self._split_mode
            generic = mode == "generic" or (mode == "auto" and not _has_deferrable_layers(module))
            self._split[s] = GenericSplit(module, self.store) if generic else None

    # -- the loop ---------------------------------------------------------------------------------------------
    def run(self, iteration: int | None = None) -> list[torch.Tensor]:
        """Execute one iteration; return the per-microbatch losses (empty unless this rank holds the last stage)."""
        if iteration is not None:
            self.iteration = iteration
        self.losses = [None] * self.num_microbatches
        tracer, p2p = self.tracer, self.p2p
        if tracer is not None:
            tracer.begin_iteration(self.iteration)
        steps = self.steps
        if p2p is not None and p2p.check:
            p2p.expect(steps)
        replay_at = self._replay_point()
        rng = _capture_rng() if replay_at is not None else None
        self.replay_requested = False
        self._w_done = {}
        for hook in self.hooks.iteration_start:
            hook(self)
        try:
            if self._execute(steps, replay_at):
                self._replay(rng)
            for hook in self.hooks.iteration_end:
                hook(self)
            if p2p is not None:
                p2p.finish()
            self._assert_clean()
        except BaseException:
            self.abandon()
            raise
        self.iteration += 1
        if self.num_stages - 1 not in self.stages:
            return []
        return list(self.losses)

    def _execute(self, steps: tuple, replay_at: int | None) -> bool:
        """Run ``steps``; True if a replay was requested by the time the replay point was reached."""
        handlers, tracer, p2p, after_post = self.handlers, self.tracer, self.p2p, self.hooks.after_post
        grads_final = self.hooks.stage_grads_final
        first_ahead = 0 if replay_at is None else replay_at  # never post ahead across the replay point's cut
        posts = self._post_plan(steps, first_ahead) if p2p is not None and p2p.can_prepost else None
        payload = self._payload
        computed = False
        for j, step in enumerate(steps):
            if type(step) is CommBatch:
                if posts is None:
                    p2p.post(step, payload)
                else:  # what is left of this batch, then the receives posted ahead here (built once per plan)
                    batch = posts[j]
                    if batch is not None:
                        p2p.post(batch, payload)
                if after_post:
                    for a in step.actions:
                        for hook in after_post.get(a.kind, ()):
                            hook(self, a)
                if j + 1 == replay_at and self.replay_requested:
                    if computed:
                        return True
                    self.replay_requested = False  # validated before any compute: nothing to redo
                continue
            computed = True
            kind = step.kind
            handler = handlers.get(kind)
            if handler is None:
                raise KeyError(f"rank {self.rank}: no handler for action kind {kind.value} ({step})")
            if tracer is None or kind is _PAIR:  # a pair's handler runs (and traces) its halves: run_compute
                handler(self, step)
            else:
                t0 = time.perf_counter()
                handler(self, step)
                tracer.compute(step, t0, time.perf_counter())
            if grads_final and (kind is _W or kind is _BW):
                self._count_weight_grads(step.stage)
        return False

    def run_compute(self, a: Action, *, pair: PairAction | None = None) -> None:
        """Run compute action ``a`` through its handler, traced (as a half of ``pair``, if given) and counted for
        ``stage_grads_final``: what the built-in pair handler does with each of its halves."""
        handler = self.handlers.get(a.kind)
        if handler is None:
            raise KeyError(f"rank {self.rank}: no handler for action kind {a.kind.value} ({a})")
        tracer = self.tracer
        if tracer is None:
            handler(self, a)
        else:
            t0 = time.perf_counter()
            handler(self, a)
            tracer.compute(a, t0, time.perf_counter(), pair=pair)
        if self.hooks.stage_grads_final and (a.kind is _W or a.kind is _BW):
            self._count_weight_grads(a.stage)

    def _count_weight_grads(self, stage: int) -> None:
        done = self._w_done.get(stage, 0) + 1
        self._w_done[stage] = done
        if done == self.num_microbatches:
            for hook in self.hooks.stage_grads_final:
                hook(stage)

    def _post_plan(self, steps: tuple, first_ahead: int) -> tuple[CommBatch | None, ...]:
        """What to post at each step index: ``post_plan(steps, self.prepost_ahead, first_ahead)``'s ``rest`` and
        ``early`` as one batch (``None``: nothing), built once per plan (and replay point).  One batch, one post:
        the P2P layer posts its sends before its receives, so ``rest``'s sends, ``rest``'s receives and then
        ``early``'s receives go out in the same order as two posts would send them."""
        key = (id(steps), self.prepost_ahead, first_ahead)
        hit = self._post_plans.get(key)
        if hit is not None and hit[0] is steps:
            return hit[1]
        if len(self._post_plans) > 8:  # replays build plans of fresh step tuples: keep the cache small
            self._post_plans.clear()
        plan = tuple(
            rest if early is None else early if rest is None else CommBatch(rest.actions + early.actions)
            for rest, early in post_plan(steps, self.prepost_ahead, first_ahead)
        )
        self._post_plans[key] = (steps, plan)
        return plan

    # -- replay (optimizer post-validation) -------------------------------------------------------------------
    def _replay_point(self) -> int | None:
        """Index after this rank's last cross-iteration (post-validation) batch; ``None`` if the plan has none."""
        if self._replay_cache[0] is not self.steps:
            self._replay_cache = (self.steps, replay_point(self.steps))
        return self._replay_cache[1]

    def request_replay(self) -> None:
        """Discard this iteration's work so far and run it again from its first action, once the rank reaches its
        replay point (after its last post-validation op).  Every rank of the pipeline must request it alike."""
        self.replay_requested = True

    def _replay(self, rng: Any) -> None:
        t0 = time.perf_counter()
        if self.p2p is not None:
            self.p2p.drain()  # the prefix is a consistent cut: every rank completes the same transfers
        self._saved.clear()
        self._local_act.clear()
        self._local_grad.clear()
        self._to_send.clear()
        self._pending_w.clear()
        self._w_done = {}
        self.store.assert_empty()  # no backward ran before the replay point
        self.losses = [None] * self.num_microbatches
        _restore_rng(rng)
        steps = without_post_validation(self.steps)
        if self.p2p is not None and self.p2p.check:
            self.p2p.expect(steps)
        self.replays += 1
        if self.tracer is not None:
            self.tracer.mark("replay", t0, time.perf_counter())
        self._execute(steps, None)

    def _payload(self, a: Action) -> torch.Tensor | None:
        handler = self.handlers.get(a.kind)
        if handler is _BUILTIN_SEND:  # its ``take_payload``, inline (this runs between compute actions)
            t = self._to_send.pop((a.kind, a.stage * self.num_microbatches + a.microbatch), None)
            if t is not None:
                return t
        if handler is None:
            raise KeyError(f"rank {self.rank}: no handler for communication kind {a.kind.value} ({a})")
        return handler(self, a)

    def _assert_clean(self) -> None:
        problems = []
        m = self.num_microbatches
        for name, keys in (
            ("saved activations (F without B)", self._saved),
            ("local activations never consumed", self._local_act),
            ("local gradients never consumed", self._local_grad),
            ("W actions missing", self._pending_w),
        ):
            if keys:
                problems.append(f"{name}: " + ", ".join(f"stage {k // m} mb {k % m}" for k in sorted(keys)))
        if self._to_send:
            problems.append("outputs never sent: " + ", ".join(f"{k.value} {i // m}/{i % m}" for k, i in self._to_send))
        if problems:
            raise RuntimeError(f"rank {self.rank}: end of iteration with work left over -- " + "; ".join(problems))
        self.store.assert_empty()

    def abandon(self) -> None:
        """Drop every piece of iteration state (after an error)."""
        self._saved.clear()
        self._local_act.clear()
        self._local_grad.clear()
        self._to_send.clear()
        self._pending_w.clear()
        self.store.clear()
        if self.p2p is not None:
            self.p2p.abandon()

    # -- plumbing shared by the built-in and user handlers -----------------------------------------------------
    def fetch_input(self, a: Action) -> torch.Tensor:
        """The input of F ``a``: the microbatch on stage 0, a local hand-off, or the received activation."""
        s, mb = a.stage, a.microbatch
        if s == 0:
            x = self.input_fn(mb)
        elif self.owner[s - 1] == self.rank:
            x = self._local_act.pop(s * self.num_microbatches + mb)
        else:
            x = self.p2p.take(_RECV_F, s, mb, a)
        for hook in self.hooks.input_ready:
            hook(a)
        return x

    def deliver_output(self, a: Action, out: torch.Tensor) -> None:
        """Hand F ``a``'s output to stage ``s + 1``: locally (as a fresh leaf) or queued for its SEND_F."""
        s = a.stage
        key = s * self.num_microbatches + a.microbatch
        if self.owner[s + 1] == self.rank:
            self._local_act[key + self.num_microbatches] = out.detach().requires_grad_(out.is_floating_point())
        else:
            self._to_send[(Kind.SEND_F, key)] = out

    def fetch_output_grad(self, a: Action) -> torch.Tensor | None:
        """The gradient of B ``a``'s output: None on the last stage (the loss), local, or received."""
        s, mb = a.stage, a.microbatch
        if s == self.num_stages - 1:
            g = None
        elif self.owner[s + 1] == self.rank:
            g = self._local_grad.pop(s * self.num_microbatches + mb)
        else:
            g = self.p2p.take(_RECV_B, s, mb, a)
        for hook in self.hooks.input_ready:
            hook(a)
        return g

    def deliver_input_grad(self, a: Action, grad: torch.Tensor) -> None:
        """Hand B ``a``'s input gradient to stage ``s - 1``: locally or queued for its SEND_B."""
        s = a.stage
        key = s * self.num_microbatches + a.microbatch
        if self.owner[s - 1] == self.rank:
            self._local_grad[key - self.num_microbatches] = grad
        else:
            self._to_send[(Kind.SEND_B, key)] = grad

    def split_of(self, stage: int) -> GenericSplit | None:
        """How ``stage``'s backward splits: ``None`` (deferrable layers in ``store.defer``) or a ``GenericSplit``."""
        return self._split[stage]

    def save_for_backward(self, a: Action, inp: torch.Tensor | None, root: Any) -> None:
        for hook in self.hooks.saved_for_backward:
            hook(a, inp, root)
        self._saved[a.stage * self.num_microbatches + a.microbatch] = (inp, root)

    def pop_saved(self, a: Action) -> tuple[torch.Tensor | None, Any]:
        key = a.stage * self.num_microbatches + a.microbatch
        try:
            return self._saved.pop(key)
        except KeyError:
            raise RuntimeError(f"rank {self.rank}: {a} has no saved forward state (its F did not run here)") from None

    def defer_w(self, a: Action) -> None:
        self._pending_w.add(a.stage * self.num_microbatches + a.microbatch)

    def complete_w(self, a: Action) -> None:
        key = a.stage * self.num_microbatches + a.microbatch
        if key not in self._pending_w:
            raise RuntimeError(f"rank {self.rank}: {a} runs before its B")
        self._pending_w.discard(key)

    def take_payload(self, a: Action) -> torch.Tensor:
        """The tensor SEND ``a`` moves (removed from the executor: the P2P layer holds it until sent)."""
        key = a.stage * self.num_microbatches + a.microbatch
        try:
            return self._to_send.pop((a.kind, key))
        except KeyError:
            raise PipelineCommError(
                f"rank {self.rank}: {a} is posted before its data exists (the producing action has not run)"
            ) from None


def _capture_rng() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _restore_rng(state: tuple[torch.Tensor, list[torch.Tensor] | None] | None) -> None:
    if state is None:
        return
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def prepost_windows(steps: Sequence[object], ahead: int) -> tuple[tuple[Action, ...], ...]:
    """For each step index ``j`` of a rank's lowered plan holding a batch: the receives to post right after it, ahead
    of their own batches -- every receive in the batches before the ``ahead + 1``-th compute action after ``j``, so
    each one is posted up to ``ahead`` compute actions earlier than the plan's batches would post it, and the
    per-peer order of receives stays the plan's (whole batches are taken in plan order).  ``ahead = 0``: none.

    Windows overlap on purpose: a receive may appear in several (``PipelineP2P.prepost`` posts it once).  The
    executor skips the windows before its post-validation replay point, and a later window must then still hold the
    skipped receives, or it would post a later receive ahead of an earlier one from the same peer."""
    if ahead < 0:
        raise ValueError(f"prepost ahead={ahead} must be >= 0")
    out: list[tuple[Action, ...]] = []
    for j, step in enumerate(steps):
        picked: list[Action] = []
        if type(step) is CommBatch and ahead > 0:
            computes = 0
            for later in steps[j + 1 :]:
                if type(later) is not CommBatch:
                    computes += 1
                    if computes == ahead + 1:
                        break
                    continue
                picked += [a for a in later.actions if a.kind is Kind.RECV_F or a.kind is Kind.RECV_B]
        out.append(tuple(picked))
    return tuple(out)


def post_plan(
    steps: Sequence[object], ahead: int, first_ahead: int = 0
) -> tuple[tuple[CommBatch | None, CommBatch | None], ...]:
    """What the executor posts at each step index of a rank's lowered plan when receives go ahead of their batches
    (gloo): ``(rest, early)`` for a batch -- the batch without the receives already posted ahead (``None`` if none
    is left), then the receives of ``prepost_windows(steps, ahead)[j]`` not yet posted (``None`` if none; windows
    before ``first_ahead``, the post-validation replay point, are skipped) -- and ``(None, None)`` for a compute
    action.  The same ops in the same order as filtering at run time, computed once per plan."""
    windows = prepost_windows(steps, ahead)
    early_posted: set[Action] = set()
    out: list[tuple[CommBatch | None, CommBatch | None]] = []
    for j, step in enumerate(steps):
        if type(step) is not CommBatch:
            out.append((None, None))
            continue
        rest = tuple(a for a in step.actions if a not in early_posted)
        early_posted.difference_update(step.actions)
        new = tuple(a for a in windows[j] if a not in early_posted) if j >= first_ahead else ()
        early_posted.update(new)
        batch = None if not rest else step if len(rest) == len(step.actions) else CommBatch(rest)
        out.append((batch, CommBatch(new) if new else None))
    return tuple(out)
