"""The multi-rank test harness: results come back per rank, failures carry tracebacks, hangs are killed."""

import os
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from zb_pipeline.testing import MultiProcessError, run_multiprocess, run_torchrun


def _allreduce_rank(rank: int, world_size: int, scale: float) -> tuple[float, int, int, str, str]:
    t = torch.tensor([float(rank) * scale])
    dist.all_reduce(t)
    return t.item(), dist.get_rank(), torch.get_num_threads(), os.environ["RANK"], os.environ.get("ZB_T", "-")


def _rank1_raises(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one is broken on purpose")
    t = torch.ones(1)
    dist.all_reduce(t)  # the other ranks wait for rank 1 here and must not hang
    return rank


def _rank0_hangs(rank: int, world_size: int) -> int:
    if rank == 0:
        _sleep_forever_marker()
    return rank


def _sleep_forever_marker() -> None:
    while True:
        time.sleep(0.05)


def _no_group(rank: int, world_size: int) -> tuple[bool, str]:
    initialised = dist.is_initialized()
    dist.init_process_group("gloo")  # env:// as under torchrun, through the parent's store
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return initialised, str(t.item())


def _returns_unpicklable(rank: int, world_size: int):
    return lambda: rank


def test_results_per_rank_and_one_thread():
    out = run_multiprocess(_allreduce_rank, 3, args=(2.0,), timeout_s=60, env={"ZB_T": "yes"})
    assert out == [(6.0, 0, 1, "0", "yes"), (6.0, 1, 1, "1", "yes"), (6.0, 2, 1, "2", "yes")]


def test_single_rank_works():
    assert run_multiprocess(_allreduce_rank, 1, args=(5.0,), timeout_s=60) == [(0.0, 0, 1, "0", "-")]


@pytest.mark.slow
def test_spawn_start_method():
    out = run_multiprocess(_allreduce_rank, 2, args=(1.0,), timeout_s=60, start_method="spawn")
    assert out == [(1.0, 0, 1, "0", "-"), (1.0, 1, 1, "1", "-")]


def test_failing_rank_reports_traceback_and_others_do_not_hang():
    start = time.monotonic()
    with pytest.raises(MultiProcessError) as info:
        run_multiprocess(_rank1_raises, 3, timeout_s=60, failure_grace_s=3)
    err = info.value
    assert next(iter(err.failures)) == 1  # the first failure listed is the real one
    assert "ValueError: rank one is broken on purpose" in err.failures[1]
    assert "_rank1_raises" in err.failures[1]  # a real traceback
    assert "rank 1" in str(err) and "broken on purpose" in str(err)
    assert time.monotonic() - start < 55  # well before the 60 s timeout: the grace period ended it


def test_hanging_rank_is_killed_at_timeout_with_its_stack():
    with pytest.raises(MultiProcessError) as info:
        run_multiprocess(_rank0_hangs, 2, timeout_s=3)
    err = info.value
    assert list(err.failures) == [0]
    assert "timed out after 3 s" in err.failures[0]
    assert "_sleep_forever_marker" in err.failures[0]  # the stack shows where it hung
    assert err.results[1] == 1


def test_fn_may_initialise_the_group_itself():
    out = run_multiprocess(_no_group, 2, timeout_s=60, init_process_group=False)
    assert out == [(False, "3"), (False, "3")]


def test_unpicklable_result_is_a_failure():
    with pytest.raises(MultiProcessError, match="does not pickle"):
        run_multiprocess(_returns_unpicklable, 1, timeout_s=60)


def test_lambda_is_rejected_up_front():
    with pytest.raises(ValueError, match="must pickle"):
        run_multiprocess(lambda r, w: r, 1)


@pytest.mark.slow  # ~30 s on a busy 2-core machine (three torch imports); the CLI tests use run_torchrun too
def test_torchrun_output_and_exit_code(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import torch, torch.distributed as dist
            torch.set_num_threads(1)
            dist.init_process_group("gloo")
            t = torch.tensor([dist.get_rank() + 1.0])
            dist.all_reduce(t)
            print(f"rank {dist.get_rank()} sum {t.item():.0f}", flush=True)
            rank = dist.get_rank()
            dist.destroy_process_group()
            if rank == 1:
                print("bad input: fix it", file=sys.stderr, flush=True)
                sys.exit(2)
            """
        )
    )
    res = run_torchrun([str(script)], 2, timeout_s=180)
    assert not res.timed_out, res.output
    assert res.returncode != 0  # torchrun reports the failed rank
    assert "rank 0 sum 3" in res.output and "rank 1 sum 3" in res.output
    assert "bad input: fix it" in res.output


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc to check that nothing survives")
def test_torchrun_timeout_kills_every_rank(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import os, time\nprint('pid', os.getpid(), flush=True)\nwhile True:\n    time.sleep(0.1)\n")
    res = run_torchrun([str(script)], 2, timeout_s=15)
    assert res.timed_out
    pids = [int(line.split()[1]) for line in res.stdout.splitlines() if line.startswith("pid ")]
    time.sleep(0.5)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), f"rank process {pid} survived the timeout"


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")
    except OSError:
        return True


class _ExitedRank:
    """A rank process that has already exited (what ``_collect`` sees when the parent reads late)."""

    def __init__(self, exitcode: int) -> None:
        import multiprocessing

        self.exitcode = exitcode
        self._r, self._w = multiprocessing.Pipe(duplex=False)
        self._w.close()
        self.sentinel = self._r  # ready at once, like a dead process's sentinel

    def is_alive(self) -> bool:
        return False

    def join(self, timeout: float | None = None) -> None:
        return None


def test_reports_already_in_the_pipes_are_read_after_every_rank_exited():
    # A busy parent may first look after every rank sent its report, passed the closing barrier and exited: the
    # reports are still in the pipes and must come back (they were dropped as None once).
    import multiprocessing

    from zb_pipeline.testing.harness import _collect

    procs, readers = [], []
    for msgs in [[("ready",), ("ok", {"big": list(range(2_000))})], [("ready",), ("ok", 1)], []]:
        r, w = multiprocessing.Pipe(duplex=False)
        for msg in msgs:
            w.send(msg)
        w.close()
        procs.append(_ExitedRank(0 if msgs else 3))
        readers.append(r)
    results, failures = _collect(procs, readers, ["", "", ""], 5.0, 1.0, 5.0)
    assert results[0] == {"big": list(range(2_000))} and results[1] == 1 and results[2] is None
    assert list(failures) == [2] and "exited with code 3 before reporting a result" in failures[2]
