"""ParallelContext on real gloo process groups: groups match the rank math and communicate over the right ranks."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron.parallel.context import ParallelContext
from megatron.parallel.rank_math import RankLayout
from zb_pipeline.testing import MultiProcessError, run_multiprocess


def _group_sum(group, ctx, value: float) -> float:
    t = torch.tensor([value])
    if group is not None:
        dist.all_reduce(t, group=group)
    return t.item()


def _check_context(rank: int, world_size: int, tp: int, pp: int) -> dict:
    ctx = ParallelContext.initialize(tp=tp, pp=pp, timeout=timedelta(seconds=60))
    lay = RankLayout.build(world_size, tp=tp, pp=pp)
    c = lay.coords(rank)
    assert (ctx.rank, ctx.world_size, ctx.backend, ctx.device.type) == (rank, world_size, "gloo", "cpu")
    assert (ctx.tp_size, ctx.pp_size, ctx.dp_size) == (lay.tp, lay.pp, lay.dp)
    assert (ctx.tp_rank, ctx.dp_rank, ctx.pp_rank) == (c.tp_rank, c.dp_rank, c.pp_rank)
    out = {}
    for kind, group, ranks in (
        ("tp", ctx.tp_group, lay.tp_group_of(rank)),
        ("dp", ctx.dp_group, lay.dp_group_of(rank)),
        ("pp", ctx.pp_group, lay.pp_group_of(rank)),
        ("mp", ctx.mp_group, lay.mp_group_of(rank)),
    ):
        if len(ranks) == 1:
            assert group is None, kind
        else:
            assert tuple(dist.get_process_group_ranks(group)) == ranks, kind
            assert dist.get_rank(group) == ranks.index(rank), kind
        # the sum of 2**rank over the group names exactly its members
        out[kind] = _group_sum(group, ctx, float(2**rank))
        assert out[kind] == float(sum(2**r for r in ranks)), kind
    assert ctx.next_rank == lay.next_rank(rank) and ctx.prev_rank == lay.prev_rank(rank)
    assert ctx.stage_to_rank(chunks=2, placement="v") == lay.stage_to_rank(rank, chunks=2, placement="v")
    if len(ctx.embedding_ranks) > 1:
        assert _group_sum(ctx.embedding_group, ctx, 1.0) == len(ctx.embedding_ranks)
    else:
        assert ctx.embedding_group is None
    return out


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_groups_on_four_ranks(tp, pp):
    results = run_multiprocess(_check_context, 4, args=(tp, pp), timeout_s=120)
    assert len(results) == 4


def _init_from_env_then_shutdown(rank: int, world_size: int) -> tuple[bool, bool, float]:
    assert not dist.is_initialized()
    ctx = ParallelContext.initialize(tp=1, pp=1, timeout=timedelta(seconds=60))  # env:// like torchrun
    owned = ctx.owns_default_group
    total = _group_sum(ctx.dp_group, ctx, 1.0)
    ctx.shutdown()
    return owned, dist.is_initialized(), total


def test_initialize_from_torchrun_environment():
    out = run_multiprocess(_init_from_env_then_shutdown, 2, timeout_s=120, init_process_group=False)
    assert out == [(True, False, 2.0), (True, False, 2.0)]


def _bad_layout_before_rendezvous(rank: int, world_size: int) -> str:
    try:
        ParallelContext.initialize(tp=3, pp=1)
    except ValueError as e:
        assert not dist.is_initialized()  # failed before joining anything: no hang possible
        return str(e)
    raise AssertionError("tp=3 on 4 ranks must be rejected")


def test_bad_layout_is_rejected_before_rendezvous():
    out = run_multiprocess(_bad_layout_before_rendezvous, 2, timeout_s=60, init_process_group=False)
    assert all("tp x pp = 3 x 1 = 3 does not divide the world size 2" in m for m in out)


def test_single_and_no_torchrun_environment(monkeypatch):
    for var in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    ctx = ParallelContext.initialize()
    assert ctx == ParallelContext.single()
    assert (ctx.tp_group, ctx.dp_group, ctx.pp_group, ctx.mp_group, ctx.backend) == (None, None, None, None, None)
    assert (ctx.next_rank, ctx.prev_rank, ctx.tp_ranks, ctx.stage_to_rank(chunks=2)) == (0, 0, (0,), (0, 0))
    assert "single process" in ctx.describe()
    with pytest.raises(ValueError, match=r"tp x pp = 2 x 1 needs a multiple of 2 processes.*torchrun"):
        ParallelContext.initialize(tp=2)
    with pytest.raises(ValueError, match="timeout"):
        ParallelContext.initialize(timeout=timedelta(0))
    with pytest.raises(Exception, match="frozen|cannot assign"):
        ctx.rank = 3  # type: ignore[misc]


def _dies_then_peer_collective(rank: int, world_size: int) -> None:
    ctx = ParallelContext.initialize(tp=2, timeout=timedelta(seconds=20))
    if rank == 1:
        raise RuntimeError("rank 1 dies before the collective")
    _group_sum(ctx.tp_group, ctx, 1.0)


def test_peer_failure_does_not_hang():
    with pytest.raises(MultiProcessError) as info:
        run_multiprocess(_dies_then_peer_collective, 2, timeout_s=60, failure_grace_s=10)
    assert next(iter(info.value.failures)) == 1


def _cuda_context(rank: int, world_size: int) -> tuple[str, str, float]:
    from megatron.parallel.data_parallel import DataParallelReducer

    ctx = ParallelContext.initialize(timeout=timedelta(seconds=60))  # backend chosen automatically
    lin = torch.nn.Linear(8, 4).to(ctx.device)
    reducer = DataParallelReducer(lin, ctx)
    reducer.zero_grad()
    reducer.prepare_microbatch(is_last=True)
    lin(torch.ones(2, 8, device=ctx.device)).sum().backward()
    reducer.finish()
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    out = (ctx.backend, str(ctx.device), float(lin.bias.main_grad.sum()) + t.item())
    ctx.shutdown()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_chosen_on_gpu():
    out = run_multiprocess(_cuda_context, 1, timeout_s=120, init_process_group=False)
    assert out == [("nccl", "cuda:0", 8.0 + 1.0)]
