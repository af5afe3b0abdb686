"""Where training samples come from: mock (synthetic) tokens or indexed datasets, and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.config.errors import require

NO_DATA_MESSAGE = (
    "no training data: pass --data-path PREFIX (a preprocessed .bin/.idx dataset), --train-data-path or --mock-data"
)
DATALOADER_TYPES = ("single", "cyclic")
MOCK_DATA_VOCAB_SIZE = 1024  # the vocabulary of --mock-data without --vocab-size


@dataclass(frozen=True)
class DataConfig:
    """``data_path`` follows Megatron: ``["prefix"]`` or ``["w1", "prefix1", "w2", "prefix2", ...]`` (blending).

    ``train_data_path`` / ``valid_data_path`` (Megatron's per-split paths) give each split its own blend, used
    whole (``--split`` does not apply to them); they replace ``data_path``.  (``--test-data-path`` is accepted with
    a warning: no test-split evaluation runs here.)  ``data_cache_path``:
    where the index caches go (default: ``cache/`` next to the data).  ``dataloader_type``: ``single`` reads the
    samples in order, ``cyclic`` reads each pass over the training set in a seeded random order.  ``num_workers``:
    worker processes of the training set's ``torch.utils.data.DataLoader`` (0: loaded in the training process).
    """

    data_path: tuple[str, ...] = ()
    split: str = "969, 30, 1"
    mock_data: bool = False
    seq_length: int = 1024
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    num_workers: int = 0
    data_cache_path: str | None = None
    train_data_path: tuple[str, ...] = ()
    valid_data_path: tuple[str, ...] = ()
    dataloader_type: str = "single"

    def __post_init__(self) -> None:
        require(self.mock_data or len(self.data_path) > 0 or len(self.train_data_path) > 0, NO_DATA_MESSAGE)
        require(
            not (self.data_path and (self.train_data_path or self.valid_data_path)),
            "--data-path and --train/valid-data-path are alternatives; pass one or the other",
        )
        require(
            not self.valid_data_path or bool(self.train_data_path),
            "--valid-data-path needs --train-data-path (or use --data-path with --split)",
        )
        require(
            self.dataloader_type in DATALOADER_TYPES,
            f"--dataloader-type={self.dataloader_type!r} must be one of {', '.join(DATALOADER_TYPES)}",
        )
        require(self.seq_length >= 1, f"--seq-length={self.seq_length} must be >= 1")
        if self.vocab_size is not None:
            require(self.vocab_size >= 2, f"--vocab-size={self.vocab_size} must be >= 2")
        parts = [p.strip() for p in self.split.replace("/", ",").split(",") if p.strip()]
        ok = 1 <= len(parts) <= 3
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            ok = False
            weights = []
        require(
            ok and all(w >= 0 for w in weights) and sum(weights) > 0, f"--split={self.split!r} must be like '969,30,1'"
        )
        require(self.num_workers >= 0, f"--num-workers={self.num_workers} must be >= 0")

    @property
    def split_weights(self) -> tuple[float, float, float]:
        """Normalised train/valid/test fractions."""
        parts = [float(p) for p in self.split.replace("/", ",").split(",") if p.strip()]
        parts += [0.0] * (3 - len(parts))
        total = sum(parts)
        return (parts[0] / total, parts[1] / total, parts[2] / total)
