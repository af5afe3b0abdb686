"""Per-action overhead (issue 21): what ``tools/bench_overhead.py`` counts, and the runtime's cuts that can be checked
without a clock -- the P2P layer resolves its group's placement once, not per transfer, and picks stream-side
completion on NCCL (the host never waits for the device there) and host waits with a timeout on gloo."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from zb_pipeline import comm
from zb_pipeline.runtime.p2p import PipelineCommError, PipelineP2P, TensorSpec
from zb_pipeline.schedule.ir import Action, Kind
from zb_pipeline.schedule.lowering import CommBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from bench_overhead import gaps, summarise  # noqa: E402


def test_gaps_split_the_time_between_actions_into_backend_runtime_cpu_and_off_cpu() -> None:
    ms = 1e-3
    # (wall start, wall end, the main thread's CPU clock at start, at end), in ms
    actions = [(0, 10, 0, 10), (10.5, 20, 10.3, 19.8), (25, 30, 24.8, 29.8), (30.2, 40, 30.0, 39.8)]
    recv_wait, blocked = (10.6, 10.65, 10.35, 10.40), (25.0, 28.0, 24.8, 24.9)  # the second one blocked: no overhead
    spans = [(10.1, 10.2, 10.0, 10.02), recv_wait, blocked, (30.05, 30.1, 29.85, 29.9), (20.5, 24.9, 20.3, 20.4)]

    def sec(rows):
        return [tuple(x * ms for x in row) for row in rows]

    got = gaps(sec(actions), sec(spans), sec([recv_wait, blocked]))
    # pair 1: gap = 10.65 - 10 = 0.65 ms, backend 0.1 + 0.05 wall (0.02 + 0.05 CPU); the thread's CPU over the gap
    # 10.40 - 10 = 0.40, so runtime CPU 0.40 - 0.07 = 0.33 and off-CPU 0.65 - 0.15 - 0.33 = 0.17.
    # pair 3: gap 0.2, backend 0.05 (on the CPU), CPU 0.2 - 0.05 = 0.15, off-CPU 0.
    want = [0.65, 0.15, 0.33, 0.2, 0.05, 0.15]
    assert [x for pair in got for x in pair] == pytest.approx([w * ms for w in want])
    s = summarise(got)
    assert s["n"] == 2 and s["runtime_mean"] == pytest.approx(((0.65 - 0.15) + (0.2 - 0.05)) / 2)
    assert s["runtime_cpu_mean"] == pytest.approx((0.33 + 0.15) / 2)
    assert s["off_cpu_mean"] == pytest.approx(0.17 / 2) and s["off_cpu_median"] == pytest.approx(0.17 / 2)


class _Work:
    def __init__(self, log: list) -> None:
        self.log = log

    def wait(self, *args) -> bool:
        self.log.append(args)
        return True

    def is_completed(self) -> bool:
        return True


class _CountingDist:
    """A backend that counts group look-ups and records how works were waited for."""

    def __init__(self, backend: str) -> None:
        self.backend, self.lookups, self.waits = backend, 0, []

    def get_backend(self, group=None) -> str:
        self.lookups += 1
        return self.backend

    def isend(self, t, peer, group=None, tag=0):
        return _Work(self.waits)

    def irecv(self, t, peer, group=None, tag=0):
        return _Work(self.waits)


def _round(p2p: PipelineP2P) -> None:
    for mb in range(3):
        send, recv = Action(0, Kind.SEND_F, mb, peer=1), Action(0, Kind.RECV_B, mb, peer=1)
        p2p.post(CommBatch((send, recv)), lambda a: torch.zeros(2, 3))
        p2p.take(Kind.RECV_B, 0, mb, Action(0, Kind.B, mb))
    p2p.finish()


def test_the_p2p_layer_looks_its_group_up_once_and_waits_on_the_host_only_on_gloo() -> None:
    group = object()
    fake = _CountingDist("gloo")
    with comm.use(fake):
        p2p = PipelineP2P(pp_rank=0, boundary_specs=[TensorSpec((2, 3))], group=group, pp_ranks=(0, 1), timeout_s=5)
        assert fake.lookups == 1 and not p2p.waits_on_stream
        _round(p2p)
    assert fake.lookups == 1, "a placement look-up per transfer is back on the hot path"
    # the 3 receives' takes and the 3 sends at finish (gloo's sends are waited for, never polled), all timed
    assert len(fake.waits) == 6 and all(isinstance(w[0], timedelta) for w in fake.waits)

    fake = _CountingDist("nccl")
    with comm.use(fake), comm.pretend(group, backend="nccl", device="meta"):
        p2p = PipelineP2P(pp_rank=0, boundary_specs=[TensorSpec((2, 3))], group=group, pp_ranks=(0, 1), timeout_s=5)
        assert p2p.waits_on_stream and p2p.device == torch.device("meta")
        send, recv = Action(0, Kind.SEND_F, 0, peer=1), Action(0, Kind.RECV_B, 0, peer=1)
        fake.batch_isend_irecv = lambda ops: [_Work(fake.waits) for _ in ops]
        fake.P2POp = lambda op, t, peer, group=None, tag=0: (op, t, peer)
        p2p.post(CommBatch((send, recv)), lambda a: torch.zeros(2, 3, device="meta"))
        p2p.take(Kind.RECV_B, 0, 0, Action(0, Kind.B, 0))
        p2p.finish()
    assert fake.waits == [()]  # stream-side: no host timeout on the receive


class _DirectDist(_CountingDist):
    """A gloo fake that offers the P2P layer's link a process group (``direct_group``), recording its calls."""

    def __init__(self) -> None:
        super().__init__("gloo")
        self.direct: list = []

    def get_group_rank(self, group, global_rank: int) -> int:
        return global_rank - 4

    def direct_group(self, group):
        fake = self

        class _PG:
            def send(self, tensors, group_peer, tag):
                fake.direct.append(("send", tuple(tensors[0].shape), group_peer, tag))
                return _Work(fake.waits)

            def recv(self, tensors, group_peer, tag):
                fake.direct.append(("recv", tuple(tensors[0].shape), group_peer, tag))
                return _Work(fake.waits)

        return _PG()


def test_the_gloo_path_posts_through_the_process_group_from_op_lists_built_once() -> None:
    group, fake = object(), _DirectDist()
    with comm.use(fake):
        p2p = PipelineP2P(pp_rank=0, boundary_specs=[TensorSpec(())], group=group, pp_ranks=(4, 5), timeout_s=5)
        send, recv = Action(0, Kind.SEND_F, 0, peer=1), Action(0, Kind.RECV_B, 0, peer=1)
        batch = CommBatch((recv, send))  # the sends go out first
        for _ in range(3):
            p2p.post(batch, lambda a: torch.zeros((), requires_grad=True) * 2)
            ops = p2p._ops_of[id(batch)]
            got = p2p.take(Kind.RECV_B, 0, 0, Action(0, Kind.B, 0))
            assert got.shape == () and not got.requires_grad
            p2p.finish()
        assert p2p._ops_of[id(batch)] is ops and len(p2p._ops_of) == 1  # built at the first post only
        with pytest.raises(PipelineCommError, match=r"sends a tensor of shape \(2,\).*boundary spec says \(\)"):
            p2p.post(batch, lambda a: torch.zeros(2))
    assert fake.direct == [("send", (), 1, 0), ("recv", (), 1, 0)] * 3 and fake.lookups == 1


@pytest.mark.parametrize("name", ["1f1b", "zb-h2", "zb-v", "interleaved-zb"])
@pytest.mark.parametrize("first_ahead", [0, 5])
def test_the_post_plan_built_once_posts_every_op_once_in_plan_order_and_never_late(name: str, first_ahead: int) -> None:
    """``post_plan`` (what the executor posts on gloo, built once per plan) against the plan itself: every op of
    every batch exactly once, sends at their own batch, each receive at its own batch or up to ``PREPOST_AHEAD``
    compute actions earlier but never before ``first_ahead``, and the per-(peer, kind) order of the plan."""
    from zb_pipeline.runtime.executor import PREPOST_AHEAD, post_plan
    from zb_pipeline.schedule.lowering import lower
    from zb_pipeline.schedule.registry import generate

    lowered = lower(generate(name, 4, 8))
    for rank, steps in enumerate(lowered.ranks):
        plan = post_plan(steps, PREPOST_AHEAD, first_ahead)
        assert len(plan) == len(steps)
        home = {a: j for j, st in enumerate(steps) if isinstance(st, CommBatch) for a in st.actions}
        computes_before = [sum(not isinstance(st, CommBatch) for st in steps[:j]) for j in range(len(steps))]
        posted: list[Action] = []
        for j, (rest, early) in enumerate(plan):
            if not isinstance(steps[j], CommBatch):
                assert (rest, early) == (None, None)
                continue
            for a in rest.actions if rest is not None else ():
                assert home[a] == j
                posted.append(a)
            for a in early.actions if early is not None else ():
                assert a.kind in (Kind.RECV_F, Kind.RECV_B) and j < home[a] and j >= first_ahead
                assert computes_before[home[a]] - computes_before[j] <= PREPOST_AHEAD
                posted.append(a)
        assert sorted(map(str, posted)) == sorted(map(str, home)) and len(set(posted)) == len(posted)
        planned = [a for st in steps if isinstance(st, CommBatch) for a in st.actions]
        for peer in {a.peer for a in planned}:
            for kind in {a.kind for a in planned}:
                want = [a for a in planned if a.peer == peer and a.kind == kind]
                assert [a for a in posted if a.peer == peer and a.kind == kind] == want, (rank, peer, kind)


def test_split_cost_ratio_is_b_plus_w_over_the_fused_bw_per_stage() -> None:
    from zb_pipeline.schedule.profile import Profile, split_cost_ratio

    def prof(name: str, b, w, bw) -> Profile:
        n = len(bw)
        zeros = (0.0,) * n
        return Profile(2, (0, 1), (1.0,) * n, b, w, bw, 0.1, zeros, zeros, zeros, schedule=name)

    split = prof("zb-h1", (2.0, 3.0), (1.0, 1.5), (None, None))
    fused = prof("1f1b", (None, None), (None, None), (3.0, 4.0))
    assert split_cost_ratio(split, fused) == (1.0, 1.125)
    assert split_cost_ratio(fused, fused) == (None, None)
    with pytest.raises(ValueError, match="different layouts"):
        split_cost_ratio(split, prof("zb-v", (1.0,) * 4, (1.0,) * 4, (None,) * 4))


def test_bench_split_ratio_reads_the_schedules_own_medians_against_1f1b() -> None:
    """``bench_pipeline_analysis.split_ratio``: a split schedule's B + W over 1F1B's BW from the profiles it is
    given (the benchmark passes the medians of each schedule's own timed runs); nothing for 1F1B or torch rows."""
    import importlib.util
    import os

    from zb_pipeline.schedule.profile import Profile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "bench_pipeline_analysis", os.path.join(root, "tools", "bench_pipeline_analysis.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def prof(name: str, b, w, bw) -> dict:
        zeros = (0.0, 0.0)
        return Profile(2, (0, 1), (1.0, 1.0), b, w, bw, 0.1, zeros, zeros, zeros, schedule=name).to_dict()

    profiles = {
        "1f1b": prof("1f1b", (None, None), (None, None), (3.0, 4.0)),
        "zb-h2": prof("zb-h2", (2.0, 2.5), (1.0, 1.7), (None, None)),
    }
    assert mod.split_ratio(profiles, "zb-h2") == pytest.approx([1.0, 1.05])
    assert mod.split_ratio(profiles, "1f1b") is None
    assert mod.split_ratio(profiles, "torch:1f1b") is None
    assert mod.split_ratio({"zb-h2": profiles["zb-h2"]}, "zb-h2") is None
