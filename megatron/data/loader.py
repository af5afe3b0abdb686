"""Reading the training microbatches: ``--dataloader-type`` (sample order) and ``--num-workers`` (worker processes).

- ``CyclicOrder`` (``--dataloader-type cyclic``): global sample ``i`` is sample ``perm_e[i mod N]`` of the dataset,
  ``perm_e`` a permutation seeded by (seed, pass ``e = i // N``): every pass over the ``N`` samples reads each once,
  in a new order, and the dataset is cycled.  ``single`` (the default) reads them in order.
- ``MicrobatchLoader``: the microbatches of each iteration in the order the trainer consumes them (Megatron's
  sampler: ``megatron.microbatches.microbatch_indices``); with ``num_workers > 0`` a ``torch.utils.data.DataLoader``
  whose workers load and collate ahead of the trainer, with 0 the trainer loads them itself.  Either way the same
  samples in the same order, so the losses are identical.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from megatron.data.mock_data import collate
from megatron.microbatches import load_microbatch, microbatch_indices

if TYPE_CHECKING:
    from megatron.arguments import RunConfig


class CyclicOrder(torch.utils.data.Dataset):
    """``dataset`` read pass after pass, each pass in a seeded random order (see the module docstring)."""

    def __init__(self, dataset: Any, *, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.n = len(dataset)
        self._perms: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.n

    def source_index(self, i: int) -> int:
        epoch, k = divmod(int(i), self.n)
        perm = self._perms.get(epoch)
        if perm is None:
            perm = self._perms[epoch] = np.random.RandomState((self.seed + 7919 * epoch) % 2**32).permutation(self.n)
        return int(perm[k])

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.source_index(i)]


class _IterationSampler:
    """Index lists of every microbatch of iterations ``start, start+1, ...`` (a DataLoader ``batch_sampler``)."""

    def __init__(self, run: RunConfig, dp_rank: int, start: int) -> None:
        self.run, self.dp_rank, self.start = run, dp_rank, start

    def __iter__(self) -> Iterator[list[int]]:
        run = self.run
        for it in range(self.start, run.training.train_iters):
            base = run.batches.consumed_before(it)
            for k in range(run.num_microbatches_at(it)):
                yield microbatch_indices(run, self.dp_rank, base, k)


class MicrobatchLoader:
    """This data-parallel rank's training microbatches, iteration by iteration, from iteration ``start`` on."""

    def __init__(self, run: RunConfig, dataset: Any, *, dp_rank: int, device: torch.device, start: int) -> None:
        self.run, self.dataset, self.dp_rank, self.device = run, dataset, dp_rank, device
        self._start(start)

    def _start(self, start: int) -> None:
        run, workers = self.run, self.run.data.num_workers
        self.next_iteration = start
        self._iter: Iterator[dict[str, torch.Tensor]] | None = None
        if workers > 0:
            loader = torch.utils.data.DataLoader(
                self.dataset,
                batch_sampler=_IterationSampler(run, self.dp_rank, start),
                num_workers=workers,
                collate_fn=collate,
                pin_memory=self.device.type == "cuda",
                persistent_workers=False,
            )
            self._iter = iter(loader)

    def close(self) -> None:
        """Stop the worker processes (dropping the DataLoader iterator shuts them down)."""
        self._iter = None

    def batches(self, iteration: int) -> list[dict[str, torch.Tensor]]:
        """The ``m`` microbatches of ``iteration`` (0-based), on the device; iterations are read in order."""
        if iteration != self.next_iteration:  # the trainer moved (a test, a reload): read from there on
            self._start(iteration)
        self.next_iteration += 1
        run = self.run
        m = run.num_microbatches_at(iteration)
        if self._iter is None:
            base = run.batches.consumed_before(iteration)
            return [
                load_microbatch(self.dataset, microbatch_indices(run, self.dp_rank, base, k), self.device)
                for k in range(m)
            ]
        got = [next(self._iter) for _ in range(m)]
        return [{k: v.to(self.device, non_blocking=True) for k, v in b.items()} for b in got]


def train_microbatches(tr: Any) -> list[dict[str, torch.Tensor]]:
    """The microbatches of the trainer's next iteration (its ``MicrobatchLoader`` is built on first use, after any
    ``--load`` has set the iteration)."""
    if tr.train_loader is None:
        tr.train_loader = MicrobatchLoader(
            tr.run, tr.train_data, dp_rank=tr.ctx.dp_rank, device=tr.ctx.device, start=tr.iteration
        )
    return tr.train_loader.batches(tr.iteration)
