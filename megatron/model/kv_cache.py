"""Keys and values of the tokens seen so far, for incremental decoding (inference only; training never uses it).

A ``KVCache`` belongs to one stage (one whole model for generation).  The stage reads ``length`` (the position of
its first new token), each layer appends its new keys and values through ``layer(number)``, and the stage advances
``length`` once all its layers ran.  Buffers are allocated at the first append, for ``max_length`` positions.
"""

from __future__ import annotations

import torch


class LayerKVCache:
    """One layer's keys and values ``[b, groups, max_length, d]``, filled up to the owner's ``length``."""

    def __init__(self, owner: KVCache) -> None:
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def offset(self) -> int:
        return self.owner.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v [b, g, s, d]`` at positions ``offset .. offset + s - 1``; return all so far
        ``[b, g, offset + s, d]``."""
        start, end = self.offset, self.offset + k.shape[2]
        if end > self.owner.max_length:
            raise ValueError(f"KV cache holds {self.owner.max_length} positions, {end} needed")
        if self.k is None:
            shape = (k.shape[0], k.shape[1], self.owner.max_length, k.shape[3])
            self.k = k.new_empty(shape)
            self.v = v.new_empty(shape)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self.length = 0
        self._layers: dict[int, LayerKVCache] = {}

    def layer(self, number: int) -> LayerKVCache:
        """The cache of layer ``number`` (global, 0-based)."""
        if number not in self._layers:
            self._layers[number] = LayerKVCache(self)
        return self._layers[number]

    def advance(self, n: int) -> None:
        self.length += n
