"""The stages torch.distributed.pipelining runs in ``bench_torch_pipelining``: our GPT blocks, one torch schedule.

``BenchModel`` is the GPT both sides of the peer comparison run; ``build_modules`` builds a rank's (virtual) stages
from ``megatron.model`` (``build_gpt_stages``: the embedding on the first stage, transformer layers, the final norm
and output head on the last, vocab-parallel cross-entropy as the loss); ``build_torch_runner`` wraps them in
``torch.distributed.pipelining.PipelineStage`` under one of ``TORCH_SCHEDULES``; ``reference_losses_and_grads``
runs the same blocks in one process.  Timing, launching and the report live in ``bench_torch_pipelining``.

Linears.  Our layers' linears are ``deferrable_linear`` (one custom autograd node that yields both gradients, and
defers the weight part through our own ``WeightGradStore``).  torch splits B and W through the autograd graph, which
cannot see inside one custom node, so its zero-bubble schedules would redo the whole linear backward at W.  By
default the torch side therefore runs the same modules with their linears and embeddings routed through the plain
``F.linear`` / ``F.embedding`` autograd nodes (``use_autograd_linears``): same weights, same forward kernels, the
split torch expects.  ``linears="deferrable"`` keeps ours, to measure that cost.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from megatron.model import GPTConfig, GPTStage, build_gpt_stages  # noqa: E402
from megatron.model.embedding import PositionEmbedding  # noqa: E402
from megatron.parallel.tensor_parallel import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

# name -> (torch schedule class name, stages per rank, placement)
TORCH_SCHEDULES: dict[str, tuple[str, int, str]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}


@dataclass(frozen=True)
class BenchModel:
    """The GPT both sides run; ``micro_batch`` sequences of ``seq_length`` tokens per microbatch."""

    num_layers: int = 8
    hidden_size: int = 256
    num_attention_heads: int = 8
    seq_length: int = 128
    vocab_size: int = 1024
    micro_batch: int = 1
    seed: int = 1234

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            vocab_size=self.vocab_size,
            seq_length=self.seq_length,
            make_vocab_size_divisible_by=128,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            untie_embeddings_and_output_weights=True,  # torch's runtime does not sync a tied copy across stages
        )

    def tokens_per_iteration(self, m: int) -> int:
        return m * self.micro_batch * self.seq_length


QUICK_MODEL = BenchModel(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512)


def available_schedules() -> list[str]:
    """The entries of ``TORCH_SCHEDULES`` that this torch provides."""
    import torch.distributed.pipelining as pipelining

    return [name for name, (cls, _, _) in TORCH_SCHEDULES.items() if hasattr(pipelining, cls)]


# ------------------------------------------------------------------------------------------------- model pieces
def make_batch(model: BenchModel, m: int, *, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[m * micro_batch, s]`` and their next-token labels, deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, model.vocab_size, (m * model.micro_batch, model.seq_length + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def make_loss_fn(model: BenchModel) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Mean token loss of logits ``[s, b, V_padded]`` against labels ``[b, s]`` (our cross-entropy)."""
    tp, vocab = TPContext(), model.vocab_size

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels.t(), tp, vocab_size=vocab).mean()

    return loss_fn


def _column_forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, self.weight if weight is None else weight, self.bias)


def _row_forward(self, x: torch.Tensor) -> torch.Tensor:
    y = F.linear(x, self.weight)
    return y if self.bias is None else y + self.bias


def _vocab_embedding_forward(self, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, self.weight)


def _position_forward(
    self, seq_len: int, position_ids: torch.Tensor | None = None, offset: int = 0
) -> torch.Tensor:  # PositionEmbedding.forward's signature
    if position_ids is not None:
        return F.embedding(position_ids.t(), self.weight)
    return F.embedding(torch.arange(offset, offset + seq_len, device=self.weight.device), self.weight).unsqueeze(1)


def use_autograd_linears(module: torch.nn.Module) -> int:
    """Route ``module``'s linears and embeddings (tp = 1) through the built-in autograd ops; returns how many.

    Same parameters and forward kernels as ``deferrable_linear``; the backward becomes the ordinary autograd nodes
    that ``torch.distributed.pipelining`` splits into input and weight gradients.
    """
    table = {
        ColumnParallelLinear: _column_forward,
        RowParallelLinear: _row_forward,
        VocabParallelEmbedding: _vocab_embedding_forward,
        PositionEmbedding: _position_forward,
    }
    done = 0
    for sub in module.modules():
        fn = table.get(type(sub))
        if fn is None:
            continue
        tp = getattr(sub, "tp", None)
        if tp is not None and tp.tp_size != 1:
            raise ValueError(f"use_autograd_linears needs tp_size=1, got {tp.tp_size} in {type(sub).__name__}")
        if getattr(sub, "sequence_parallel", False):
            raise ValueError("use_autograd_linears does not support sequence parallelism")
        sub.forward = types.MethodType(fn, sub)
        done += 1
    return done


def stage_indices(rank: int, pp: int, chunks: int, placement: str) -> list[int]:
    """The virtual stages rank ``rank`` holds, in chunk order (loop: r, r + pp, ...; V: r, 2pp - 1 - r)."""
    if chunks == 1:
        return [rank]
    if placement == "loop":
        return [rank + c * pp for c in range(chunks)]
    if placement == "v" and chunks == 2:
        return [rank, 2 * pp - 1 - rank]
    raise ValueError(f"placement={placement!r} with chunks={chunks} is not supported")


class ContiguousOutput(torch.nn.Module):
    """A stage whose output is made contiguous: P2P sends and receives need dense buffers (our hidden states are
    ``[s, b, h]`` views of ``[b, s, h]`` embeddings)."""

    def __init__(self, stage: GPTStage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage(x).contiguous()


def build_modules(
    model: BenchModel, indices: Sequence[int], num_stages: int, *, linears: str
) -> list[ContiguousOutput]:
    """Our GPT stages ``indices`` of a ``num_stages``-way split, with ``linears`` in {"autograd", "deferrable"}."""
    if linears not in ("autograd", "deferrable"):
        raise ValueError(f"linears={linears!r} must be 'autograd' or 'deferrable'")
    mods = build_gpt_stages(model.gpt_config(), num_stages, stages=list(indices), seed=model.seed)
    if linears == "autograd":
        for mod in mods:
            use_autograd_linears(mod)
    return [ContiguousOutput(mod) for mod in mods]


# ------------------------------------------------------------------------------------------- one torch schedule
@dataclass
class TorchRunner:
    """One built torch schedule on this rank: ``step()`` runs one iteration (forward + backward, no optimizer)."""

    name: str
    m: int
    modules: list[ContiguousOutput]
    schedule: object
    has_first: bool
    has_last: bool
    tokens: torch.Tensor
    labels: torch.Tensor

    def zero_grad(self) -> None:
        for mod in self.modules:
            mod.zero_grad(set_to_none=True)

    def step(self) -> list[float]:
        """One iteration; returns the per-microbatch losses on the rank holding the last stage, else ``[]``."""
        losses: list[torch.Tensor] = []
        args = (self.tokens,) if self.has_first else ()
        target = self.labels if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses if self.has_last else None, return_outputs=False)
        return [float(x.detach()) for x in losses]

    def grads(self) -> dict[str, np.ndarray]:
        """Parameter gradients by global name (numpy, for the harness's pipe)."""
        out = {}
        for mod in self.modules:
            for name, param in mod.stage.named_parameters():
                if param.grad is not None:
                    out[mod.stage.global_name(name)] = param.grad.detach().numpy().copy()
        return out


def build_torch_runner(
    rank: int, world_size: int, model: BenchModel, name: str, m: int, *, linears: str
) -> TorchRunner:
    """Build torch schedule ``name`` (a key of ``TORCH_SCHEDULES``) for ``world_size`` ranks on this rank."""
    import torch.distributed.pipelining as pipelining

    if name not in TORCH_SCHEDULES:
        raise ValueError(f"schedule {name!r} is not one of {sorted(TORCH_SCHEDULES)}")
    cls_name, chunks, placement = TORCH_SCHEDULES[name]
    num_stages = world_size * chunks
    indices = stage_indices(rank, world_size, chunks, placement)
    modules = build_modules(model, indices, num_stages, linears=linears)
    device = torch.device("cpu")
    stages = [
        pipelining.PipelineStage(mod, idx, num_stages, device)  # shapes inferred on the first step
        for mod, idx in zip(modules, indices)
    ]
    cls = getattr(pipelining, cls_name)
    loss_fn = make_loss_fn(model)
    schedule = cls(stages[0], m, loss_fn=loss_fn) if chunks == 1 else cls(stages, m, loss_fn=loss_fn)
    tokens, labels = make_batch(model, m)
    return TorchRunner(
        name=name,
        m=m,
        modules=modules,
        schedule=schedule,
        has_first=0 in indices,
        has_last=num_stages - 1 in indices,
        tokens=tokens,
        labels=labels,
    )


def torch_schedule_steps(
    rank: int, world_size: int, model: BenchModel, names: Sequence[str], m: int, *, linears: str = "autograd"
) -> dict[str, Callable[[], None]]:
    """``{"torch:<name>": step}`` for each torch schedule, ready for ``time_alternated`` (grads zeroed per step)."""
    steps = {}
    for name in names:
        runner = build_torch_runner(rank, world_size, model, name, m, linears=linears)

        def step(r: TorchRunner = runner) -> None:
            r.zero_grad()
            r.step()

        steps[f"torch:{name}"] = step
    return steps


def reference_losses_and_grads(model: BenchModel, m: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """The same blocks in one process (one stage, deferrable linears): per-microbatch losses and the gradient of
    their mean, by global name."""
    (whole,) = build_gpt_stages(model.gpt_config(), 1, seed=model.seed)
    tokens, labels = make_batch(model, m)
    loss_fn = make_loss_fn(model)
    losses = []
    for tok, lab in zip(tokens.chunk(m), labels.chunk(m)):
        loss = loss_fn(whole(tok), lab)
        (loss / m).backward()
        losses.append(float(loss.detach()))
    grads = {whole.global_name(n): p.grad.detach().numpy().copy() for n, p in whole.named_parameters()}
    return losses, grads
