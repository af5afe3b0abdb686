"""Flags that another flag overrides: never silently ignored.

Some flags only mean something without another one (``--split`` is not used by ``--mock-data``), or another flag
takes their place (``--distributed-timeout-seconds`` over ``--distributed-timeout-minutes``).  A flag set to a value
other than its default (on the command line or by ``--model-config``) that the run would not use gets one warning
line on rank 0, printed with the ignored-flag warnings before training starts.  Where the two flags contradict, so
that either could be the one meant (``--data-path`` with ``--mock-data``), it is a ``ConfigError`` instead (one line,
exit 2).  ``override_warnings`` holds every pair; docs/training.md ("Flags that override others") lists them.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from megatron.config.errors import ConfigError

__all__ = ["override_warnings"]

_MOCK_IGNORES = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "split")
_DYNAMIC_SCALER = ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")
_ADAM = ("adam_beta1", "adam_beta2", "adam_eps")
_LOAD_OPTIONS = ("no_load_optim", "no_load_rng", "finetune")


@lru_cache(maxsize=1)
def _defaults() -> dict[str, Any]:
    from megatron.flag_table import build_parser  # the flag table is the one home of the defaults

    return dict(build_parser()[1].defaults)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def override_warnings(v: dict[str, Any], *, tp_size: int) -> tuple[str, ...]:
    """The warning lines for flags in ``v`` (resolved flag values) that other flags override, in flag order;
    raises ``ConfigError`` for the pairs that contradict (see the module docstring)."""
    defaults = _defaults()

    def given(dest: str) -> bool:
        return dest in v and v[dest] != defaults.get(dest)

    def shown(dest: str) -> str:
        value = v[dest]
        if isinstance(value, bool):
            return _flag(dest)
        if isinstance(value, (list, tuple)):
            value = " ".join(str(x) for x in value)
        elif isinstance(value, float):
            value = f"{value:g}"
        return f"{_flag(dest)} {value}"

    lines: list[str] = []

    def ignored(dests: tuple[str, ...], because: str) -> None:
        lines.extend(f"warning: {shown(d)} is ignored: {because}" for d in dests if given(d))

    if v.get("mock_data"):
        if v.get("data_path"):
            raise ConfigError(
                f"--mock-data and {shown('data_path')} contradict: --mock-data trains on synthetic tokens and would "
                "never read the dataset; drop one of them"
            )
        # NullTokenizer is not ignored: its end-of-document id joins the mock vocabulary (megatron.tokenizer.build)
        null = v.get("tokenizer_type") == "NullTokenizer"
        ignores = tuple(d for d in _MOCK_IGNORES if not (null and d == "tokenizer_type"))
        ignored(ignores, "--mock-data draws synthetic token ids (below --vocab-size) and reads no dataset")
    if v.get("distributed_timeout_seconds") is not None:
        ignored(("distributed_timeout_minutes",), f"--distributed-timeout-seconds {v['distributed_timeout_seconds']:g} "
                "sets the timeout")  # fmt: skip
    if not v.get("group_query_attention"):
        ignored(("num_query_groups",), "it needs --group-query-attention (without it every head has its own keys)")
    if tp_size == 1:
        ignored(("sequence_parallel",), "tensor-parallel size 1 has no sequence to split (turned off, as Megatron)")
    if not v.get("fp16"):
        ignored(("loss_scale", *_DYNAMIC_SCALER), "only --fp16 scales the loss (bf16 and fp32 need no scaling)")
    elif v.get("loss_scale") is not None:
        ignored(_DYNAMIC_SCALER, f"--loss-scale {v['loss_scale']:g} fixes the scale (these tune the dynamic one)")
    if v.get("optimizer") == "sgd":
        ignored(_ADAM, "--optimizer sgd has no Adam moments")
    elif v.get("optimizer") == "adam":
        ignored(("sgd_momentum",), "it applies to --optimizer sgd, not adam")
    if not v.get("load"):
        ignored(_LOAD_OPTIONS, "there is no --load to restore from")
    if v.get("eval_iters") == 0:
        ignored(("eval_interval",), "--eval-iters 0 turns validation off")
    return tuple(lines)
