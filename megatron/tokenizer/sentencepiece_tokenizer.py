"""SentencePiece models (`--tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model`).

The end-of-document id is the model's EOS piece (`</s>`); a model trained without one gets an extra id appended
after its vocabulary (`vocab_size` grows by one), as Megatron does for its added special tokens. Padding is the
model's PAD piece when it has one, otherwise the end-of-document id.

SentencePiece normalises text (NFKC by default, whitespace folding) before encoding, so detokenize(tokenize(x)) is x
up to that normalisation; a model trained with `--normalization identity` and byte fallback round-trips exactly
except for leading/duplicate spaces.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from megatron.tokenizer.base import MegatronTokenizer, StoredIdsMixin, clean_text


class SentencePieceTokenizer(StoredIdsMixin, MegatronTokenizer):
    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str | os.PathLike) -> None:
        import sentencepiece

        if not os.path.isfile(model_file):
            raise ValueError(
                f"--tokenizer-model {os.fspath(model_file)!r} does not exist; train one with tools/train_tokenizer.py"
            )
        self.model_file = os.fspath(model_file)
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.Load(self.model_file)
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"--tokenizer-model {self.model_file!r} is not a SentencePiece model ({exc})") from None
        n = self.sp.GetPieceSize()
        eos = self.sp.eos_id()
        self._eod = eos if eos >= 0 else n
        self._vocab_size = n if eos >= 0 else n + 1
        pad = self.sp.pad_id()
        self._pad = pad if pad >= 0 else self._eod
        self.vocab = {self.sp.IdToPiece(i): i for i in range(n)}
        self.inv_vocab = {i: p for p, i in self.vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        return self.sp.EncodeAsIds(clean_text(text))

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.Encode([clean_text(t) for t in texts])

    def detokenize(self, ids: Iterable[int]) -> str:
        n = self.sp.GetPieceSize()
        return self.sp.DecodeIds([int(i) for i in ids if 0 <= int(i) < n])
