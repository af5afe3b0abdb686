"""Global gradient statistics (norm, inf/NaN) across every model-parallel rank, and clipping by the global norm.

The statistics are one float64 sum of squared gradients; the norm and the inf/NaN flag follow from it by
``zb_pipeline.optim.grad_stats`` (the rule the post-validated step shares).

The sum of squares is taken over the gradients this rank *owns*: a tensor-parallel shard is owned by every
tensor-parallel rank (each holds a different slice); a parameter replicated across the tensor-parallel group (norm
weights, row-parallel biases) is owned by tensor-parallel rank 0 only; a parameter that is a copy of another rank's
(the tied output embedding on the last pipeline stage, marked ``param.shared_embedding = True``) is owned by
nobody here. Data-parallel replicas hold identical reduced gradients, so only the model-parallel group is reduced.

``reduce_grad_stats`` is the single synchronisation point of these statistics: the post-validation work replaces
exactly that function, so nothing else here may communicate.  The statistics stay on the gradients' device until
``grad_stats`` reads the reduced sum to the host: one host synchronisation per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from zb_pipeline import comm
from zb_pipeline.optim.grad_stats import GradStats, grad_stats


def grad_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient the optimizer uses: the fp32 ``main_grad`` buffer when present, else ``.grad``."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def owns_grad(param: torch.nn.Parameter, *, tp_rank: int) -> bool:
    """Whether this rank counts ``param`` in the global norm (see the module docstring)."""
    if getattr(param, "shared_embedding", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def local_grad_stats(params: Iterable[torch.nn.Parameter], *, tp_rank: int = 0) -> torch.Tensor:
    """The sum of squares (0-d float64, on the gradients' device) of the gradients this rank owns (``sum_squares``)."""
    grads = [g for p in params if (g := grad_of(p)) is not None and owns_grad(p, tp_rank=tp_rank)]
    return sum_squares(grads, device=grads[0].device if grads else torch.device("cpu"))


def sum_squares(grads: Iterable[torch.Tensor], *, device: torch.device | str) -> torch.Tensor:
    """The sum of squares (0-d float64, on ``device``, where the gradients are) of the given gradient tensors (already
    chosen); no host synchronisation.  It is inf or NaN whenever some entry is (``zb_pipeline.optim.grad_stats``): no
    ``isfinite`` pass over every gradient (several times the sum of squares' cost on a CPU)."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        g32 = g.detach().float().reshape(-1)
        sq += torch.dot(g32, g32).double()
    return sq


def clip_coefficient(norm: float, max_norm: float) -> float:
    """Megatron's clip factor ``max_norm / (norm + 1e-6)`` when that is below 1, else 1 (``max_norm = 0``: off)."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    coeff = max_norm / (norm + 1e-6)
    return coeff if coeff < 1.0 else 1.0


def reduce_grad_stats(local: torch.Tensor, *, group: comm.ProcessGroup | None) -> torch.Tensor:
    """THE synchronisation of gradient statistics: sum ``local`` over the model-parallel ``group`` (one collective).

    ``group=None`` (or a single-rank group) means nothing to reduce. Returns the summed tensor (same shape).
    """
    if group is None or comm.world_size(group) == 1:
        return local
    out = local.clone()
    comm.all_reduce(out, op="sum", group=group)
    return out


def clip_grads(
    params: Sequence[torch.nn.Parameter],
    max_norm: float,
    *,
    tp_rank: int = 0,
    mp_group: comm.ProcessGroup | None = None,
) -> GradStats:
    """Compute the global grad norm over every model-parallel rank and scale gradients so it is at most ``max_norm``.

    ``max_norm = 0`` only measures. Non-finite gradients are reported, never scaled (the caller skips the update).
    Gradients are scaled by ``max_norm / (norm + 1e-6)`` when that is below 1, as in Megatron.
    """
    stats = grad_stats(reduce_grad_stats(local_grad_stats(params, tp_rank=tp_rank), group=mp_group))
    coeff = clip_coefficient(stats.norm, max_norm)  # 1 when non-finite (the norm is NaN then)
    if coeff < 1.0:
        for p in params:
            g = grad_of(p)
            if g is not None:
                g.mul_(coeff)
    return stats
