"""Rotary position embeddings (RoPE), "rotate half" convention: dimension i pairs with i + d/2."""

from __future__ import annotations

import torch


class RotaryEmbedding(torch.nn.Module):
    """Produces ``cos, sin`` tables ``[s, 1, 1, d]`` for positions ``0..s-1``; holds no parameters."""

    def __init__(self, head_dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head size, got {head_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # [d/2]
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self._cache: tuple[int, torch.device, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(self, seq_len: int, *, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._cache
        if c is not None and c[0] == seq_len and c[1] == device and c[2] == dtype:
            return c[3], c[4]
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)  # [s]
        freqs = torch.outer(pos, self.inv_freq.to(device))  # [s, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, d]
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self._cache = (seq_len, device, dtype, cos, sin)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [s, b, n, d]`` by the position-dependent angles in ``cos, sin [s, 1, 1, d]``."""
    x1, x2 = x.chunk(2, dim=-1)  # [s, b, n, d/2] each
    rotated = torch.cat([-x2, x1], dim=-1)  # [s, b, n, d]
    return x * cos + rotated * sin
