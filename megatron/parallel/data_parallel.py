"""Bucketed data-parallel gradient reduction over fp32 ``main_grad`` buffers, launched as soon as gradients are final.

Why not ``torch.nn.parallel.DistributedDataParallel``: with zero-bubble schedules the weight gradients are produced
by W steps long after autograd's backward has returned, and the deferrable linears accumulate them straight into
``param.main_grad``; DDP only sees gradients that autograd hands to ``param.grad``.

Layout.  Every trainable parameter gets ``param.main_grad``: an fp32 view into one contiguous buffer.  Parameters are
laid out in *reverse* registration order (backward reaches the last layers first) and grouped into buckets of about
``bucket_numel`` elements; a parameter never straddles two buckets; each bucket is padded to a multiple of the
data-parallel size so that it splits into equal shards (for reduce-scatter).

When a bucket goes.  A bucket's reduction (``all_reduce`` of the bucket, pre-scaled by ``1/dp`` so the result is the
mean over data-parallel ranks) is launched asynchronously the moment every parameter in it is *ready* (its gradient
for this iteration is final), so it overlaps with the rest of backward.  A parameter becomes ready when:

* someone calls ``mark_grad_ready(param)`` (the pipeline runtime, after a stage's last W), or
* during the last microbatch (``prepare_microbatch(is_last=True)``) it has received as many gradient contributions
  as it did in a previous microbatch.  Contributions are counted from autograd (a post-accumulate-grad hook that
  moves ``param.grad`` into ``main_grad``) and from ``zb_pipeline``'s deferrable functions, which accumulate into
  ``main_grad`` themselves and call ``register_grad_accumulated_hook`` hooks.  Counting (rather than "first
  contribution") keeps a parameter used twice per forward (tied embeddings) from launching half-finished.  With no
  previous microbatch to learn from (the very first iteration with one microbatch) nothing launches early.

``finish()`` launches whatever is left (in bucket order), waits for every reduction and checks the iteration:
a contribution that arrives after its parameter was declared ready raises ``RuntimeError`` at once (the reduction
may already be in flight).  With ``dp = 1`` there are no collectives at all.

Ordering assumption: every data-parallel rank runs the same program, so buckets become ready, and their collectives
are issued, in the same order on every rank (as in Megatron's and torch's DDP).

For the distributed optimizer (``megatron.optimizer.distributed``): ``reduce_op="reduce_scatter"`` reduces each
bucket so that this rank holds the mean only in its own shard, ``bucket.shard(dp_rank)`` (a view into the buffer);
``buckets``, ``param_range(param)`` and ``buffer`` describe the layout it needs to map shards back to parameters.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from zb_pipeline import comm
from zb_pipeline.runtime.deferrable_linear import register_grad_accumulated_hook

if TYPE_CHECKING:
    from megatron.parallel.context import ParallelContext

__all__ = ["DEFAULT_BUCKET_NUMEL", "DataParallelReducer", "GradBucket", "REDUCE_OPS"]

DEFAULT_BUCKET_NUMEL = 10_000_000  # ~40 MB of fp32 per bucket
REDUCE_OPS = ("all_reduce", "reduce_scatter")


@dataclass(eq=False)
class GradBucket:
    """A contiguous slice ``[start, end)`` of the reducer's buffer holding whole parameters' gradients."""

    index: int
    params: tuple[torch.nn.Parameter, ...]
    names: tuple[str, ...]
    data: torch.Tensor  # fp32 view of buffer[start:end], padded to a multiple of dp
    start: int
    end: int
    numel_unpadded: int
    dp_size: int
    work: Any = field(default=None, repr=False)
    launched: bool = False

    def shard(self, dp_rank: int) -> torch.Tensor:
        """This data-parallel rank's equal share of the bucket (what reduce-scatter leaves reduced)."""
        n = self.data.numel() // self.dp_size
        return self.data[dp_rank * n : (dp_rank + 1) * n]


class DataParallelReducer:
    """Owns the fp32 main-gradient buffer of a module's parameters and averages it over the data-parallel group.

    Per iteration::

        reducer.zero_grad()
        for k in range(m):
            reducer.prepare_microbatch(is_last=k == m - 1)
            loss_k.backward()                  # buckets launch during the last backward as they become final
        reducer.finish()                       # every main_grad now holds the dp-mean
    """

    def __init__(
        self,
        params: torch.nn.Module | Iterable[torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]],
        ctx: ParallelContext | None = None,
        *,
        dp_group: comm.ProcessGroup | None = None,
        dp_size: int | None = None,
        dp_rank: int | None = None,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        reduce_op: str = "all_reduce",
        device: torch.device | str | None = None,
    ) -> None:
        if reduce_op not in REDUCE_OPS:
            raise ValueError(f"{reduce_op=} is not one of {', '.join(REDUCE_OPS)}")
        if bucket_numel < 1:
            raise ValueError(f"{bucket_numel=} must be >= 1")
        if ctx is not None:
            dp_group = ctx.dp_group if dp_group is None else dp_group
            dp_size = ctx.dp_size if dp_size is None else dp_size
            dp_rank = ctx.dp_rank if dp_rank is None else dp_rank
        self.dp_group = dp_group
        self.dp_size = 1 if dp_size is None else int(dp_size)
        self.dp_rank = 0 if dp_rank is None else int(dp_rank)
        if self.dp_size > 1 and dp_group is None and not comm.is_initialized():
            raise ValueError(f"dp_size={self.dp_size} needs a data-parallel process group (pass ctx or dp_group)")
        self.reduce_op = reduce_op

        named = _named_trainable(params)
        if not named:
            raise ValueError("DataParallelReducer got no trainable parameters")
        order = list(reversed(named))  # backward visits the last layers first
        dev = torch.device(device) if device is not None else order[0][1].device
        self.buckets: tuple[GradBucket, ...] = self._lay_out_buckets(_plan_buckets(order, bucket_numel), dev)
        self.params: tuple[torch.nn.Parameter, ...] = tuple(p for _, p in order)
        self._init_iteration_state()
        self._handles = [p.register_post_accumulate_grad_hook(self._autograd_hook) for p in self.params]
        self._hooks_active = True
        contribution_hook = _weak_contribution_hook(self)
        for p in self.params:
            register_grad_accumulated_hook(p, contribution_hook)

    def _lay_out_buckets(
        self, plan: list[list[tuple[str, torch.nn.Parameter]]], device: torch.device
    ) -> tuple[GradBucket, ...]:
        """Allocate ``buffer`` for the planned buckets (each padded to a multiple of dp), point every parameter's
        ``main_grad`` into it and record where each one lies."""
        padded = [_round_up(sum(p.numel() for _, p in b), self.dp_size) for b in plan]
        self.buffer = torch.zeros(sum(padded), dtype=torch.float32, device=device)
        self._index: dict[int, tuple[int, int, int]] = {}  # id(param) -> (bucket, start, end) in buffer
        self._names: dict[int, str] = {}
        buckets = []
        start = 0
        for bi, (members, n_padded) in enumerate(zip(plan, padded)):
            offset = start
            for name, p in members:
                self._index[id(p)] = (bi, offset, offset + p.numel())
                self._names[id(p)] = name
                p.main_grad = self.buffer[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
            buckets.append(
                GradBucket(
                    index=bi,
                    params=tuple(p for _, p in members),
                    names=tuple(n for n, _ in members),
                    data=self.buffer[start : start + n_padded],
                    start=start,
                    end=start + n_padded,
                    numel_unpadded=offset - start,
                    dp_size=self.dp_size,
                )
            )
            start += n_padded
        return tuple(buckets)

    def _init_iteration_state(self) -> None:
        """The per-iteration bookkeeping, before the first iteration (nothing learned yet)."""
        self._ready: set[int] = set()
        self._pending: list[int] = [len(b.params) for b in self.buckets]  # params not yet ready per bucket
        self._counts: dict[int, int] = {}  # contributions in the current microbatch
        self._expected: dict[int, int] | None = None  # contributions per microbatch, learned
        self._is_last = False
        self._in_microbatch = False
        self.launch_order: list[int] = []  # bucket indices in launch order, this iteration (for tests and traces)

    # ----------------------------------------------------------------------------------------------- layout
    def param_range(self, param: torch.nn.Parameter) -> tuple[int, int, int]:
        """(bucket index, start, end) of ``param``'s gradient in ``buffer``."""
        try:
            return self._index[id(param)]
        except KeyError:
            raise KeyError(f"parameter of shape {tuple(param.shape)} is not managed by this reducer") from None

    # ---------------------------------------------------------------------------------------- per iteration
    def zero_grad(self) -> None:
        """Zero the buffer and start a new iteration (waits for any reduction still in flight first)."""
        self.start_iteration()
        self.buffer.zero_()
        for p in self.params:
            p.grad = None

    def start_iteration(self) -> None:
        """Reset the per-iteration bucket state but keep the buffer: with optimizer post-validation the previous
        step's gradients stay until it is validated, which zeroes them (``MainParamOptimizer.zero_grad``)."""
        for b in self.buckets:
            if b.work is not None:
                comm.wait(b.work, group=self.dp_group, op=f"gradient {self.reduce_op}")
            b.work = None
            b.launched = False
        self._ready.clear()
        self._pending = [len(b.params) for b in self.buckets]
        self._counts = {}
        self._is_last = False
        self._in_microbatch = False
        self.launch_order = []

    def prepare_microbatch(self, *, is_last: bool) -> None:
        """Call before each microbatch's backward; ``is_last`` lets gradients that are now final launch early."""
        self._close_microbatch()
        self._in_microbatch = True
        self._is_last = is_last
        if is_last and self._expected is not None:
            for p in self.params:  # parameters that get no gradient are final already
                if self._expected.get(id(p), 0) == 0:
                    self._set_ready(p)

    @contextmanager
    def last_microbatch(self) -> Iterator[None]:
        """``with reducer.last_microbatch(): loss.backward()`` for a single-microbatch step."""
        self.prepare_microbatch(is_last=True)
        yield

    def mark_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Declare ``param``'s gradient final for this iteration; its bucket launches if it was the last one.

        Idempotent: marking a parameter that is already ready (explicitly or by count) does nothing.
        """
        if id(param) not in self._index:
            raise KeyError(f"parameter of shape {tuple(param.shape)} is not managed by this reducer")
        self._set_ready(param)

    def finish(self, *, strict: bool = False) -> None:
        """Launch the buckets still waiting (in bucket order), wait for every reduction, check the iteration.

        ``strict=True`` raises if some parameter was never declared ready (neither explicitly nor by count), which
        means its bucket got no overlap; by default such buckets simply launch here.
        """
        self._close_microbatch()
        missing = [self._names[id(p)] for p in self.params if id(p) not in self._ready]
        if strict and missing:
            raise RuntimeError(f"{len(missing)} parameter gradients never marked ready: {', '.join(missing[:8])}")
        for b in self.buckets:
            if not b.launched:
                for p in b.params:
                    self._ready.add(id(p))
                self._pending[b.index] = 0
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                comm.wait(b.work, group=self.dp_group, op=f"gradient {self.reduce_op}")
                b.work = None
        self._in_microbatch = False
        self._is_last = False

    # ------------------------------------------------------------------------------------------- internals
    def _close_microbatch(self) -> None:
        """Learn how many contributions each parameter gets per microbatch from the one that just ended."""
        if self._in_microbatch and self._counts:
            self._expected = {id(p): self._counts.get(id(p), 0) for p in self.params}
        self._counts = {}

    def _autograd_hook(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        self._check_not_final(param)
        param.main_grad.add_(grad)
        param.grad = None
        self._count(param)

    def _on_contribution(self, param: torch.Tensor) -> None:
        # The deferrable function already added into main_grad; the check comes late but still catches the bug.
        if not self._hooks_active or id(param) not in self._index:
            return
        self._check_not_final(param)
        self._count(param)

    def _check_not_final(self, param: torch.Tensor) -> None:
        if id(param) in self._ready:
            raise RuntimeError(
                f"a gradient for {self._names[id(param)]} arrived after it was marked final for this iteration "
                f"(its bucket may already be reducing); mark it ready only after its last contribution"
            )

    def _count(self, param: torch.Tensor) -> None:
        key = id(param)
        n = self._counts.get(key, 0) + 1
        self._counts[key] = n
        if self._is_last and self._expected is not None and n == self._expected.get(key, -1):
            self._set_ready(param)

    def _set_ready(self, param: torch.Tensor) -> None:
        key = id(param)
        if key in self._ready:
            return
        self._ready.add(key)
        bi = self._index[key][0]
        self._pending[bi] -= 1
        if self._pending[bi] == 0:
            self._launch(self.buckets[bi])

    def _launch(self, bucket: GradBucket) -> None:
        if bucket.launched:
            return
        bucket.launched = True
        self.launch_order.append(bucket.index)
        if self.dp_size == 1:
            return
        bucket.data.mul_(1.0 / self.dp_size)  # mean over dp; exact for powers of two
        if self.reduce_op == "all_reduce":
            bucket.work = comm.all_reduce(bucket.data, group=self.dp_group, async_op=True)
        else:
            shard = bucket.shard(self.dp_rank)
            bucket.work = comm.reduce_scatter_tensor(shard, bucket.data, group=self.dp_group, async_op=True)

    def remove_hooks(self) -> None:
        """Detach from the parameters: autograd hooks removed, deferrable-function hooks turned into no-ops."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._hooks_active = False


def _weak_contribution_hook(reducer: DataParallelReducer):
    """A hook that does not keep the reducer alive (the parameters outlive it) and is a no-op once it is gone."""
    ref = weakref.ref(reducer)

    def hook(param: torch.Tensor) -> None:
        r = ref()
        if r is not None:
            r._on_contribution(param)

    return hook


def _named_trainable(
    params: torch.nn.Module | Iterable[torch.nn.Parameter] | Iterable[tuple[str, torch.nn.Parameter]],
) -> list[tuple[str, torch.nn.Parameter]]:
    items = params.named_parameters() if isinstance(params, torch.nn.Module) else params
    out: list[tuple[str, torch.nn.Parameter]] = []
    seen: set[int] = set()
    for i, item in enumerate(items):
        name, p = item if isinstance(item, tuple) else (f"param{i}", item)
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def _plan_buckets(
    order: list[tuple[str, torch.nn.Parameter]], bucket_numel: int
) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Group parameters (in ``order``) into buckets of whole parameters, about ``bucket_numel`` elements each."""
    plan: list[list[tuple[str, torch.nn.Parameter]]] = [[]]
    size = 0
    for name, p in order:
        if plan[-1] and size + p.numel() > bucket_numel:
            plan.append([])
            size = 0
        plan[-1].append((name, p))
        size += p.numel()
    return plan


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k
