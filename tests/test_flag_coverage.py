"""The coverage rule of docs/flags.md, checked: every flag ``pretrain_gpt.py`` registers is either

- in a table of docs/flags.md (every table of the file is read) with a test ``tests/<file>.py::<name>`` that exists,
  and its config field is read somewhere outside ``megatron/arguments.py`` and ``megatron/config/`` (so the value
  reaches the code that acts on it), or
- on ``KNOWN_IGNORED_FLAGS`` (accepted with one warning line; listed in docs/flags.md too).

``test_flag_reaches_its_config`` is the named test of the flags whose effect other tests exercise through their
config (the model sizes, tokenizer files, loss-scale settings, ...): it fails if a flag stops reaching its field.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from megatron.arguments import parse_run_config
from megatron.flag_table import KNOWN_IGNORED_FLAGS, build_parser

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "flags.md"

# Where a flag's value lands when the mapping is not ``field=v["dest"]`` in the flag-reading code.
FIELD_OF = {
    "group_query_attention": "num_query_groups",
    "tensor_model_parallel_size": "tp_size",
    "pipeline_model_parallel_size": "pp_size",
    "distributed_timeout_minutes": "distributed_timeout_s",
    "distributed_timeout_seconds": "distributed_timeout_s",
    "rampup_batch_size": "batch_schedule",
    "global_batch_size": "global_batch_size",
    "pipeline_schedule": "schedule",
    "enable_zero_bubble": "schedule",
    "zero_bubble_v_schedule": "schedule",
    "zero_bubble_v_schedule_mem_setup": "schedule",
    "zero_bubble_max_pending_backward": "mem_limit",
    "zero_bubble_pipeline_timers_start_iter": "timers_start_iter",
    "zero_bubble_pipeline_timers_end_iter": "timers_end_iter",
    "num_layers_per_virtual_pipeline_stage": "num_layers_per_virtual_stage",
    "train_samples": "train_iters",  # --train-samples sets the run's iterations (megatron.batch_schedule)
    "bf16": "params_dtype",  # read through PrecisionConfig.params_dtype / .name
    # the LR spans: megatron.optimizer.lr_scheduler reads them through LRScheduleConfig.warmup_and_decay
    "lr_warmup_iters": "warmup_and_decay",
    "lr_decay_iters": "warmup_and_decay",
    "lr_warmup_samples": "warmup_and_decay",
    "lr_decay_samples": "warmup_and_decay",
    "lr_warmup_fraction": "warmup_and_decay",
    # RecomputeConfig (megatron/config/recompute.py): the model reads the granularity as .selective and the method
    # and layer count as .segments(...)
    "recompute_activations": "selective",
    "recompute_granularity": "selective",
    "recompute_method": "segments",
    "recompute_num_layers": "segments",
}
# Flags with no config field of their own, and why.
NO_FIELD = {
    "model_config": "a source of model-flag values (megatron.config.model_sizes), resolved while parsing",
    "use_checkpoint_args": "applied while parsing: megatron.checkpoint_args replaces the model flags' values",
    "enable_exactly_numeric_match": "the fork's switch; the runtime is exact by construction "
    "(tests/test_pipeline_training.py::test_zb_h1_pp2_dp2_bit_identical_to_pp1_dp2)",
    "use_rotary_position_embeddings": "Megatron's legacy alias, resolved while parsing into position_embedding_type",
    "add_position_embedding": "--no-position-embedding, resolved while parsing into position_embedding_type",
    "attention_backend": "every choice runs scaled_dot_product_attention; the ones it cannot honour warn once "
    "(tests/test_model_variants.py)",
}
FLAG_READERS = ("megatron/arguments.py", "megatron/config/kernels.py", "megatron/pipeline/schedule_flags.py")


def registered_flags() -> dict[str, str]:
    """Every long option of the parser -> its argparse destination (ignored flags and --help left out)."""
    parser, _ = build_parser()
    out = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and opt != "--help" and opt not in KNOWN_IGNORED_FLAGS:
                out[opt] = action.dest
    return out


def doc_rows() -> dict[str, str]:
    """Flag -> its named test, from every table of docs/flags.md (a first cell may name several flags)."""
    rows: dict[str, str] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        if len(cells) < 3:
            continue
        test = re.search(r"tests/[\w/]+\.py::\w+", cells[-1])
        for flag in re.findall(r"`(--[\w-]+)", cells[0]):
            if test:
                rows.setdefault(flag, test.group(0))
    return rows


@functools.cache
def _test_names(path: str) -> frozenset[str]:
    file = ROOT / path
    if not file.is_file():
        return frozenset()
    return frozenset(n.name for n in ast.parse(file.read_text()).body if isinstance(n, ast.FunctionDef))


def _test_exists(ref: str) -> bool:
    path, name = ref.split("::")
    return name in _test_names(path)


def _field_of(dest: str, reader_text: str) -> str:
    if dest in FIELD_OF:
        return FIELD_OF[dest]
    m = re.search(rf"(\w+)=[^,\n]*?(?:v\[|get\()\"{dest}\"", reader_text)
    return m.group(1) if m else dest


def _sources_outside_flag_code() -> str:
    texts = []
    for path in [*ROOT.glob("megatron/**/*.py"), *ROOT.glob("zb_pipeline/**/*.py"), ROOT / "pretrain_gpt.py"]:
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("megatron/arguments.py", "megatron/flag_table.py") or rel.startswith("megatron/config/"):
            continue
        texts.append(path.read_text())
    return "\n".join(texts)


def test_every_registered_flag_is_documented_with_a_test_or_warned() -> None:
    flags, rows = registered_flags(), doc_rows()
    missing = sorted(f for f in flags if f not in rows)
    assert not missing, f"flags with no row in docs/flags.md (add a row with its test, or warn): {missing}"
    bad = sorted(f"{f} -> {rows[f]}" for f in flags if not _test_exists(rows[f]))
    assert not bad, f"docs/flags.md names tests that do not exist: {bad}"
    unknown = sorted(f for f in rows if f not in flags and f not in KNOWN_IGNORED_FLAGS)
    assert not unknown, f"docs/flags.md has rows for flags the parser does not register: {unknown}"


def test_every_warned_flag_is_listed_in_the_docs() -> None:
    text = DOC.read_text()
    section = text[text.index("## Flags accepted with a warning") :]
    listed = set(re.findall(r"`(--[\w-]+)`", section))
    assert listed >= set(KNOWN_IGNORED_FLAGS), sorted(set(KNOWN_IGNORED_FLAGS) - listed)


def test_every_flag_value_is_read_outside_the_flag_code() -> None:
    readers = "\n".join((ROOT / p).read_text() for p in FLAG_READERS)
    source = _sources_outside_flag_code()
    unread = []
    for flag, dest in sorted(registered_flags().items()):
        if dest in NO_FIELD:
            continue
        field = _field_of(dest, readers)
        if not re.search(rf"\.{field}\b", source):
            unread.append(f"{flag} ({dest} -> .{field})")
    assert not unread, f"flags whose config field nothing outside arguments.py/config/ reads: {unread}"


BASE = ["--model-config", "gpt-tiny", "--mock-data", "--train-iters", "2", "--lr", "1e-3"]
# (extra flags, attribute path on the RunConfig, expected value)
REACHES = [
    (["--ffn-hidden-size", "96"], "model.ffn_hidden_size", 96),
    (["--kv-channels", "8"], "model.kv_channels", 8),
    (["--position-embedding-type", "rope", "--rotary-base", "500"], "model.rotary_base", 500),
    (["--norm-epsilon", "1e-6"], "model.norm_epsilon", 1e-6),
    (["--disable-bias-linear"], "model.add_bias_linear", False),
    (["--vocab-file", "v.json"], "data.vocab_file", "v.json"),
    (["--merge-file", "m.txt"], "data.merge_file", "m.txt"),
    (["--tokenizer-model", "t.model"], "data.tokenizer_model", "t.model"),
    (["--fp16", "--loss-scale", "128"], "precision.loss_scale", 128.0),
    (["--fp16", "--min-loss-scale", "4"], "precision.min_loss_scale", 4.0),
    (["--fp16", "--loss-scale-window", "7"], "precision.loss_scale_window", 7),
    (
        ["--check-for-nan-in-loss-and-grad", "--no-check-for-nan-in-loss-and-grad"],
        "precision.check_for_nan_in_loss_and_grad",
        False,
    ),
    (["--adam-eps", "1e-5"], "optimizer.adam_eps", 1e-5),
    (["--wandb-project", "p"], "logging.wandb_project", "p"),
    (["--wandb-exp-name", "e"], "logging.wandb_exp_name", "e"),
    (["--no-load-optim"], "checkpoint.no_load_optim", True),
    (["--no-load-rng"], "checkpoint.no_load_rng", True),
    (["--finetune"], "checkpoint.finetune", True),
    (["--zero-bubble-adaptive-memory-limit-percentile", "70"], "pipeline.adaptive_memory_percentile", 70.0),
    (["--emulate-compute", "1,2,1"], "pipeline.emulate_compute", "1,2,1"),
    (["--pipeline-p2p-check"], "pipeline.p2p_check", True),
    (
        ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"],
        "pipeline_layout.layer_ranges",
        (range(0, 1), range(1, 4)),
    ),
    (
        ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "1"],
        "pipeline_layout.layer_ranges",
        (range(0, 3), range(3, 4)),
    ),
    (
        ["--num-layers", "3", "--pipeline-model-parallel-size", "2", "--allow-padding-num-layers"],
        "pipeline_layout.layer_ranges",
        (range(0, 2), range(2, 3)),
    ),
]


@pytest.mark.parametrize("extra,path,expected", REACHES, ids=[" ".join(r[0][:2]) for r in REACHES])
def test_flag_reaches_its_config(extra: list[str], path: str, expected: object) -> None:
    argv = [a for a in BASE if not (extra[0] == "--train-data-path" and a == "--mock-data")] + extra
    world = 2 if "--pipeline-model-parallel-size" in extra else 1
    value: object = parse_run_config(argv, world_size=world)
    for part in path.split("."):
        value = getattr(value, part)
    assert value == expected
