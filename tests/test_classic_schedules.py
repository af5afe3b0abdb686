"""GPipe, 1F1B and interleaved 1F1B: exact orders, Megatron's warm-up counts, and validity over a grid of shapes."""

from __future__ import annotations

import pytest

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.generators.classic import interleaved_order
from zb_pipeline.schedule.ir import Kind
from zb_pipeline.schedule.registry import available, generate, get
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.schedule.validate import check_and_lower

CLASSIC = {"gpipe": (1,), "1f1b": (1,), "interleaved-1f1b": (1, 2, 3)}


def rows(sched) -> list[list[str]]:
    return [[str(a) for a in r] for r in sched.ranks]


def test_registered():
    names = available()
    for name in CLASSIC:
        assert name in names
    assert get("interleaved-1f1b").chunks is None and get("interleaved-1f1b").default_chunks == 2
    assert get("1f1b").placement == "loop"


def test_1f1b_exact_order():
    assert rows(generate("1f1b", 3, 4)) == [
        ["0F0", "0F1", "0F2", "0BW0", "0F3", "0BW1", "0BW2", "0BW3"],
        ["1F0", "1F1", "1BW0", "1F2", "1BW1", "1F3", "1BW2", "1BW3"],
        ["2F0", "2BW0", "2F1", "2BW1", "2F2", "2BW2", "2F3", "2BW3"],
    ]


def test_1f1b_fewer_microbatches_than_ranks():
    assert rows(generate("1f1b", 4, 2))[0] == ["0F0", "0F1", "0BW0", "0BW1"]


def test_gpipe_exact_order():
    assert rows(generate("gpipe", 2, 3)) == [
        ["0F0", "0F1", "0F2", "0BW0", "0BW1", "0BW2"],
        ["1F0", "1F1", "1F2", "1BW0", "1BW1", "1BW2"],
    ]


def test_interleaved_group_order():
    # Groups of p microbatches, chunk by chunk; a smaller last group.
    assert interleaved_order(2, 5, 2) == [
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
        (2, 0),
        (3, 0),
        (2, 1),
        (3, 1),
        (4, 0),
        (4, 1),
    ]


def test_interleaved_exact_order_p2_m4():
    sched = generate("interleaved-1f1b", 2, 4, chunks=2)
    assert sched.stage_to_rank == (0, 1, 0, 1)
    assert rows(sched) == [
        # warm-up 2 (p - 0 - 1) + (2 - 1) 2 = 4, then F/BW pairs, then drain.
        ["0F0", "0F1", "2F0", "2F1", "0F2", "2BW0", "0F3", "2BW1", "2F2", "0BW0", "2F3", "0BW1"]
        + ["2BW2", "2BW3", "0BW2", "0BW3"],
        ["1F0", "1F1", "3F0", "3BW0", "3F1", "3BW1", "1F2", "1BW0", "1F3", "1BW1", "3F2", "3BW2"]
        + ["3F3", "3BW3", "1BW2", "1BW3"],
    ]


@pytest.mark.parametrize(("p", "m", "chunks"), [(2, 4, 2), (4, 8, 2), (4, 16, 3), (3, 6, 4), (8, 8, 2), (4, 4, 2)])
def test_interleaved_megatron_warmup(p: int, m: int, chunks: int):
    """With m a multiple of p, rank r runs min(total, 2 (p - r - 1) + (chunks - 1) p + 1) forwards first."""
    sched = generate("interleaved-1f1b", p, m, chunks=chunks)
    total = m * chunks
    for r, acts in enumerate(sched.ranks):
        leading = next((i for i, a in enumerate(acts) if a.kind is not Kind.F), len(acts))
        assert leading == min(total, 2 * (p - r - 1) + (chunks - 1) * p + 1)


@pytest.mark.parametrize(("p", "m"), [(1, 1), (3, 2), (4, 7), (5, 10)])
def test_interleaved_one_chunk_is_1f1b(p: int, m: int):
    assert generate("interleaved-1f1b", p, m, chunks=1).ranks == generate("1f1b", p, m).ranks


def test_interleaved_reduces_bubble():
    p, m = 4, 8
    one = simulate(generate("1f1b", p, m), StageCosts.uniform(p))
    two = simulate(generate("interleaved-1f1b", p, m, chunks=2), StageCosts.uniform(2 * p))
    assert two.bubble_rate < one.bubble_rate
    assert one.makespan == (m + p - 1) * 3


def test_mem_limit_below_peak_names_the_smallest_that_works():
    with pytest.raises(ValueError, match=r"needs a memory limit of at least 4 \(peak on rank 0\)"):
        generate("1f1b", 4, 8, mem_limit=3)
    generate("1f1b", 4, 8, mem_limit=4)  # exactly enough
    with pytest.raises(ValueError, match="at least 8"):
        generate("gpipe", 2, 8, mem_limit=7.5)


def test_chunks_constraint_is_named():
    with pytest.raises(ValueError, match=r"supports chunks in \[1\]"):
        generate("1f1b", 4, 8, chunks=2)


def check_shape(name: str, p: int, m: int, chunks: int) -> None:
    """Either a plan that passes the validator (and whose simulation agrees on memory), or a clear ValueError."""
    try:
        sched = generate(name, p, m, chunks=chunks)
    except ValueError as e:
        msg = str(e)
        assert "\n" not in msg and ("=" in msg or "must" in msg), msg
        return
    assert (sched.num_ranks, sched.num_microbatches, sched.chunks) == (p, m, chunks)
    costs = StageCosts.build(num_ranks=p, chunks=chunks, f=1, b=1, w=1, comm=0.1)
    check_and_lower(sched, costs=costs)
    res = simulate(sched, costs)
    assert len([a for r in sched.ranks for a in r]) == 2 * p * chunks * m  # one F and one BW per stage and mb
    assert 0 <= res.bubble_rate < 1


def _grid(ps, ms, full: bool):
    for name, chunk_set in CLASSIC.items():
        for p in ps:
            for m in ms:
                for c in chunk_set:
                    yield name, p, m, c


SUBSET = list(_grid((1, 2, 3, 4, 5, 8), (1, 2, 3, 5, 8, 13), False))


@pytest.mark.parametrize(("name", "p", "m", "chunks"), SUBSET)
def test_classic_subset_valid(name: str, p: int, m: int, chunks: int):
    check_shape(name, p, m, chunks)


@pytest.mark.slow
@pytest.mark.parametrize("p", range(1, 17))
def test_classic_full_grid_valid(p: int):
    for name, chunk_set in CLASSIC.items():
        for m in range(1, 65):
            for c in chunk_set:
                check_shape(name, p, m, c)
