"""Merge a checkpoint's shards into full tensors and write full tensors as a checkpoint of any tp x pp layout.

Used by ``tools/checkpoint_convert.py`` (re-partitioning, export), the Hugging Face import/export (``megatron.hf``)
and text generation (``megatron.generation``), which all see a model as one state dict of full tensors keyed by
global parameter name, with the vocabulary padding removed.

Merging joins tensor-parallel shards along their split dimension (with their partition stride) and keeps one copy
of the tied output table; splitting re-pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x tp``,
cuts the shards and assigns layers to pipeline stages evenly.  The optimizer's pieces are merged and split the same
way.  The output is written like any checkpoint: a temporary directory, a verified manifest, a rename, the tracker;
the tokenizer files travel with it.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch

from megatron import checkpoint_files as cf
from megatron.checkpointing import model_split_metadata
from megatron.config.errors import ConfigError
from megatron.model.config import GPTConfig, padded_vocab_size
from megatron.model.gpt import WORD_EMBEDDING, build_gpt_model, stage_layer_ranges
from megatron.optimizer.main_params import assemble_pieces
from megatron.parallel.tensor_parallel.partitioning import merge_shards, shard_tensor
from megatron.tokenizer.recorded import copy_tokenizer_files, recorded_files

_LAYER = re.compile(r"^layers\.(\d+)\.")


# ------------------------------------------------------------------------------------------------------- reading
def open_checkpoint(root: str | Path, iteration: int | None = None) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """(directory, manifest, common state) of the tracker's (or the given) iteration."""
    it = cf.read_tracker(root) if iteration is None else iteration
    if it is None:
        raise ConfigError(f"--load {root} holds no checkpoint; pass a directory written with --save")
    directory = cf.iteration_dir(root, it)
    if not directory.is_dir():
        raise ConfigError(f"{directory} does not exist; pick an iteration that was saved")
    manifest = cf.read_manifest(directory)
    return directory, manifest, cf.verified_load(directory, cf.COMMON, manifest)


def _merge(parts: list[torch.Tensor], meta: dict[str, Any], vocab_size: int) -> torch.Tensor:
    full = merge_shards(parts, dim=meta["dim"], stride=meta["stride"]) if meta["tp"] and len(parts) > 1 else parts[0]
    return full[:vocab_size].clone() if meta["vocab"] else full


def read_full_state(
    directory: Path, manifest: dict[str, Any], common: dict[str, Any], *, optimizer: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], dict[str, dict[str, torch.Tensor]] | None, int]:
    """Full model tensors, their split metadata, full optimizer tensors per name (or None) and the optimizer step;
    ``optimizer=False`` reads the model only."""
    lay, vocab = common["layout"], int(common["model_args"]["vocab_size"])
    params: dict[str, list[torch.Tensor]] = {}
    optim: dict[str, dict[str, list[torch.Tensor]]] = {}
    meta: dict[str, dict[str, Any]] = {}
    steps: set[int] = set()
    has_optim = optimizer
    for p in range(lay["pp"]):
        stage_params: dict[str, list[torch.Tensor]] = {}
        stage_optim: dict[str, dict[str, list[torch.Tensor]]] = {}
        for t in range(lay["tp"]):
            payload = cf.verified_load(directory, cf.model_file(t, p), manifest)
            for name, tensor in payload["params"].items():
                stage_params.setdefault(name, []).append(tensor)
                meta.setdefault(name, payload["meta"][name])
            prefix = f"optim_tp{t:02d}_pp{p:03d}_"
            files = sorted(n for n in manifest if n.startswith(prefix)) if has_optim else []
            if not files:
                has_optim = False
                continue
            states = [cf.verified_load(directory, n, manifest) for n in files]
            steps.update(int(s["step"]) for s in states)
            for name, entry in assemble_pieces([s["pieces"] for s in states]).items():
                shape = entry["shape"]
                keys = [k for k in entry if k != "shape"]  # main and the update rule's state (Adam, SGD)
                slot = stage_optim.setdefault(name, {k: [] for k in keys})
                for k in keys:
                    slot[k].append(entry[k].view(shape))
        for name, parts in stage_params.items():
            params.setdefault(name, parts)  # the tied output copy on the last stage repeats the embedding
        for name, slot in stage_optim.items():
            optim.setdefault(name, slot)
    if len(steps) > 1:
        raise ConfigError(f"checkpoint {directory}: optimizer files disagree on the step count {sorted(steps)}")
    full = {n: _merge(parts, meta[n], vocab) for n, parts in params.items()}
    full_optim = None
    if has_optim and optim:
        full_optim = {n: {k: _merge(v, meta[n], vocab) for k, v in slot.items()} for n, slot in optim.items()}
    return full, meta, full_optim, (steps.pop() if steps else 0)


def read_full_model(root: str | Path, iteration: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(full model tensors, common state) of a checkpoint: the weights only, merged from any tp x pp layout."""
    directory, manifest, common = open_checkpoint(root, iteration)
    full, _, _, _ = read_full_state(directory, manifest, common, optimizer=False)
    return full, common


# ------------------------------------------------------------------------------------------------------ splitting
def stage_names(names: list[str], *, stage: int, pp: int, num_layers: int, tied: bool) -> list[str]:
    """The global parameter names held by pipeline stage ``stage`` of ``pp`` (even layer split)."""
    ranges = stage_layer_ranges(num_layers, pp)
    out = []
    for name in names:
        m = _LAYER.match(name)
        if m:
            keep = int(m.group(1)) in ranges[stage]
        elif name.startswith("embedding."):
            keep = stage == 0 or (tied and name == WORD_EMBEDDING and stage == pp - 1)
        else:  # final norm, untied output layer
            keep = stage == pp - 1
        if keep:
            out.append(name)
    return out


def _split(full: torch.Tensor, meta: dict[str, Any], *, tp_rank: int, tp: int, padded_vocab: int) -> torch.Tensor:
    if meta["vocab"] and full.shape[0] < padded_vocab:
        pad = torch.zeros((padded_vocab - full.shape[0], *full.shape[1:]), dtype=full.dtype)
        full = torch.cat([full, pad])
    if meta["tp"] and tp > 1:
        return shard_tensor(full, dim=meta["dim"], tp_rank=tp_rank, tp_size=tp, stride=meta["stride"])
    return full.clone().contiguous()


def check_layout(args: dict[str, Any], *, tp: int, pp: int) -> None:
    """``ConfigError`` unless a model with config ``args`` splits over tp x pp."""
    for what, n in (
        ("--num-attention-heads", args["num_attention_heads"]),
        ("--num-query-groups", args["num_query_groups"]),
        ("--ffn-hidden-size", args["ffn_hidden_size"]),
    ):
        if n % tp:
            raise ConfigError(f"{what}={n} of the checkpoint is not divisible by --target-tp {tp}; pick a divisor")
    if args["num_layers"] % pp:
        layers = args["num_layers"]
        raise ConfigError(f"--num-layers={layers} of the checkpoint does not split over --target-pp {pp} stages")


def write_checkpoint(
    save: str | Path,
    common: dict[str, Any],
    full: dict[str, torch.Tensor],
    meta: dict[str, dict[str, Any]],
    *,
    tp: int,
    pp: int,
    dp: int = 1,
    full_optim: dict[str, dict[str, torch.Tensor]] | None = None,
    step: int = 0,
    tokenizer_files: dict[str, Path] | None = None,
) -> Path:
    """Write full tensors (vocabulary unpadded) as a tp x pp checkpoint of iteration ``common["iteration"]`` under
    ``save`` (optimizer, if given, in ``dp`` shards); ``tokenizer_files``: file name -> source, copied along."""
    args = dict(common["model_args"])
    check_layout(args, tp=tp, pp=pp)
    padded = padded_vocab_size(
        int(args["vocab_size"]), divisible_by=int(args["make_vocab_size_divisible_by"]), tensor_parallel_size=tp
    )
    args["padded_vocab_size"] = padded
    tied = not args["untie_embeddings_and_output_weights"]
    out_root = Path(save)
    cf.check_writable(out_root)
    it = int(common["iteration"])
    cf.FAULTS.start_save(it)
    tmp = cf.prepare_tmp(out_root, it)
    entries: dict[str, dict[str, Any]] = {}
    new_common = dict(common)
    new_common["model_args"] = args
    new_common["layout"] = dict(common["layout"], tp=tp, pp=pp, dp=dp, world_size=tp * pp * dp)
    # The target is split evenly (stage_names); the source's split no longer holds: loading checks every tensor.
    new_common["layout"].pop("layers_per_stage", None)
    new_common["has_rng"] = False
    new_common["has_optimizer"] = full_optim is not None
    entries[cf.COMMON] = cf.write_tensor_file(tmp / cf.COMMON, new_common)
    entries.update(copy_tokenizer_files(tokenizer_files or {}, tmp))
    for p in range(pp):
        names = stage_names(sorted(full), stage=p, pp=pp, num_layers=args["num_layers"], tied=tied)
        for t in range(tp):
            split = {n: _split(full[n], meta[n], tp_rank=t, tp=tp, padded_vocab=padded) for n in names}
            name = cf.model_file(t, p)
            entries[name] = cf.write_tensor_file(tmp / name, {"params": split, "meta": {n: meta[n] for n in names}})
            if full_optim is None:
                continue
            shards: list[dict[str, Any]] = [{} for _ in range(dp)]
            for n in names:
                flat = {k: _split(v, meta[n], tp_rank=t, tp=tp, padded_vocab=padded) for k, v in full_optim[n].items()}
                shape = list(flat["main"].shape)
                numel = flat["main"].numel()
                per = -(-numel // dp)
                for d in range(dp):
                    lo, hi = min(d * per, numel), min((d + 1) * per, numel)
                    if lo < hi:
                        piece = {"lo": lo, "hi": hi, "numel": numel, "shape": shape}
                        piece.update({k: v.reshape(-1)[lo:hi].float().clone() for k, v in flat.items()})
                        shards[d][n] = piece
            for d in range(dp):
                name = cf.optim_file(t, p, d)
                entries[name] = cf.write_tensor_file(tmp / name, {"step": step, "pieces": shards[d]})
    return cf.commit(out_root, it, entries)


def convert(load: str | Path, save: str | Path, *, tp: int, pp: int, dp: int, iteration: int | None = None) -> Path:
    """Write the checkpoint at ``load`` re-partitioned for tp x pp (optimizer in ``dp`` shards) under ``save``."""
    directory, manifest, common = open_checkpoint(load, iteration)
    check_layout(common["model_args"], tp=tp, pp=pp)
    full, meta, full_optim, step = read_full_state(directory, manifest, common)
    tokenizer = recorded_files(directory, common, manifest)
    return write_checkpoint(
        save, common, full, meta, tp=tp, pp=pp, dp=dp, full_optim=full_optim, step=step, tokenizer_files=tokenizer
    )


# -------------------------------------------------------------------------------------------- a model, no run yet
_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_model_state(config: GPTConfig, full: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """``ConfigError`` unless ``full`` (global names, vocabulary unpadded) holds exactly the tensors of ``config``'s
    model with their shapes; returns how each is split over tensor-parallel ranks.  Both facts are read off the
    model itself, built on the meta device (no memory, no initialisation cost)."""
    with torch.device("meta"):
        model = build_gpt_model(config)
    meta = model_split_metadata(model)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    for name, m in meta.items():
        if m["vocab"]:
            expected[name] = (config.vocab_size, *expected[name][1:])
    missing, unexpected = sorted(set(expected) - set(full)), sorted(set(full) - set(expected))
    if missing or unexpected:
        raise ConfigError(f"the weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, shape in expected.items():
        if tuple(full[name].shape) != shape:
            raise ConfigError(f"{name} has shape {tuple(full[name].shape)}, the model config needs {shape}")
    return meta


def write_model_checkpoint(
    save: str | Path,
    config: GPTConfig,
    full: dict[str, torch.Tensor],
    *,
    tp: int = 1,
    pp: int = 1,
    tokenizer: dict[str, Any] | None = None,
    tokenizer_files: dict[str, Path] | None = None,
    source: str | None = None,
) -> Path:
    """Write model weights (full tensors, vocabulary unpadded) as a tp x pp checkpoint of iteration 0 without
    optimizer or RNG state, for a run to start from (an imported model); ``tokenizer``: its record
    (``megatron.tokenizer.recorded``), ``tokenizer_files`` the files it names."""
    dtype = full[WORD_EMBEDDING].dtype
    common = {
        "format": cf.FORMAT_VERSION,
        "iteration": 0,
        "consumed_train_samples": 0,
        "consumed_valid_samples": 0,
        "skipped_iterations": 0,
        "nan_iterations": 0,
        "scheduler": None,
        "loss_scaler": None,
        "model_args": dataclasses.asdict(config),
        "layout": {
            "tp": tp,
            "pp": pp,
            "dp": 1,
            "world_size": tp * pp,
            "use_distributed_optimizer": False,
            "precision": _PRECISION.get(dtype, "fp32"),
        },
        "tokenizer": tokenizer,
        "source": source,
    }
    meta = check_model_state(config, full)
    return write_checkpoint(save, common, full, meta, tp=tp, pp=pp, tokenizer_files=tokenizer_files)
