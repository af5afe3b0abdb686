"""The optimizer the trainer uses: fp32 main parameters over (possibly half-precision) model parameters.

One optimizer step (``step``)::

    main_grad /= loss_scale                                      # fp16 only; exact (the scale is a power of two)
    local = sum g^2 over the gradients this rank counts, reduced over its pipeline position's group
            (tensor-parallel ranks; tensor- and data-parallel ranks with the distributed optimizer)
    stats = norm and inf/NaN of the pipeline ranks' ``local`` summed in pipeline-rank order  # THE cross-stage sync
    loss_scaler.update(stats.found_nonfinite)
    if stats.found_nonfinite: skip the step
    clip main grads by the global norm; the update rule (``--optimizer``: AdamW or SGD) on the fp32 main parameters
    publish: copy main parameters into the model parameters (cast to bf16/fp16)

The pieces are public and communicate only within a pipeline position, so ``zb_pipeline.optim.post_validation``
can run the same step without the cross-stage synchronisation (this class is its ``PostValidatableOptimizer``):
``unscale_and_local_stats``, ``clip_coefficient``, ``apply_update``, ``update_loss_scale``, ``snapshot``/``restore``
and ``zero_grad``.  Both paths sum the per-stage states in the same order, so they compute the identical norm.

``MainParamOptimizer`` holds every main parameter on every data-parallel rank; ``DistributedOptimizer``
(``megatron.optimizer.distributed``) holds only this rank's shard of each gradient bucket and all-gathers the
updated parameters. Both keep their state as ``MainShard`` pieces (a flat element range ``[lo, hi)`` of one
parameter), so a checkpoint written by either loads into either, at any data-parallel size.

With an fp32 model and no sharding the main parameter *is* the model parameter (no copy).

``last_step_ms`` is this rank's own work in its last applied step on the CPU (unscale and local statistics, update
and publish; not the wait for the other stages' statistics): the stage planner's share of the optimizer per part
(``megatron.pipeline.part_costs``).  ``None`` on a GPU, where the host does not see the device's time.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from megatron.config.optimizer import OptimizerConfig
from megatron.config.precision import PrecisionConfig
from megatron.optimizer.grad_norm import GradStats, clip_coefficient, owns_grad, reduce_grad_stats, sum_squares
from megatron.optimizer.loss_scaler import LossScaler, build_loss_scaler
from megatron.optimizer.registry import build_update_rule
from megatron.optimizer.tensor_lists import by_device_and_dtype, mul_
from megatron.optimizer.update_rule import default_no_weight_decay
from zb_pipeline import comm
from zb_pipeline.optim.grad_stats import grad_stats
from zb_pipeline.optim.post_validation import gather_in_rank_order, local_state

PIECE_METADATA = ("lo", "hi", "numel", "shape")  # a checkpoint piece's other entries are flat fp32 tensors


@dataclass(eq=False)
class MainShard:
    """Elements ``[lo, hi)`` of model parameter ``name`` (flattened) that this rank updates."""

    name: str
    param: torch.nn.Parameter
    lo: int
    hi: int
    main: torch.Tensor  # fp32: the model parameter itself, or a copy (param-shaped, or flat when sharded)
    grad: torch.Tensor  # the matching view of param.main_grad (fp32)
    owned: bool  # counted in the global grad norm on this rank (see grad_norm.owns_grad)

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == self.param.numel()


@dataclass(frozen=True)
class StepOutcome:
    stats: GradStats
    skipped: bool
    loss_scale: float  # the scale this iteration's gradients were computed with


class MainParamOptimizer:
    """The update rule over fp32 main parameters, loss scaling and global clipping (every dp rank holds
    everything)."""

    sharded = False

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.nn.Parameter]],
        config: OptimizerConfig,
        precision: PrecisionConfig,
        *,
        tp_rank: int = 0,
        stage_group: comm.ProcessGroup | None = None,
        pp_group: comm.ProcessGroup | None = None,
    ) -> None:
        self.config, self.precision = config, precision
        self.tp_rank = tp_rank
        self.stage_group = stage_group  # reduces the local statistics (tp; tp x dp when sharded)
        self.pp_group = pp_group  # the pipeline: per-stage statistics are summed over it in pipeline-rank order
        # The DataParallelReducer owning the main_grad buffer (zero_grad zeroes all of it); set by the trainer.
        self.reducer: Any = getattr(self, "reducer", None)
        self.scaler: LossScaler = build_loss_scaler(precision)
        params: list[tuple[str, torch.nn.Parameter]] = []
        seen: set[int] = set()
        for name, p in named_params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append((name, p))
        self.model_params = params
        # Where the gradients (and so their statistics) live: they never leave it before the one host read per step.
        self.device = params[0][1].device if params else torch.device("cpu")
        self.shards: list[MainShard] = self._build_shards(params)
        by_name = {s.name: s for s in self.shards}
        self.update_rule = build_update_rule(
            ((s.name, s.main) for s in self.shards),
            config,
            no_weight_decay=lambda name, _main: default_no_weight_decay(name, by_name[name].param),
        )
        self.timed = self.device.type == "cpu"  # the host clock sees the step's work
        self._stats_s = 0.0  # seconds of the last unscale_and_local_stats
        self.last_step_ms: float | None = None  # this rank's own work in its last applied step (module docstring)

    # ------------------------------------------------------------------------------------------- layout
    def _build_shards(self, params: list[tuple[str, torch.nn.Parameter]]) -> list[MainShard]:
        shards = []
        for name, p in params:
            main_grad = getattr(p, "main_grad", None)
            if main_grad is None:
                raise ValueError(f"parameter {name} has no main_grad buffer; build the DataParallelReducer first")
            main = p if p.dtype == torch.float32 else fp32_main_copy(p.detach())
            main.main_grad = main_grad
            shards.append(MainShard(name, p, 0, p.numel(), main, main_grad, owns_grad(p, tp_rank=self.tp_rank)))
        return shards

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The model parameters this optimizer updates."""
        return [p for _, p in self.model_params]

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def step_count(self) -> int:
        return self.update_rule.step_count

    # --------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def unscale_and_local_stats(self) -> torch.Tensor:
        """Unscale the main gradients (fp16) and return the float64 sum of squares (0-d) of the ones this rank
        counts, reduced over its pipeline position (no communication across pipeline stages)."""
        start = time.perf_counter()
        scale = self.scaler.scale
        if scale != 1.0:
            self._scale_grads(1.0 / scale)
        local = self._local_stats()
        self._stats_s, self.last_step_ms = time.perf_counter() - start, None
        return local

    def _local_stats(self) -> torch.Tensor:
        local = sum_squares((s.grad for s in self.shards if s.owned), device=self.device)
        return reduce_grad_stats(local, group=self.stage_group)

    def grad_stats(self, local: torch.Tensor | None = None) -> GradStats:
        """Global norm and inf/NaN of the (unscaled) main gradients: the stages' local statistics summed in
        pipeline-rank order (one all-gather over the pipeline; ``local`` defaults to this rank's, not unscaled).
        Everything stays on the device up to ``grad_stats``, the step's one host read."""
        if local is None:
            local = self._local_stats()
        total = gather_in_rank_order(local_state(local), self.pp_group)
        return grad_stats(total[0])

    def clip_coefficient(self, norm: float) -> float:
        return clip_coefficient(norm, self.config.clip_grad)

    @torch.no_grad()
    def apply_update(self, lr: float, coeff: float) -> None:
        """Scale the gradients by ``coeff`` (if below 1), apply the update rule, publish."""
        start = time.perf_counter()
        if coeff < 1.0:
            self._scale_grads(coeff)
        self.update_rule.step(lr)
        self.publish()
        if self.timed:
            self.last_step_ms = (self._stats_s + time.perf_counter() - start) * 1e3

    def _scale_grads(self, factor: float) -> None:
        """Every main gradient of this rank's shards times ``factor`` (one multi-tensor call per device/dtype)."""
        for (grads,) in by_device_and_dtype([s.grad for s in self.shards]):
            mul_(grads, factor)

    def update_loss_scale(self, found_nonfinite: bool) -> None:
        self.scaler.update(found_nonfinite)

    @torch.no_grad()
    def step(self, lr: float) -> StepOutcome:
        """Unscale, check, clip, update and publish; returns the stats and whether the step was skipped."""
        scale = self.scaler.scale
        stats = self.grad_stats(self.unscale_and_local_stats())
        self.scaler.update(stats.found_nonfinite)
        if stats.found_nonfinite:
            return StepOutcome(stats=stats, skipped=True, loss_scale=scale)
        self.apply_update(lr, self.clip_coefficient(stats.norm))
        return StepOutcome(stats=stats, skipped=False, loss_scale=scale)

    # ------------------------------------------------------------------------ post-validation: exact rollback
    @torch.no_grad()
    def snapshot(self) -> tuple[int, list[torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
        """Copies of everything ``apply_update`` changes: step count, main parameters, the update rule's state
        (Adam moments, SGD momentum buffers)."""
        rule = self.update_rule
        states = {k: {n: t.clone() for n, t in v.items()} for k, v in rule.state.items()}
        return rule.step_count, [s.main.detach().clone() for s in self.shards], states

    @torch.no_grad()
    def restore(self, snap: tuple[int, list[torch.Tensor], dict[int, dict[str, torch.Tensor]]]) -> None:
        """Put a ``snapshot`` back (copies, never an algebraic inversion) and re-publish the model parameters."""
        step, mains, states = snap
        for s, main in zip(self.shards, mains):
            s.main.copy_(main)
        self.update_rule.state = states
        self.update_rule.step_count = step
        self.publish()

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero every main gradient (the reducer's whole buffer when there is one)."""
        if self.reducer is not None:
            self.reducer.buffer.zero_()
        else:
            for s in self.shards:
                s.grad.zero_()

    @torch.no_grad()
    def publish(self) -> None:
        """Copy the fp32 main parameters into the model parameters."""
        for s in self.shards:
            if s.main is not s.param:
                s.param.copy_(s.main)

    @torch.no_grad()
    def reset_main_from_model(self) -> None:
        """Main parameters := model parameters (after loading model weights without optimizer state)."""
        for s in self.shards:
            if s.main is not s.param:
                s.main.copy_(s.param.detach().reshape(-1)[s.lo : s.hi].view_as(s.main))

    # ------------------------------------------------------------------------------------- checkpoints
    def sharded_state_dict(self) -> dict[str, object]:
        """This rank's optimizer state as flat pieces per parameter name (tensors and plain data only): the main
        parameter and each of the update rule's state tensors (zeros before its first step)."""
        rule = self.update_rule
        pieces: dict[str, dict[str, object]] = {}
        for s in self.shards:
            st = rule.state.get(id(s.main))
            flat_main = s.main.detach().reshape(-1)
            if s.main is s.param:
                flat_main = flat_main[s.lo : s.hi]
            piece: dict[str, object] = {
                "lo": s.lo,
                "hi": s.hi,
                "numel": s.param.numel(),
                "shape": list(s.param.shape),
                "main": flat_main.float().clone(),
            }
            for key in rule.state_keys:
                piece[key] = (
                    st[key].reshape(-1).clone() if st is not None else torch.zeros(s.hi - s.lo, device=s.main.device)
                )
            pieces[s.name] = piece
        return {"step": rule.step_count, "pieces": pieces}

    @torch.no_grad()
    def load_sharded_state_dicts(self, states: list[dict[str, object]]) -> None:
        """Load from the pieces of every file of this (tp, pp) position, whatever dp split wrote them."""
        steps = {int(st["step"]) for st in states}  # type: ignore[arg-type]
        if len(steps) != 1:
            raise ValueError(f"optimizer shards disagree on the step count: {sorted(steps)}")
        full = assemble_pieces([st["pieces"] for st in states])  # type: ignore[misc]
        rule = self.update_rule
        for s in self.shards:
            if s.name not in full:
                raise ValueError(f"optimizer state has no entry for parameter {s.name}")
            entry = full[s.name]
            if entry["main"].numel() != s.param.numel():
                raise ValueError(
                    f"optimizer state for {s.name} has {entry['main'].numel()} elements, the model {s.param.numel()}"
                )
            missing = [k for k in rule.state_keys if k not in entry]
            if missing:
                saved = ", ".join(k for k in entry if k not in ("main", "shape")) or "none"
                raise ValueError(
                    f"it holds {saved} but --optimizer {self.config.optimizer} needs {', '.join(missing)} (saved by "
                    "another --optimizer); resume with that optimizer or pass --no-load-optim"
                )
            s.main.copy_(entry["main"][s.lo : s.hi].view_as(s.main))
            rule.state[id(s.main)] = {
                k: entry[k][s.lo : s.hi].clone().view_as(s.main).to(s.main.device) for k in rule.state_keys
            }
        rule.step_count = steps.pop()  # the caller publishes (a collective for the distributed optimizer)


def assemble_pieces(piece_dicts: list[dict[str, dict[str, object]]]) -> dict[str, dict[str, torch.Tensor]]:
    """Full flat ``main`` and optimizer-state tensors (``exp_avg``/``exp_avg_sq`` or ``momentum_buffer``) per
    parameter name, plus its ``shape``, from pieces ``[lo, hi)`` that tile it."""
    by_name: dict[str, list[dict[str, object]]] = {}
    for pieces in piece_dicts:
        for name, piece in pieces.items():
            by_name.setdefault(name, []).append(piece)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, parts in by_name.items():
        parts.sort(key=lambda p: int(p["lo"]))  # type: ignore[arg-type]
        numel = int(parts[0]["numel"])  # type: ignore[arg-type]
        cursor = 0
        for p in parts:
            if int(p["lo"]) != cursor:  # type: ignore[arg-type]
                raise ValueError(f"optimizer pieces of {name} do not tile [0, {numel}): gap or overlap at {cursor}")
            cursor = int(p["hi"])  # type: ignore[arg-type]
        if cursor != numel:
            raise ValueError(f"optimizer pieces of {name} cover [0, {cursor}) of [0, {numel})")
        keys = [k for k in parts[0] if k not in PIECE_METADATA]
        entry = {k: torch.cat([p[k] for p in parts]) for k in keys}  # type: ignore[misc]
        entry["shape"] = list(parts[0]["shape"])  # type: ignore[assignment,arg-type]
        out[name] = entry
    return out


def fp32_main_copy(t: torch.Tensor) -> torch.nn.Parameter:
    """A detached fp32 copy of ``t`` as a parameter: the main parameter of a half-precision (or sharded) one."""
    return torch.nn.Parameter(t.detach().float().clone(), requires_grad=True)
