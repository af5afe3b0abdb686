"""Named GPT sizes (``--model-config gpt-125m``) and YAML model configs (``--model-config my_model.yaml``).

A model config is a mapping from Megatron model-flag names (``num_layers`` or ``num-layers``) to values. Precedence,
lowest first: the flag defaults, the named size or YAML file, then flags given on the command line. A YAML file may
start from a named size or from another YAML file with ``base:``::

    # my_model.yaml
    base: gpt-350m
    num_layers: 12
    swiglu: true
    normalization: RMSNorm

Users add a model without touching code: write such a file and pass its path to ``--model-config``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from megatron.config.errors import ConfigError


def _gpt(layers: int, hidden: int, heads: int, seq: int = 2048) -> dict[str, Any]:
    return {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "seq_length": seq,
    }


# GPT-3 family shapes (Brown et al. 2020, table 2.1; heads chosen so hidden % heads == 0), plus two tiny CPU sizes.
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "gpt-tiny": _gpt(2, 64, 4, seq=128),
    "gpt-mini": _gpt(4, 128, 4, seq=128),
    "gpt-125m": _gpt(12, 768, 12),
    "gpt-350m": _gpt(24, 1024, 16),
    "gpt-760m": _gpt(24, 1536, 16),
    "gpt-1.3b": _gpt(24, 2048, 16),
    "gpt-2.7b": _gpt(32, 2560, 32),
    "gpt-6.7b": _gpt(32, 4096, 32),
    "gpt-13b": _gpt(40, 5120, 40),
}


def available_sizes() -> tuple[str, ...]:
    return tuple(MODEL_SIZES)


def _normalise_keys(raw: dict[str, Any], source: str, allowed: frozenset[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        dest = str(key).strip().lstrip("-").replace("-", "_")
        if dest == "base":
            continue
        if dest not in allowed:
            raise ConfigError(f"{source}: unknown model setting {key!r}; allowed: {', '.join(sorted(allowed))}, base")
        out[dest] = value
    return out


def load_model_config(name_or_path: str, *, allowed: frozenset[str], _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """Resolve a named size or a YAML file (following ``base:`` chains) to a dict of model-flag values; ``allowed``
    are the flag destinations a file may set (the model flags of ``megatron.flag_table``)."""
    if name_or_path in MODEL_SIZES:
        return dict(MODEL_SIZES[name_or_path])
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(
            f"--model-config {name_or_path!r} is neither a named size ({', '.join(MODEL_SIZES)}) nor a YAML file"
        )
    key = str(path.resolve())
    if key in _seen:
        raise ConfigError(f"--model-config {name_or_path}: 'base:' chain loops back to {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"--model-config {name_or_path}: not valid YAML ({first}); fix the file") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"--model-config {name_or_path}: expected a mapping of model settings, got {type(raw).__name__}"
        )
    values: dict[str, Any] = {}
    base = raw.get("base")
    if base is not None:
        base_str = str(base)
        if base_str not in MODEL_SIZES and not Path(base_str).is_absolute():
            candidate = path.parent / base_str
            if candidate.is_file():
                base_str = str(candidate)
        values.update(load_model_config(base_str, allowed=allowed, _seen=(*_seen, key)))
    values.update(_normalise_keys(raw, f"--model-config {name_or_path}", allowed))
    return values
