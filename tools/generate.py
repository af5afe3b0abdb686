"""Generate text from a checkpoint (any tp x pp layout, merged on load), on CPU or GPU, with a KV cache.

    python tools/generate.py --load ckpt --prompt "def main(" --max-new-tokens 32 --temperature 0.8 --top-p 0.9
    python tools/generate.py --load ckpt --prompt "Hello" --temperature 0 --json   # greedy; one JSON object

The tokenizer is the one the checkpoint records (``megatron.tokenizer.recorded``).  ``--json`` prints
``{"prompt_ids": [...], "generated_ids": [...], "text": "..."}`` (``text``: the generated part).  Bad input (no
checkpoint, a checkpoint without tokenizer files, a prompt too long) prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from megatron.config.errors import ConfigError
from megatron.generation import SamplingConfig, generate, load_for_generation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="checkpoint directory (as given to --save)")
    parser.add_argument("--iteration", type=int, default=None, help="iteration to load (default: the tracker's)")
    parser.add_argument("--prompt", required=True, help="text to continue")
    d = SamplingConfig()  # the defaults
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=d.max_new_tokens,
        help=f"tokens to generate at most (default {d.max_new_tokens})",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=d.temperature,
        help=f"softmax temperature; 0: greedy (default {d.temperature:g})",
    )
    parser.add_argument("--top-k", type=int, default=d.top_k, help="sample among the k most likely tokens (0: off)")
    parser.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling mass (1: off)")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"sampling seed (default {d.seed})")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    parser.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    args = parser.parse_args(argv)
    try:
        config = SamplingConfig(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model, tokenizer = load_for_generation(args.load, iteration=args.iteration, device=device)
        try:
            prompt_ids = tokenizer.tokenize(args.prompt)
        except ValueError as err:
            raise ConfigError(f"--prompt cannot be tokenized: {str(err).splitlines()[0]}") from None
        cache = not args.no_kv_cache
        ids = generate(model, prompt_ids, config, eod=tokenizer.eod, vocab_size=tokenizer.vocab_size, use_cache=cache)
        text = tokenizer.detokenize(ids)
    except ConfigError as err:
        print(f"generate.py: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"prompt_ids": prompt_ids, "generated_ids": ids, "text": text}, ensure_ascii=False))
    else:
        print(args.prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
