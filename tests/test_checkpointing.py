"""Checkpoints that never lose a run: bit-exact resume across processes, atomic saves under injected faults,
ENOSPC, tampered files refused without executing anything, SIGTERM, and one-line errors for bad input.

Resume: the losses of an uninterrupted N-step run equal, bit for bit, those of an N/2-step run that saves, stops
(its processes end) and a fresh launch that loads and runs to N (fp32, dropout on).
"""

from __future__ import annotations

import io
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from training_runs import pretrain_rank

from megatron import checkpoint_files as cf
from megatron.arguments import parse_run_config
from megatron.config.errors import ConfigError, RunAbortedError
from megatron.training import pretrain
from zb_pipeline.testing.harness import run_multiprocess

ROOT = Path(__file__).resolve().parents[1]
N = 6
BASE = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "100", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--train-iters", str(N), "--lr", "5e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
    "--eval-iters", "0", "--log-interval", "1", "--seed", "7",
    "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--distributed-timeout-seconds", "120",
]  # fmt: skip


def _launch(argv: list[str], world_size: int = 1, env: dict[str, str] | None = None) -> list[float]:
    return run_multiprocess(pretrain_rank, world_size, args=(argv,), timeout_s=240, env=env)[0]["losses"]


def _resume_case(tmp_path: Path, extra: list[str], world_size: int) -> None:
    argv = [*BASE, *extra]
    full = _launch(argv, world_size)
    ckpt = str(tmp_path / "ckpt")
    first = _launch([*argv, "--save", ckpt, "--exit-interval", str(N // 2)], world_size)
    assert cf.read_tracker(ckpt) == N // 2
    second = _launch([*argv, "--load", ckpt], world_size)
    assert len(first) == N // 2 and len(second) == N - N // 2
    assert first + second == full, "resumed losses must equal the uninterrupted run bit for bit"


@pytest.mark.slow  # the default run resumes single-rank in test_crash_during_save_keeps_previous_checkpoint
def test_resume_is_bit_exact_single_rank(tmp_path):
    _resume_case(tmp_path, [], 1)


def test_resume_is_bit_exact_dp2_distributed_optimizer(tmp_path):
    _resume_case(tmp_path, ["--use-distributed-optimizer"], 2)


def test_resume_is_bit_exact_sgd_dp2_distributed_optimizer(tmp_path):
    # the momentum buffers are sharded, saved and re-tiled like Adam's moments; without them the resume would differ
    _resume_case(tmp_path, ["--optimizer", "sgd", "--sgd-momentum", "0.8", "--use-distributed-optimizer"], 2)


@pytest.mark.slow
def test_resume_is_bit_exact_tp2_dp2_distributed_optimizer(tmp_path):
    _resume_case(tmp_path, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"], 4)


@pytest.mark.slow
def test_resume_is_bit_exact_bf16_tp2(tmp_path):
    _resume_case(tmp_path, ["--tensor-model-parallel-size", "2", "--bf16"], 2)


# ------------------------------------------------------------------------------------------- faults during a save
def _in_process(argv: list[str]) -> list[float]:
    torch.set_num_threads(1)
    return list(pretrain(parse_run_config(argv), stream=io.StringIO()).losses)


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    argv = [*BASE, "--save", ckpt, "--save-interval", "2"]
    reference = _in_process(BASE)
    monkeypatch.setenv("ZB_CKPT_FAULT_ITERATION", "4")
    monkeypatch.setenv("ZB_CKPT_FAIL_AFTER_FILES", "2")
    with pytest.raises(cf.SimulatedCrashError):
        _in_process(argv)
    monkeypatch.delenv("ZB_CKPT_FAIL_AFTER_FILES")
    assert cf.read_tracker(ckpt) == 2
    assert not cf.iteration_dir(ckpt, 4).exists() and cf.tmp_dir(ckpt, 4).exists()  # as a killed process leaves it
    # The resumed run saves iterations 3 and 6, never 4 again: its first save removes the crashed save's directory.
    resumed = _in_process([*BASE, "--load", ckpt, "--save", ckpt, "--save-interval", "3"])
    assert resumed == reference[2:], "resuming from the surviving checkpoint must continue the run exactly"
    assert cf.read_tracker(ckpt) == N and cf.iteration_dir(ckpt, 3).is_dir()
    assert not list(Path(ckpt).glob("*.tmp")), "a stale temporary directory outlived a successful save"


def test_enospc_stops_run_with_clear_message_and_keeps_previous(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    monkeypatch.setenv("ZB_CKPT_FAULT_ITERATION", "4")
    monkeypatch.setenv("ZB_CKPT_ENOSPC", "1")
    with pytest.raises(RunAbortedError) as info:
        _in_process([*BASE, "--save", ckpt, "--save-interval", "2"])
    message = str(info.value)
    assert "\n" not in message and "No space left on device" in message
    assert "previous checkpoint (iteration 2) is intact" in message
    assert cf.read_tracker(ckpt) == 2 and not cf.tmp_dir(ckpt, 4).exists()
    monkeypatch.delenv("ZB_CKPT_ENOSPC")
    assert len(_in_process([*BASE, "--load", ckpt])) == N - 2


# ---------------------------------------------------------------------------------------------- tampered files
class _Payload:
    """Pickles to a call of ``os.system``: what a malicious checkpoint would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
    _in_process([*BASE, "--train-iters", "2", "--save", str(ckpt)])
    return ckpt


def _copy(saved: Path, tmp_path: Path) -> Path:
    import shutil

    dst = tmp_path / "ckpt"
    shutil.copytree(saved, dst)
    return dst


def test_truncated_file_is_refused(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    target = cf.iteration_dir(ckpt, 2) / cf.model_file(0, 0)
    target.write_bytes(target.read_bytes()[:1000])
    with pytest.raises(ConfigError, match="is damaged: 1000 bytes"):
        _in_process([*BASE, "--load", str(ckpt)])


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickled_code_is_refused_and_never_runs(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    marker = tmp_path / "pwned"
    directory = cf.iteration_dir(ckpt, 2)
    target = directory / cf.rng_file(0)
    target.write_bytes(pickle.dumps({"torch": _Payload(marker)}))
    with pytest.raises(ConfigError, match="is damaged"):
        _in_process([*BASE, "--load", str(ckpt)])
    # An attacker who also rewrites the manifest still gets nothing executed: weights_only refuses the object.
    import json

    manifest = json.loads((directory / cf.MANIFEST).read_text())
    manifest["files"][target.name] = cf.file_entry(target)
    (directory / cf.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="refusing checkpoint file .*not plain tensors"):
        _in_process([*BASE, "--load", str(ckpt)])
    assert not marker.exists(), "loading must never execute code from a checkpoint"


def _load_rank(rank: int, world_size: int, argv: list[str]) -> tuple[str, str]:
    """``pretrain(argv)`` on this rank: (the error it raised, or "", its log)."""
    torch.set_num_threads(1)
    log = io.StringIO()
    try:
        pretrain(parse_run_config(argv, world_size=world_size), stream=log)
    except ConfigError as err:
        return str(err), log.getvalue()
    return "", log.getvalue()


def test_load_refused_by_another_rank_logs_no_loaded_line(tmp_path):
    # dp = 2: rank 1's RNG file is damaged, rank 0's part is fine; rank 0 (the logging rank) must not say "loaded".
    ckpt = tmp_path / "ckpt"
    argv = [*BASE, "--train-iters", "1", "--save", str(ckpt)]
    run_multiprocess(_load_rank, 2, args=(argv,), timeout_s=120)
    target = cf.iteration_dir(ckpt, 1) / cf.rng_file(1)
    intact = target.read_bytes()
    target.write_bytes(intact[:-8])
    load = [*BASE, "--train-iters", "2", "--load", str(ckpt)]
    results = run_multiprocess(_load_rank, 2, args=(load,), timeout_s=120)
    for error, _ in results:  # every rank refuses, with the damaged file named
        assert f"checkpoint file {target} is damaged" in error, error
    assert "loaded checkpoint" not in results[0][1], results[0][1]


def test_accepted_load_logs_loaded_line(saved, tmp_path):
    error, log = _load_rank(0, 1, [*BASE, "--train-iters", "3", "--load", str(_copy(saved, tmp_path))])
    assert error == "" and f"loaded checkpoint {cf.iteration_dir(tmp_path / 'ckpt', 2)} (iteration 2)" in log, log


# ---------------------------------------------------------------------------------------------------- bad input
def test_bad_load_and_save_inputs_are_one_line_errors(saved, tmp_path):
    cases = []
    with pytest.raises(ConfigError) as e:
        _in_process([*BASE, "--load", str(tmp_path / "missing")])
    cases.append((e.value, "does not exist"))
    ckpt = _copy(saved, tmp_path)
    (ckpt / cf.TRACKER).write_text("9\n")
    with pytest.raises(ConfigError) as e:
        _in_process([*BASE, "--load", str(ckpt)])
    cases.append((e.value, "points at iteration 9"))
    (ckpt / cf.TRACKER).write_text("2\n")
    with pytest.raises(ConfigError) as e:
        _in_process([*BASE, "--load", str(ckpt), "--hidden-size", "64"])
    cases.append((e.value, "is of another model: hidden_size=32"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError) as e:
        _in_process([*BASE, "--save", str(blocker / "sub")])
    cases.append((e.value, "is not writable"))
    for err, needle in cases:
        assert needle in str(err) and "\n" not in str(err), str(err)


def test_layout_mismatch_names_the_converter(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_multiprocess(
        pretrain_rank,
        2,
        args=([*BASE, "--train-iters", "1", "--save", ckpt, "--tensor-model-parallel-size", "2"],),
        timeout_s=120,
    )
    with pytest.raises(ConfigError, match=r"tp=2, pp=1 but this run has tp=1.*checkpoint_convert.py --target-tp 1"):
        _in_process([*BASE, "--load", ckpt])


@pytest.mark.slow
def test_cli_bad_load_exits_2_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), *BASE, "--load", str(tmp_path / "nowhere")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "does not exist" in proc.stderr


# ----------------------------------------------------------------------------------------------------- signals
@pytest.mark.slow
def test_sigterm_saves_and_resume_is_bit_exact(tmp_path):
    ckpt = tmp_path / "ckpt"
    iters = 40
    argv = [*BASE, "--train-iters", str(iters)]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), *argv, "--save", str(ckpt), "--exit-signal-handler"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )  # fmt: skip
    lines = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if line.startswith(" iteration        3/"):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    text = "".join(lines) + rest
    assert proc.returncode == 0, text
    assert "exiting program after receiving SIGTERM" in text
    stopped = cf.read_tracker(ckpt)
    assert stopped is not None and 3 <= stopped < iters
    reference = _in_process(argv)
    resumed = _in_process([*argv, "--load", str(ckpt)])
    assert resumed == reference[stopped:]


def test_sigterm_in_process_saves_at_iteration_end(tmp_path):
    """The handler path without a subprocess: SIGTERM raised during iteration 2 saves iteration 2 and exits."""
    from megatron import training

    ckpt = tmp_path / "ckpt"
    original = training.train_step
    calls = []

    def step_then_signal(tr, **kwargs):
        res = original(tr, **kwargs)
        calls.append(tr.iteration)
        if tr.iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
        return res

    training.train_step = step_then_signal
    try:
        out = io.StringIO()
        pretrain(parse_run_config([*BASE, "--save", str(ckpt), "--exit-signal-handler"]), stream=out)
    finally:
        training.train_step = original
    assert calls == [1, 2] and cf.read_tracker(ckpt) == 2
    assert "exiting program after receiving SIGTERM, at iteration 2" in out.getvalue()
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None) or callable(signal.getsignal(signal.SIGTERM))
