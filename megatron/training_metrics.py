"""Optional per-iteration measurements: ``--log-num-zeros-in-grad`` and ``--log-memory-to-tensorboard``.

``num_zeros_in_grad``: zero entries of the gradients the optimizer steps with (``main_grad``), counted over the
gradients each rank owns in the global grad norm (``megatron.optimizer.grad_norm.owns_grad``) and summed over the
tensor- and pipeline-parallel ranks -- Megatron's "num zeros" field.  ``memory_stats``: the CUDA caching allocator's
allocated and reserved bytes (Megatron's ``mem-allocated-bytes`` / ``mem-reserved-bytes``); on CPU the process's
peak resident set size.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch

from megatron.optimizer.grad_norm import grad_of, owns_grad
from zb_pipeline import comm


def num_zeros_in_grad(tr: Any) -> int:
    """Zero gradient entries of one model replica (collective over its tensor- and pipeline-parallel ranks)."""
    local = 0
    for p in tr.optimizer.params:
        g = grad_of(p)
        if g is not None and owns_grad(p, tp_rank=tr.ctx.tp_rank):
            local += int((g == 0).sum())
    if tr.ctx.mp_group is not None:
        local = int(comm.all_reduce_values([local], group=tr.ctx.mp_group, dtype=torch.int64)[0])
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
