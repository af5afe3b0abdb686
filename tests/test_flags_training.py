"""Megatron's training, schedule, data, checkpoint and logging flags: each test fails if its flag is ignored.

In one process (pp = 1) unless the flag is about ranks; the pipeline ramp-up lives in test_flags_rampup.py and the
example scripts' flag sets in test_flags_examples.py.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.arguments import lr_schedule_length, parse_flags, parse_run_config
from megatron.batch_schedule import BatchSizeSchedule, iterations_for_samples, ramp_up_sizes
from megatron.config.errors import ConfigError
from megatron.optimizer.lr_scheduler import LRScheduler
from megatron.pipeline.schedule_flags import ScheduleConfig
from megatron.training import pretrain
from zb_pipeline.testing.harness import run_multiprocess

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
    "--vocab-size", "96", "--mock-data", "--micro-batch-size", "2", "--lr", "3e-3",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "5", "--eval-iters", "0", "--log-interval", "1",
]  # fmt: skip


def _run(argv: list[str], **kw) -> tuple[object, str]:
    torch.set_num_threads(1)
    out = io.StringIO()
    summary = pretrain(parse_run_config(argv), stream=out, **kw)
    return summary, out.getvalue()


def _main(argv: list[str], capsys) -> tuple[int, str]:
    from pretrain_gpt import main

    code = main(argv)
    return code, capsys.readouterr().err


def _scheduler(run) -> LRScheduler:
    return LRScheduler(
        run.lr_schedule,
        train_iters=lr_schedule_length(run.training, run.lr_schedule, run.batch_schedule, run.global_batch_size),
    )


def _rates(run, iterations: int) -> list[float]:
    """The learning rate of each of the first ``iterations`` updates (every step applied)."""
    sched, out = _scheduler(run), []
    for it in range(1, iterations + 1):
        out.append(sched.current_lr)
        sched.step(run.lr_increment(it))
    return out


# ----------------------------------------------------------------------------------------------- run length, LR
def test_train_samples_sets_the_iterations_and_excludes_train_iters(capsys) -> None:
    run = parse_run_config([*TINY, "--global-batch-size", "8", "--train-samples", "100"])
    assert run.training.train_iters == 12 and run.training.train_samples == 100  # 100 // 8, the partial batch dropped
    code, err = _main([*TINY, "--global-batch-size", "8", "--train-samples", "100", "--train-iters", "3"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--train-iters and --train-samples" in err
    with pytest.raises(ConfigError, match="--lr-decay-iters counts iterations"):
        parse_run_config([*TINY, "--train-samples", "100", "--lr-decay-iters", "5"])
    with pytest.raises(ConfigError, match="--lr-warmup-samples counts samples"):
        parse_run_config([*TINY, "--train-iters", "10", "--lr-warmup-samples", "5"])


def test_sample_based_lr_schedule_warmup_samples_decay_samples_and_init() -> None:
    argv = [*TINY, "--global-batch-size", "4", "--train-samples", "400", "--lr", "1.0", "--min-lr", "0.1"]
    run = parse_run_config([*argv, "--lr-warmup-samples", "8", "--lr-decay-samples", "40", "--lr-warmup-init", "0.2"])
    # steps count samples (4 per iteration): warmup over 8 samples from 0.2, linear decay to 0.1 at 40 samples
    expected = [0.2, 0.6, 1.0] + [0.1 + 0.9 * (1 - (4 * n - 8) / 32) for n in range(3, 10)] + [0.1, 0.1]
    assert _rates(run, 12) == pytest.approx(expected, abs=1e-12)
    # --lr-decay-samples defaults to --train-samples
    default = parse_run_config([*argv, "--lr-warmup-samples", "8"])
    assert _rates(default, 4)[3] == pytest.approx(0.1 + 0.9 * (1 - (12 - 8) / 392))


def test_lr_warmup_fraction_of_the_decay_span_iterations_and_samples() -> None:
    argv = [*TINY, "--train-iters", "40", "--lr-decay-iters", "20", "--lr", "1.0", "--lr-warmup-fraction", "0.25"]
    it = parse_run_config(argv)
    assert _rates(it, 6)[:6] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])  # 0.25 x --lr-decay-iters 20 = 5
    assert _rates(it, 21)[20] == 0.0  # decayed to --min-lr 0 at --lr-decay-iters, not at --train-iters
    sa = parse_run_config(
        [*TINY, "--global-batch-size", "4", "--train-samples", "80", "--lr", "1.0", "--lr-warmup-fraction", "0.25"]
    )
    assert _rates(sa, 6)[:6] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])  # 0.25 x 80 samples = 5 x 4
    with pytest.raises(ConfigError, match="alternatives"):
        parse_run_config([*TINY, "--train-iters", "20", "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"])


def test_warmup_shorter_than_one_iteration_is_not_silent(capsys) -> None:
    argv = [*TINY, "--train-iters", "20", "--lr-warmup-fraction", "0.001", "--lr-decay-iters", "20"]
    run = parse_run_config(argv)
    assert any("LR warm-up spans 0.02 iterations" in w for w in run.warnings)


# ------------------------------------------------------------------------------------------------- ramp-up
def test_rampup_batch_sizes_follow_megatron() -> None:
    # START 2, INCR 2, 20 samples to G = 8: 3 increments, one per 20/3 samples of consumption
    ramp = ramp_up_sizes(2, 2, 20, final=8, per_microbatch=2)
    assert ramp == (2, 2, 2, 2, 4, 4, 6)  # consumed before: 0 2 4 6 | 8 12 | 16; 22 > 20 ends the ramp
    sched = BatchSizeSchedule(final=8, per_microbatch=2, ramp=ramp)
    assert [sched.num_microbatches(i) for i in range(9)] == [1, 1, 1, 1, 2, 2, 3, 4, 4]
    assert sched.consumed_before(7) == 22 and sched.consumed_before(9) == 38
    assert iterations_for_samples(sched, 100) == 7 + (100 - 22) // 8
    with pytest.raises(ConfigError, match="multiple of micro-batch x data-parallel size 4"):
        ramp_up_sizes(2, 2, 20, final=8, per_microbatch=4)


def test_rampup_trains_with_growing_batches_pp1() -> None:
    argv = [*TINY, "--global-batch-size", "8", "--train-samples", "40", "--rampup-batch-size", "2", "2", "12"]
    summary, text = _run(argv)
    lines = [line for line in text.splitlines() if "global batch size:" in line]
    gbs = [int(line.split("global batch size:")[1].split("|")[0]) for line in lines]
    consumed = [int(line.split("consumed samples:")[1].split("|")[0]) for line in lines]
    assert gbs == [2, 2, 4, 6, 8, 8, 8] and consumed == [2, 4, 8, 14, 22, 30, 38]
    assert summary.iterations == 7


# ------------------------------------------------------------------------------------------------- exits
def test_exit_duration_in_mins_stops_the_run_and_saves(tmp_path) -> None:
    argv = [*TINY, "--train-iters", "5", "--exit-duration-in-mins", "1e-6", "--save", str(tmp_path)]
    summary, text = _run(argv)
    assert summary.iterations == 1 and "--exit-duration-in-mins" in text
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def _agree(rank: int, world_size: int) -> tuple[bool, bool, bool]:
    from megatron.any_rank_flag import AnyRankFlag
    from megatron.training import _time_is_up

    tr = SimpleNamespace(
        run=SimpleNamespace(training=SimpleNamespace(exit_duration_in_mins=1.0)),
        ctx=SimpleNamespace(is_distributed=True, timeout=None),
    )
    start = time.time() - (120.0 if rank == 1 else 0.0)  # only rank 1's clock has passed the minute
    flag = AnyRankFlag()
    started = _time_is_up(tr, start, flag, wait=False)  # no answer yet: the reduction is only started
    answered = _time_is_up(tr, start, flag, wait=False)  # the previous iteration's answer
    now = _time_is_up(tr, start, AnyRankFlag(), wait=True)
    return started, answered, now


@pytest.mark.slow  # two processes (about 20 s on a loaded 2-core machine)
def test_exit_duration_is_agreed_over_ranks_one_iteration_later_without_a_wait() -> None:
    assert run_multiprocess(_agree, 2, timeout_s=120) == [(False, True, True)] * 2


# ------------------------------------------------------------------------------------------------- checkpoints
def test_save_interval_without_save_is_accepted_with_one_warning(tmp_path, capsys) -> None:
    run = parse_run_config([*TINY, "--train-iters", "2", "--save-interval", "1"])
    assert run.warnings == ("warning: --save-interval 1 without --save: no checkpoint is written",)


def test_no_save_optim_and_no_save_rng_leave_them_out(tmp_path) -> None:
    base = [*TINY, "--train-iters", "1", "--save-interval", "1"]
    _run([*base, "--save", str(tmp_path / "full")])
    _run([*base, "--save", str(tmp_path / "lean"), "--no-save-optim", "--no-save-rng"])

    def files(name: str) -> set[str]:
        manifest = json.loads((tmp_path / name / "iter_0000001" / "manifest.json").read_text())
        return {f.split("_")[0] for f in manifest["files"]}

    assert {"optim", "rng"} <= files("full")
    assert not {"optim", "rng"} & files("lean")
    # resuming a lean checkpoint starts the optimizer fresh and keeps the seeded streams
    _, text = _run([*TINY, "--train-iters", "2", "--load", str(tmp_path / "lean")])
    assert "has no optimizer state" in text


def test_no_load_optim_no_load_rng_and_finetune_change_the_resume(tmp_path) -> None:
    dropout = [*TINY, "--hidden-dropout", "0.1"]  # the last value wins
    _run([*dropout, "--train-iters", "2", "--save", str(tmp_path), "--save-interval", "2"])
    resume = [*dropout, "--train-iters", "4", "--load", str(tmp_path)]
    full, _ = _run(resume)
    no_optim, _ = _run([*resume, "--no-load-optim"])
    no_rng, _ = _run([*resume, "--no-load-rng"])
    finetune, _ = _run([*resume, "--finetune"])
    assert len(full.losses) == 2 and full.iterations == 4
    assert no_optim.losses[0] == full.losses[0] and no_optim.losses[1] != full.losses[1]  # fresh Adam moments
    assert no_rng.losses[0] != full.losses[0]  # other dropout masks: the seeded streams, not the saved ones
    assert finetune.iterations == 4 and len(finetune.losses) == 4  # weights only, from iteration 0


def test_use_checkpoint_args_takes_the_model_from_the_checkpoint(tmp_path) -> None:
    _run([*TINY, "--train-iters", "1", "--save", str(tmp_path), "--save-interval", "1"])
    other = [a if a != "32" else "64" for a in TINY]  # --hidden-size 64 on the command line
    run = parse_run_config([*other, "--train-iters", "2", "--load", str(tmp_path), "--use-checkpoint-args"])
    assert run.model.hidden_size == 32 and run.model.num_layers == 2
    assert parse_run_config([*other, "--train-iters", "2"]).model.hidden_size == 64
    with pytest.raises(ConfigError, match="--use-checkpoint-args needs --load"):
        parse_run_config([*TINY, "--train-iters", "2", "--use-checkpoint-args"])


# ------------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_type_defaults_to_gpt2_bpe_and_mock_data_needs_none(tmp_path, capsys) -> None:
    values, _ = parse_flags(["--mock-data"])
    assert values["tokenizer_type"] == "GPT2BPETokenizer"
    run = parse_run_config([a for a in TINY if a not in ("--vocab-size", "96")] + ["--train-iters", "1"])
    assert run.model.vocab_size == 1024  # --mock-data: no tokenizer demanded
    prefix = _write_dataset(tmp_path / "d", seed=0)
    real = [a for a in TINY if a not in ("--vocab-size", "96", "--mock-data")]
    code, err = _main([*real, "--train-iters", "1", "--data-path", prefix], capsys)
    assert code == 2 and "GPT2BPETokenizer needs --vocab-file and --merge-file" in err and err.count("\n") == 1


# ------------------------------------------------------------------------------------------------- data
def _write_dataset(path: Path, *, seed: int, low: int = 0, high: int = 48, docs: int = 40) -> str:
    from megatron.data.indexed_dataset import IndexedDatasetWriter

    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    prefix = str(path / "text_document")
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
        for _ in range(docs):
            w.add_document(rng.integers(low, high, size=int(rng.integers(20, 60))))
    return prefix


def _datasets(argv: list[str]):
    from megatron.parallel.context import ParallelContext
    from megatron.training_setup import build_datasets

    run = parse_run_config(argv)
    ctx = ParallelContext.initialize(tp=1, pp=1)
    try:
        return run, build_datasets(run, ctx)
    finally:
        ctx.shutdown()


def test_data_cache_path_and_per_split_data_paths(tmp_path) -> None:
    low = _write_dataset(tmp_path / "low", seed=1, low=0, high=48)
    high = _write_dataset(tmp_path / "high", seed=2, low=48, high=96)
    real = [a for a in TINY if a != "--mock-data"]
    cache = tmp_path / "my_cache"
    _, (train, valid) = _datasets(
        [*real, "--train-iters", "3", "--eval-iters", "1", "--eval-interval", "3", "--train-data-path", low,
         "--valid-data-path", high, "--data-cache-path", str(cache)]
    )  # fmt: skip
    assert any(cache.iterdir()) and not (tmp_path / "low" / "cache").exists()  # the indices went to the cache path
    train_tokens = np.concatenate([train[i]["tokens"].numpy() for i in range(len(train))])
    valid_tokens = np.concatenate([valid[i]["tokens"].numpy() for i in range(len(valid))])
    assert train_tokens.max() < 48 and valid_tokens.min() >= 48  # each split from its own path, used whole
    with pytest.raises(ConfigError, match="alternatives"):
        parse_run_config([*real, "--train-iters", "1", "--data-path", low, "--train-data-path", low])


def test_dataloader_type_cyclic_reads_each_pass_in_a_new_seeded_order() -> None:
    from megatron.data.loader import CyclicOrder

    base = list(range(10))
    order = CyclicOrder(base, seed=3)
    first, second = [order[i] for i in range(10)], [order[i] for i in range(10, 20)]
    assert sorted(first) == base and sorted(second) == base and first != base and first != second
    run, (train, _) = _datasets([*TINY, "--train-iters", "2", "--dataloader-type", "cyclic"])
    assert isinstance(train, CyclicOrder)
    single = [*TINY, "--train-iters", "3", "--global-batch-size", "4"]
    a, _ = _run(single)
    b, _ = _run([*single, "--dataloader-type", "cyclic"])
    assert a.losses != b.losses  # other samples


def test_num_workers_loads_in_worker_processes_with_identical_losses() -> None:
    from megatron.data.loader import MicrobatchLoader

    argv = [*TINY, "--train-iters", "3", "--global-batch-size", "4"]
    a, _ = _run(argv)
    b, _ = _run([*argv, "--num-workers", "2"])
    assert a.losses == b.losses
    run = parse_run_config([*argv, "--num-workers", "2"])
    from megatron.data.mock_data import MockGPTDataset

    data = MockGPTDataset(seed=5, seq_length=16, vocab_size=96, split="train", num_samples=64)
    loader = MicrobatchLoader(run, data, dp_rank=0, device=torch.device("cpu"), start=0)
    assert loader._iter is not None and loader._iter._num_workers == 2  # a DataLoader with two workers
    assert torch.equal(loader.batches(0)[0]["tokens"], torch.stack([data[0]["tokens"], data[1]["tokens"]]))


# ------------------------------------------------------------------------------------------------- profiling
@pytest.mark.slow  # torch.profiler takes about 10 s to start on CPU
def test_profile_writes_a_torch_profiler_trace_on_the_chosen_ranks_and_steps(tmp_path) -> None:
    argv = [*TINY, "--train-iters", "3", "--profile", "--use-pytorch-profiler", "--profile-step-start", "1",
            "--profile-step-end", "2", "--tensorboard-dir", str(tmp_path / "tb")]  # fmt: skip
    _run([*argv, "--profile-ranks", "0"])
    trace = tmp_path / "tb" / "rank0_iters1-2.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)
    trace.unlink()
    _run([*argv, "--profile-ranks", "1"])  # rank 0 is not asked to profile
    assert not trace.exists()
    with pytest.raises(ConfigError, match="--profile-step-end"):
        parse_run_config([*argv, "--profile-step-end", "1"])


def test_enable_zero_bubble_alone_gets_the_forks_default_window() -> None:
    cfg = ScheduleConfig.from_flags({"enable_zero_bubble": True})
    assert (cfg.schedule, cfg.timers_start_iter, cfg.timers_end_iter) == ("zb-auto", 100, 110)
    v = ScheduleConfig.from_flags({"zero_bubble_v_schedule": True, "zero_bubble_pipeline_timers_start_iter": 5})
    assert (v.timers_start_iter, v.timers_end_iter) == (5, 110)
    assert ScheduleConfig.from_flags({"pipeline_schedule": "zb-auto"}).timers_start_iter is None  # our own flag


# ------------------------------------------------------------------------------------------------- logging
class _Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int]] = []

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.calls.append((name, value, step))


def test_tensorboard_log_interval_zeros_and_memory() -> None:
    sink = _Sink()
    argv = [*TINY, "--train-iters", "4", "--tensorboard-log-interval", "2", "--log-num-zeros-in-grad",
            "--log-memory-to-tensorboard", "--untie-embeddings-and-output-weights"]  # fmt: skip
    _, text = _run(argv, scalar_sink=sink)
    assert sorted({step for name, _, step in sink.calls if name == "lm loss"}) == [2, 4]
    assert {"num-zeros", "batch-size", "learning-rate"} <= {name for name, _, _ in sink.calls}
    # untied: the input-embedding rows of the 96-token vocabulary that a batch of 2 x 16 tokens misses get no
    # gradient, so at least (96 - 32) rows x 32 hidden entries are zero
    assert all(v >= (96 - 32) * 32 for name, v, _ in sink.calls if name == "num-zeros")
    lines = [line for line in text.splitlines() if "global batch size:" in line]
    assert all(" num zeros: " in line and (" mem-max-rss-bytes: " in line or "mem-allocated" in line) for line in lines)
    plain = _Sink()
    _, text = _run([*TINY, "--train-iters", "2"], scalar_sink=plain)
    assert sorted({s for n, _, s in plain.calls if n == "lm loss"}) == [1, 2] and " num zeros: " not in text


def test_warned_flags_print_one_line_each(capsys) -> None:
    argv = [*TINY, "--train-iters", "1", "--DDP-impl", "local", "--no-barrier-with-level-1-timing",
            "--timing-log-level", "2"]  # fmt: skip
    run = parse_run_config(argv)
    warnings = run.ignored_flag_warnings()
    assert [w.split()[1] for w in warnings] == ["--DDP-impl", "--no-barrier-with-level-1-timing", "--timing-log-level"]


def _zeros(rank: int, world_size: int, argv: list[str]) -> list[float]:
    torch.set_num_threads(1)
    sink = _Sink()
    pretrain(parse_run_config(argv, world_size=world_size), stream=io.StringIO(), scalar_sink=sink)
    return [v for name, v, _ in sink.calls if name == "num-zeros"]


@pytest.mark.slow  # three pairs of processes
def test_num_zeros_counts_the_whole_model_once_at_any_layout() -> None:
    argv = [*TINY, "--train-iters", "2", "--global-batch-size", "4", "--log-num-zeros-in-grad",
            "--untie-embeddings-and-output-weights"]  # fmt: skip
    one = _zeros(0, 1, argv)
    assert one and all(v > 0 for v in one)
    for extra in ([], ["--use-distributed-optimizer"], ["--pipeline-model-parallel-size", "2"]):
        got = run_multiprocess(_zeros, 2, args=([*argv, *extra],), timeout_s=240)[0]
        # iteration 1 starts from identical weights: the same gradient, the same zeros (later iterations' weights
        # differ in the last bits between layouts, and so may an exact zero)
        assert got[0] == one[0], extra
