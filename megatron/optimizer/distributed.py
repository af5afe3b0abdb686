"""The distributed optimizer (ZeRO-1): fp32 main parameters and optimizer states sharded over data-parallel ranks.

The data-parallel reducer (``reduce_op="reduce_scatter"``) leaves each rank the dp-mean gradient only in its own
equal shard of every bucket, ``bucket.shard(dp_rank)``. This optimizer owns exactly the parameter elements that fall
in those shards (a parameter may be split between ranks; its pieces are ``MainShard`` ranges ``[lo, hi)``), keeps
their fp32 main copy and update-rule state (Adam moments or SGD momentum buffers), and after the update all-gathers
each bucket's updated parameters (in the model's dtype) so every rank holds the whole model again.

The update is elementwise, so it equals the plain optimizer's exactly; the grad norm sums the same squares in a
different order. Gradient statistics count each element once: this rank's shard, tensor-parallel replicas on tp rank
0 only, reduced over this pipeline position's tensor- and data-parallel ranks, then summed over the pipeline in
pipeline-rank order (``MainParamOptimizer.grad_stats``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron.config.optimizer import OptimizerConfig
from megatron.config.precision import PrecisionConfig
from megatron.optimizer.grad_norm import owns_grad
from megatron.optimizer.main_params import MainParamOptimizer, MainShard, fp32_main_copy
from megatron.parallel.data_parallel import DataParallelReducer
from zb_pipeline import comm


class DistributedOptimizer(MainParamOptimizer):
    """``MainParamOptimizer`` over this data-parallel rank's shard of the reducer's buckets."""

    sharded = True

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
        config: OptimizerConfig,
        precision: PrecisionConfig,
        *,
        reducer: DataParallelReducer,
        tp_rank: int = 0,
        stage_group: comm.ProcessGroup | None = None,
        pp_group: comm.ProcessGroup | None = None,
    ) -> None:
        if reducer.reduce_op != "reduce_scatter" and reducer.dp_size > 1:
            raise ValueError("the distributed optimizer needs a DataParallelReducer with reduce_op='reduce_scatter'")
        self.reducer = reducer
        named = list(named_params)
        dtypes = {p.dtype for _, p in named if p.requires_grad}
        if len(dtypes) != 1:
            raise ValueError(f"the distributed optimizer needs one parameter dtype, got {sorted(map(str, dtypes))}")
        self.gather_buffer = torch.zeros(reducer.buffer.numel(), dtype=dtypes.pop(), device=reducer.buffer.device)
        super().__init__(named, config, precision, tp_rank=tp_rank, stage_group=stage_group, pp_group=pp_group)

    def _build_shards(self, params: list[tuple[str, torch.nn.Parameter]]) -> list[MainShard]:
        r, dp = self.reducer.dp_rank, self.reducer.dp_size
        shards = []
        for name, p in params:
            bi, start, end = self.reducer.param_range(p)
            bucket = self.reducer.buckets[bi]
            n = (bucket.end - bucket.start) // dp
            s0, s1 = bucket.start + r * n, bucket.start + (r + 1) * n  # this rank's shard, in buffer coordinates
            lo, hi = max(start, s0) - start, min(end, s1) - start
            if lo >= hi:
                continue
            grad = self.reducer.buffer[start + lo : start + hi]
            main = fp32_main_copy(p.detach().reshape(-1)[lo:hi])
            main.main_grad = grad
            shards.append(MainShard(name, p, lo, hi, main, grad, owns_grad(p, tp_rank=self.tp_rank)))
        return shards

    @torch.no_grad()
    def publish(self) -> None:
        """Write this rank's updated shard of each bucket, all-gather the buckets, copy them into the parameters."""
        red = self.reducer
        for s in self.shards:
            start = red.param_range(s.param)[1]
            self.gather_buffer[start + s.lo : start + s.hi].copy_(s.main)
        if red.dp_size > 1:
            for b in red.buckets:
                out = self.gather_buffer[b.start : b.end]
                n = out.numel() // red.dp_size
                mine = out[red.dp_rank * n : (red.dp_rank + 1) * n].clone()
                comm.all_gather_into_tensor(out, mine, group=red.dp_group)
        for _, p in self.model_params:
            _, start, end = red.param_range(p)
            p.copy_(self.gather_buffer[start:end].view_as(p))

    @torch.no_grad()
    def reset_main_from_model(self) -> None:
        for s in self.shards:
            s.main.copy_(s.param.detach().reshape(-1)[s.lo : s.hi])
