"""``--use-checkpoint-args``: the model flags come from the ``--load`` checkpoint (Megatron's meaning).

Read while the flags are parsed, before the model is built: the checkpoint's ``common.pt`` holds the model config it
was written with (``model_args``); every model field found there replaces the command line's value, so a resume
(or a fine-tuning run) needs only ``--load``.  Without a checkpoint in the directory yet, the flags stand (one
warning line).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron import checkpoint_files as cf
from megatron.model.config import GPTConfig


def checkpoint_model_args(load: str) -> dict[str, Any] | None:
    """The model flags' values saved in the latest checkpoint under ``load`` (``None`` when it holds none yet): its
    ``GPTConfig`` fields, and for a NullTokenizer run that tokenizer with its ``--vocab-size``."""
    common = cf.read_latest_common(load)
    if common is None:
        return None
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    saved = {k: v for k, v in common["model_args"].items() if k in names}
    tokenizer = common.get("tokenizer") or {}
    if tokenizer.get("tokenizer_type") == "NullTokenizer":  # its --vocab-size N; the model's N + 1 follows from it
        saved["tokenizer_type"] = "NullTokenizer"
        saved["vocab_size"] = int(tokenizer["vocab_size"])
    return saved


def apply_checkpoint_args(values: dict[str, Any], load: str) -> list[str]:
    """Overwrite the model flag values in ``values`` (argparse dest names) with the checkpoint's; returns warnings."""
    saved = checkpoint_model_args(load)
    if saved is None:
        return [f"warning: --use-checkpoint-args: no checkpoint in --load {load} yet; using the command line's model"]
    for name, value in saved.items():
        values[name] = value
    heads, groups = saved.get("num_attention_heads"), saved.get("num_query_groups")
    values["group_query_attention"] = groups is not None and groups != heads
    values["num_query_groups"] = groups if values["group_query_attention"] else 1
    return []
