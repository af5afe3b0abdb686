"""Save and resume a training run: ``--save/--save-interval/--load``, ``--no-load-optim``, ``--no-load-rng``,
``--finetune``.

What a checkpoint holds (files and atomic commit: ``megatron.checkpoint_files``):

- the model weights of every (tp, pp) position, keyed by *global* parameter name, with how each is split over
  tensor-parallel ranks (for ``tools/checkpoint_convert.py``);
- the optimizer as pieces ``[lo, hi)`` of each parameter's flat fp32 main copy and update-rule state (Adam moments,
  or SGD momentum buffers with ``--optimizer sgd``), one file per data-parallel shard (distributed optimizer) or one
  per (tp, pp) (plain): the loader re-tiles the pieces, so either optimizer, at any data-parallel size, resumes from
  either kind;
- the LR schedule, the loss scaler, the iteration, the data position, skip/nan counters, the model and layout
  configs (``common.pt``) and the tokenizer's files (``tokenizer/``, for generation and export); every rank's
  Python, NumPy and torch RNG states (and a tensor-parallel RNG tracker's, when the model has one).

Every rank takes part in a save and a load; errors found by any rank are shared, so all ranks fail together with
one message (no rank waits forever in a collective).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from megatron import checkpoint_files as cf
from megatron.config.errors import ConfigError, RunAbortedError
from megatron.model.config import GPTConfig
from megatron.parallel.tensor_parallel import VocabParallelEmbedding
from megatron.tokenizer.recorded import copy_tokenizer_files, tokenizer_sources
from zb_pipeline import comm

if TYPE_CHECKING:
    from megatron.arguments import RunConfig
    from megatron.trainer_state import Trainer


# ----------------------------------------------------------------------------------------------- what is saved
def _global_name(model: torch.nn.Module, local: str) -> str:
    fn = getattr(model, "global_name", None)
    return fn(local) if fn is not None else local


def model_split_metadata(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """How each parameter is split over tensor-parallel ranks and whether its rows are a padded vocabulary."""
    meta: dict[str, dict[str, Any]] = {}
    for module_name, module in model.named_modules():
        vocab = isinstance(module, VocabParallelEmbedding) or bool(getattr(module, "vocab_rows", False))
        for pname, p in module.named_parameters(recurse=False):
            local = f"{module_name}.{pname}" if module_name else pname
            meta[_global_name(model, local)] = {
                "tp": bool(getattr(p, "tensor_model_parallel", False)),
                "dim": int(getattr(p, "partition_dim", -1)),
                "stride": int(getattr(p, "partition_stride", 1)),
                "vocab": vocab and pname == "weight",
            }
    return meta


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {_global_name(model, n): t.detach().cpu().clone() for n, t in model.state_dict().items()}


def rng_state(model: torch.nn.Module) -> dict[str, Any]:
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    out: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(state, dtype=torch.int64, device="cpu"), "gauss": gauss},
        "numpy": {
            "kind": np_state[0],
            "key": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    tracker = getattr(model, "rng_tracker", None)
    if tracker is not None:
        out["tp_tracker"] = tracker.get_states()
    return out


def set_rng_state(state: dict[str, Any], model: torch.nn.Module) -> None:
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["kind"], npy["key"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = getattr(model, "rng_tracker", None)
    if tracker is not None and "tp_tracker" in state:
        tracker.set_states(state["tp_tracker"])


def _layers_per_stage(tr: Trainer) -> list[int] | None:
    """Transformer layers per virtual stage (--pipeline-layer-split / --decoder-first/last-pipeline-num-layers)."""
    layout = tr.run.pipeline_layout
    return None if layout is None else list(layout.layers_per_stage)


def layout_of(tr: Trainer) -> dict[str, Any]:
    ctx = tr.ctx
    return {
        "tp": ctx.tp_size,
        "pp": ctx.pp_size,
        "dp": ctx.dp_size,
        "world_size": ctx.world_size,
        "use_distributed_optimizer": bool(tr.run.optimizer.use_distributed_optimizer),
        "precision": tr.run.precision.name,
        "layers_per_stage": _layers_per_stage(tr),
        "recompute_per_stage": _recompute_per_stage(tr.run),
    }


def _recompute_per_stage(run: RunConfig) -> list[str] | None:
    """``--recompute-granularity auto``'s choice per virtual stage (None: not auto), which a resume takes back."""
    layout = run.pipeline_layout
    return None if layout is None or not run.recompute.auto else list(run.recompute.choices(layout.layer_ranges))


def common_state(tr: Trainer, iteration: int) -> dict[str, Any]:
    return {
        "format": cf.FORMAT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": tr.consumed_train_samples,
        "consumed_valid_samples": tr.consumed_valid_samples,
        "skipped_iterations": tr.skipped_iterations,
        "nan_iterations": tr.nan_iterations,
        "scheduler": tr.scheduler.state_dict(),
        "loss_scaler": tr.optimizer.scaler.state_dict(),
        # the model config, and the padded vocabulary for tools/checkpoint_convert.py (checked apart: it follows tp)
        "model_args": {**dataclasses.asdict(tr.run.model), "padded_vocab_size": tr.run.padded_vocab_size},
        "layout": layout_of(tr),
        "tokenizer": tokenizer_sources(tr.run.data)[0],  # its files go under tokenizer/ (megatron.tokenizer.recorded)
        "has_rng": not tr.run.checkpoint.no_save_rng,
        "has_optimizer": not tr.run.checkpoint.no_save_optim,
    }


# --------------------------------------------------------------------------------------- collective error handling
def _agree(ctx: Any, error: str | None) -> str | None:
    """Every rank learns the first error any rank hit (one small collective)."""
    if not ctx.is_distributed:
        return error
    errors: list[str | None] = [None] * ctx.world_size
    comm.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def _barrier(ctx: Any) -> None:
    if ctx.is_distributed:
        comm.barrier()


# --------------------------------------------------------------------------------------------------------- save
def save_checkpoint(tr: Trainer, *, log=None) -> Path:
    """Write the state after ``tr.iteration`` iterations to ``--save``; atomic, all ranks together.

    Raises ``RunAbortedError`` (every rank) if any rank cannot write (disk full, permissions); the previous checkpoint
    and the tracker are untouched. ``SimulatedCrashError`` (fault injection) propagates like a killed process would.
    """
    ctx, root, it = tr.ctx, Path(tr.run.checkpoint.save), tr.iteration
    cf.FAULTS.start_save(it)
    error: str | None = None
    if ctx.rank == 0:
        try:
            cf.prepare_tmp(root, it)
        except OSError as err:
            error = f"rank 0: {err}"
    error = _agree(ctx, error)
    entries: dict[str, dict[str, Any]] = {}
    if error is None:
        tmp = cf.tmp_dir(root, it)
        try:
            if ctx.rank == 0:
                entries[cf.COMMON] = cf.write_tensor_file(tmp / cf.COMMON, common_state(tr, it), rank=ctx.rank)
                entries.update(copy_tokenizer_files(tokenizer_sources(tr.run.data)[1], tmp, rank=ctx.rank))
            if ctx.dp_rank == 0:
                name = cf.model_file(ctx.tp_rank, ctx.pp_rank)
                payload = {"params": model_state(tr.model), "meta": model_split_metadata(tr.model)}
                entries[name] = cf.write_tensor_file(tmp / name, payload, rank=ctx.rank)
            if not tr.run.checkpoint.no_save_optim and (tr.optimizer.sharded or ctx.dp_rank == 0):
                dp_index = ctx.dp_rank if tr.optimizer.sharded else 0
                name = cf.optim_file(ctx.tp_rank, ctx.pp_rank, dp_index)
                entries[name] = cf.write_tensor_file(tmp / name, tr.optimizer.sharded_state_dict(), rank=ctx.rank)
            if not tr.run.checkpoint.no_save_rng:
                name = cf.rng_file(ctx.rank)
                entries[name] = cf.write_tensor_file(tmp / name, rng_state(tr.model), rank=ctx.rank)
        except OSError as err:
            error = f"rank {ctx.rank}: {err.strerror or err}" + (f" ({err.filename})" if err.filename else "")
    error = _agree(ctx, error)
    if error is None:
        if ctx.is_distributed:
            gathered: list[dict[str, Any]] = [{}] * ctx.world_size
            comm.all_gather_object(gathered, entries)
            for part in gathered:
                entries.update(part)
        if ctx.rank == 0:
            try:
                cf.commit(root, it, entries, rank=ctx.rank)
            except OSError as err:
                error = f"rank 0: {err.strerror or err}"
        error = _agree(ctx, error)
    if error is not None:
        if ctx.rank == 0:
            cf.remove_tmp(root, it)
        _barrier(ctx)
        previous = _previous(root)
        raise RunAbortedError(
            f"saving the checkpoint of iteration {it} to {root} failed ({error}); {previous}; "
            "free disk space or point --save elsewhere, then resume with --load"
        )
    _barrier(ctx)
    if log is not None:
        log(f"saved checkpoint at iteration {it:7d} to {root}")
    return cf.iteration_dir(root, it)


def _previous(root: Path) -> str:
    try:
        last = cf.read_tracker(root)
    except ConfigError:
        last = None
    return f"the previous checkpoint (iteration {last}) is intact" if last is not None else "no earlier checkpoint"


# --------------------------------------------------------------------------------------------------------- load
def _check_compatible(tr: Trainer, common: dict[str, Any], directory: Path) -> None:
    lay = common["layout"]
    if (lay["tp"], lay["pp"]) != (tr.ctx.tp_size, tr.ctx.pp_size):
        raise ConfigError(
            f"checkpoint {directory} was written with tp={lay['tp']}, pp={lay['pp']} but this run has "
            f"tp={tr.ctx.tp_size}, pp={tr.ctx.pp_size}; re-partition it with tools/checkpoint_convert.py "
            f"--target-tp {tr.ctx.tp_size} --target-pp {tr.ctx.pp_size}"
        )
    ours_split = _layers_per_stage(tr)
    saved_split = lay.get("layers_per_stage", ours_split)  # older checkpoints: the even split, checked per tensor
    if saved_split != ours_split:
        raise ConfigError(
            f"checkpoint {directory} was written with {saved_split} transformer layers per pipeline stage, this run "
            f"splits them {ours_split}; pass the same --pipeline-layer-split and "
            "--decoder-first/last-pipeline-num-layers"
        )
    saved_model = common["model_args"]  # its padded_vocab_size follows tp, checked above; the config's fields here
    ours = dataclasses.asdict(tr.run.model)
    # a field newer than the checkpoint was written with its default (e.g. qk_layernorm before it existed)
    saved = {k: saved_model.get(k, GPTConfig.default(k)) for k in ours}
    diffs = [f"{k}={saved[k]!r} (run: {v!r})" for k, v in ours.items() if saved[k] != v]
    if diffs:
        raise ConfigError(
            f"checkpoint {directory} is of another model: {', '.join(diffs[:4])}; "
            "use the checkpoint's model flags or load a matching checkpoint"
        )


def checkpoint_layer_split(run: RunConfig) -> RunConfig:
    """``--pipeline-layer-split auto`` with ``--load``: the run takes the layers per stage the checkpoint recorded
    (a re-split at the end of a profiling window may have changed them) and, with ``--recompute-granularity auto``,
    each stage's recompute choice, before any stage is built.  Every rank reads the same file, so all agree without
    a collective."""
    layout = run.pipeline_layout
    if not run.checkpoint.load or layout is None or run.parallel.layer_split != "auto" or layout.split == "explicit":
        return run
    common = cf.read_latest_common(run.checkpoint.load)
    if common is None:
        return run
    saved = common.get("layout", {}).get("layers_per_stage")
    if saved is None or len(saved) != len(layout.layer_ranges) or sum(saved) != run.model.num_layers:
        return run  # another shape: _check_compatible names the problem at load
    if tuple(saved) != layout.layers_per_stage:
        run = dataclasses.replace(run, pipeline_layout=layout.with_split(saved, split="auto"))
    choices = common["layout"].get("recompute_per_stage")
    if run.recompute.auto and choices is not None and len(choices) == len(saved):
        run = dataclasses.replace(run, recompute=run.recompute.planned(run.pipeline_layout.layer_ranges, choices))
    return run


def load_checkpoint(tr: Trainer, *, log=None) -> bool:
    """Restore ``tr`` from ``--load`` (the tracker's iteration). Returns False if the directory holds none yet."""
    ctx, cfg = tr.ctx, tr.run.checkpoint
    root = Path(cfg.load)
    error: str | None = None
    loaded: str | None = None
    try:
        loaded = _load(tr, root, log)
    except ConfigError as err:
        error = str(err)
    error = _agree(ctx, error)
    if error is not None:
        raise ConfigError(error)
    if loaded is None:
        return False
    tr.optimizer.publish()  # model params := main params (all-gathers for the distributed optimizer)
    if log is not None:  # only now: every rank has read and accepted its part
        log(loaded)
    return True


def _load(tr: Trainer, root: Path, log) -> str | None:
    """This rank's part of the load; returns the "loaded checkpoint ..." line (``None``: nothing to load), which
    the caller logs once every rank has agreed that the load succeeded."""
    ctx, cfg = tr.ctx, tr.run.checkpoint
    iteration = cf.read_tracker(root)
    if iteration is None:
        if log is not None:
            log(f"no checkpoint in --load {root} yet; starting from scratch")
        return None
    directory = cf.iteration_dir(root, iteration)
    manifest = cf.read_manifest(directory)
    common = cf.verified_load(directory, cf.COMMON, manifest)
    _check_compatible(tr, common, directory)

    payload = cf.verified_load(directory, cf.model_file(ctx.tp_rank, ctx.pp_rank), manifest)
    local = {_global_name(tr.model, n): n for n in tr.model.state_dict()}
    params = payload["params"]
    missing = sorted(set(local) - set(params))
    unexpected = sorted(set(params) - set(local))
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint {directory} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    state = {}
    for gname, lname in local.items():
        expected = tr.model.state_dict()[lname].shape
        if params[gname].shape != expected:
            raise ConfigError(
                f"checkpoint {directory}: {gname} has shape {tuple(params[gname].shape)}, the model "
                f"{tuple(expected)}; it was written for another model or layout"
            )
        state[lname] = params[gname]
    tr.model.load_state_dict(state, strict=True)

    finetune = cfg.finetune
    load_optim = not (cfg.no_load_optim or finetune) and common.get("has_optimizer", True)
    if not (cfg.no_load_optim or finetune) and not load_optim and log is not None:
        log(f"checkpoint {directory} has no optimizer state (--no-save-optim or converted); the optimizer starts fresh")
    if load_optim:
        prefix = f"optim_tp{ctx.tp_rank:02d}_pp{ctx.pp_rank:03d}_"
        names = sorted(n for n in manifest if n.startswith(prefix))
        if not names:
            raise ConfigError(f"checkpoint {directory} has no optimizer state; resume with --no-load-optim")
        states = [cf.verified_load(directory, n, manifest) for n in names]
        try:
            tr.optimizer.load_sharded_state_dicts(states)
        except (ValueError, KeyError) as err:
            raise ConfigError(f"checkpoint {directory}: optimizer state does not fit: {err}") from None
        tr.scheduler.load_state_dict(common["scheduler"])
        tr.optimizer.scaler.load_state_dict(common["loss_scaler"])
    else:
        tr.optimizer.reset_main_from_model()

    load_rng = not (cfg.no_load_rng or finetune)
    if load_rng and common.get("has_rng", True):
        if common["layout"]["world_size"] != ctx.world_size:
            raise ConfigError(
                f"checkpoint {directory} holds RNG states of {common['layout']['world_size']} ranks, this run has "
                f"{ctx.world_size}; pass --no-load-rng to keep this run's seeded streams"
            )
        set_rng_state(cf.verified_load(directory, cf.rng_file(ctx.rank), manifest), tr.model)
    elif load_rng and log is not None:
        log(f"checkpoint {directory} has no RNG states (converted); using this run's seeded streams")

    if not finetune:
        tr.iteration = int(common["iteration"])
        tr.consumed_valid_samples = int(common["consumed_valid_samples"])
        tr.skipped_iterations = int(common["skipped_iterations"])
        tr.nan_iterations = int(common["nan_iterations"])
        if not load_optim:  # the LR schedule continues from the run's position (in its unit)
            tr.scheduler.num_steps = tr.consumed_train_samples if tr.run.lr_schedule.sample_based else tr.iteration
    what = "model only (--finetune)" if finetune else f"iteration {iteration}"
    return f"loaded checkpoint {directory} ({what})"
