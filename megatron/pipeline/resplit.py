"""Moving transformer layers between pipeline ranks in process: a re-split at an iteration boundary.

When the profiling window's measured per-part costs give another layer split (``megatron.pipeline.layer_split``,
``MeasuredSplit``), ``resplit`` hands every rank the state of the layers it will own and rebuilds the rank's trainer
objects for the new split through the same set-up code the run started with (``megatron.training_setup.setup``):

1. the pending optimizer step is settled (post-validation), so the weights are validated ones;
2. every rank's parameters (by global name, this tensor-parallel shard), its optimizer state (main parameters, the
   update rule's moments, the step count; the distributed optimizer's dp shards) and RNG states are exchanged over
   the job through the communication layer (``all_gather_object``, under the run's distributed timeout) -- each
   rank keeps what its tensor-parallel rank holds;
3. ``setup`` builds the stages with their new layer ranges (global names follow), the ``main_grad`` buffers and the
   data-parallel reducer's buckets, the optimizer (re-sharded over dp for the distributed optimizer), the pipeline
   runtime (a fresh weight-gradient store) and the post-validation chain; ``RunConfig.pipeline_layout`` carries the
   new split, so a checkpoint written afterwards records it;
   under ``--recompute-granularity auto`` the new stages take the planner's recompute choice (``apply_recompute``
   at set-up), also when only the choice changed and no layer moves;
4. parameters, optimizer state, learning-rate schedule, loss scaler, counters and this rank's RNG states are loaded
   into the new objects, and the model parameters are published from the main parameters, exactly as a resume does;
5. a schedule whose plan depends on the costs runs the plan the stage planner simulated for the new split.

Everything moves through pickled CPU copies of the full state (every rank sees every rank's state): simple and exact,
sized for the models a CPU or single-node run re-splits; large models would send only the moving layers point to
point.  The losses continue bit for bit as in a run that started with the new split (the split only decides where a
layer runs; parameters and their order of accumulation do not change).  Dropout masks come from the new owner's RNG
stream, as they would in a run started with that split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from megatron.checkpointing import model_state, rng_state, set_rng_state
from megatron.data.document_masks import DocumentMaskedDataset
from megatron.pipeline.layer_split import MeasuredSplit
from megatron.trainer_state import Trainer
from megatron.training_setup import setup
from megatron.training_step import settle_losses, settle_pending_step
from zb_pipeline import comm
from zb_pipeline.schedule import registry


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu(v) for v in obj]
    return obj


def _raw(dataset: Any) -> Any:
    """The dataset ``setup`` wraps again (--eod-mask-loss and friends)."""
    return dataset.dataset if isinstance(dataset, DocumentMaskedDataset) else dataset


def resplit(
    tr: Trainer,
    layers_per_stage: Sequence[int],
    *,
    decision: MeasuredSplit | None = None,
    recompute: Sequence[str] | None = None,
) -> Trainer:
    """``tr``'s run continued with ``layers_per_stage`` transformer layers per virtual stage (collective over the
    job: every rank calls it at the same iteration boundary with the same split).  Returns the new trainer; ``tr``
    must not be used afterwards.  ``decision``: the planner's answer it came from (its simulated plan is run, and
    under ``--recompute-granularity auto`` its recompute choice).  ``recompute``: each virtual stage's choice
    (auto only; default: the decision's, else the choice in force where the layers did not move)."""
    run, ctx = tr.run, tr.ctx
    layout = run.pipeline_layout
    sizes = tuple(int(n) for n in layers_per_stage)
    if layout is None or len(sizes) != len(layout.layer_ranges) or sum(sizes) != run.model.num_layers:
        raise ValueError(f"a re-split needs {run.model.num_layers} layers over the run's stages, got {list(sizes)}")
    settle_pending_step(tr)
    settle_losses(tr)  # the deferred loss reductions finish on the old trainer (megatron.deferred_loss)
    mine = {
        "tp": ctx.tp_rank,
        "params": model_state(tr.model) if ctx.dp_rank == 0 else {},
        "optim": _cpu(tr.optimizer.sharded_state_dict()),
        "rng": rng_state(tr.model),
        "rank": ctx.rank,
    }
    every: list[Any] = [mine]
    if ctx.is_distributed:
        every = [None] * ctx.world_size
        comm.all_gather_object(every, mine)
    params: dict[str, torch.Tensor] = {}
    optim: list[dict[str, Any]] = []
    seen: set[tuple[str, int]] = set()  # a piece held twice (tied embedding copies, dp replicas) is taken once
    for one in every:
        if one["tp"] != ctx.tp_rank:
            continue
        params.update(one["params"])
        pieces = {n: p for n, p in one["optim"]["pieces"].items() if (n, int(p["lo"])) not in seen}
        seen.update((n, int(p["lo"])) for n, p in pieces.items())
        optim.append({"step": one["optim"]["step"], "pieces": pieces})
    plan = decision.plan if decision is not None else None
    new_layout = layout.with_split(sizes, split=layout.split, plan=plan, even=layout.even_iteration)
    new_run = dataclasses.replace(run, pipeline_layout=new_layout)
    if run.recompute.auto:  # the new stages' recompute: the planner's choice for them
        if recompute is None and decision is not None:
            recompute = decision.plan.recompute
        if recompute is None:
            recompute = run.recompute.choices(new_layout.layer_ranges)  # no choice given: the stages keep theirs
        new_run = dataclasses.replace(new_run, recompute=run.recompute.planned(new_layout.layer_ranges, recompute))
    elif recompute is not None:
        raise ValueError("a per-stage recompute choice needs --recompute-granularity auto")
    new = setup(new_run, ctx, train_data=_raw(tr.train_data), valid_data=_raw(tr.valid_data))
    _load(new, params, optim)
    new.scheduler.load_state_dict(tr.scheduler.state_dict())
    new.optimizer.scaler.load_state_dict(tr.optimizer.scaler.state_dict())
    new.optimizer.publish()  # model params := main params (all-gathers for the distributed optimizer)
    set_rng_state(mine["rng"], new.model)  # setup re-seeded: this rank's streams continue
    for name in ("iteration", "consumed_valid_samples", "skipped_iterations", "nan_iterations", "losses"):
        setattr(new, name, getattr(tr, name))
    new.step_listeners = tr.step_listeners
    new.train_loader = tr.train_loader
    new.replanner = None  # its work is done; dropping it frees the old stages
    if decision is not None and registry.get(layout.schedule.name).uses_costs and new.pipeline is not None:
        runtime = new.pipeline.runtime  # the measured costs' plan for the new split, as the window had chosen
        runtime.switch_plan(runtime.plans.replanned(costs=decision.plan.costs, mem_limit=decision.mem_limit))
    return new


@torch.no_grad()
def _load(tr: Trainer, params: dict[str, torch.Tensor], optim: list[dict[str, Any]]) -> None:
    model = tr.model
    names = {model.global_name(n): n for n in model.state_dict()}
    missing = sorted(set(names) - set(params))
    if missing:
        raise RuntimeError(f"re-split: no rank sent {missing[:3]}")
    model.load_state_dict({local: params[g] for g, local in names.items()}, strict=True)
    tr.optimizer.load_sharded_state_dicts(optim)
