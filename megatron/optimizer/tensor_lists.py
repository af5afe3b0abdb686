"""Parallel tensor lists for the multi-tensor (``torch._foreach_*``) update rules, split by device and dtype.

A ``torch._foreach_*`` call applies one operation to a whole list of tensors: on CUDA a few fused kernel launches
for the list instead of one launch per tensor; on the CPU one call from Python instead of one per tensor, then the
same per-tensor kernels, so the results are bit-identical to a per-tensor loop of the same operations.  Its fast
(fused) path needs every tensor of a call on one device with one dtype, so the rules split their lists by the
parameters' (device, dtype) first.  Each operation is elementwise and no two lists share a tensor, so running
operation by operation over all tensors, instead of tensor by tensor, changes nothing an element sees.

The out-of-place ops (Adam's denominator, SGD's decayed gradient) hold a temporary for the whole group at once, as
``torch.optim``'s foreach implementations do: the peak is one fp32 copy of the group's parameters above the loop's.
On the CPU the gain is small: the rules' passes are bound by memory traffic, not by the per-call overhead
(``tools/bench_optimizer_step.py``; bench/results/NOTES.md, 2026-12-02 optimizer step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def by_device_and_dtype(*lists: Sequence[torch.Tensor]) -> list[tuple[list[torch.Tensor], ...]]:
    """Split equally long parallel ``lists`` into groups whose first-list tensors share device and dtype; each group
    is a tuple of lists (one per input list, order kept). Empty input gives no groups."""
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], ...]] = {}
    for items in zip(*lists, strict=True):
        key = (items[0].device, items[0].dtype)
        group = groups.get(key)
        if group is None:
            group = groups[key] = tuple([] for _ in lists)
        for out, t in zip(group, items):
            out.append(t)
    return list(groups.values())


def mul_(tensors: list[torch.Tensor], factor: float) -> None:
    """``t.mul_(factor)`` for every tensor of one device/dtype group, in one multi-tensor call.

    The CPU foreach kernel rounds a Python scalar to a half-precision list's dtype before multiplying, where
    ``t.mul_`` multiplies in fp32; such a list gets the factor as an fp32 0-dim CPU tensor, which keeps ``t.mul_``'s
    result.  The CUDA kernels take the scalar in fp32 already, and a 0-dim CUDA tensor would cost a host-to-device
    copy (a stream synchronisation) per call there.  (The other scalars of the rules meet fp32 lists only, or are
    taken in fp32 by their kernels.)
    """
    first = tensors[0]
    if first.device.type == "cpu" and first.dtype in (torch.float16, torch.bfloat16):
        torch._foreach_mul_(tensors, torch.tensor(factor, dtype=torch.float32))
    else:
        torch._foreach_mul_(tensors, factor)
