"""One training iteration's forward and backward through the zero-bubble pipeline runtime, for GPT stages.

Build once per run, call once per iteration (``megatron.pipeline.trainer_hooks`` shows how the trainer does it)::

    pipe = build_gpt_pipeline(ctx, model_config, schedule_config, num_microbatches=m, micro_batch_size=b,
                              sequence_parallel=sp, seed=seed)
    model = pipe.model                      # nn.ModuleList of this rank's stages: reducer and optimizer take it
    ...
    total = pipe.forward_backward(batches)  # batches[k]: {"tokens", "labels", "loss_mask"} of microbatch k
                                            # (+ "position_ids", "document_ids": read by every stage)
    total, work = pipe.start_forward_backward(batches)  # the same, the pipeline sum started, not waited for

``GPTPipeline`` is the GPT side of ``zb_pipeline.runtime.PipelineRuntime``: it builds the stage modules, gives the
runtime a loss over each microbatch's batch, and passes the batches to ``runtime.run`` as an argument.  Each
microbatch's loss is the masked mean of the per-token loss, and ``loss / m`` is backpropagated -- exactly what the
pp = 1 loop in ``training_step.py`` does, so an untied model gets bit-identical gradients.  ``forward_backward``
returns the float64 sum of the microbatch losses on *every* pipeline rank (one small all-reduce over the pipeline
group), ready for the trainer's data-parallel mean; ``start_forward_backward`` only starts that all-reduce and
returns its work, so no rank waits for the others at the end of the plan (``megatron.deferred_loss``).

Tied embeddings work with every schedule: the first stage's word embedding and the last stage's output-layer copy
get the sum of their gradients (one all-reduce over the embedding group when they live on different ranks, a local
add when they share a rank as with V placement), so the two copies stay equal after every optimizer step.  The
all-reduce starts asynchronously when this rank's copy is final -- after its stage's last W (the executor's
``stage_grads_final`` hook) -- and is waited for after the plan, the only wait between the last compute action and
the optimizer step that the tied copies add.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron.config.errors import ConfigError
from megatron.data.document_masks import model_inputs
from megatron.model.config import GPTConfig
from megatron.model.gpt import WORD_EMBEDDING, GPTStage, build_gpt_stages
from megatron.parallel.context import ParallelContext
from megatron.pipeline.layout import PipelineLayout, pipeline_layout
from megatron.pipeline.schedule_flags import ScheduleConfig
from zb_pipeline import comm
from zb_pipeline.runtime.emulate import EmulatedCompute, EmulatedCosts
from zb_pipeline.runtime.executor import PipelineExecutor
from zb_pipeline.runtime.p2p import PipelineP2P, TensorSpec
from zb_pipeline.runtime.runtime import PipelineRuntime
from zb_pipeline.runtime.trace import Tracer, gather_trace
from zb_pipeline.schedule.ir import Schedule
from zb_pipeline.schedule.lowering import LoweredSchedule
from zb_pipeline.schedule.plan_file import plan_to_dict
from zb_pipeline.schedule.trace_timeline import PLAN_KEY
from zb_pipeline.schedule.validate import ScheduleError


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
class MaskedMeanLoss:
    """The loss of one microbatch: the masked mean of the last stage's per-token loss, backpropagated times the
    loss scale over ``num_microbatches`` (the pp = 1 loop's expression, so gradients match bit for bit)."""

    num_microbatches: int
    scale: float = 1.0
    # With ``scale_fn`` set the scale is read when each loss is computed (post-validation updates the fp16 loss
    # scale inside the plan, before the last rank's first forward).
    scale_fn: Callable[[], float] | None = None

    def __call__(self, per_token: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        mask = batch["loss_mask"]
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        scale = self.scale_fn() if self.scale_fn is not None else self.scale
        return loss * scale / self.num_microbatches, loss


def _gpt_input(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return batch["tokens"]


@dataclass
class _GPTForward:
    last_stage: int

    def __call__(self, module: torch.nn.Module, x: torch.Tensor, stage: int, batch: Mapping[str, Any]) -> Any:
        extra = model_inputs(batch)  # position ids / attention mask: every stage needs the same ones
        if stage == self.last_stage:
            return module(x, labels=batch["labels"], **extra)  # per-token loss [b, s]
        return module(x, **extra)


@dataclass
class GPTPipeline:
    """This rank's part of a pipelined GPT: its stage modules and the runtime that runs the plan over them."""

    ctx: ParallelContext
    runtime: PipelineRuntime
    model: PipelineModel  # this rank's stages in increasing order (for the reducer, optimizer, checkpoints)
    loss: MaskedMeanLoss
    tracer: Tracer | None = None
    emulator: EmulatedCompute | None = None
    # the tied copy's all-reduce of this iteration, started by its stage's last W (``_start_tied_sum``)
    _tied_work: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._tied = self._tied_copies()
        if len(self._tied) == 1:  # one copy here, the other on another rank: sum over the embedding group
            self.runtime.hooks.stage_grads_final.append(self._start_tied_sum)

    @property
    def schedule(self) -> Schedule:
        return self.runtime.schedule

    @property
    def lowered(self) -> LoweredSchedule:
        return self.runtime.lowered

    @property
    def executor(self) -> PipelineExecutor:
        return self.runtime.executor

    @property
    def stages(self) -> dict[int, GPTStage]:
        return self.runtime.stages  # type: ignore[return-value]

    @property
    def loss_scale_fn(self) -> Callable[[], float] | None:
        return self.loss.scale_fn

    @loss_scale_fn.setter
    def loss_scale_fn(self, fn: Callable[[], float] | None) -> None:
        self.loss.scale_fn = fn

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
        ranks may pass anything of length ``m``); ``position_ids``/``document_ids``, when used, on every rank.
        Returns the float64 sum of the microbatch losses on every rank.
        """
        return self._waited(*self.start_forward_backward(batches, iteration=iteration))

    def start_forward_backward(
        self, batches: Sequence[Mapping[str, torch.Tensor]], *, iteration: int = 0
    ) -> tuple[torch.Tensor, Any]:
        """``forward_backward`` without its wait: ``(total, work)``, where ``total`` holds the sum over the pipeline
        once ``work`` (the all-reduce's; ``None`` with one pipeline rank) has completed (``comm.wait``)."""
        self.loss.num_microbatches = len(batches)
        self._tied_work = None
        losses = self.runtime.run(batches, iteration=iteration)
        if self.emulator is not None:
            self.emulator.optimizer_step()
        self.sum_tied_embedding_grads()
        return self._start_sum_over_pipeline(losses if self.emulator is None else [])

    @torch.no_grad()
    def forward_only(self, batches: Sequence[Mapping[str, torch.Tensor]]) -> torch.Tensor:
        """Evaluation: the float64 sum of the microbatch losses (on every pipeline rank), forward passes only."""
        self.loss.num_microbatches = len(batches)
        return self._waited(*self._start_sum_over_pipeline(self.runtime.forward_only(batches)))

    def _waited(self, total: torch.Tensor, work: Any) -> torch.Tensor:
        """``total`` once its pipeline-group sum ``work`` (``None``: nothing to wait for) has completed."""
        if work is not None:
            comm.wait(work, group=self.ctx.pp_group, timeout=self.ctx.timeout)
        return total

    def _start_sum_over_pipeline(self, losses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Any]:
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for loss in losses:
            total += loss.double()
        if self.ctx.pp_group is None:
            return total, None
        return total, comm.all_reduce(total, group=self.ctx.pp_group, async_op=True)

    def write_trace(self, path: str | None) -> None:
        """Gather every pipeline rank's trace on the pipeline's first rank, which writes ``path``."""
        if self.tracer is not None:
            dst = self.ctx.pp_ranks[0] if self.ctx.pp_group is not None else self.ctx.rank
            doc = gather_trace(self.tracer, None, group=self.ctx.pp_group, dst=dst)
            if doc is not None and path is not None:
                doc[PLAN_KEY] = plan_to_dict(self.schedule)  # so `zb-schedule show --trace` can draw the plan too
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(doc, f)

    # -- tied embeddings --------------------------------------------------------------------------------------
    def tied_embedding_params(self) -> list[torch.nn.Parameter]:
        """This rank's copies of the tied word embedding that are separate tensors (0, 1 or 2 of them)."""
        return [p for _, p in self._tied_copies()]

    def _tied_copies(self) -> list[tuple[int, torch.nn.Parameter]]:
        """``(stage, parameter)`` of each separately held tied copy on this rank, in stage order."""
        out = []
        for s, stage in sorted(self.stages.items()):
            if stage.shares_embedding_in_stage:
                continue  # one tensor serves both uses already
            if stage.embedding is not None and stage.config.tied_embeddings:
                out.append((s, stage.embedding.word_embeddings.weight))
            if stage.output_layer is not None and getattr(stage.output_layer.weight, "shared_embedding", False):
                out.append((s, stage.output_layer.weight))
        return out

    def _tied_grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        g = _grad_of(p)
        if g is None:
            raise RuntimeError("a tied embedding copy has no gradient after the iteration")
        return g

    def _embedding_group(self) -> Any:
        group = self.ctx.embedding_group
        if group is None:
            raise RuntimeError(
                f"rank {self.ctx.rank} holds one tied-embedding copy but no embedding group; build the "
                "ParallelContext with the schedule's chunks and placement"
            )
        return group

    def _start_tied_sum(self, stage: int) -> None:
        """``stage_grads_final`` hook: the copy's gradient is final; start its all-reduce (waited for after the
        plan)."""
        ((s, p),) = self._tied
        if stage == s and self._tied_work is None:
            self._tied_work = comm.all_reduce(self._tied_grad(p), group=self._embedding_group(), async_op=True)

    def sum_tied_embedding_grads(self) -> None:
        """Give both copies of a tied embedding the sum of their gradients (see the module docstring)."""
        tied = self._tied
        if not tied:
            return
        if len(tied) == 2:  # both copies on this rank (V placement): a local add
            first, second = (self._tied_grad(p) for _, p in tied)
            second.copy_(first.add_(second))
            return
        work, self._tied_work = self._tied_work, None
        if work is None:  # the hook did not see the stage's last W (a plan without one): sum now
            work = comm.all_reduce(self._tied_grad(tied[0][1]), group=self._embedding_group(), async_op=True)
        comm.wait(work, group=self.ctx.embedding_group, timeout=self.ctx.timeout)


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
    layout: PipelineLayout | None = None,
) -> GPTPipeline:
    """Build this rank's GPT stages and the runtime that runs the plan over them.

    ``layout`` is the run's plan and layer split (``RunConfig.pipeline_layout``); without it they are computed here
    from the other arguments.  Bad shapes (m below what the schedule needs, layers that do not split, a plan file for
    another shape) raise ``ConfigError`` with one line at start-up, before any communication.
    """
    pp, rank = ctx.pp_size, ctx.pp_rank
    if layout is None:
        layout = pipeline_layout(
            schedule_config,
            pp=pp,
            num_microbatches=num_microbatches,
            num_layers=model_config.num_layers,
            first_stage_layers=first_stage_layers,
            last_stage_layers=last_stage_layers,
            allow_padding=allow_padding,
        )
    schedule = layout.schedule
    S = schedule.num_stages
    mine = schedule.stages_of(rank)
    modules = build_gpt_stages(
        model_config, S, stages=mine, tp=ctx, sequence_parallel=sequence_parallel, seed=seed, ranges=layout.layer_ranges
    )
    stages = {s: mod.to(device=ctx.device, dtype=dtype) for s, mod in zip(mine, modules)}
    seq = model_config.seq_length // (ctx.tp_size if sequence_parallel else 1)
    boundary_dtype = torch.float32 if model_config.fp32_residual_connection else dtype  # the residual stream's
    specs = [TensorSpec((seq, micro_batch_size, model_config.hidden_size), boundary_dtype)] * (S - 1)
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
    loss = MaskedMeanLoss(num_microbatches)
    try:
        runtime = PipelineRuntime(
            stages,
            rank=rank,
            plans=layout.plans,
            num_microbatches=num_microbatches,
            comm=p2p,
            input_fn=_gpt_input,
            loss_fn=loss,
            forward_fn=_GPTForward(S - 1),
            tracer=tracer,
        )
    except ScheduleError as err:
        raise ConfigError(f"pipeline plan {schedule.name!r} is not runnable: {str(err).splitlines()[0]}") from None
    emulator = None
    if schedule_config.emulate_compute:
        try:
            costs_ms = EmulatedCosts.parse(schedule_config.emulate_compute)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        scale = schedule_config.stage_scale(pp)[rank]
        emulator = runtime.attach(
            EmulatedCompute(costs_ms, chunks=schedule.chunks, boundary_specs=specs, device=ctx.device, scale=scale)
        )
    if tracer is not None:
        tracer.align(ctx.pp_group)
    model = PipelineModel([stages[s] for s in sorted(stages)])
    return GPTPipeline(ctx, runtime, model, loss, tracer, emulator)
