"""Re-partition a checkpoint to another tensor/pipeline/data-parallel layout, export it, or import a HF model.

    python tools/checkpoint_convert.py --load ckpt --save ckpt_tp1 --target-tp 1 [--target-pp 1] [--target-dp 1]
    python tools/checkpoint_convert.py --load ckpt --export model.safetensors      # or model.pt
    python tools/checkpoint_convert.py --load ckpt --export-hf hf_dir              # transformers loads hf_dir
    python tools/checkpoint_convert.py --import-hf hf_dir --save ckpt [--target-tp 2 --target-pp 2]

Model weights *and* optimizer state (fp32 main parameters, Adam moments, step) are merged to full tensors (tensor-
parallel shards joined along their split dimension, vocabulary padding dropped), then split for the target layout
(vocabulary re-padded to a multiple of ``--make-vocab-size-divisible-by x tp``, shards cut, layers assigned to
pipeline stages evenly). Optimizer pieces are written as ``--target-dp`` shards; the trainer re-tiles pieces on load,
so the result resumes with the plain or the distributed optimizer at any data-parallel size. RNG states are not
carried over (they belong to ranks of the old layout); the resumed run keeps its seeded streams.

``--export-hf`` and ``--import-hf`` convert to and from Hugging Face model directories (GPT-2 and Llama layouts;
``megatron.hf``); an imported model starts at iteration 0 without optimizer state.

The output is written like any checkpoint: a temporary directory, a verified manifest, a rename, the tracker.
Bad input (missing checkpoint, impossible layout) prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megatron.checkpoint_repartition import convert, open_checkpoint, read_full_state
from megatron.config.errors import ConfigError
from megatron.model.config import model_flags

__all__ = ["convert", "export_single_file", "main"]


def export_single_file(load: str | Path, path: str | Path, *, iteration: int | None = None) -> dict[str, torch.Tensor]:
    """Write the full (unsharded, vocabulary unpadded) weights as one ``.safetensors`` or ``.pt`` state dict."""
    directory, manifest, common = open_checkpoint(load, iteration)
    full, _, _, _ = read_full_state(directory, manifest, common, optimizer=False)
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
    parser.add_argument("--load", default=None, help="checkpoint directory (as given to --save)")
    parser.add_argument("--iteration", type=int, default=None, help="iteration to convert (default: the tracker's)")
    parser.add_argument("--save", default=None, help="output checkpoint directory")
    parser.add_argument("--target-tp", type=int, default=None, help="tensor-parallel size of the output")
    parser.add_argument("--target-pp", type=int, default=None, help="pipeline-parallel size of the output")
    parser.add_argument("--target-dp", type=int, default=1, help="optimizer shards (distributed optimizer dp size)")
    parser.add_argument("--export", default=None, help="write one plain state dict (.safetensors or .pt) instead")
    parser.add_argument("--export-hf", default=None, metavar="DIR", help="write a Hugging Face model directory")
    parser.add_argument("--import-hf", default=None, metavar="DIR", help="make a checkpoint (--save) from a HF model")
    parser.add_argument("--seq-length", type=int, default=None, help="--import-hf: training sequence length "
                        "recorded in the checkpoint (default: the model's max positions)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        if args.import_hf:
            return _import_hf(args)
        if args.load is None:
            raise ConfigError("--load CKPT is required (or pass --import-hf DIR --save CKPT)")
        if args.export_hf:
            from megatron.hf import export_hf

            tensors = export_hf(args.load, args.export_hf, iteration=args.iteration)
            print(f"exported {len(tensors)} tensors to {args.export_hf} (config.json, model.safetensors)")
            return 0
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


def _import_hf(args: argparse.Namespace) -> int:
    from megatron.hf import import_hf

    if args.save is None:
        raise ConfigError("--import-hf needs --save DIR, the checkpoint directory to write")
    tp, pp = args.target_tp or 1, args.target_pp or 1
    for flag, value in (("--target-tp", tp), ("--target-pp", pp), ("--seq-length", args.seq_length or 1)):
        if value < 1:
            raise ConfigError(f"{flag}={value} must be >= 1")
    out, config = import_hf(args.import_hf, args.save, tp=tp, pp=pp, seq_length=args.seq_length)
    print(f"wrote {out} (tp={tp}, pp={pp}); train from it with --load {args.save} and the model flags:")
    print(" ".join(model_flags(config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
