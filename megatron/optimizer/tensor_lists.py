"""Parallel tensor lists for the multi-tensor (``torch._foreach_*``) update rules: split by device and dtype, and
on the CPU into cache-sized blocks.

A ``torch._foreach_*`` call applies one operation to a whole list of tensors: on CUDA a few fused kernel launches
for the list instead of one launch per tensor; on the CPU one call from Python instead of one per tensor, then the
same per-tensor kernels, so the results are bit-identical to a per-tensor loop of the same operations.  Its fast
(fused) path needs every tensor of a call on one device with one dtype, so the lists are split by the first
list's (device, dtype) first.  Each operation is elementwise and no two lists share a tensor, so running operation
by operation over a list, instead of tensor by tensor, changes nothing an element sees.

On the CPU an update rule's several passes are bound by memory traffic, not by Python: running each operation
over all of a stage's tensors evicts them from the cache between passes.  ``multi_tensor_groups`` therefore cuts
CPU groups into blocks of at most ``CPU_BLOCK_NUMEL`` elements (a larger tensor into flat views of consecutive
elements, when every list's tensor is contiguous and of one shape), so that AdamW's 5 lists of a block (~1.3 MB in
fp32) stay in a core's L2 cache across its 8 operations; elementwise, a view changes nothing either.  The
out-of-place temporaries (Adam's denominator, SGD's decayed gradient) are one block's; on CUDA (no blocking) they
are one group's, as in ``torch.optim``'s foreach implementations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CPU_BLOCK_NUMEL = 1 << 16  # elements per CPU block (see the module docstring)

TensorLists = tuple[list[torch.Tensor], ...]


def by_device_and_dtype(*lists: Sequence[torch.Tensor]) -> list[TensorLists]:
    """Split equally long parallel ``lists`` into groups whose first-list tensors share device and dtype; each group
    is a tuple of lists (one per input list, order kept). Empty input gives no groups."""
    groups: dict[tuple[torch.device, torch.dtype], TensorLists] = {}
    for items in zip(*lists, strict=True):
        key = (items[0].device, items[0].dtype)
        group = groups.get(key)
        if group is None:
            group = groups[key] = tuple([] for _ in lists)
        for out, t in zip(group, items):
            out.append(t)
    return list(groups.values())


def multi_tensor_groups(*lists: Sequence[torch.Tensor]) -> list[TensorLists]:
    """``by_device_and_dtype``, with CPU groups cut into blocks of at most ``CPU_BLOCK_NUMEL`` elements (for rules
    that make several passes over the same tensors)."""
    out: list[TensorLists] = []
    for group in by_device_and_dtype(*lists):
        out += _cpu_blocks(group) if group[0][0].device.type == "cpu" else [group]
    return out


def _cpu_blocks(group: TensorLists) -> list[TensorLists]:
    blocks: list[TensorLists] = []
    block: TensorLists = tuple([] for _ in group)
    size = 0
    for items in zip(*group):
        n = items[0].numel()
        pieces = [items]
        if n > CPU_BLOCK_NUMEL and all(t.is_contiguous() and t.shape == items[0].shape for t in items):
            flat = [t.view(-1) for t in items]
            pieces = [tuple(f[i : i + CPU_BLOCK_NUMEL] for f in flat) for i in range(0, n, CPU_BLOCK_NUMEL)]
        for piece in pieces:
            k = piece[0].numel()
            if size and size + k > CPU_BLOCK_NUMEL:
                blocks.append(block)
                block, size = tuple([] for _ in group), 0
            for out, t in zip(block, piece):
                out.append(t)
            size += k
    if block[0]:
        blocks.append(block)
    return blocks


def mul_(tensors: list[torch.Tensor], factor: float) -> None:
    """``t.mul_(factor)`` for every tensor of one device/dtype group, in one multi-tensor call.

    The CPU foreach kernel rounds a Python scalar to a half-precision list's dtype before multiplying, where
    ``t.mul_`` multiplies in fp32; such a list gets the factor as an fp32 0-dim tensor, which keeps ``t.mul_``'s
    result.  (The other scalars of the rules meet fp32 lists only, or are taken in fp32 by their kernels.)
    """
    if tensors[0].dtype in (torch.float16, torch.bfloat16):
        torch._foreach_mul_(tensors, torch.tensor(factor, dtype=torch.float32, device=tensors[0].device))
    else:
        torch._foreach_mul_(tensors, factor)
