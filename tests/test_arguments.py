"""Flags -> configs (Megatron names and meanings, sizes, YAML), ignored flags, and bad input: one line, exit 2."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron.arguments import parse_run_config
from megatron.config.errors import ConfigError
from megatron.config.model_sizes import MODEL_SIZES
from megatron.flag_table import KNOWN_IGNORED_FLAGS, build_parser
from megatron.model.config import GPTConfig, swiglu_ffn_size

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--mock-data", "--train-iters", "10", "--lr", "1e-3"]
TINY = ["--model-config", "gpt-tiny", *BASE]


def test_megatron_flags_map_onto_component_configs():
    argv = [
        *BASE,
        "--num-layers", "4", "--hidden-size", "96", "--num-attention-heads", "6", "--seq-length", "64",
        "--max-position-embeddings", "128", "--group-query-attention", "--num-query-groups", "2",
        "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--attention-dropout", "0", "--hidden-dropout", "0.05",
        "--init-method-std", "0.01", "--vocab-size", "1000", "--make-vocab-size-divisible-by", "64",
        "--micro-batch-size", "2", "--global-batch-size", "16", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "3",
        "--weight-decay", "0.1", "--clip-grad", "0.5", "--adam-beta1", "0.8", "--adam-beta2", "0.95",
        "--seed", "7", "--eval-interval", "5", "--eval-iters", "2", "--log-interval", "1", "--exit-interval", "8",
        "--distributed-timeout-minutes", "2", "--split", "90,10,0",
    ]  # fmt: skip
    run = parse_run_config(argv, world_size=4)
    m = run.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups) == (4, 96, 6, 2)
    assert (m.seq_length, m.max_position_embeddings, m.kv_channels) == (64, 128, 16)
    assert m.ffn_hidden_size == swiglu_ffn_size(96) == 256 and m.swiglu
    assert (m.normalization, m.position_embedding_type, m.untie_embeddings_and_output_weights) == (
        "RMSNorm",
        "rope",
        True,
    )
    assert (m.attention_dropout, m.hidden_dropout, m.init_method_std) == (0.0, 0.05, 0.01)
    assert (m.vocab_size, run.padded_vocab_size) == (1000, 1024)  # next multiple of 64 x tp
    assert run.dp_size == 2 and run.num_microbatches == 4 and run.global_batch_size == 16
    assert run.parallel.tp_size == 2 and run.parallel.sequence_parallel and run.parallel.distributed_timeout_s == 120
    assert (run.lr_schedule.lr, run.lr_schedule.min_lr, run.lr_schedule.decay_style) == (1e-3, 1e-5, "cosine")
    assert run.lr_schedule.warmup_iters == 3
    o = run.optimizer
    assert (o.weight_decay, o.clip_grad, o.adam_beta1, o.adam_beta2) == (0.1, 0.5, 0.8, 0.95)
    t = run.training
    assert (t.seed, t.eval_interval, t.eval_iters, t.exit_interval, run.logging.log_interval) == (7, 5, 2, 8, 1)
    assert run.data.split_weights == pytest.approx((0.9, 0.1, 0.0)) and run.data.mock_data


def test_the_model_vocabulary_follows_the_null_tokenizer_and_nothing_else():
    """NullTokenizer's --vocab-size N is N ids plus its EOD id N (Megatron): the model gets N + 1 rows, padded; without
    that tokenizer (mock data, or the default tokenizer type, never built) --vocab-size N is the model's N."""
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    cases = {
        (): (1024, 1024, 1024),  # mock data's default vocabulary
        ("--vocab-size", "128"): (128, 128, 128),
        tuple(null): (129, 128, 256),
        (*null, "--make-vocab-size-divisible-by", "1"): (129, 128, 129),
    }
    for extra, expected in cases.items():
        run = parse_run_config([*TINY, *extra])
        assert (run.model.vocab_size, run.data.vocab_size, run.padded_vocab_size) == expected, extra
    real = ["--model-config", "gpt-tiny", "--train-iters", "10", "--lr", "1e-3", "--data-path", "corpus"]
    assert parse_run_config([*real, *null]).model.vocab_size == 129
    assert parse_run_config(real).model.vocab_size == 0  # the default tokenizer's, read from its files at setup


def test_megatron_defaults_and_derivations():
    run = parse_run_config([*TINY], world_size=1)
    m = run.model
    assert m.ffn_hidden_size == 4 * m.hidden_size and m.max_position_embeddings == m.seq_length
    assert (m.attention_dropout, m.hidden_dropout, m.init_method_std) == (0.1, 0.1, 0.02)
    assert run.global_batch_size == 1 and run.num_microbatches == 1
    assert run.optimizer.clip_grad == 1.0 and run.lr_schedule.decay_style == "linear"
    assert (run.optimizer.optimizer, run.optimizer.sgd_momentum) == ("adam", 0.9)
    sgd = parse_run_config([*TINY, "--optimizer", "sgd", "--sgd-momentum", "0.5"]).optimizer
    assert (sgd.optimizer, sgd.sgd_momentum) == ("sgd", 0.5)
    assert run.parallel.distributed_timeout_s == 600
    # sequence parallelism is meaningless without tp and is switched off, as in Megatron
    assert not parse_run_config([*TINY, "--sequence-parallel"]).parallel.sequence_parallel
    secs = parse_run_config([*TINY, "--distributed-timeout-seconds", "7"])
    assert secs.parallel.distributed_timeout_s == 7


def test_model_flags_are_gptconfig_fields_with_its_defaults():
    run = parse_run_config([*TINY], world_size=1)
    assert isinstance(run.model, GPTConfig)  # the one model config: no separate flag-level model record
    _, table = build_parser()
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    aliases = {"group_query_attention", "use_rotary_position_embeddings", "add_position_embedding"}
    assert table.model_keys == fields | aliases  # what a --model-config file may set
    for name in fields - {"num_query_groups"}:  # Megatron's --num-query-groups default (1) applies with GQA only
        assert table.defaults[name] == GPTConfig.default(name), name


def test_named_sizes_yaml_and_explicit_flag_precedence(tmp_path):
    assert {"gpt-tiny", "gpt-125m", "gpt-1.3b", "gpt-13b"} <= set(MODEL_SIZES)
    big = parse_run_config(["--model-config", "gpt-13b", *BASE, "--tensor-model-parallel-size", "8"], world_size=8)
    assert (big.model.num_layers, big.model.hidden_size, big.model.num_attention_heads) == (40, 5120, 40)
    base = tmp_path / "base.yaml"
    base.write_text("base: gpt-125m\nnum_layers: 6\nswiglu: true\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\nhidden-size: 480\nnormalization: RMSNorm\n")
    run = parse_run_config(["--model-config", str(child), *BASE, "--num-layers", "3"])
    m = run.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.swiglu, m.normalization) == (
        3,
        480,
        12,
        True,
        "RMSNorm",
    )
    for text, needle in [
        ("num_layerz: 3\n", "unknown model setting"),
        ("swiglu: 3\n", "true or false"),
        ("normalization: BatchNorm\n", "must be one of"),
        ("[1, 2]\n", "expected a mapping"),
    ]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=needle):
            parse_run_config(["--model-config", str(bad), *BASE])
    with pytest.raises(ConfigError, match="neither a named size"):
        parse_run_config(["--model-config", "gpt-huge", *BASE])


def test_ignored_flags_warn_once_each_and_unknown_flags_fail():
    run = parse_run_config([*TINY, "--use-mcore-models", "--distributed-backend", "nccl", "--no-masked-softmax-fusion"])
    assert run.ignored_flags == ("--use-mcore-models", "--distributed-backend", "--no-masked-softmax-fusion")
    warnings = run.ignored_flag_warnings()
    assert len(warnings) == 3 and all(w.startswith("warning: --") and "\n" not in w for w in warnings)
    assert {"--overlap-grad-reduce", "--no-rope-fusion", "--use-flash-attn"} <= set(KNOWN_IGNORED_FLAGS)
    with pytest.raises(ConfigError, match="unrecognized arguments: --no-such-flag"):
        parse_run_config([*TINY, "--no-such-flag"])
    with pytest.raises(ConfigError, match="unrecognized"):  # no abbreviations, as in Megatron
        parse_run_config([*TINY, "--num-lay", "2"])


# Each case: (argv, world size, a phrase the one-line message must contain).
BAD_INPUT = {
    "world-size": ([*TINY, "--tensor-model-parallel-size", "2"], 3, "not divisible by tensor x pipeline"),
    "heads-vs-tp": (
        [*TINY, "--num-attention-heads", "2", "--tensor-model-parallel-size", "4"],
        4,
        "--num-attention-heads=2",
    ),
    "layers-vs-stages": (
        [*TINY, "--num-layers", "3", "--pipeline-model-parallel-size", "2"],
        2,
        "--allow-padding-num-layers",
    ),
    "seq-vs-positions": (
        [*TINY, "--seq-length", "256", "--max-position-embeddings", "128"],
        1,
        "--max-position-embeddings",
    ),
    "global-batch": ([*TINY, "--micro-batch-size", "2", "--global-batch-size", "6"], 2, "--global-batch-size=6"),
    "unknown-flag": ([*TINY, "--frobnicate"], 1, "unrecognized arguments: --frobnicate"),
    "bad-value": ([*TINY, "--num-layers", "two"], 1, "invalid"),
    "bad-choice": ([*TINY, "--normalization", "BatchNorm"], 1, "invalid choice"),
    "bad-optimizer": ([*TINY, "--optimizer", "adagrad"], 1, "argument --optimizer: invalid choice: 'adagrad'"),
    "negative-lr": ([*TINY, "--lr", "-1"], 1, "--lr=-1.0 must be > 0"),
    "pipeline-schedule": (
        [*TINY, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b", "--enable-zero-bubble"],
        2,
        "contradicts --enable-zero-bubble",
    ),
    "no-data": (["--model-config", "gpt-tiny", "--train-iters", "3", "--lr", "1e-3"], 1, "--mock-data"),
    "memory-limit": (
        [
            *TINY,
            "--pipeline-model-parallel-size",
            "2",
            "--pipeline-layer-split",
            "auto",
            "--recompute-granularity",
            "auto",
            "--pipeline-memory-limit-gb",
            "1e-6",
        ],
        2,
        "the smallest limit that works is",
    ),  # fmt: skip
}

# Runs pretrain_gpt.main for every case in a forked child (a real process: its own exit code and stderr), after
# importing torch once, so the whole battery costs one interpreter start.
_FORK_DRIVER = textwrap.dedent(
    """
    import json, os, sys, traceback
    sys.path.insert(0, {root!r})
    import torch
    torch.set_num_threads(1)
    import pretrain_gpt
    cases = json.loads(sys.argv[1])
    out = {{}}
    for name, (argv, world, rank) in cases.items():
        err_path = os.path.join({tmp!r}, name + ".err")
        pid = os.fork()
        if pid == 0:
            fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
            try:
                code = pretrain_gpt.main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out[name] = [os.waitstatus_to_exitcode(status), open(err_path).read()]
    print(json.dumps(out))
    """
)


def test_bad_input_exits_2_with_one_line_on_rank_0_only(tmp_path):
    cases = {}
    for name, (argv, world, _) in BAD_INPUT.items():
        cases[f"{name}-r0"] = (argv, world, 0)
        cases[f"{name}-r1"] = (argv, max(world, 2), 1)
    driver = _FORK_DRIVER.format(root=str(ROOT), tmp=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", driver, json.dumps(cases)],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (_, _, phrase) in BAD_INPUT.items():
        code, err = results[f"{name}-r0"]
        lines = err.strip().splitlines()
        assert code == 2, (name, err)
        assert len(lines) == 1 and "Traceback" not in err, (name, err)
        assert lines[0].startswith("pretrain_gpt.py: error: ") and phrase in lines[0], (name, lines[0])
        code1, err1 = results[f"{name}-r1"]  # another rank fails the same check, silently
        assert code1 == 2 and err1 == "", (name, code1, err1)


@pytest.mark.slow  # the fork battery above already runs real processes; this is the plain `python pretrain_gpt.py`
def test_bad_input_as_a_plain_script_run():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), *TINY, "--seq-length", "4096",
         "--max-position-embeddings", "128"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert (
        proc.stderr.count("\n") == 1 and "--seq-length=4096 is larger than --max-position-embeddings=128" in proc.stderr
    )


@pytest.mark.slow
def test_bad_input_under_torchrun_fails_every_rank_without_hanging():
    from zb_pipeline.testing.harness import run_torchrun

    res = run_torchrun(
        ["pretrain_gpt.py", *TINY, "--num-attention-heads", "3", "--tensor-model-parallel-size", "2"],
        2,
        timeout_s=180,
        cwd=ROOT,
    )
    assert not res.timed_out and res.returncode != 0
    ours = [line for line in res.stderr.splitlines() if "pretrain_gpt.py: error:" in line]
    assert len(ours) == 1 and "--num-attention-heads=3" in ours[0]
    assert 'File "' + str(ROOT / "megatron") not in res.stderr and 'pretrain_gpt.py", line' not in res.stderr
