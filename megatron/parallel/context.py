"""The frozen ParallelContext: this process's place in the tp x dp x pp grid and its torch.distributed groups.

Built once at start-up and passed by argument to everything that communicates; there are no module-level group
globals (Megatron's ``mpu`` globals let a layer silently talk over the wrong group).  Groups come from the pure
``RankLayout`` (``megatron.parallel.rank_math``), which also documents the rank order (tp fastest, then dp, then pp).

Launch under torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment):
single node with ``torchrun --standalone --nproc-per-node N``, several nodes through torchrun's rendezvous
(``--nnodes --node-rank --rdzv-backend c10d --rdzv-endpoint host:port``); see ``examples/``.

Groups of size 1 are ``None``: code must treat a ``None`` group (or size 1) as "no communication needed".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from megatron.config.errors import ConfigError
from megatron.parallel.rank_math import RankLayout
from zb_pipeline import comm

__all__ = ["DEFAULT_TIMEOUT", "ParallelContext", "default_backend"]

DEFAULT_TIMEOUT = timedelta(minutes=10)

ProcessGroup = comm.ProcessGroup


def default_backend() -> str:
    """``nccl`` when CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


@dataclass(frozen=True)
class ParallelContext:
    """One process's parallel coordinates and groups.  Immutable; pass it to whatever needs to communicate."""

    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: ProcessGroup | None
    pp_group: ProcessGroup | None
    dp_group: ProcessGroup | None
    mp_group: ProcessGroup | None  # tensor x pipeline: one model replica (grad norm, loss over stages)
    backend: str | None  # None for a single process without torch.distributed
    device: torch.device
    timeout: timedelta
    layout: RankLayout = field(repr=False, default=None)  # type: ignore[assignment]  # set by the constructors
    local_rank: int = 0
    # Ranks holding the first or the last virtual stage of this pipeline (tied embeddings); None if this rank holds
    # neither or if they are the same rank.
    embedding_group: ProcessGroup | None = None
    embedding_ranks: tuple[int, ...] = ()
    # Every rank at this pipeline position (tp x dp); None when that is this rank alone.
    stage_group: ProcessGroup | None = None
    owns_default_group: bool = field(default=False, repr=False)  # initialize() created it; shutdown() destroys it

    # ------------------------------------------------------------------------------------------- constructors
    @classmethod
    def single(
        cls, *, device: torch.device | str | None = None, timeout: timedelta = DEFAULT_TIMEOUT
    ) -> ParallelContext:
        """A world of one process: every size 1, every group ``None``, no ``torch.distributed`` needed."""
        dev = torch.device(device) if device is not None else _default_device(0)
        return cls(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            dp_size=1,
            tp_rank=0,
            pp_rank=0,
            dp_rank=0,
            tp_group=None,
            pp_group=None,
            dp_group=None,
            mp_group=None,
            backend=None,
            device=dev,
            timeout=timeout,
            layout=RankLayout(1, 1, 1, 1),
            local_rank=0,
            embedding_ranks=(0,),
        )

    @classmethod
    def initialize(
        cls,
        *,
        tp: int = 1,
        pp: int = 1,
        timeout: timedelta = DEFAULT_TIMEOUT,
        backend: str | None = None,
        chunks: int = 1,
        placement: str = "loop",
    ) -> ParallelContext:
        """Join (or reuse) the default process group and build every tp/dp/pp/model-parallel group.

        The world comes from the torchrun environment; if the default group is already initialised (tests, a
        caller that set it up) it is reused.  The layout is checked *before* any rendezvous, so a bad ``tp``/``pp``
        raises ``ValueError`` at once instead of hanging.  Without a torchrun environment and with ``tp = pp = 1``
        this is ``single()``.  ``backend=None`` picks NCCL when CUDA is available, else gloo.  Every group gets
        ``timeout``, so a peer that dies turns a collective into an error, not a hang: gloo's host-side waits time
        out; on NCCL it is the watchdog's timeout, with asynchronous error handling on (``zb_pipeline.comm.groups``),
        and waits never block the CPU.  ``chunks``/``placement`` (virtual stages) decide the embedding group.
        """
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"{timeout=} must be a positive datetime.timedelta")
        world = _launched_world(tp, pp)
        if world is None:
            return cls.single(timeout=timeout)
        world_size, rank = world
        layout = RankLayout.build(world_size, tp=tp, pp=pp)
        layout.embedding_groups(chunks=chunks, placement=placement)  # validates chunks/placement before rendezvous
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        owns, backend, device = _join_default_group(backend, rank, world_size, local_rank, timeout)

        def make(groups: tuple[tuple[int, ...], ...], name: str) -> ProcessGroup | None:
            return _new_groups(groups, rank, timeout, name)

        c = layout.coords(rank)
        ctx = cls(
            rank=rank,
            world_size=world_size,
            tp_size=layout.tp,
            pp_size=layout.pp,
            dp_size=layout.dp,
            tp_rank=c.tp_rank,
            pp_rank=c.pp_rank,
            dp_rank=c.dp_rank,
            tp_group=make(layout.tp_groups, "tp"),
            pp_group=make(layout.pp_groups, "pp"),
            dp_group=make(layout.dp_groups, "dp"),
            mp_group=make(layout.mp_groups, "model-parallel"),
            backend=backend,
            device=device,
            timeout=timeout,
            layout=layout,
            local_rank=local_rank,
            embedding_group=make(layout.embedding_groups(chunks=chunks, placement=placement), "embedding"),
            embedding_ranks=layout.embedding_group_of(rank, chunks=chunks, placement=placement) or (),
            stage_group=make(layout.stage_groups, "stage"),
            owns_default_group=owns,
        )
        return ctx

    # ---------------------------------------------------------------------------------------------- queries
    @property
    def is_distributed(self) -> bool:
        return self.backend is not None

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's tensor-parallel group (in tp_rank order)."""
        return self.layout.tp_group_of(self.rank)

    @property
    def dp_ranks(self) -> tuple[int, ...]:
        return self.layout.dp_group_of(self.rank)

    @property
    def pp_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's pipeline, in pipeline order."""
        return self.layout.pp_group_of(self.rank)

    @property
    def mp_ranks(self) -> tuple[int, ...]:
        return self.layout.mp_group_of(self.rank)

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline position (wraps around)."""
        return self.layout.next_rank(self.rank)

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline position (wraps around)."""
        return self.layout.prev_rank(self.rank)

    @property
    def is_first_pipeline_rank(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_pipeline_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_to_rank(self, *, chunks: int = 1, placement: str = "loop") -> tuple[int, ...]:
        """Global rank of each virtual stage of this rank's pipeline."""
        return self.layout.stage_to_rank(self.rank, chunks=chunks, placement=placement)

    def describe(self) -> str:
        """A start-up summary line."""
        where = f"backend {self.backend}, device {self.device}" if self.backend else f"single process, {self.device}"
        return f"{self.layout.describe()}; {where}"

    def shutdown(self) -> None:
        """Destroy the default process group if ``initialize`` created it (call once, at exit)."""
        if self.owns_default_group and comm.is_initialized():
            comm.destroy()


def _launched_world(tp: int, pp: int) -> tuple[int, int] | None:
    """``(world_size, rank)`` of the default group or the torchrun environment; ``None`` for a single process with
    ``tp = pp = 1``; a single process asked for more raises ``ValueError`` with the launch command."""
    if comm.is_initialized():
        return comm.world_size(), comm.rank()
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return _env_int("WORLD_SIZE"), _env_int("RANK")
    if tp == 1 and pp == 1:
        return None
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    raise ValueError(
        f"tp x pp = {tp} x {pp} needs a multiple of {tp * pp} processes but this is a single process "
        f"(WORLD_SIZE unset); launch with torchrun --nproc-per-node {tp * pp} (see examples/)"
    )


def _join_default_group(
    backend: str | None, rank: int, world_size: int, local_rank: int, timeout: timedelta
) -> tuple[bool, str, torch.device]:
    """Initialise the default group unless it already is; returns (created it, its backend, this rank's device)."""
    owns = not comm.is_initialized()
    if owns:
        backend = backend or default_backend()
        if "nccl" in backend:
            _check_gpus_for(local_rank)
            torch.cuda.set_device(local_rank)  # before the group, so NCCL binds this rank's GPU
        comm.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    backend = comm.backend_name()  # subgroups inherit the default group's backend
    if "nccl" in backend:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return owns, backend, device


def _check_gpus_for(local_rank: int) -> None:
    """NCCL gives each process of a node its own GPU: more processes than visible GPUs is bad input, refused with
    one line before any rendezvous (``LOCAL_WORLD_SIZE`` is the same on every rank of a node, so they all refuse)."""
    gpus = torch.cuda.device_count()
    per_node = max(_env_int("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in os.environ else 0, local_rank + 1)
    if gpus == 0:
        raise ConfigError("the nccl backend needs CUDA GPUs but this process sees none; check CUDA_VISIBLE_DEVICES")
    if per_node > gpus:
        raise ConfigError(
            f"NCCL needs one GPU per process, but this node runs {per_node} processes and sees {gpus} GPU(s); "
            f"launch with torchrun --nproc-per-node {gpus} (or fewer), or check CUDA_VISIBLE_DEVICES"
        )


def _new_groups(groups: tuple[tuple[int, ...], ...], rank: int, timeout: timedelta, name: str) -> ProcessGroup | None:
    """Create every group of size > 1 in ``groups``; returns the one holding ``rank`` (``None`` if none does).

    ``name`` (``tp``, ``dp``, ...) is what a ``comm.PeerFailedError`` calls the group.

    ``new_group`` is collective over the whole world: every rank creates every group, in the same order.
    """
    mine = None
    for ranks in groups:
        if len(ranks) == 1:
            continue
        g = comm.new_group(ranks, timeout=timeout, name=name)
        if rank in ranks:
            mine = g
    return mine


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer (set by torchrun)") from None


def _default_device(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
