"""One training iteration's forward and backward through the zero-bubble pipeline runtime, for GPT stages.

Build once per run, call once per iteration (see ``.notes/runtime_integration.md`` for how ``training.py`` uses it)::

    pipe = build_gpt_pipeline(ctx, model_config, schedule_config, num_microbatches=m, micro_batch_size=b,
                              sequence_parallel=sp, seed=seed)
    model = pipe.model                      # nn.ModuleList of this rank's stages: reducer and optimizer take it
    ...
    total = pipe.forward_backward(batches)  # batches[k]: {"tokens", "labels", "loss_mask"} of microbatch k

Each microbatch's loss is the masked mean of the per-token loss, and ``loss / m`` is backpropagated -- exactly what
the pp = 1 loop in ``training.py`` does, so an untied model gets bit-identical gradients.  ``forward_backward``
returns the float64 sum of the microbatch losses on *every* pipeline rank (one small all-reduce over the pipeline
group), ready for the trainer's data-parallel mean.

Tied embeddings work with every schedule: the first stage's word embedding and the last stage's output-layer copy
get the sum of their gradients (one all-reduce over the embedding group when they live on different ranks, a local
add when they share a rank as with V placement), so the two copies stay equal after every optimizer step.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron.config.errors import ConfigError
from megatron.model.config import GPTConfig
from megatron.model.gpt import WORD_EMBEDDING, GPTStage, build_gpt_stages
from megatron.parallel.context import ParallelContext
from megatron.pipeline.schedule_flags import ScheduleConfig
from zb_pipeline.runtime.emulate import EmulatedCompute, EmulatedCosts
from zb_pipeline.runtime.executor import PipelineExecutor
from zb_pipeline.runtime.p2p import PipelineP2P, TensorSpec
from zb_pipeline.runtime.trace import Tracer, gather_trace
from zb_pipeline.runtime.weight_grad_store import WeightGradStore
from zb_pipeline.schedule.ir import Action, F, Kind, Schedule
from zb_pipeline.schedule.lowering import LoweredSchedule, lower
from zb_pipeline.schedule.plan_file import plan_to_dict
from zb_pipeline.schedule.trace_timeline import PLAN_KEY
from zb_pipeline.schedule.validate import ScheduleError, validate


class PipelineModel(torch.nn.ModuleList):
    """This rank's stages in increasing order, named like the whole model (``global_name``) for the optimizer and
    checkpoints: ``"1.layers.0.mlp.fc1.weight"`` -> ``"layers.6.mlp.fc1.weight"``.

    The one name clash -- a rank holding both tied copies of the word embedding as separate tensors (V placement) --
    is resolved by naming the output head's copy ``TIED_OUTPUT_COPY``; a copy on another rank keeps the embedding's
    name, so it is initialised identically and checkpoints key it like the pp = 1 model.
    """

    def __init__(self, stages: Sequence[GPTStage]) -> None:
        super().__init__(stages)
        self._has_embedding = any(st.embedding is not None for st in stages)

    def global_name(self, local_name: str) -> str:
        index, _, rest = local_name.partition(".")
        stage = self[int(index)]
        name = stage.global_name(rest)
        if name == WORD_EMBEDDING and rest == "output_layer.weight" and self._has_embedding:
            return TIED_OUTPUT_COPY
        return name


TIED_OUTPUT_COPY = "output_layer.weight.tied_copy"


@dataclass
class GPTPipeline:
    """This rank's part of a pipelined GPT: the plan, its stage modules and the executor that runs them."""

    ctx: ParallelContext
    schedule: Schedule
    lowered: LoweredSchedule
    stages: dict[int, GPTStage]
    executor: PipelineExecutor
    model: PipelineModel  # this rank's stages in increasing order (for the reducer, optimizer, checkpoints)
    tracer: Tracer | None = None
    emulator: EmulatedCompute | None = None
    # Multiplies each microbatch's loss before backward (with the 1/m of the mean): the fp16 loss scale.  With
    # ``loss_scale_fn`` set it is read when the last stage computes each loss (post-validation updates the scale
    # inside the plan, before the last rank's first forward).
    loss_scale: float = 1.0
    loss_scale_fn: Callable[[], float] | None = None
    # Called with a virtual stage once its last W (or BW) of the iteration has run: its weight gradients are final.
    on_stage_grads_final: Callable[[int], None] | None = None
    _batches: Sequence[Mapping[str, torch.Tensor]] = field(default=(), repr=False)
    _backward_done: dict[int, int] = field(default_factory=dict, repr=False)
    _forward_only: PipelineExecutor | None = field(default=None, repr=False)

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stages

    @property
    def holds_last_stage(self) -> bool:
        return self.schedule.num_stages - 1 in self.stages

    # -- one iteration ----------------------------------------------------------------------------------------
    def forward_backward(self, batches: Sequence[Mapping[str, torch.Tensor]], *, iteration: int = 0) -> torch.Tensor:
        """Run the plan over this data-parallel rank's ``m`` microbatches; gradients land in ``main_grad``/``grad``.

        ``batches[k]`` needs ``tokens`` on the first stage's rank and ``labels``/``loss_mask`` on the last's (other
        ranks may pass anything of length ``m``).  Returns the float64 sum of the microbatch losses on every rank.
        """
        m = self.schedule.num_microbatches
        if len(batches) != m:
            raise ValueError(f"got {len(batches)} microbatches, the plan has m={m}")
        self._batches = batches
        self._backward_done = dict.fromkeys(self.stages, 0)
        try:
            losses = self.executor.run(iteration)
        finally:
            self._batches = ()
        if self.emulator is not None:
            self.emulator.optimizer_step()
        self.sum_tied_embedding_grads()
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        if self.holds_last_stage and self.emulator is None:
            for loss in losses:
                total += loss.double()
        if self.ctx.pp_group is not None:
            dist.all_reduce(total, group=self.ctx.pp_group)
        return total

    def _weight_grads_done(self, stage: int) -> None:
        """After every W/BW: once a stage has run all ``m`` of them its gradients are final for the iteration."""
        done = self._backward_done[stage] + 1
        self._backward_done[stage] = done
        if done == self.schedule.num_microbatches and self.on_stage_grads_final is not None:
            self.on_stage_grads_final(stage)

    @torch.no_grad()
    def forward_only(self, batches: Sequence[Mapping[str, torch.Tensor]]) -> torch.Tensor:
        """Evaluation: the float64 sum of the microbatch losses (on every pipeline rank), forward passes only.

        Runs a forward-only plan (every rank's F actions in microbatch order, lowered like any plan, so P2P keeps
        the strict order and its timeouts) through a second executor that shares this one's stages and store.
        """
        m = self.schedule.num_microbatches
        if len(batches) != m:
            raise ValueError(f"got {len(batches)} microbatches, the plan has m={m}")
        if self._forward_only is None:
            self._forward_only = _forward_only_executor(self)
        self._batches = batches
        try:
            losses = self._forward_only.run()
        finally:
            self._batches = ()
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for loss in losses:
            total += loss.double()
        if self.ctx.pp_group is not None:
            dist.all_reduce(total, group=self.ctx.pp_group)
        return total

    def write_trace(self, path: str | None) -> None:
        """Gather every pipeline rank's trace on the pipeline's first rank, which writes ``path``."""
        if self.tracer is not None:
            dst = self.ctx.pp_ranks[0] if self.ctx.pp_group is not None else self.ctx.rank
            doc = gather_trace(self.tracer, None, group=self.ctx.pp_group, dst=dst)
            if doc is not None and path is not None:
                doc[PLAN_KEY] = plan_to_dict(self.schedule)  # so `zb-schedule show --trace` can draw the plan too
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(doc, f)

    # -- tied embeddings --------------------------------------------------------------------------------------
    def tied_embedding_params(self) -> list[torch.nn.Parameter]:
        """This rank's copies of the tied word embedding that are separate tensors (0, 1 or 2 of them)."""
        out = []
        for _, stage in sorted(self.stages.items()):
            if stage.shares_embedding_in_stage:
                continue  # one tensor serves both uses already
            if stage.embedding is not None and stage.config.tied_embeddings:
                out.append(stage.embedding.word_embeddings.weight)
            if stage.output_layer is not None and getattr(stage.output_layer.weight, "shared_embedding", False):
                out.append(stage.output_layer.weight)
        return out

    def sum_tied_embedding_grads(self) -> None:
        """Give both copies of a tied embedding the sum of their gradients (see the module docstring)."""
        params = self.tied_embedding_params()
        if not params:
            return
        grads = [_grad_of(p) for p in params]
        if any(g is None for g in grads):
            raise RuntimeError("a tied embedding copy has no gradient after the iteration")
        total = grads[0] if len(grads) == 1 else grads[0].add_(grads[1])
        if len(grads) == 1:
            group = self.ctx.embedding_group
            if group is None:
                raise RuntimeError(
                    f"rank {self.ctx.rank} holds one tied-embedding copy but no embedding group; build the "
                    "ParallelContext with the schedule's chunks and placement"
                )
            dist.all_reduce(total, group=group)
        else:
            grads[1].copy_(total)


def _grad_of(p: torch.nn.Parameter) -> torch.Tensor | None:
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def build_gpt_pipeline(
    ctx: ParallelContext,
    model_config: GPTConfig,
    schedule_config: ScheduleConfig,
    *,
    num_microbatches: int,
    micro_batch_size: int,
    sequence_parallel: bool = False,
    seed: int = 1234,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    allow_padding: bool = False,
    dtype: torch.dtype = torch.float32,
    costs: Any = None,
) -> GPTPipeline:
    """Generate, validate and lower the plan; build this rank's GPT stages and the executor that runs them.

    Bad shapes (m below what the schedule needs, layers that do not split, a plan file for another shape) raise
    ``ConfigError`` with one line at start-up, before any communication.
    """
    pp, rank = ctx.pp_size, ctx.pp_rank
    schedule = schedule_config.build_schedule(
        pp=pp, num_microbatches=num_microbatches, num_layers=model_config.num_layers, costs=costs
    )
    try:
        lowered = validate(schedule)
    except ScheduleError as err:
        raise ConfigError(f"pipeline plan {schedule.name!r} is not runnable: {str(err).splitlines()[0]}") from None
    S = schedule.num_stages
    mine = schedule.stages_of(rank)
    modules = build_gpt_stages(
        model_config,
        S,
        stages=mine,
        tp=ctx,
        sequence_parallel=sequence_parallel,
        seed=seed,
        first=first_stage_layers,
        last=last_stage_layers,
        allow_padding=allow_padding,
    )
    stages = {s: mod.to(device=ctx.device, dtype=dtype) for s, mod in zip(mine, modules)}
    seq = model_config.seq_length // (ctx.tp_size if sequence_parallel else 1)
    specs = [TensorSpec((seq, micro_batch_size, model_config.hidden_size), dtype)] * (S - 1)
    tracer = Tracer(ctx.rank) if schedule_config.trace_path else None
    p2p = PipelineP2P(
        pp_rank=rank,
        boundary_specs=specs,
        group=ctx.pp_group,
        pp_ranks=ctx.pp_ranks,
        device=ctx.device,
        timeout_s=ctx.timeout.total_seconds(),
        check=schedule_config.p2p_check,
        tracer=tracer,
    )
    pipe_box: list[GPTPipeline] = []

    def input_fn(mb: int) -> torch.Tensor:
        return pipe_box[0]._batches[mb]["tokens"]

    def forward_fn(module: torch.nn.Module, x: torch.Tensor, s: int, mb: int) -> torch.Tensor:
        if s == S - 1:
            return module(x, labels=pipe_box[0]._batches[mb]["labels"])  # per-token loss [b, s]
        return module(x)

    def loss_fn(per_token: torch.Tensor, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        mask = pipe_box[0]._batches[mb]["loss_mask"]
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        # The pp = 1 loop backpropagates loss * scale / m: the same expression gives the same gradients bit for bit.
        pipe = pipe_box[0]
        scale = pipe.loss_scale_fn() if pipe.loss_scale_fn is not None else pipe.loss_scale
        return loss * scale / num_microbatches, loss

    executor = PipelineExecutor(
        lowered,
        rank,
        stages,
        p2p=p2p,
        store=WeightGradStore(),
        input_fn=input_fn,
        loss_fn=loss_fn,
        forward_fn=forward_fn,
        tracer=tracer,
    )
    emulator = None
    if schedule_config.emulate_compute:
        try:
            costs_ms = EmulatedCosts.parse(schedule_config.emulate_compute)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        emulator = EmulatedCompute(costs_ms, chunks=schedule.chunks, boundary_specs=specs)
        emulator.install(executor)
    for kind in (Kind.W, Kind.BW):
        executor.handlers[kind] = _counting(executor.handlers[kind], pipe_box)
    if tracer is not None:
        tracer.align(ctx.pp_group)
    model = PipelineModel([stages[s] for s in sorted(stages)])
    pipe = GPTPipeline(ctx, schedule, lowered, stages, executor, model, tracer, emulator)
    pipe_box.append(pipe)
    return pipe


def _counting(inner: Callable[[PipelineExecutor, Action], Any], pipe_box: list[GPTPipeline]):
    """Wrap a W/BW handler so the pipeline learns when a stage's weight gradients are final."""

    def handler(ex: PipelineExecutor, a: Action) -> None:
        inner(ex, a)
        pipe_box[0]._weight_grads_done(a.stage)

    return handler


def forward_only_plan(schedule: Schedule) -> Schedule:
    """The same stages and placement, F actions only: each rank runs its forwards in (microbatch, stage) order,
    which is a topological order of the forward dependencies, so the plan cannot deadlock."""
    ranks = []
    for r in range(schedule.num_ranks):
        fs = [F(s, mb) for mb in range(schedule.num_microbatches) for s in schedule.stages_of(r)]
        ranks.append(tuple(fs))
    return Schedule(
        name=f"{schedule.name}/forward-only",
        num_ranks=schedule.num_ranks,
        num_stages=schedule.num_stages,
        num_microbatches=schedule.num_microbatches,
        stage_to_rank=schedule.stage_to_rank,
        ranks=tuple(ranks),
    )


def _forward_only_handler(ex: PipelineExecutor, a: Action) -> None:
    s, mb = a.stage, a.microbatch
    out = ex.forward_fn(ex.stages[s], ex.fetch_input(a), s, mb)
    if s == ex.num_stages - 1:
        got = ex.loss_fn(out, mb)
        ex.losses[mb] = (got[1] if isinstance(got, tuple) else got).detach()
    else:
        ex.deliver_output(a, out)


def _forward_only_executor(pipe: GPTPipeline) -> PipelineExecutor:
    main, train_p2p = pipe.executor, pipe.executor.p2p
    lowered = lower(forward_only_plan(pipe.schedule))
    p2p = None
    if train_p2p is not None:
        p2p = PipelineP2P(
            pp_rank=train_p2p.pp_rank,
            boundary_specs=train_p2p.specs,
            group=train_p2p.group,
            pp_ranks=train_p2p.pp_ranks,
            device=train_p2p.device,
            timeout_s=train_p2p.timeout_s,
            check=train_p2p.check,
        )
    ex = PipelineExecutor(
        lowered,
        main.rank,
        pipe.stages,
        p2p=p2p,
        store=main.store,  # binding the stages to another store would divert training's deferred W work
        input_fn=main.input_fn,
        loss_fn=main.loss_fn,
        forward_fn=main.forward_fn,
    )
    ex.handlers[Kind.F] = _forward_only_handler
    return ex


def word_embedding_name() -> str:
    """The global parameter name both tied copies map to (checkpoints key on it)."""
    return WORD_EMBEDDING
