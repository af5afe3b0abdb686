"""zb_pipeline on its own: two nn.Module stages on two ranks, trained with ZB-H1 through ``PipelineRuntime``.

    torchrun --standalone --nproc-per-node 2 examples/pipeline_runtime.py

Any ``nn.Module`` works as a stage (layers built on ``DeferrableLinear`` get the exact B/W split, others a generic
autograd split).  The runtime is built once; each iteration passes its microbatches as an argument.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zb_pipeline.runtime.p2p import PipelineP2P, TensorSpec
from zb_pipeline.runtime.runtime import PipelineRuntime, PlanSource

BATCH, HIDDEN, MICROBATCHES = 4, 16, 4


def stage(index: int) -> torch.nn.Module:
    torch.manual_seed(index)
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN))


def microbatch(k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(BATCH, HIDDEN, generator=g)
    return {"x": x, "y": torch.sin(x)}


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plans = PlanSource("zb-h1", num_ranks=world)  # any registered schedule: `zb-schedule list`
    stages = {s: stage(s) for s in plans.schedule(MICROBATCHES).stages_of(rank)}
    runtime = PipelineRuntime(
        stages,
        rank=rank,
        plans=plans,
        num_microbatches=MICROBATCHES,
        comm=PipelineP2P(pp_rank=rank, boundary_specs=[TensorSpec((BATCH, HIDDEN))] * (world - 1), timeout_s=60),
        input_fn=lambda batch: batch["x"],  # stage 0's input
        loss_fn=lambda out, batch: ((out - batch["y"]) ** 2).mean() / MICROBATCHES,  # last stage
    )
    params = [p for module in stages.values() for p in module.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    batches = [microbatch(k) for k in range(MICROBATCHES)]  # the same data each step: the loss falls
    for step in range(5):
        losses = runtime.run(batches)  # this rank's per-microbatch losses; [] off the last stage's rank
        optimizer.step()
        optimizer.zero_grad()
        if losses:
            print(f"step {step}: loss {sum(float(x) for x in losses):.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
