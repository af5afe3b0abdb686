"""A dead or stopped rank, named: every surviving rank prints one line and exits with code 3.

- The communication layer turns a backend's peer error (gloo's "Connection reset by peer" or "Timed out waiting
  ...ms") into ``comm.PeerFailedError`` naming the call, the group, its members, this rank and the ranks waited for;
  any other error passes through unchanged (a fake backend underneath the layer, one process).
- The trainer: pp = 2 x dp = 2 on gloo (4 processes, tiny GPT, ``--distributed-timeout-seconds 10``); at the start of
  iteration 2 rank 3 (stage 1) kills itself (SIGKILL) or stops (SIGSTOP).  Every survivor's ``pretrain_gpt.main``
  returns 3 within the timeout + 10 s of the fault, having printed exactly one line to stderr that names itself
  with its stage, the call, the group and a peer rank with its stage; rank 0's line says what to do.
- Slow: the same through the real command line (4 ``pretrain_gpt.py`` processes launched by hand, the fault sent
  from outside), which checks the exit codes and each process's whole stderr.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron.peer_failure import EXIT_PEER_FAILURE, peer_failure_line
from zb_pipeline import comm
from zb_pipeline.testing import MultiProcessError, run_multiprocess

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 10.0
ARGV = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--vocab-size", "100", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--train-iters", "1000", "--lr", "5e-3", "--eval-iters", "0", "--log-interval", "1", "--seed", "3",
    "--pipeline-model-parallel-size", "2", "--distributed-timeout-seconds", f"{TIMEOUT_S:g}",
]  # fmt: skip
VICTIM, AT_ITERATION = 3, 2
STAGE = {0: 0, 1: 0, 2: 1, 3: 1}  # pp = 2 x dp = 2, rank order tp-dp-pp
# One line: "pretrain_gpt.py: peer failure: rank R (stage S): OP over group G [members] failed|timed out waiting for
# rank P (stage Q): cause" (rank 0 adds what to do).
LINE = re.compile(
    r"^pretrain_gpt\.py: peer failure: rank (?P<rank>\d) \(stage (?P<stage>\d)\): (?P<op>.+?) over group "
    r"(?P<group>[\w-]+) \[(?P<members>[\d, ]+)\] (failed|timed out) waiting for rank (?P<peer>\d) \(stage "
    r"(?P<peer_stage>\d)\): (?P<cause>.+)$"
)


# ----------------------------------------------------------------------------------- the layer, one process
class _FailingBackend:
    """Stands in for ``torch.distributed``: ``all_reduce`` and ``wait`` raise ``error``; rank 1 of 4."""

    ReduceOp = SimpleNamespace(SUM="sum")

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def get_rank(self, group=None) -> int:
        return 1

    def get_world_size(self, group=None) -> int:
        return 4

    def get_backend(self, group=None) -> str:
        return "gloo"

    def get_process_group_ranks(self, group) -> list[int]:
        return [1, 3]

    def all_reduce(self, t, op=None, group=None, async_op=False):
        raise self.error


class _Group:
    group_desc = "dp"


class _Work:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def wait(self, timeout=None) -> None:
        raise self.error


RESET = RuntimeError(
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:8627: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
)
TIMED_OUT = RuntimeError(
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for "
    "recv operation to complete"
)


def test_the_layer_names_the_call_group_and_peers_of_a_peer_error() -> None:
    import torch

    group = _Group()
    with comm.use(_FailingBackend(RESET)):
        with pytest.raises(comm.PeerFailedError) as info:
            comm.all_reduce(torch.zeros(2), group=group)
    err = info.value
    assert (err.op, err.group, err.members, err.rank, err.peers) == ("all_reduce", "dp", (1, 3), 1, (3,))
    assert not err.timed_out and err.cause == "Read error [127.0.0.1]:8627: Connection reset by peer"
    assert err.__cause__ is RESET
    assert err.line({1: "stage 0", 3: "stage 1"}) == (
        "rank 1 (stage 0): all_reduce over group dp [1, 3] failed waiting for rank 3 (stage 1): "
        "Read error [127.0.0.1]:8627: Connection reset by peer"
    )
    # A timed-out wait on an async collective: the caller names the call; the peers default to the other members.
    with comm.use(_FailingBackend(TIMED_OUT)):
        with pytest.raises(comm.PeerFailedError) as info:
            comm.wait(_Work(TIMED_OUT), group=group, timeout=timedelta(seconds=3), op="gradient all_reduce")
    err = info.value
    assert err.timed_out and err.op == "gradient all_reduce" and err.peers == (3,)
    assert err.cause == "Timed out waiting 3000ms for recv operation to complete"
    first = peer_failure_line(err, labels={1: "stage 0", 3: "stage 1"}, first_rank=True, timeout_s=3.0)
    assert first.startswith("peer failure: rank 1 (stage 0): gradient all_reduce over group dp [1, 3] timed out")
    assert "rank 3 did not answer in time: check its log" in first
    assert "--distributed-timeout-minutes (now 3 s)" in first
    assert "\n" not in first
    # Not a peer error (a bad argument): unchanged.
    bad = RuntimeError("Tensors must be contiguous")
    with comm.use(_FailingBackend(bad)):
        with pytest.raises(RuntimeError) as info:
            comm.all_reduce(torch.zeros(2), group=group)
    assert info.value is bad


# ------------------------------------------------------------------------------ the trainer, pp = 2 x dp = 2
def _train_rank(rank: int, world_size: int, argv: list[str], sig: str, stamp: str) -> tuple[int, str, float]:
    """``pretrain_gpt.main(argv)`` on this rank: (exit code, its stderr, when it returned).  Rank ``VICTIM`` sends
    itself ``sig`` at the start of iteration ``AT_ITERATION`` (after writing the time to ``stamp``)."""
    import megatron.training as training
    import pretrain_gpt

    if rank == VICTIM:
        real_step = training.train_step

        def faulty_step(tr, **kwargs):
            if tr.iteration == AT_ITERATION:
                Path(stamp).write_text(repr(time.time()))
                if sig == "STOP":  # a sleeper wakes it once the survivors are done (SIGCONT: harmless to a reused pid)
                    subprocess.Popen(["sh", "-c", f"sleep {TIMEOUT_S + 12:g}; kill -CONT {os.getpid()}"])
                os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
                raise RuntimeError(f"rank {rank} continued after SIG{sig} (the survivors have reported by now)")
            return real_step(tr, **kwargs)

        training.train_step = faulty_step  # fault injection in this test process only
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = pretrain_gpt.main(argv)
    return code, err.getvalue(), time.time()


def _check_survivor(rank: int, code: int, stderr: str, took_s: float) -> None:
    lines = stderr.splitlines()
    assert code == EXIT_PEER_FAILURE, f"rank {rank}: exit code {code}, stderr:\n{stderr}"
    assert len(lines) == 1, f"rank {rank} must print exactly one line:\n{stderr}"
    m = LINE.match(lines[0].split("; rank ")[0] if rank == 0 else lines[0])
    assert m, f"rank {rank}: {lines[0]}"
    assert int(m["rank"]) == rank and int(m["stage"]) == STAGE[rank], lines[0]
    peer = int(m["peer"])
    assert peer != rank and int(m["peer_stage"]) == STAGE[peer], lines[0]
    members = [int(x) for x in m["members"].split(", ")]
    assert rank in members and peer in members, lines[0]
    assert m["group"] in ("pp", "dp", "embedding", "model-parallel", "stage", "world"), lines[0]
    if rank == 0:
        assert "check its log" in lines[0] and "--distributed-timeout-minutes (now 10 s)" in lines[0], lines[0]
    if peer == VICTIM:  # the rank that waited for the faulty one directly
        assert ("timed out" in lines[0]) or ("onnection" in m["cause"]), lines[0]
    assert took_s <= TIMEOUT_S + 10, f"rank {rank} reported {took_s:.1f} s after the fault: {lines[0]}"


def _faulty_run(sig: str, tmp_path: Path) -> None:
    stamp = str(tmp_path / "fault_time")
    with pytest.raises(MultiProcessError) as info:
        run_multiprocess(
            _train_rank,
            4,
            args=(ARGV, sig, stamp),
            timeout_s=180,
            init_process_group=False,
            failure_grace_s=TIMEOUT_S + 15,
        )
    err = info.value
    assert set(err.failures) == {VICTIM}, err  # only the faulty rank fails; the others return their exit code
    fault_at = float(Path(stamp).read_text())
    victims_stage = STAGE[VICTIM]
    named = set()
    for rank in (0, 1, 2):
        code, stderr, done_at = err.results[rank]
        _check_survivor(rank, code, stderr, done_at - fault_at)
        named.add(int(LINE.match(stderr.splitlines()[0].split("; rank ")[0])["peer"]))
    assert VICTIM in named, f"no survivor named rank {VICTIM} (stage {victims_stage})"


def test_killed_rank_is_named_by_every_survivor(tmp_path: Path) -> None:
    _faulty_run("KILL", tmp_path)


@pytest.mark.slow
def test_stopped_rank_is_named_by_every_survivor(tmp_path: Path) -> None:
    _faulty_run("STOP", tmp_path)


# ------------------------------------------------------------------------------ the real command line (slow)
def _launch_by_hand(tmp_path: Path) -> tuple[list[subprocess.Popen], list[Path], list[Path]]:
    """Four ``pretrain_gpt.py`` processes joined through a store this test hosts (as a launcher would)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    procs, outs, errs = [], [], []
    for r in range(4):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="4", LOCAL_WORLD_SIZE="4")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        outs.append(tmp_path / f"out{r}")
        errs.append(tmp_path / f"err{r}")
        with outs[-1].open("w") as out, errs[-1].open("w") as er:
            procs.append(
                subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), *ARGV], env=env, stdout=out, stderr=er)
            )
    procs[0].store = store  # keep the store alive as long as the processes
    return procs, outs, errs


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["KILL", "STOP"])
def test_command_line_survivors_print_one_line_and_exit_3(sig: str, tmp_path: Path) -> None:
    procs, outs, errs = _launch_by_hand(tmp_path)
    try:
        deadline = time.monotonic() + 240
        while sum(p.read_text().count(" iteration ") for p in outs) < AT_ITERATION:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.read_text() for p in errs]
            time.sleep(0.1)
        fault_at = time.monotonic()
        os.kill(procs[VICTIM].pid, getattr(signal, f"SIG{sig}"))
        for rank in (0, 1, 2):
            code = procs[rank].wait(timeout=TIMEOUT_S + 10 + 5)
            _check_survivor(rank, code, errs[rank].read_text(), time.monotonic() - fault_at)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
