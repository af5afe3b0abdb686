"""Parameter initialisation that depends only on the seed and each parameter's global name.

For every parameter the *full* (unsharded) tensor is generated on the CPU from a generator seeded by
``sha256(seed, global name)``, then this rank's shard is cut out of it (``shard_tensor``).  So a tensor-parallel
shard equals the slice of the full tensor, and any tp / pp / virtual-stage layout builds the same model: the global
name of a parameter does not depend on the stage it lives on.

Rules (Megatron's): weights ~ N(0, std); the output projections of attention and MLP (row-parallel weights)
~ N(0, std / sqrt(2 * num_layers)); biases 0; norm weights 1 (0 for ``--apply-layernorm-1p``, which stores
``gamma - 1``).  Vocabulary tables generate ``vocab_size`` real rows
and append zero rows up to the padded size, so the real rows do not depend on the padding (which depends on tp).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch

from megatron.model.config import GPTConfig
from megatron.model.norms import LayerNorm, RMSNorm
from megatron.parallel.tensor_parallel import (
    HasTensorParallel,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_shape,
    is_tensor_parallel,
    shard_tensor,
)


def parameter_seed(seed: int, global_name: str) -> int:
    """A 63-bit generator seed from ``(seed, global_name)``; stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}/{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _normal(shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)


def full_initial_value(
    global_name: str, module: torch.nn.Module, param_name: str, shape: tuple[int, ...], *, seed: int, config: GPTConfig
) -> torch.Tensor:
    """The full fp32 initial value of parameter ``param_name`` of ``module`` (shape ``shape``, unsharded)."""
    if isinstance(module, (LayerNorm, RMSNorm)):
        one = param_name == "weight" and not module.zero_centered
        return torch.ones(shape) if one else torch.zeros(shape)
    if param_name == "bias":
        return torch.zeros(shape)
    std = config.init_method_std
    if isinstance(module, RowParallelLinear):
        std = std / math.sqrt(2.0 * config.num_layers)
    if getattr(module, "vocab_rows", False) or isinstance(module, VocabParallelEmbedding):
        real = min(config.vocab_size, shape[0])
        table = _normal((real, *shape[1:]), std, parameter_seed(seed, global_name))
        return torch.cat([table, torch.zeros((shape[0] - real, *shape[1:]))]) if real < shape[0] else table
    return _normal(shape, std, parameter_seed(seed, global_name))


@torch.no_grad()
def initialize_parameters(
    root: torch.nn.Module,
    *,
    seed: int,
    config: GPTConfig,
    tp: HasTensorParallel,
    global_name: Callable[[str], str] = lambda name: name,
) -> None:
    """Fill every parameter of ``root`` from ``(seed, global_name(local name))``, sharded for this tp rank."""
    for module_name, module in root.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            local = f"{module_name}.{param_name}" if module_name else param_name
            name = global_name(local)
            full = full_initial_value(name, module, param_name, full_shape(param, tp.tp_size), seed=seed, config=config)
            if is_tensor_parallel(param) and tp.tp_size > 1:
                full = shard_tensor(
                    full,
                    dim=param.partition_dim,
                    tp_rank=tp.tp_rank,
                    tp_size=tp.tp_size,
                    stride=getattr(param, "partition_stride", 1),
                )
            param.copy_(full)
