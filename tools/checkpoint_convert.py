"""Re-partition a checkpoint to another tensor/pipeline/data-parallel layout, or export one plain state dict.

    python tools/checkpoint_convert.py --load ckpt --save ckpt_tp1 --target-tp 1 [--target-pp 1] [--target-dp 1]
    python tools/checkpoint_convert.py --load ckpt --export model.safetensors      # or model.pt

Model weights *and* optimizer state (fp32 main parameters, Adam moments, step) are merged to full tensors (tensor-
parallel shards joined along their split dimension, vocabulary padding dropped), then split for the target layout
(vocabulary re-padded to a multiple of ``--make-vocab-size-divisible-by x tp``, shards cut, layers assigned to
pipeline stages evenly). Optimizer pieces are written as ``--target-dp`` shards; the trainer re-tiles pieces on load,
so the result resumes with the plain or the distributed optimizer at any data-parallel size. RNG states are not
carried over (they belong to ranks of the old layout); the resumed run keeps its seeded streams.

The output is written like any checkpoint: a temporary directory, a verified manifest, a rename, the tracker.
Bad input (missing checkpoint, impossible layout) prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import torch

from megatron import checkpoint_files as cf
from megatron.config.errors import ConfigError
from megatron.model.config import padded_vocab_size
from megatron.model.gpt import WORD_EMBEDDING, stage_layer_ranges
from megatron.optimizer.main_params import assemble_pieces
from megatron.parallel.tensor_parallel.partitioning import merge_shards, shard_tensor

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
    directory: Path, manifest: dict[str, Any], common: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], dict[str, dict[str, torch.Tensor]] | None, int]:
    """Full model tensors, their split metadata, full optimizer tensors per name (or None) and the optimizer step."""
    lay, vocab = common["layout"], int(common["model_args"]["vocab_size"])
    params: dict[str, list[torch.Tensor]] = {}
    optim: dict[str, dict[str, list[torch.Tensor]]] = {}
    meta: dict[str, dict[str, Any]] = {}
    steps: set[int] = set()
    has_optim = True
    for p in range(lay["pp"]):
        stage_params: dict[str, list[torch.Tensor]] = {}
        stage_optim: dict[str, dict[str, list[torch.Tensor]]] = {}
        for t in range(lay["tp"]):
            payload = cf.verified_load(directory, cf.model_file(t, p), manifest)
            for name, tensor in payload["params"].items():
                stage_params.setdefault(name, []).append(tensor)
                meta.setdefault(name, payload["meta"][name])
            prefix = f"optim_tp{t:02d}_pp{p:03d}_"
            files = sorted(n for n in manifest if n.startswith(prefix))
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


def convert(load: str | Path, save: str | Path, *, tp: int, pp: int, dp: int, iteration: int | None = None) -> Path:
    """Write the checkpoint at ``load`` re-partitioned for tp x pp (optimizer in ``dp`` shards) under ``save``."""
    directory, manifest, common = open_checkpoint(load, iteration)
    args = dict(common["model_args"])
    heads, groups, layers = args["num_attention_heads"], args["num_query_groups"], args["num_layers"]
    for what, n in (
        ("--num-attention-heads", heads),
        ("--num-query-groups", groups),
        ("--ffn-hidden-size", args["ffn_hidden_size"]),
    ):
        if n % tp:
            raise ConfigError(f"{what}={n} of the checkpoint is not divisible by --target-tp {tp}; pick a divisor")
    if layers % pp:
        raise ConfigError(f"--num-layers={layers} of the checkpoint does not split over --target-pp {pp} stages")
    full, meta, full_optim, step = read_full_state(directory, manifest, common)
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
    for p in range(pp):
        names = stage_names(sorted(full), stage=p, pp=pp, num_layers=layers, tied=tied)
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


def export_single_file(load: str | Path, path: str | Path, *, iteration: int | None = None) -> dict[str, torch.Tensor]:
    """Write the full (unsharded, vocabulary unpadded) weights as one ``.safetensors`` or ``.pt`` state dict."""
    directory, manifest, common = open_checkpoint(load, iteration)
    full, _, _, _ = read_full_state(directory, manifest, common)
    full = {n: t.contiguous() for n, t in sorted(full.items())}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(full, str(path), metadata={"iteration": str(common["iteration"])})
    else:
        torch.save(full, path)
    return full


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="checkpoint directory (as given to --save)")
    parser.add_argument("--iteration", type=int, default=None, help="iteration to convert (default: the tracker's)")
    parser.add_argument("--save", default=None, help="output checkpoint directory")
    parser.add_argument("--target-tp", type=int, default=None, help="tensor-parallel size of the output")
    parser.add_argument("--target-pp", type=int, default=None, help="pipeline-parallel size of the output")
    parser.add_argument("--target-dp", type=int, default=1, help="optimizer shards (distributed optimizer dp size)")
    parser.add_argument("--export", default=None, help="write one plain state dict (.safetensors or .pt) instead")
    args = parser.parse_args(argv)
    try:
        if args.export:
            full = export_single_file(args.load, args.export, iteration=args.iteration)
            print(f"exported {len(full)} tensors to {args.export}")
            return 0
        if args.save is None:
            raise ConfigError("--save DIR is required to re-partition (or pass --export FILE)")
        _, _, common = open_checkpoint(args.load, args.iteration)
        tp = args.target_tp or common["layout"]["tp"]
        pp = args.target_pp or common["layout"]["pp"]
        for flag, value in (("--target-tp", tp), ("--target-pp", pp), ("--target-dp", args.target_dp)):
            if value < 1:
                raise ConfigError(f"{flag}={value} must be >= 1")
        out = convert(args.load, args.save, tp=tp, pp=pp, dp=args.target_dp, iteration=args.iteration)
        print(f"wrote {out} (tp={tp}, pp={pp}, optimizer in {args.target_dp} shards)")
        return 0
    except ConfigError as err:
        print(f"checkpoint_convert.py: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
