"""Loss mask, position ids and document ids from the end-of-document (EOD) token: Megatron's ``--eod-mask-loss``,
``--reset-position-ids`` and ``--reset-attention-mask`` (``megatron.config.documents.DocumentMaskConfig``).

A GPT sample runs across document boundaries.  For the inputs ``tokens [s]`` of one sample:

    loss_mask      0 where tokens[t] is EOD (with --eod-mask-loss), else as the dataset gave it
    document_ids   the number of EODs in tokens[0..t-1]: the EOD ends (belongs to) its document
    position_ids   t minus the first position of t's document (with --reset-position-ids)

``DocumentMaskedDataset`` adds them to every sample of a dataset: ``position_ids`` only with
``--reset-position-ids`` and ``document_ids`` only with ``--reset-attention-mask`` (a batch without them means
positions ``0..s-1`` and the causal mask, so a run without these flags computes exactly what it did before).
``document_attention_mask`` turns a batch's document ids into the model's ``attention_mask`` on the batch's device:
position i attends to j iff j <= i and both lie in the same document; ``model_inputs`` gives every stage's model
call its keyword inputs from a batch (the pp = 1 loop and the pipeline share it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from megatron.config.documents import DocumentMaskConfig


def tokenizer_given(
    tokenizer_type: str | None,
    *,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
) -> bool:
    """Whether the flags name a tokenizer together with the files it needs (so it has an EOD id to read)."""
    if tokenizer_type is None:
        return False
    from megatron.tokenizer.build import TokenizerConfig

    try:
        TokenizerConfig(tokenizer_type, vocab_file, merge_file, tokenizer_model, vocab_size)
    except ValueError:
        return False
    return True


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``[..., s]`` -> ``[..., s]`` int64: the number of EOD tokens strictly before each position."""
    is_eod = (tokens == eod).long()
    return torch.cumsum(is_eod, dim=-1) - is_eod


def reset_position_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``[s]`` -> ``[s]`` int64: each position's offset in its document (0 right after every EOD)."""
    s = tokens.shape[-1]
    index = torch.arange(s, dtype=torch.int64)
    starts = torch.zeros(s, dtype=torch.int64)
    after = torch.nonzero(tokens[:-1] == eod).flatten() + 1  # the first position of each following document
    starts[after] = after
    return index - torch.cummax(starts, dim=0).values


def document_attention_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` document ids -> ``[b, 1, s, s]`` bool, True = masked out (Megatron's convention): causal, and no
    attention across documents."""
    s = doc_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # [b, s, s]
    return ~(same & causal).unsqueeze(1)


def model_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword inputs every stage takes besides tokens/hidden states: ``position_ids`` and ``attention_mask``
    when the batch carries them (``megatron.data.document_masks``; none: positions 0..s-1, causal mask)."""
    out = {}
    if "position_ids" in batch:
        out["position_ids"] = batch["position_ids"]
    if "document_ids" in batch:
        out["attention_mask"] = document_attention_mask(batch["document_ids"])
    return out


def apply_document_masks(sample: dict[str, torch.Tensor], eod: int, config: DocumentMaskConfig) -> dict:
    """``sample`` (``tokens``, ``labels``, ``loss_mask``) with the fields ``config`` asks for."""
    out = dict(sample)
    tokens = sample["tokens"]
    if config.eod_mask_loss:
        out["loss_mask"] = sample["loss_mask"] * (tokens != eod).to(sample["loss_mask"].dtype)
    if config.reset_position_ids:
        out["position_ids"] = reset_position_ids(tokens, eod)
    if config.reset_attention_mask:
        out["document_ids"] = document_ids(tokens, eod)
    return out


class DocumentMaskedDataset:
    """``dataset`` with ``apply_document_masks`` on every sample (``dataset[k]`` stays a function of ``k``).

    Only samples are served: the wrapped dataset's raw-token readers (``tokens``, ``tokens_batch``) are not
    forwarded, so nothing can read around the masks."""

    def __init__(self, dataset: Any, *, eod: int, config: DocumentMaskConfig) -> None:
        self.dataset, self.eod, self.config = dataset, eod, config

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        return apply_document_masks(self.dataset[k], self.eod, self.config)

    @property
    def seq_length(self) -> int:
        return self.dataset.seq_length

    def __repr__(self) -> str:
        return f"DocumentMaskedDataset({self.dataset!r}, eod={self.eod}, {', '.join(self.config.flags())})"
