"""StageCosts: how user-style cost and memory specs expand to virtual stages."""

import pytest

from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.ir import v_placement


def test_scalar_is_a_ranks_whole_share_split_over_chunks() -> None:
    c = StageCosts.build(num_ranks=2, chunks=2, f=4.0, b=6.0, w=2.0, comm=0.5)
    assert c.f == (2.0, 2.0, 2.0, 2.0) and c.b == (3.0,) * 4 and c.w == (1.0,) * 4 and c.comm == 0.5
    assert c.mem_f == (0.5,) * 4 and c.mem_b == (0.0,) * 4 and c.mem_w == (-0.5,) * 4


def test_per_rank_list_follows_placement() -> None:
    c = StageCosts.build(num_ranks=2, chunks=2, stage_to_rank=v_placement(2, 2), f=[2.0, 4.0])
    # V placement: stages 0..3 on ranks 0, 1, 1, 0.
    assert c.f == (1.0, 2.0, 2.0, 1.0)


def test_per_stage_list_is_taken_as_given() -> None:
    c = StageCosts.build(num_ranks=2, chunks=2, f=[1, 2, 3, 4], mem_f=[1, 1, 2, 2], mem_b=[-0.5, -0.5, -1, -1])
    assert c.f == (1.0, 2.0, 3.0, 4.0)
    assert c.mem_w == (-0.5, -0.5, -1.0, -1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"f": 0}, "must be finite and > 0"),
        ({"b": -1}, "must be finite and > 0"),
        ({"f": [1, 2, 3]}, "give one number, one per rank"),
        ({"comm": -1}, "communication cost"),
        ({"mem_f": 1, "mem_b": 0, "mem_w": 0}, "must sum to 0"),
    ],
)
def test_bad_specs(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StageCosts.build(num_ranks=2, chunks=2, **kwargs)
