"""Export a checkpoint as a Hugging Face model directory, and import one as a checkpoint.

Export writes ``config.json``, ``model.safetensors`` (the real vocabulary rows only: the padding is dropped) and
the tokenizer files the checkpoint records, with a ``tokenizer_config.json`` naming the Hugging Face tokenizer
class where there is one.  The layout follows the model: learned absolute positions -> GPT-2, rotary -> Llama
(``megatron.hf.gpt2_layout``, ``megatron.hf.llama_layout``).

Export also keeps the training settings neither layout has (sequence length, vocabulary padding multiple, hidden
dropout, fp32 residual stream) under a ``zb_megatron`` key of ``config.json``, which import reads back.

What is exported is checked field by field (``unexpressed``): every ``GPTConfig`` field that the chosen layout does
not map (its ``MAPPED_FIELDS``) and that is not a training setting must hold its default, so a model feature added
to ``GPTConfig`` later is refused until a layout learns it, never exported silently wrong.  ``--apply-layernorm-1p``
is expressed by folding: the norms' stored ``gamma - 1`` become ``gamma`` (in the stored dtype, the sum the forward
computes), so the exported model is a plain-norm one, and importing it gives a model without the flag whose logits
are the same.

Import reads ``config.json`` (``model_type`` "gpt2" or "llama") and ``model.safetensors`` (or a sharded
``model.safetensors.index.json``), maps the weights and writes a checkpoint at iteration 0 with no optimizer state
at any tp x pp (``megatron.checkpoint_repartition``), with the tokenizer files it finds.  Weights that the layout
does not place (a part our model lacks) are refused, as is any config feature our model lacks.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from megatron.checkpoint_repartition import open_checkpoint, read_full_state, write_model_checkpoint
from megatron.config.errors import ConfigError
from megatron.hf import gpt2_layout, llama_layout
from megatron.model.config import GPTConfig
from megatron.tokenizer.recorded import record_from_files, recorded_files, recorded_tokenizer

LAYOUTS: dict[str, ModuleType] = {gpt2_layout.MODEL_TYPE: gpt2_layout, llama_layout.MODEL_TYPE: llama_layout}
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# our training settings that neither layout's config has, kept in config.json (transformers ignores the key) so that
# export -> import gives back the same model config
TRAINING_KEY = "zb_megatron"
TRAINING_FIELDS = ("seq_length", "make_vocab_size_divisible_by", "hidden_dropout", "fp32_residual_connection")
# features no layout has, by field, in the words of the refusal (a field not named here is named by its flag)
UNEXPRESSED: dict[str, str] = {
    "qk_layernorm": "q/k layer norms (--qk-layernorm), which neither GPT-2 nor Llama in transformers has",
    "rotary_percent": "partial rotary embeddings (--rotary-percent {value}); transformers' Llama rotates every "
    "channel of a head",
}
# buffers some Hugging Face checkpoints carry besides the weights (GPT-2's causal masks, Llama's rotary table)
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# --------------------------------------------------------------------------------------------------------- export
def layout_for(config: GPTConfig) -> ModuleType:
    """The Hugging Face layout of ``config``; ``ConfigError`` naming the feature when neither layout has it.
    ``--apply-layernorm-1p`` is not a problem: export folds it (``fold_layernorm_1p``)."""
    if config.position_embedding_type == "none":
        raise ConfigError(
            "cannot export to Hugging Face: the model has no position embeddings (--position-embedding-type none); "
            "the GPT-2 layout needs learned absolute positions, the Llama layout rotary ones"
        )
    layout = gpt2_layout if config.position_embedding_type == "learned_absolute" else llama_layout
    problem = layout.unsupported(config) or unexpressed(config, layout)
    if problem is not None:
        raise ConfigError(
            f"cannot export to Hugging Face: the model has {problem}; the GPT-2 layout needs "
            f"{gpt2_layout.FEATURES}, the Llama layout {llama_layout.FEATURES}"
        )
    return layout


def unexpressed(config: GPTConfig, layout: ModuleType) -> str | None:
    """The first field of ``config`` away from its default that ``layout`` does not map and that is not a training
    setting (in ``UNEXPRESSED``'s words, else as its flag), or None.  Works on any ``GPTConfig`` subclass, so a field
    added later is covered without a change here."""
    handled = set(layout.MAPPED_FIELDS) | set(TRAINING_FIELDS) | {"apply_layernorm_1p"}  # 1p: folded on export
    for f in dataclasses.fields(config):
        if f.name in handled:
            continue
        value = getattr(config, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        words = UNEXPRESSED.get(f.name, "--{flag}={value}, which the {layout} layout does not map")
        return words.format(value=value, flag=f.name.replace("_", "-"), layout=layout.MODEL_TYPE)
    return None


def fold_layernorm_1p(state: dict[str, torch.Tensor], config: GPTConfig) -> tuple[dict[str, torch.Tensor], GPTConfig]:
    """``--apply-layernorm-1p`` weights (``gamma - 1``) as plain ones (``gamma``), and the config without the flag;
    unchanged without it.  The sum is taken in the stored dtype, as the norms' forward takes it."""
    if not config.apply_layernorm_1p:
        return state, config
    folded = {n: t + 1 if n.endswith("layernorm.weight") else t for n, t in state.items()}
    return folded, dataclasses.replace(config, apply_layernorm_1p=False)


def export_hf(load: str | Path, out: str | Path, *, iteration: int | None = None) -> dict[str, torch.Tensor]:
    """Write the checkpoint at ``load`` as a Hugging Face model directory ``out``; returns the tensors written."""
    from safetensors.torch import save_file

    directory, manifest, common = open_checkpoint(load, iteration)
    config = GPTConfig.from_object(common["model_args"])
    layout = layout_for(config)
    full, _, _, _ = read_full_state(directory, manifest, common, optimizer=False)
    full, config = fold_layernorm_1p(full, config)
    tensors = layout.to_hf(full, config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf = layout.hf_config(config)
    hf["torch_dtype"] = _DTYPE_NAMES.get(full["embedding.word_embeddings.weight"].dtype, "float32")
    hf[TRAINING_KEY] = {name: getattr(config, name) for name in TRAINING_FIELDS}
    tokenizer_files = recorded_files(directory, common, manifest)
    if tokenizer_files:
        tokenizer = recorded_tokenizer(directory, common, manifest)
        hf["bos_token_id"] = hf["eos_token_id"] = int(tokenizer.eod)
        for name, path in tokenizer_files.items():
            (out / name).write_bytes(path.read_bytes())
        extra = _tokenizer_config(common["tokenizer"]["tokenizer_type"], tokenizer, config)
        if extra is not None:
            (out / "tokenizer_config.json").write_text(json.dumps(extra, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(hf, indent=1) + "\n")
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt", "iteration": str(common["iteration"])})
    return tensors


def _tokenizer_config(kind: str, tokenizer: Any, config: GPTConfig) -> dict[str, Any] | None:
    """``tokenizer_config.json`` for ``AutoTokenizer``, where a Hugging Face class reads our files as we do."""
    eod = tokenizer.inv_vocab.get(tokenizer.eod) if hasattr(tokenizer, "inv_vocab") else None
    common = {"model_max_length": config.max_position_embeddings}
    if kind == "GPT2BPETokenizer":
        special = {"bos_token": eod, "eos_token": eod, "unk_token": eod}
        return {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, **special, **common}
    if kind == "HuggingFaceTokenizer":
        return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod, **common}
    return None  # SentencePiece: tokenizer.model is copied; NullTokenizer: no files


# --------------------------------------------------------------------------------------------------------- import
def read_hf_config(directory: Path) -> tuple[dict[str, Any], ModuleType]:
    """(``config.json``, its layout) of a Hugging Face model directory; ``ConfigError`` if unsupported."""
    path = directory / "config.json"
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--import-hf {directory} has no config.json; pass a Hugging Face model directory") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"--import-hf {path} is not a valid JSON config ({err})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"--import-hf {path} is not a JSON object")
    model_type = hf.get("model_type")
    if model_type not in LAYOUTS:
        arch = ",".join(hf.get("architectures") or []) or "?"
        raise ConfigError(
            f"--import-hf {directory}: model_type {model_type!r} ({arch}) is not supported; "
            "import reads GPT-2 ('gpt2') and Llama ('llama') layouts"
        )
    return hf, LAYOUTS[model_type]


def read_hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards a ``model.safetensors.index.json`` lists."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if (directory / WEIGHTS).is_file():
        files = [directory / WEIGHTS]
    elif (directory / WEIGHTS_INDEX).is_file():
        try:
            index = json.loads((directory / WEIGHTS_INDEX).read_text())
            files = [directory / name for name in sorted(set(index["weight_map"].values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"--import-hf {directory / WEIGHTS_INDEX} is not a valid index ({err!r})") from None
    else:
        raise ConfigError(
            f"--import-hf {directory} has no {WEIGHTS} (or {WEIGHTS_INDEX}); save the model with safetensors"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (OSError, SafetensorError) as err:
            raise ConfigError(f"--import-hf {f} cannot be read as safetensors ({err})") from None
    return tensors


def import_hf(
    source: str | Path, save: str | Path, *, tp: int = 1, pp: int = 1, seq_length: int | None = None
) -> tuple[Path, GPTConfig]:
    """Write the Hugging Face model directory ``source`` as a tp x pp checkpoint (iteration 0) under ``save``."""
    source = Path(source)
    if not source.is_dir():
        raise ConfigError(f"--import-hf {source} is not a directory; pass a Hugging Face model directory")
    hf, layout = read_hf_config(source)
    try:
        config = layout.gpt_config(hf, seq_length=seq_length)
        ours = hf.get(TRAINING_KEY) or {}
        kept = {n: ours[n] for n in TRAINING_FIELDS if n in ours and not (n == "seq_length" and seq_length)}
        config = dataclasses.replace(config, **kept)
    except ConfigError as err:
        raise ConfigError(f"--import-hf {source}: {err}") from None
    tensors = layout.canonical_names(read_hf_tensors(source))
    try:
        state = layout.from_hf(tensors, config)
    except ConfigError as err:
        raise ConfigError(f"--import-hf {source}: {err}") from None
    except RuntimeError as err:  # a tensor whose size does not fit the reshapes of config.json's sizes
        first = str(err).splitlines()[0]
        raise ConfigError(f"--import-hf {source}: the weights do not match config.json's sizes ({first})") from None
    placed = set(layout.to_hf(state, config))
    tied_copy = {"lm_head.weight"} if config.tied_embeddings else set()
    extra = sorted(n for n in set(tensors) - placed - tied_copy if not n.endswith(_BUFFER_SUFFIXES))
    if extra:
        raise ConfigError(
            f"--import-hf {source}: the model has weights our GPT model has no place for: {', '.join(extra[:3])}"
        )
    record, tokenizer_files = record_from_files(source)
    try:
        out = write_model_checkpoint(
            save, config, state, tp=tp, pp=pp, tokenizer=record, tokenizer_files=tokenizer_files, source=str(source)
        )
    except ConfigError as err:
        raise ConfigError(f"--import-hf {source}: {err}") from None
    return out, config
