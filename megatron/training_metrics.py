"""Optional per-iteration measurements: ``--log-num-zeros-in-grad`` and ``--log-memory-to-tensorboard``.

``num_zeros_in_grad``: zero entries of the gradients the optimizer steps with (``main_grad``), counted exactly as
the global grad norm counts them -- this rank's optimizer shards that it owns (``MainShard.owned``: a replicated
parameter once per tensor-parallel group, the tied output copy never; with the distributed optimizer each
data-parallel rank its own piece), summed over the same groups -- Megatron's "num zeros" field.

``memory_stats``: the CUDA caching allocator's allocated and reserved bytes (Megatron's ``mem-allocated-bytes`` /
``mem-reserved-bytes``); on CPU the process's peak resident set size.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch

from zb_pipeline import comm


def num_zeros_in_grad(tr: Any) -> int:
    """Zero gradient entries of the whole model (collective over the optimizer's stage and pipeline groups)."""
    opt = tr.optimizer
    local = int(sum((s.grad == 0).sum() for s in opt.shards if s.owned))  # one device-to-host read, not one per shard
    for group in (opt.stage_group, opt.pp_group):
        if group is not None:
            local = int(comm.all_reduce_values([local], group=group, dtype=torch.int64)[0])
    return local


def memory_stats(device: torch.device) -> dict[str, int]:
    """Bytes in use on ``device`` (see the module docstring)."""
    if device.type == "cuda":
        return {
            "mem-allocated-bytes": int(torch.cuda.memory_allocated(device)),
            "mem-reserved-bytes": int(torch.cuda.memory_reserved(device)),
            "mem-max-allocated-bytes": int(torch.cuda.max_memory_allocated(device)),
        }
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mem-max-rss-bytes": int(peak if sys.platform == "darwin" else peak * 1024)}
