"""The two tokenizers that need no vocabulary files of ours: HuggingFace (by name or path) and Null (synthetic)."""

from __future__ import annotations

import os
from collections.abc import Iterable

from megatron.tokenizer.base import MegatronTokenizer, StoredIdsMixin, clean_text

_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


class NullTokenizer(MegatronTokenizer):
    """Ids written as whitespace-separated integers (`--tokenizer-type NullTokenizer --vocab-size N`).

    For synthetic data: "3 1 4" -> [3, 1, 4]. Ids lie in [0, N); the end-of-document id is N, so `vocab_size` is
    N + 1 (Megatron's convention).
    """

    name = "NullTokenizer"

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or int(vocab_size) < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1 (got {vocab_size=})")
        self._n = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    @property
    def eod(self) -> int:
        return self._n

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(
                "NullTokenizer reads whitespace-separated integer ids; the text holds something else"
            ) from None
        bad = [i for i in ids if not 0 <= i < self._n]
        if bad:
            raise ValueError(f"NullTokenizer: id {bad[0]} is outside [0, {self._n}); raise --vocab-size")
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class HuggingFaceTokenizer(StoredIdsMixin, MegatronTokenizer):
    """A HuggingFace tokenizer (`--tokenizer-type HuggingFaceTokenizer --tokenizer-model NAME_OR_PATH`), offline only.

    A `tokenizer.json` file (or a directory holding one) loads through the `tokenizers` package alone. Anything else
    (a hub name, a directory of slow-tokenizer files) needs `transformers` and must already be in the local cache:
    nothing is downloaded.
    """

    name = "HuggingFaceTokenizer"

    def __init__(self, name_or_path: str | os.PathLike) -> None:
        if not name_or_path:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model NAME_OR_PATH")
        self.source = os.fspath(name_or_path)
        json_file = self.source
        if os.path.isdir(json_file):
            json_file = os.path.join(json_file, "tokenizer.json")
        self._fast = None
        self._hf = None
        if os.path.isfile(json_file) and json_file.endswith(".json"):
            from tokenizers import Tokenizer

            try:
                self._fast = Tokenizer.from_file(json_file)
            except Exception as exc:  # noqa: BLE001 - the Rust error types are not importable
                raise ValueError(f"--tokenizer-model {json_file!r} is not a tokenizers JSON file ({exc})") from None
            vocab = self._fast.get_vocab(with_added_tokens=True)
            eod = next((vocab[t] for t in _EOS_CANDIDATES if t in vocab), None)
        else:
            try:
                import transformers
            except ImportError:
                raise ValueError(
                    f"HuggingFaceTokenizer {self.source!r} needs the `transformers` package "
                    "(pip install transformers), or pass the path of a tokenizer.json file"
                ) from None
            try:
                self._hf = transformers.AutoTokenizer.from_pretrained(self.source, local_files_only=True)
            except (OSError, ValueError) as exc:
                raise ValueError(
                    f"HuggingFace tokenizer {self.source!r} is not available offline ({str(exc).splitlines()[0]}); "
                    "download it once into the HF cache or pass a local path"
                ) from None
            vocab = self._hf.get_vocab()
            eod = self._hf.eos_token_id
        if eod is None:
            raise ValueError(f"HuggingFace tokenizer {self.source!r} defines no end-of-sequence token to use as eod")
        self.vocab = vocab
        self.inv_vocab = {i: t for t, i in vocab.items()}
        self._eod = int(eod)
        self._vocab_size = max(vocab.values()) + 1
        pad = None if self._hf is None else self._hf.pad_token_id
        self._pad = self._eod if pad is None else int(pad)

    def tokenize(self, text: str) -> list[int]:
        text = clean_text(text)
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._hf.encode(text, add_special_tokens=False)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch([clean_text(t) for t in texts], add_special_tokens=False)]
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=False)
        return self._hf.decode(ids)
