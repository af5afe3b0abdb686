"""Megatron's per-token variants derived from the end-of-document (EOD) token of the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DocumentMaskConfig:
    """``--eod-mask-loss``: no loss where the input token is EOD (the prediction of the next document's first token);
    ``--reset-position-ids``: positions restart at 0 after each EOD; ``--reset-attention-mask``: no attention across
    an EOD within a sample (a block-diagonal causal mask).  The EOD token belongs to the document it ends."""

    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    @property
    def active(self) -> bool:
        return self.eod_mask_loss or self.reset_position_ids or self.reset_attention_mask

    @property
    def every_stage(self) -> bool:
        """Whether every pipeline stage reads the batch (position ids for RoPE, the attention mask), not only the
        first and last."""
        return self.reset_position_ids or self.reset_attention_mask

    def flags(self) -> list[str]:
        """The flags given, as on the command line."""
        return [
            flag
            for flag, on in (
                ("--eod-mask-loss", self.eod_mask_loss),
                ("--reset-position-ids", self.reset_position_ids),
                ("--reset-attention-mask", self.reset_attention_mask),
            )
            if on
        ]
