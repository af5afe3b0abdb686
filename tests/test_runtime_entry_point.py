"""``PipelineRuntime``: one entry point, data as an argument, extension without patching.

- Iterations with different microbatch counts (the plan for each count comes from the registry's cache) give the
  same losses and gradients, to the bit, as one process running the same microbatches in sequence.
- A new action kind registered with its handler runs inside a plan; stage modules replaced between iterations are
  the ones the next iteration runs; the runtime issues no collective of its own (every collective is refused while
  it runs).
- The forward-only plan of evaluation gives the training forward's losses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from runtime_models import BATCH, HIDDEN, MLPStage, mlp_input, mlp_target

from zb_pipeline.runtime.p2p import PipelineP2P, TensorSpec
from zb_pipeline.runtime.runtime import PipelineRuntime, PlanSource, forward_only_plan
from zb_pipeline.schedule import registry
from zb_pipeline.schedule.ir import Action, Kind, register_kind
from zb_pipeline.testing.harness import run_multiprocess

P = 2
COUNTS = (4, 2, 5)  # microbatches of the three iterations


def _batch(it: int, mb: int) -> dict[str, torch.Tensor]:
    return {"x": mlp_input(10 * it + mb), "y": mlp_target(10 * it + mb)}


class _Loss:
    def __init__(self) -> None:
        self.m = 1

    def __call__(self, out: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        loss = ((out - batch["y"]) ** 2).mean()
        return loss / self.m, loss


_COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "reduce_scatter", "gather", "all_gather_object")


def _runtime_rank(rank: int, world_size: int, name: str) -> dict:
    torch.set_num_threads(1)
    plans = PlanSource(name, num_ranks=world_size)
    stages = {s: MLPStage(s) for s in plans.schedule(COUNTS[0]).stages_of(rank)}
    specs = [TensorSpec((BATCH, HIDDEN))] * (plans.schedule(COUNTS[0]).num_stages - 1)
    loss = _Loss()
    runtime = PipelineRuntime(
        stages,
        rank=rank,
        plans=plans,
        num_microbatches=COUNTS[0],
        comm=PipelineP2P(pp_rank=rank, boundary_specs=specs, timeout_s=30, check=True),
        input_fn=lambda batch: batch["x"],
        loss_fn=loss,
    )
    finals: list[int] = []
    runtime.hooks.stage_grads_final.append(finals.append)
    refused = {}
    for fn in _COLLECTIVES:  # the runtime may only move the plan's transfers
        refused[fn] = getattr(dist, fn)
        setattr(dist, fn, _refuse(fn))
    losses, plans_run = [], []
    try:
        for it, m in enumerate(COUNTS):
            loss.m = m
            losses.append([float(x) for x in runtime.run([_batch(it, mb) for mb in range(m)], iteration=it)])
            plans_run.append(runtime.schedule.num_microbatches)
    finally:
        for fn, orig in refused.items():
            setattr(dist, fn, orig)
    grads = {s: [p.grad.numpy().copy() for p in mod.parameters()] for s, mod in stages.items()}
    loss.m = COUNTS[0]
    evaluated = [float(x) for x in runtime.forward_only([_batch(0, mb) for mb in range(COUNTS[0])])]
    dist.barrier()
    return {"losses": losses, "grads": grads, "plans": plans_run, "finals": finals, "eval": evaluated}


def _refuse(name: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"the runtime called torch.distributed.{name} during an iteration")

    return refuse


def _reference(num_stages: int) -> tuple[list[list[float]], dict[int, list[np.ndarray]]]:
    stages = {s: MLPStage(s) for s in range(num_stages)}
    losses = []
    for it, m in enumerate(COUNTS):
        row = []
        for mb in range(m):
            batch = _batch(it, mb)
            x = batch["x"]
            for s in range(num_stages):
                x = stages[s](x)
            loss = ((x - batch["y"]) ** 2).mean()
            (loss / m).backward()
            row.append(float(loss.detach()))
        losses.append(row)
    return losses, {s: [p.grad.numpy().copy() for p in mod.parameters()] for s, mod in stages.items()}


@pytest.mark.parametrize("name", ["zb-h1", "zb-v"])
def test_changing_microbatch_counts_match_one_process(name: str) -> None:
    """Three iterations with m = 4, 2, 5 (gradients accumulate over them): bit-identical to one process, the plan of
    each count loaded from the registry, every stage's gradients declared final once per iteration, and no
    collective issued by the runtime."""
    results = run_multiprocess(_runtime_rank, P, args=(name,), timeout_s=120)
    num_stages = registry.generate(name, P, COUNTS[0]).num_stages
    ref_losses, ref_grads = _reference(num_stages)
    last = registry.generate(name, P, COUNTS[0]).stage_to_rank[num_stages - 1]
    assert results[last]["losses"] == ref_losses
    for r, res in enumerate(results):
        assert res["plans"] == list(COUNTS)
        mine = registry.generate(name, P, COUNTS[0]).stages_of(r)
        assert sorted(res["finals"]) == sorted(list(mine) * len(COUNTS))
        for s, grads in res["grads"].items():
            for got, want in zip(grads, ref_grads[s]):
                assert np.array_equal(got, want), f"{name}: stage {s} gradient differs"
    assert results[last]["eval"] == ref_losses[0]


def test_new_action_kind_runs_through_its_handler() -> None:
    """A kind declared with ``register_kind`` parses, prints and runs through the handler set for it; here it
    replaces every W of a one-rank plan and does the W's work, so the gradients equal the plain plan's."""
    wx = register_kind("WX")
    assert str(Action.parse("0WX3")) == "0WX3" and Action.parse("0WX3").kind is wx

    def run(custom: bool) -> list[np.ndarray]:
        stages = {0: MLPStage(0)}
        loss = _Loss()
        loss.m = 3
        runtime = PipelineRuntime(
            stages, rank=0, plans=PlanSource("zb-h1"), num_microbatches=3, comm=None, input_fn=lambda b: b["x"],
            loss_fn=loss,
        )  # fmt: skip
        ran = []
        if custom:

            def handler(ex, a) -> None:
                ran.append(str(a))
                ex.complete_w(a)
                ex.store.run(a.stage, a.microbatch)

            runtime.set_handler(wx, handler)
            steps = tuple(Action(a.stage, wx, a.microbatch) if a.kind is Kind.W else a for a in runtime.executor.steps)
            runtime.use_steps(steps)
        runtime.run([_batch(0, mb) for mb in range(3)])
        if custom:
            assert ran == ["0WX0", "0WX1", "0WX2"]
        return [p.grad.numpy().copy() for p in stages[0].parameters()]

    for got, want in zip(run(True), run(False)):
        assert np.array_equal(got, want)


def test_a_handler_wrapper_is_taken_out_again() -> None:
    """``wrap_handler`` returns the wrap; ``remove()`` takes it out of the chain, the wrappers added after it applied
    anew over what remains (the profiler wraps after a timer that leaves at its window's end); a handler replaced
    by ``set_handler`` took its wrappers with it, so removing one then changes nothing."""
    runtime = PipelineRuntime(
        {0: MLPStage(0)}, rank=0, plans=PlanSource("1f1b"), num_microbatches=2, comm=None, input_fn=lambda b: b["x"],
        loss_fn=_Loss(),
    )  # fmt: skip
    ran: list[str] = []
    handlers = runtime.executor.handlers
    base = handlers[Kind.F]

    def named(name: str):
        def wrapper(inner):
            def handler(ex, a):
                ran.append(name)
                return inner(ex, a)

            return handler

        return wrapper

    inner, outer = runtime.wrap_handler(Kind.F, named("inner")), runtime.wrap_handler(Kind.F, named("outer"))
    runtime.run([_batch(0, mb) for mb in range(2)])
    assert ran == ["outer", "inner"] * 2
    inner.remove()
    inner.remove()  # twice: nothing more
    ran.clear()
    runtime.run([_batch(1, mb) for mb in range(2)])
    assert ran == ["outer"] * 2
    outer.remove()
    assert handlers[Kind.F] is base
    again = runtime.wrap_handler(Kind.F, named("again"))
    runtime.set_handler(Kind.F, base)
    again.remove()
    assert handlers[Kind.F] is base
    # the same with a replacement other than the wrapped handler (above, unwrapping would also give ``base``)
    again, other = runtime.wrap_handler(Kind.F, named("again")), named("other")(base)
    runtime.set_handler(Kind.F, other)
    again.remove()
    assert handlers[Kind.F] is other


def test_replaced_stages_run_from_the_next_iteration() -> None:
    """``replace_stages`` between iterations: the next iteration runs (and accumulates into) the new modules."""
    loss = _Loss()
    loss.m = 2
    runtime = PipelineRuntime(
        {0: MLPStage(0)}, rank=0, plans=PlanSource("1f1b"), num_microbatches=2, comm=None, input_fn=lambda b: b["x"],
        loss_fn=loss,
    )  # fmt: skip
    runtime.run([_batch(0, mb) for mb in range(2)])
    fresh = MLPStage(0)
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(2.0)
    runtime.replace_stages({0: fresh})
    got = [float(x) for x in runtime.run([_batch(1, mb) for mb in range(2)])]
    with torch.no_grad():
        want = [float(((fresh(_batch(1, mb)["x"]) - _batch(1, mb)["y"]) ** 2).mean()) for mb in range(2)]
    assert got == want
    assert all(p.grad is not None for p in fresh.parameters())
    with pytest.raises(ValueError, match="holds virtual stages"):
        runtime.replace_stages({1: fresh})


def test_forward_only_plan_keeps_placement_and_order() -> None:
    sched = registry.generate("zb-v", 2, 3)
    fwd = forward_only_plan(sched)
    assert fwd.stage_to_rank == sched.stage_to_rank
    assert [str(a) for a in fwd.ranks[0]] == ["0F0", "3F0", "0F1", "3F1", "0F2", "3F2"]


def test_plan_source_fixed_plan_serves_its_own_count_only() -> None:
    sched = registry.generate("1f1b", 2, 4)
    src = PlanSource.of(sched)
    assert src.schedule(4) is sched
    with pytest.raises(ValueError, match="is for m=4"):
        src.schedule(3)
    with pytest.raises(ValueError, match="cannot be re-planned"):
        src.replanned(costs=None, mem_limit=None)
