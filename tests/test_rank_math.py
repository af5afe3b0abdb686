"""Rank math over every factorisation of world sizes 1..64: groups partition the ranks and agree with each other."""

import pytest

from megatron.parallel.rank_math import RankLayout, stage_to_pipeline_rank
from zb_pipeline.schedule.ir import loop_placement, v_placement


def _layouts(max_world: int = 64):
    for w in range(1, max_world + 1):
        for tp in range(1, w + 1):
            if w % tp:
                continue
            for pp in range(1, w // tp + 1):
                if (w // tp) % pp == 0:
                    yield RankLayout.build(w, tp=tp, pp=pp)


ALL_LAYOUTS = list(_layouts())


def _assert_partition(groups, world_size, size, what):
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(range(world_size)), f"{what}: every rank in exactly one group"
    assert all(len(g) == size for g in groups), what
    assert len(groups) == world_size // size, what


def test_number_of_layouts():
    # ordered factorisations w = tp * pp * dp, summed over w = 1..64
    expected = sum(
        sum(1 for tp in range(1, w + 1) for pp in range(1, w + 1) if w % (tp * pp) == 0) for w in range(1, 65)
    )
    assert len(ALL_LAYOUTS) == expected


def test_every_factorisation_groups_and_coordinates():
    for lay in ALL_LAYOUTS:
        w, tp, pp, dp = lay.world_size, lay.tp, lay.pp, lay.dp
        assert tp * pp * dp == w
        _assert_partition(lay.tp_groups, w, tp, f"tp {lay}")
        _assert_partition(lay.dp_groups, w, dp, f"dp {lay}")
        _assert_partition(lay.pp_groups, w, pp, f"pp {lay}")
        _assert_partition(lay.mp_groups, w, tp * pp, f"mp {lay}")
        coords = [lay.coords(r) for r in range(w)]
        # documented order: tp fastest, then dp, then pp
        assert [c.tp_rank + tp * (c.dp_rank + dp * c.pp_rank) for c in coords] == list(range(w))
        assert all(
            lay.rank_of(tp_rank=c.tp_rank, dp_rank=c.dp_rank, pp_rank=c.pp_rank) == r for r, c in enumerate(coords)
        )
        # a group varies exactly its own coordinate, in order, and holds the others fixed
        for g in lay.tp_groups:
            assert [coords[x].tp_rank for x in g] == list(range(tp))
            assert len({(coords[x].dp_rank, coords[x].pp_rank) for x in g}) == 1
            assert g == tuple(range(g[0], g[0] + tp))  # consecutive ranks
        for g in lay.dp_groups:
            assert [coords[x].dp_rank for x in g] == list(range(dp))
            assert len({(coords[x].tp_rank, coords[x].pp_rank) for x in g}) == 1
        for g in lay.pp_groups:
            assert [coords[x].pp_rank for x in g] == list(range(pp))
            assert len({(coords[x].tp_rank, coords[x].dp_rank) for x in g}) == 1
        for g in lay.mp_groups:
            assert len({coords[x].dp_rank for x in g}) == 1 and tuple(sorted(g)) == g
        for r in range(w):
            tpg, dpg, ppg, mpg = lay.tp_group_of(r), lay.dp_group_of(r), lay.pp_group_of(r), lay.mp_group_of(r)
            assert r in tpg and r in dpg and r in ppg and r in mpg
            # consistency between kinds: two kinds meet only at r; mp = the tp groups along r's pipeline
            assert set(tpg) & set(dpg) == {r} and set(tpg) & set(ppg) == {r} and set(dpg) & set(ppg) == {r}
            assert set(mpg) & set(dpg) == {r}
            assert set(mpg) == {x for p in ppg for x in lay.tp_group_of(p)}


def test_every_factorisation_pipeline_neighbours():
    for lay in ALL_LAYOUTS:
        for r in range(lay.world_size):
            nxt, prv = lay.next_rank(r), lay.prev_rank(r)
            pipe = lay.pp_group_of(r)
            assert nxt in pipe and prv in pipe
            assert lay.prev_rank(nxt) == r and lay.next_rank(prv) == r
            i = pipe.index(r)
            assert nxt == pipe[(i + 1) % lay.pp] and prv == pipe[(i - 1) % lay.pp]
            if lay.pp == 1:
                assert nxt == prv == r
            # walking next pp times visits the whole pipeline and comes back
            seen, x = [], r
            for _ in range(lay.pp):
                seen.append(x)
                x = lay.next_rank(x)
            assert x == r and sorted(seen) == list(pipe)


@pytest.mark.parametrize("placement", ["loop", "v"])
def test_every_factorisation_stage_maps_and_embedding_groups(placement):
    for lay in ALL_LAYOUTS:
        for chunks in (1, 2, 3):
            s2p = stage_to_pipeline_rank(lay.pp, chunks, placement)
            assert s2p == (loop_placement if placement == "loop" else v_placement)(lay.pp, chunks)
            emb = lay.embedding_groups(chunks=chunks, placement=placement)
            assert len(emb) == lay.tp * lay.dp  # one per pipeline
            holders = set()
            for r in range(lay.world_size):
                stages = lay.stages_of(r, chunks=chunks, placement=placement)
                s2r = lay.stage_to_rank(r, chunks=chunks, placement=placement)
                assert len(stages) == chunks and len(s2r) == lay.pp * chunks
                assert set(s2r) == set(lay.pp_group_of(r))
                assert [s for s, x in enumerate(s2r) if x == r] == list(stages)
                group = lay.embedding_group_of(r, chunks=chunks, placement=placement)
                assert (group is not None) == (r in (s2r[0], s2r[-1]))
                if group is not None:
                    assert set(group) == {s2r[0], s2r[-1]}
                    holders.add(r)
            assert sorted(holders) == sorted(x for g in emb for x in g)
            if placement == "v" and chunks % 2 == 0:
                assert all(len(g) == 1 for g in emb)  # first and last stage on the same rank
            if placement == "loop" or chunks % 2:
                assert all(len(g) == min(2, lay.pp) for g in emb)


def test_documented_example():
    lay = RankLayout.build(8, tp=2, pp=2)
    assert lay.dp == 2
    assert lay.tp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert lay.dp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert lay.pp_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert lay.mp_groups == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert lay.embedding_groups() == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert lay.embedding_groups(chunks=2, placement="v") == ((0,), (1,), (2,), (3,))
    assert lay.stage_to_rank(1, chunks=2, placement="loop") == (1, 5, 1, 5)
    assert lay.stage_to_rank(1, chunks=2, placement="v") == (1, 5, 5, 1)
    assert "tp 2 x dp 2 x pp 2" in lay.describe()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(world_size=8, tp=3, pp=1), r"tp x pp = 3 x 1 = 3 does not divide the world size 8.*fix"),
        (dict(world_size=8, tp=2, pp=3), r"does not divide the world size 8"),
        (dict(world_size=0, tp=1, pp=1), r"world_size=0 must be an integer >= 1"),
        (dict(world_size=4, tp=0, pp=1), r"tp=0 must be"),
        (dict(world_size=4, tp=1, pp=-2), r"pp=-2 must be"),
    ],
)
def test_bad_layouts_build(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RankLayout.build(kwargs.pop("world_size"), **kwargs)


def test_bad_layouts_direct_and_lookups():
    with pytest.raises(ValueError, match=r"tp x pp x dp = 2 x 2 x 3 = 12 != world size 8; fix"):
        RankLayout(8, 2, 2, 3)
    lay = RankLayout.build(4, tp=2)
    with pytest.raises(ValueError, match="rank 4 outside 0..3"):
        lay.coords(4)
    with pytest.raises(ValueError, match="tp_rank=2 outside 0..1"):
        lay.rank_of(tp_rank=2, dp_rank=0, pp_rank=0)
    with pytest.raises(ValueError, match="unknown stage placement 'zigzag'"):
        lay.embedding_groups(placement="zigzag")
