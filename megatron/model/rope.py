"""Rotary position embeddings (RoPE), "rotate half" convention: dimension i pairs with i + r/2.

``r`` is the rotary dimension: all of a head's ``d`` channels, or Megatron's ``--rotary-percent`` share of them (the
first ``r`` channels are rotated, the rest pass through unchanged).
"""

from __future__ import annotations

import torch


class RotaryEmbedding(torch.nn.Module):
    """Produces ``cos, sin`` tables ``[s, 1, 1, r]`` for positions ``0..s-1`` (``[s, b, 1, r]`` for explicit
    ``position_ids [b, s]``); holds no parameters."""

    def __init__(self, head_dim: int, *, base: float = 10000.0, rotary_dim: int | None = None) -> None:
        super().__init__()
        dim = head_dim if rotary_dim is None else rotary_dim
        if dim % 2 or not 2 <= dim <= head_dim:
            raise ValueError(f"rotary embeddings need an even rotary size in [2, {head_dim}], got {dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))  # [r/2]
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self._cache: tuple[int, torch.device, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(
        self,
        seq_len: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._table(seq_len, device, dtype)  # [s, 1, 1, r]
        if position_ids is None:
            return cos, sin
        ids = position_ids.t()  # [s, b], each < s (reset positions only restart the count)
        return cos[:, 0, 0][ids].unsqueeze(2), sin[:, 0, 0][ids].unsqueeze(2)  # [s, b, 1, r]

    def _table(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._cache
        if c is not None and c[0] == seq_len and c[1] == device and c[2] == dtype:
            return c[3], c[4]
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)  # [s]
        freqs = torch.outer(pos, self.inv_freq.to(device))  # [s, r/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, r]
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self._cache = (seq_len, device, dtype, cos, sin)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``r`` channels of ``x [s, b, n, d]`` by the angles in ``cos, sin [s, 1 or b, 1, r]``."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:  # --rotary-percent < 1: the remaining channels pass through
        return torch.cat([apply_rotary(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)  # [s, b, n, d/2] each
    rotated = torch.cat([-x2, x1], dim=-1)  # [s, b, n, d]
    return x * cos + rotated * sin
