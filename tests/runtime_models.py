"""Stage models, pipeline rank bodies and single-process references for the runtime tests (test_runtime_*.py).

Everything here is top-level so that ``run_multiprocess`` can pickle it.  A rank body returns only numpy arrays and
Python values (tensors do not survive the harness's pipe).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from zb_pipeline.runtime.deferrable_linear import DeferrableLinear
from zb_pipeline.runtime.executor import PipelineExecutor
from zb_pipeline.runtime.p2p import PipelineP2P, TensorSpec
from zb_pipeline.runtime.trace import Tracer
from zb_pipeline.schedule.ir import Action, Kind, Schedule
from zb_pipeline.schedule.lowering import CommBatch, LoweredSchedule, lower
from zb_pipeline.schedule.plan_file import load_plan
from zb_pipeline.schedule.registry import generate

BATCH, HIDDEN = 3, 8


@dataclass(frozen=True)
class Case:
    """One pipeline run: which plan, which model, which runtime options."""

    name: str
    p: int
    m: int
    chunks: int | None = None
    model: str = "mlp"  # "mlp" (deferrable MLP), "generic" (plain nn.Linear + LayerNorm: GenericSplit), "gpt"
    plan_file: str | None = None
    check: bool = True
    iterations: int = 1
    trace: bool = False
    timeout_s: float = 30.0
    fault: dict = field(default_factory=dict)  # {"rank": r, "signal": "KILL"|"STOP", "at": step index}
    mutate: str | None = None  # name of a hand-made change to the lowered plan (see MUTATIONS)

    def schedule(self) -> Schedule:
        if self.plan_file is not None:
            return load_plan(self.plan_file)
        return generate(self.name, self.p, self.m, chunks=self.chunks)


# ----------------------------------------------------------------------------------------------- stage models
class MLPStage(torch.nn.Sequential):
    def __init__(self, stage: int, *, deferrable: bool = True) -> None:
        torch.manual_seed(1000 + stage)
        if deferrable:
            super().__init__(DeferrableLinear(HIDDEN, HIDDEN), torch.nn.Tanh(), DeferrableLinear(HIDDEN, HIDDEN))
        else:
            super().__init__(
                torch.nn.Linear(HIDDEN, HIDDEN),
                torch.nn.LayerNorm(HIDDEN),
                torch.nn.GELU(),
                torch.nn.Linear(HIDDEN, HIDDEN),
            )


def mlp_input(mb: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 + mb)
    return torch.randn(BATCH, HIDDEN, generator=g)


def mlp_target(mb: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(90 + mb)
    return torch.randn(BATCH, HIDDEN, generator=g)


class Model:
    """Builds stages and supplies input/loss functions for a case (same on every rank and in the reference)."""

    def __init__(self, case: Case, num_stages: int) -> None:
        self.case, self.num_stages = case, num_stages
        self.m = case.m
        if case.model == "gpt":
            from model_configs import pipeline_config

            self.cfg = pipeline_config(num_stages, tied=False)
            self.specs = [TensorSpec((self.cfg.seq_length, 2, self.cfg.hidden_size))] * (num_stages - 1)
        else:
            self.specs = [TensorSpec((BATCH, HIDDEN))] * (num_stages - 1)

    def stage(self, s: int) -> torch.nn.Module:
        if self.case.model == "gpt":
            from megatron.model.gpt import build_gpt_stages

            return build_gpt_stages(self.cfg, self.num_stages, stages=[s], seed=77)[0]
        return MLPStage(s, deferrable=self.case.model == "mlp")

    def tokens(self, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(300 + mb)
        t = torch.randint(0, self.cfg.vocab_size, (2, self.cfg.seq_length + 1), generator=g)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def input_fn(self, mb: int) -> torch.Tensor:
        return self.tokens(mb)[0] if self.case.model == "gpt" else mlp_input(mb)

    def forward_fn(self, module: torch.nn.Module, x: torch.Tensor, s: int, mb: int) -> torch.Tensor:
        if self.case.model == "gpt" and s == self.num_stages - 1:
            return module(x, labels=self.tokens(mb)[1])
        return module(x)

    def loss_fn(self, out: torch.Tensor, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        loss = out.mean() if self.case.model == "gpt" else ((out - mlp_target(mb)) ** 2).mean()
        return loss / self.m, loss


# ------------------------------------------------------------------------------------------------ rank bodies
def _grads(stages: dict[int, torch.nn.Module]) -> dict[int, dict[str, np.ndarray]]:
    out = {}
    for s, mod in stages.items():
        out[s] = {n: p.grad.detach().numpy().copy() for n, p in mod.named_parameters() if p.grad is not None}
    return out


def _maybe_fault(case: Case, rank: int, ex: PipelineExecutor) -> None:
    """Make ``case.fault['rank']`` kill or stop itself just before its step ``case.fault['at']``."""
    if not case.fault or case.fault["rank"] != rank:
        return
    import signal

    at, sig = case.fault["at"], getattr(signal, "SIG" + case.fault["signal"])
    original = ex.handlers[ex.steps[at].kind] if not hasattr(ex.steps[at], "actions") else None
    target = ex.steps[at]

    def die(executor, action):
        if action is target or action == target:
            os.kill(os.getpid(), sig)
        return original(executor, action)

    if original is None:
        raise ValueError("fault injection needs a compute step")
    ex.handlers[target.kind] = die


def pipeline_rank(rank: int, world_size: int, case: Case) -> dict:
    torch.set_num_threads(1)
    lowered = lowered_for(case)
    sched = lowered.schedule
    model = Model(case, sched.num_stages)
    stages = {s: model.stage(s) for s in sched.stages_of(rank)}
    p2p = PipelineP2P(pp_rank=rank, boundary_specs=model.specs, timeout_s=case.timeout_s, check=case.check)
    tracer = Tracer(rank) if case.trace else None
    if tracer is not None:
        tracer.align()
    ex = PipelineExecutor(
        lowered,
        rank,
        stages,
        p2p=p2p,
        input_fn=model.input_fn,
        loss_fn=model.loss_fn,
        forward_fn=model.forward_fn,
        tracer=tracer,
    )
    p2p.tracer = tracer
    _maybe_fault(case, rank, ex)
    losses = []
    for it in range(case.iterations):
        losses.append([float(x) for x in ex.run(it)])
    dist.barrier()
    return {
        "losses": losses,
        "grads": _grads(stages),
        "trace": tracer.chrome_events() if tracer is not None else None,
    }


# ------------------------------------------------------------------------------------------------- reference
def reference(case: Case, num_stages: int) -> tuple[list[float], dict[int, dict[str, np.ndarray]]]:
    """The same stages run in sequence in one process, microbatch by microbatch, plain autograd."""
    torch.set_num_threads(1)
    model = Model(case, num_stages)
    stages = {s: model.stage(s) for s in range(num_stages)}
    losses = []
    for _ in range(case.iterations):
        for mb in range(case.m):
            x = model.input_fn(mb)
            for s in range(num_stages):
                x = model.forward_fn(stages[s], x, s, mb)
            loss, report = model.loss_fn(x, mb)
            loss.backward()
            losses.append(float(report.detach()))
    return losses, _grads(stages)


def pipeline_cases(rank: int, world_size: int, cases: list[Case]) -> list[dict]:
    """Several cases one after the other in the same processes (saves the start-up of a process group per case)."""
    return [pipeline_rank(rank, world_size, c) for c in cases]


# ------------------------------------------------------------------------------------------ hand-made plans
def _move_step(steps: list, what: str, after: str) -> list:
    """Move the step printed ``what`` to just after the step printed ``after``."""
    names = [str(st) for st in steps]
    step = steps.pop(names.index(what))
    names.remove(what)
    steps.insert(names.index(after) + 1, step)
    return steps


def _needs_buffering(lowered: LoweredSchedule) -> LoweredSchedule:
    """zb-h1, p=2, m=3 with rank 1 receiving 1F1's input only after sending 1B0's gradient.

    Rank 0 sends 0F1's output before it receives 1B0's gradient, rank 1 sends that gradient before it receives
    0F1's output: with buffering (gloo) both sends complete, under NCCL's strict matching both ranks block forever.
    """
    ranks = list(lowered.ranks)
    ranks[1] = tuple(_move_step(list(ranks[1]), "{1RECV_F1@0}", "{1SEND_B0@0}"))
    return LoweredSchedule(lowered.schedule, tuple(ranks))


def _swapped_order(lowered: LoweredSchedule) -> LoweredSchedule:
    """gpipe, p=2, m=3 with rank 1 posting its receives of microbatches 0 and 1 in one batch, in reverse order,
    while rank 0 sends them in order: untagged matching would hand 0F1's output to 1F0."""
    ranks = [list(r) for r in lowered.ranks]
    r0 = [st for st in ranks[0] if str(st) not in ("{0SEND_F0@1}", "{0SEND_F1@1}")]
    both0 = CommBatch(
        tuple(
            a
            for st in ranks[0]
            if isinstance(st, CommBatch)
            for a in st.actions
            if a.microbatch < 2 and a.kind.value == "SEND_F"
        )
    )
    r0.insert([str(st) for st in r0].index("0F1") + 1, both0)
    r1 = [st for st in ranks[1] if str(st) not in ("{1RECV_F0@0}", "{1RECV_F1@0}")]
    recvs = [
        a
        for st in ranks[1]
        if isinstance(st, CommBatch)
        for a in st.actions
        if a.microbatch < 2 and a.kind.value == "RECV_F"
    ]
    r1.insert(0, CommBatch(tuple(reversed(recvs))))
    return LoweredSchedule(lowered.schedule, (tuple(r0), tuple(r1)))


MUTATIONS = {"needs_buffering": _needs_buffering, "swapped_order": _swapped_order}


def lowered_for(case: Case) -> LoweredSchedule:
    lowered = lower(case.schedule())
    return MUTATIONS[case.mutate](lowered) if case.mutate else lowered


def posted_as_planned(executed: list[str], planned: list[Action]) -> str | None:
    """None if ``executed`` (a rank's actions from its trace) is ``planned`` up to receives posted ahead: compute
    actions and sends in the plan's order, every receive once and in the plan's order, each before its consumer
    (what the executor does on gloo, see ``PipelineP2P.prepost``); else what differs."""
    recv = (Kind.RECV_F, Kind.RECV_B)
    if [x for x in executed if "RECV" not in x] != [str(a) for a in planned if a.kind not in recv]:
        return "compute actions and sends are not in the plan's order"
    recvs = [a for a in planned if a.kind in recv]
    if [x for x in executed if "RECV" in x] != [str(a) for a in recvs]:
        return "receives are not the plan's, in its order"
    for a in recvs:
        consumers = {f"{a.stage}F{a.microbatch}"} if a.kind is Kind.RECV_F else {
            f"{a.stage}B{a.microbatch}", f"{a.stage}BW{a.microbatch}"}  # fmt: skip
        first_use = min(i for i, x in enumerate(executed) if x in consumers)
        if executed.index(str(a)) > first_use:
            return f"{a} was posted after its consumer"
    return None
