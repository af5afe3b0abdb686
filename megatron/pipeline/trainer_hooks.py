"""What ``megatron.training`` calls when ``--pipeline-model-parallel-size`` > 1: build, step, evaluate, trace.

The pp = 1 path of the trainer is untouched; with pp > 1 it calls, in this order:

    ParallelContext.initialize(..., **context_layout(run))    # embedding group follows the plan's placement
    pipe = build_trainer_pipeline(run, ctx, model_config)     # plan generated, validated, lowered; stages built
    ... model = pipe.model; optimizer/reducer built over it as for pp = 1 ...
    attach_reducer(pipe, reducer)                             # buckets launch after each stage's last W
    loss = pipeline_forward_backward(tr)                      # one iteration: a PendingLoss (deferred_loss)
    loss = pipeline_evaluate(tr)                              # a forward-only plan through the same stages
    write_pipeline_trace(tr)                                  # --pipeline-trace, at the end of the run

Gradient reduction and tied embeddings, in the order that keeps every optimizer exact:

1. ``reducer.prepare_microbatch(is_last=False)`` once: the reducer's contribution counting never declares a
   gradient final on its own (it cannot know that the tied copies still need their sum).
2. During the plan, after a stage's m-th W (or BW) its parameters are final: ``mark_grad_ready`` for each of them
   except the tied word-embedding copies, so a data-parallel bucket launches as soon as its last stage finished --
   overlapping the reduction with the other stages' remaining work.
3. The two tied copies' gradients are summed by ``GPTPipeline`` (an all-reduce over the embedding group, started
   when the copy's stage ran its last W and waited for after the plan, or a local add when V placement puts both
   on one rank).  Their buckets cannot have launched yet, so the sum happens *before* the data-parallel reduction
   -- required for the distributed optimizer, whose reduce-scatter leaves only a shard of each bucket valid, and
   the two copies live in differently laid-out buffers on different ranks.
4. ``reducer.finish()`` launches the rest (the tied copies' buckets) and waits; sequence-parallel grads are summed.

The global grad norm counts the tied copy once, as Megatron does: the output head's copy is tagged
``shared_embedding`` and ``megatron.optimizer.grad_norm.owns_grad`` skips it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from megatron.data.loader import train_microbatches
from megatron.deferred_loss import PendingLoss
from megatron.microbatches import load_microbatch, mean_over_dp, microbatch_indices
from megatron.model.config import GPTConfig
from megatron.parallel.context import ParallelContext
from megatron.parallel.tensor_parallel.partitioning import allreduce_sequence_parallel_grads
from megatron.pipeline.forward_backward import GPTPipeline, build_gpt_pipeline
from megatron.pipeline.layer_split import (
    GIB,
    MeasuredSplit,
    measured_layer_split,
    measured_limit_error,
    memory_limit_bytes,
    planner_costs,
    plans_within_bytes,
)
from megatron.pipeline.part_timer import PartTimer
from zb_pipeline.runtime.replanner import WindowReplanner
from zb_pipeline.schedule import registry
from zb_pipeline.schedule.profile import Profile
from zb_pipeline.schedule.stage_planner import PlannerError

if TYPE_CHECKING:
    from megatron.arguments import RunConfig
    from megatron.parallel.data_parallel import DataParallelReducer
    from megatron.pipeline.layout import PipelineLayout
    from megatron.trainer_state import Trainer


def context_layout(run: RunConfig) -> dict[str, Any]:
    """``chunks``/``placement`` keyword arguments of ``ParallelContext.initialize`` for this run's plan."""
    return {} if run.pipeline_layout is None else run.pipeline_layout.context_layout()


def build_trainer_pipeline(run: RunConfig, ctx: ParallelContext, model_config: GPTConfig) -> GPTPipeline:
    """This rank's stages and executor for ``run`` (parameters from ``(seed, global name)`` like pp = 1)."""
    return build_gpt_pipeline(
        ctx,
        model_config,
        run.pipeline,
        num_microbatches=run.num_microbatches,
        micro_batch_size=run.training.micro_batch_size,
        sequence_parallel=run.parallel.sequence_parallel,
        seed=run.training.seed,
        first_stage_layers=run.parallel.decoder_first_pipeline_num_layers,
        last_stage_layers=run.parallel.decoder_last_pipeline_num_layers,
        allow_padding=run.parallel.allow_padding_num_layers,
        dtype=run.precision.params_dtype,
        layout=run.pipeline_layout,
    )


def attach_reducer(pipe: GPTPipeline, reducer: DataParallelReducer) -> None:
    """Launch a stage's data-parallel buckets once its last W has run (step 2 of the module docstring)."""
    tied = {id(p) for p in pipe.tied_embedding_params()}
    per_stage = {
        s: [p for p in stage.parameters() if p.requires_grad and id(p) not in tied] for s, stage in pipe.stages.items()
    }

    def ready(stage: int) -> None:
        for p in per_stage[stage]:
            reducer.mark_grad_ready(p)

    pipe.runtime.hooks.stage_grads_final.append(ready)


def _reads_batches(tr: Trainer) -> bool:
    """Whether a stage of this rank reads the batches: the first (tokens), the last (labels, loss mask), and with
    --reset-position-ids / --reset-attention-mask every stage (position ids, attention mask)."""
    pipe = tr.pipeline
    return pipe.holds_first_stage or pipe.holds_last_stage or tr.run.documents.every_stage


def _batches(tr: Trainer, dataset: Any, base: int) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's m microbatches starting at global sample ``base`` (only where a stage reads them)."""
    run, ctx = tr.run, tr.ctx
    if not _reads_batches(tr):
        return [{} for _ in range(run.num_microbatches)]
    return [
        load_microbatch(dataset, microbatch_indices(run, ctx.dp_rank, base, k), ctx.device)
        for k in range(run.num_microbatches)
    ]


def _train_batches(tr: Trainer) -> list[dict[str, torch.Tensor]]:
    """This iteration's microbatches (ramp-up: their count follows the global batch size); placeholders on ranks
    whose stages read no batch."""
    if not _reads_batches(tr):
        return [{} for _ in range(tr.run.num_microbatches_at(tr.iteration))]
    return train_microbatches(tr)


def pipeline_forward_backward(tr: Trainer) -> PendingLoss:
    """One iteration through the plan; returns the global-batch mean loss (as the pp = 1 loop does) with its
    reductions over the pipeline and data-parallel groups started, not waited for (``megatron.deferred_loss``)."""

    run, ctx, pipe = tr.run, tr.ctx, tr.pipeline
    batches = _train_batches(tr)
    tr.model.train()
    if tr.post_validation is None:
        tr.reducer.zero_grad()
    else:  # the previous step's gradients stay until the plan validates it (which zeroes them)
        tr.reducer.start_iteration()
    tr.reducer.prepare_microbatch(is_last=False)  # readiness comes from the plan, not from counting
    total, work = pipe.start_forward_backward(batches, iteration=tr.iteration)  # tied copies summed before buckets
    tr.reducer.finish()
    if run.parallel.sequence_parallel or run.model.qk_layernorm:  # grads that are partial sums over tp
        allreduce_sequence_parallel_grads(tr.model.parameters(), ctx)
    return PendingLoss.of_context(total, len(batches), ctx, pp_work=work)


@torch.no_grad()
def pipeline_evaluate(tr: Trainer) -> float:
    """Mean validation loss over ``--eval-iters`` global batches, forward-only through the pipeline."""
    run, ctx, pipe = tr.run, tr.ctx, tr.pipeline
    tr.model.eval()
    total = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for _ in range(run.training.eval_iters):
        total += pipe.forward_only(_batches(tr, tr.valid_data, tr.consumed_valid_samples))
        tr.consumed_valid_samples += run.global_batch_size
    tr.model.train()
    return mean_over_dp(total, run.num_microbatches * run.training.eval_iters, ctx)


def write_pipeline_trace(tr: Trainer, log: Any = print) -> None:
    """``--pipeline-trace``: gather every pipeline rank's trace; the first pipeline rank of dp replica 0 writes it.

    Collective over each pipeline group, so every rank calls it.  With dp > 1 each replica gathers its own; only
    data-parallel rank 0's is written (the replicas run the same plan).
    """
    pipe, path = tr.pipeline, tr.run.pipeline.trace_path
    if pipe is None or path is None:
        return
    pipe.write_trace(path if tr.ctx.dp_rank == 0 else None)
    if tr.ctx.dp_rank == 0 and tr.ctx.pp_rank == 0 and tr.ctx.tp_rank == 0:
        log(f"wrote the pipeline trace {path} (draw it: zb-schedule show --trace {path} --png trace.png)")


def pipeline_summary(run: RunConfig, pipe: GPTPipeline | None) -> dict[str, str]:
    """Start-up summary lines for the pipeline (empty for pp = 1)."""
    if pipe is None:
        return {}
    s = pipe.schedule
    what = f"{s.name} from {run.pipeline.schedule_file}" if run.pipeline.schedule_file else s.name
    line = f"{what}: p={s.num_ranks}, m={s.num_microbatches}, {s.chunks} chunk(s) per rank ({s.placement} placement)"
    out = {"pipeline schedule": line}
    layout = run.pipeline_layout
    if layout is not None:
        out["layers per stage"] = layer_split_summary(layout)
    if run.pipeline.emulate_compute:
        out["emulated compute"] = f"F,B,W[,OPT] = {run.pipeline.emulate_compute} ms (losses are 0)"
        if run.pipeline.emulate_stage_scale:
            out["emulated compute"] += f", rank r's F,B,W times s_r = {run.pipeline.emulate_stage_scale}"
    if run.pipeline.trace_path:
        out["pipeline trace"] = run.pipeline.trace_path
    return out


def layer_split_summary(layout: PipelineLayout) -> str:
    """``[3, 1] (auto: simulated iteration -12.0% against the even split, analytic FLOPs model)``."""
    text = f"{list(layout.layers_per_stage)} ({layout.split}"
    plan = layout.split_plan
    if plan is not None and layout.even_iteration:
        text += f": simulated iteration {plan.iteration / layout.even_iteration - 1:+.1%} against the even split"
    if plan is not None:
        text += ", analytic FLOPs model"
    return text + ")"


def attach_replanner(
    pipe: GPTPipeline | None,
    run: RunConfig,
    ctx: ParallelContext,
    log: Any,
    *,
    step_ms: Callable[[], float | None] | None = None,
) -> Any:
    """The run's schedule re-planned from profiled costs: a ``WindowReplanner`` over
    ``--zero-bubble-pipeline-timers-start/end-iter``.

    Returns ``None`` unless the run has a profiling window and uses a schedule whose plan depends on the costs
    (``uses_costs`` in the registry: zb-auto, zb-h2's W placement, the V schedules, interleaved-zb) or an auto layer
    split (``--pipeline-layer-split auto``, any schedule): the window then also times the model's parts and every
    rank re-decides the split from the agreed profile (``replanner.agreed``, applied by the training loop).
    The memory limit (``--zero-bubble-max-pending-backward``) applies to zb-auto; the others keep the bound they
    state.  ``--pipeline-memory-limit-gb`` bounds the split re-decided in the window; a limit that the measured
    memory proves impossible raises ``ConfigError`` on every rank alike (the same agreed profile everywhere).
    Every rank builds it (the switch is collective over the job so all tensor- and data-parallel replicas
    adopt one plan).  ``step_ms``: this rank's own optimizer work in its last step (the optimizer's
    ``last_step_ms``), which the window shares among the parts (``PartTimer``).
    """
    cfg = run.pipeline
    resplit = _measures_split(run)
    if (
        pipe is None
        or cfg.schedule_file is not None
        or not (registry.get(cfg.schedule).uses_costs or resplit)
        or cfg.timers_start_iter is None
        or cfg.timers_end_iter is None
    ):
        return None
    save = run.checkpoint.save
    auto = cfg.schedule == "zb-auto"
    # zb-auto and the V schedules plan within --pipeline-memory-limit-gb in bytes (zb-auto beside its pending-B count)
    gb_limit = memory_limit_bytes(run.parallel) if plans_within_bytes(cfg.schedule) else None
    replanner = WindowReplanner(
        pipe.executor,
        start_iter=cfg.timers_start_iter,
        end_iter=cfg.timers_end_iter,
        name=cfg.schedule,
        mem_limit="auto" if cfg.mem_limit_auto and auto else gb_limit,
        mem_limit_microbatches=cfg.mem_limit if auto else None,
        percentile=cfg.adaptive_memory_percentile,
        group=ctx.pp_group,
        save_path=os.path.join(save, "zb_profile.json") if save else None,
        log=log,
        stage_layers=() if run.pipeline_layout is None else run.pipeline_layout.layers_per_stage,
        limit_flag=_limit_flag(cfg if auto else None, gb_limit),
    )
    if resplit:
        _measure_split(replanner, pipe, run, ctx, log, step_ms)
    return pipe.runtime.attach(replanner)  # it switches the runtime's plans after the window's last iteration


def _limit_flag(cfg: Any, gb_limit: float | None = None) -> str:
    """How the user gave the re-plan's memory limit (``cfg``: zb-auto's flags, else None), for the window's one-line
    error."""
    if cfg is None:
        return "the memory limit" if gb_limit is None else f"--pipeline-memory-limit-gb {gb_limit / GIB:g}"
    if cfg.mem_limit_auto:
        return (
            f"--zero-bubble-max-pending-backward auto (--zero-bubble-adaptive-memory-limit-percentile "
            f"{cfg.adaptive_memory_percentile:g})"
        )
    given = [] if gb_limit is None else [f"--pipeline-memory-limit-gb {gb_limit / GIB:g}"]
    if cfg.mem_limit is not None:
        given.append(f"--zero-bubble-max-pending-backward {cfg.mem_limit:g}")
    return " and ".join(given) or "the memory limit"  # none: the re-plan cannot fail on one


def _measures_split(run: RunConfig) -> bool:
    """``--pipeline-layer-split auto`` planned the split: the profiling window re-decides it from measured costs."""
    layout = run.pipeline_layout
    return run.parallel.layer_split == "auto" and layout is not None and layout.split == "auto"


def _measure_split(
    replanner: WindowReplanner,
    pipe: GPTPipeline,
    run: RunConfig,
    ctx: ParallelContext,
    log: Any,
    step_ms: Callable[[], float | None] | None = None,
) -> None:
    """Time the parts of the stages in the window (``PartTimer``), put them in the profile's ``parts`` and plan
    the split from the agreed profile on every rank (``MeasuredSplit``, kept in ``replanner.agreed``)."""
    layout = run.pipeline_layout
    auto = run.recompute.auto  # the window re-decides each stage's recompute with the split
    timer = PartTimer(
        pipe.runtime,
        start_iter=replanner.start_iter,
        end_iter=replanner.end_iter,
        layers_without_recompute=auto,
        step_ms=step_ms,
        accounting=lambda: replanner.profiler.accounting_s,
    )
    bytes_per_element = run.precision.params_dtype.itemsize
    on_cuda = ctx.device.type == "cuda"
    analytic = planner_costs(  # an explicit recompute: its one option on every stage, kept
        run.model,
        run.recompute,
        padded_vocab_size=run.padded_vocab_size,
        micro_batch_size=run.training.micro_batch_size,
        bytes_per_element=bytes_per_element,
        on_cuda=on_cuda,
    )
    chosen = run.recompute.choices(layout.layer_ranges) if auto else None  # in force in the window, per stage
    if auto:
        in_force = chosen
    elif analytic.fixed_recompute:
        in_force = (analytic.recompute[0].name,) * len(layout.layer_ranges)
    else:
        in_force = ()

    def parts(profile: Profile) -> dict[str, Any] | None:
        # the window's means too (collective over the pipeline group; the latency is the median profile's): they
        # predict the iteration the trainer logs at the decision, the medians plan it
        means = replanner.profiler.gather(group=ctx.pp_group, comm_ms=profile.comm, statistic="mean")
        means = dataclasses.replace(means, stage_layers=profile.stage_layers)
        try:  # every rank combines the same gathered samples, so all fail alike
            return timer.gather(profile, analytic, group=ctx.pp_group, predict=means, recompute=in_force)
        except ValueError as err:
            if ctx.rank == 0:
                log(f"layer split kept: no per-part costs ({err})")
            return None
        finally:
            timer.detach()

    gb_limit = memory_limit_bytes(run.parallel)  # --pipeline-memory-limit-gb, checked against measured memory
    window = (replanner.start_iter, replanner.end_iter - 1)
    schedule = layout.schedule.name

    def kept_need() -> float | None:
        """Bytes per rank the plan in force peaks at under the measured memory (the window's re-plan)."""
        return None if replanner.replan is None else max(replanner.replan.result.peak_memory)

    def check_kept(why: str) -> None:
        """The split (and recompute choice) stays: its plan's peak under the measured memory must fit the limit."""
        need = kept_need()
        if gb_limit is not None and need is not None and need > gb_limit:
            finding = f"the plan kept in force ({why}) does not fit it with {schedule}"
            raise measured_limit_error(gb_limit, need, window=window, finding=finding)

    def decide(profile: Profile) -> MeasuredSplit | None:
        if profile.parts is None:
            check_kept("no per-part costs")
            return None
        limit = replanner.replan.mem_limit if replanner.replan is not None else None
        if gb_limit is not None:
            limit = gb_limit if limit is None else min(limit, gb_limit)
        try:  # deterministic in the agreed profile: every rank decides alike
            decision = measured_layer_split(
                profile, layout, num_microbatches=run.num_microbatches, mem_limit=limit, recompute=chosen
            )
        except PlannerError as err:
            need = kept_need()
            # the measured memory proves the user's limit impossible: no split fits, nor does the plan in force
            if err.smallest is not None and limit == gb_limit and (need is None or need > gb_limit):
                hint = "" if run.recompute.enabled else " or let stages recompute (--recompute-granularity auto)"
                what = "layer split or recompute choice" if auto else "layer split"
                finding = f"no {what} fits it with {schedule} (the analytic model underestimated the activations)"
                smallest = err.smallest if need is None else min(err.smallest, need)
                raise measured_limit_error(gb_limit, smallest, window=window, finding=finding, hint=hint) from None
            if ctx.rank == 0:
                log(f"layer split kept: {str(err).splitlines()[0]}")
            return None
        except ValueError as err:
            if ctx.rank == 0:
                log(f"layer split kept: {str(err).splitlines()[0]}")
            return None
        if ctx.rank == 0:
            log(decision.summary())
        return decision

    replanner.parts, replanner.on_agreed = parts, decide
