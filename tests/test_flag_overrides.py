"""No silently ignored input: a flag that another flag overrides is one warning line, or an error if they contradict.

Each pair of ``megatron.config.overrides`` is given on a command line and must produce exactly its warning (naming the
flag, its value and the flag that wins), and nothing else; ``--data-path`` with ``--mock-data`` makes
``pretrain_gpt.main`` exit 2 with one line on rank 0 and none on the others.  Flags at their defaults, or given
together with what they need, warn about nothing.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from megatron.arguments import parse_run_config
from megatron.config.errors import ConfigError

BASE = ["--model-config", "gpt-tiny", "--train-iters", "3", "--lr", "1e-3", "--mock-data"]

# extra flags -> the one warning they must give
PAIRS = {
    "tokenizer-with-mock": (
        ["--tokenizer-type", "SentencePieceTokenizer"],
        "--tokenizer-type SentencePieceTokenizer",
        "--mock-data",
    ),
    "vocab-file-with-mock": (["--vocab-file", "v.json"], "--vocab-file v.json", "--mock-data"),
    "split-with-mock": (["--split", "90,10,0"], "--split 90,10,0", "--mock-data"),
    "minutes-and-seconds": (
        ["--distributed-timeout-minutes", "2", "--distributed-timeout-seconds", "7"],
        "--distributed-timeout-minutes 2",
        "--distributed-timeout-seconds 7",
    ),
    "query-groups-without-gqa": (["--num-query-groups", "2"], "--num-query-groups 2", "--group-query-attention"),
    "sequence-parallel-tp1": (["--sequence-parallel"], "--sequence-parallel", "tensor-parallel size 1"),
    "scaler-without-fp16": (["--initial-loss-scale", "1024"], "--initial-loss-scale 1024", "--fp16"),
    "fixed-scale-wins": (["--fp16", "--loss-scale", "128", "--hysteresis", "3"], "--hysteresis 3", "--loss-scale 128"),
    "adam-flag-with-sgd": (["--optimizer", "sgd", "--adam-beta1", "0.8"], "--adam-beta1 0.8", "--optimizer sgd"),
    "sgd-flag-with-adam": (["--sgd-momentum", "0.5"], "--sgd-momentum 0.5", "--optimizer sgd"),
    "load-option-without-load": (["--no-load-optim"], "--no-load-optim", "--load"),
    "eval-interval-without-eval": (
        ["--eval-iters", "0", "--eval-interval", "5"],
        "--eval-interval 5",
        "--eval-iters 0",
    ),
}


@pytest.mark.parametrize("name", PAIRS)
def test_an_overridden_flag_is_one_warning_naming_both(name: str) -> None:
    extra, loser, winner = PAIRS[name]
    warnings = parse_run_config([*BASE, *extra]).ignored_flag_warnings()
    assert len(warnings) == 1, warnings
    line = warnings[0]
    assert line.startswith(f"warning: {loser} is ignored: ") and winner in line and "\n" not in line, line


def test_flags_used_as_meant_warn_about_nothing() -> None:
    quiet = [
        [],
        ["--distributed-timeout-minutes", "2"],
        ["--group-query-attention", "--num-query-groups", "2"],
        ["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "3"],
        ["--optimizer", "sgd", "--sgd-momentum", "0.5"],
        ["--adam-beta1", "0.8"],
        ["--eval-iters", "2", "--eval-interval", "5"],
        ["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"],  # its EOD id joins the mock vocabulary
    ]
    for extra in quiet:
        assert parse_run_config([*BASE, *extra]).ignored_flag_warnings() == [], extra


def test_data_path_with_mock_data_exits_2_with_one_line(monkeypatch) -> None:
    import pretrain_gpt

    argv = [*BASE, "--data-path", "data/corpus_text_document"]
    with pytest.raises(ConfigError, match="--mock-data and --data-path data/corpus_text_document contradict"):
        parse_run_config(argv)
    for rank, lines in ((0, 1), (1, 0)):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert pretrain_gpt.main(argv) == 2
        assert len(err.getvalue().splitlines()) == lines, err.getvalue()
        if lines:
            assert err.getvalue().startswith("pretrain_gpt.py: error: --mock-data and --data-path"), err.getvalue()
    # ZB_DEBUG=1 (docs/failures.md) adds the traceback before the line; the exit code stays.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("ZB_DEBUG", "1")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert pretrain_gpt.main(argv) == 2
    text = err.getvalue()
    assert text.startswith("Traceback") and "ConfigError" in text, text
    assert text.splitlines()[-1].startswith("pretrain_gpt.py: error: --mock-data and --data-path"), text
