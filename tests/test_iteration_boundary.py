"""No wait at the iteration boundary (issue 21): what the trainer issues between a pipeline rank's last compute
action and its optimizer step, recorded through the communication layer (``zb_pipeline.testing.op_recorder``) --
structure, not timings.

With ``--enable-optimizer-post-validation`` the step needs no other rank, so nothing between the two may wait for
one: no blocking collective and no wait on a receive or a collective (the loss's pipeline and data-parallel sums
are started asynchronously and read back at log lines; ``--log-num-zeros-in-grad`` counts only at the iterations
that log).  Between the step and the next iteration's first compute action no blocking collective is called: the
``--exit-signal-handler`` and ``--exit-duration-in-mins`` flags are reduced asynchronously, each answer read an
iteration after it was started.  With tied embeddings the one wait allowed is the embedding copy's own gradient
sum, which must have been started right after the last W of the copy's stage.  The run's last iteration
synchronises (log line, end of run) and is not checked.
"""

from __future__ import annotations

import math

import pytest

from zb_pipeline.testing.harness import run_multiprocess

ITERS = 5
BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
    "--vocab-size", "120", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--train-iters", str(ITERS), "--lr", "1e-2", "--lr-warmup-iters", "1", "--seed", "3", "--eval-iters", "0",
    "--log-interval", "100", "--distributed-timeout-seconds", "60", "--pipeline-model-parallel-size", "2",
    "--pipeline-schedule", "zb-h1", "--enable-optimizer-post-validation", "--exit-signal-handler",
    "--exit-duration-in-mins", "10000", "--log-num-zeros-in-grad",
]  # fmt: skip
COMPUTE = ("F", "B", "W", "BW")


def _recorded_run(rank: int, world_size: int, argv: list[str]) -> dict:
    import io

    import torch
    import torch.distributed as dist

    from megatron import training
    from megatron.arguments import parse_run_config
    from zb_pipeline import comm
    from zb_pipeline.schedule.ir import Kind
    from zb_pipeline.testing.op_recorder import OpRecorder

    torch.set_num_threads(1)
    rec = OpRecorder(dist)
    real_setup = training.setup
    groups: dict = {}

    def marking(handler):
        def run(ex, a):
            handler(ex, a)
            rec.mark("compute", (a.kind.value, a.stage, a.microbatch))

        return run

    def setup(run, ctx, **kwargs):
        tr = real_setup(run, ctx, **kwargs)
        groups.update(pp=ctx.pp_group, dp=ctx.dp_group, embedding=ctx.embedding_group)
        for kind in (Kind.F, Kind.B, Kind.W, Kind.BW):
            tr.pipeline.runtime.wrap_handler(kind, marking)
        pv, real_step = tr.post_validation, tr.post_validation.step

        def step(lr, iteration):
            rec.mark("step", iteration)
            real_step(lr, iteration)

        pv.step = step
        return tr

    training.setup = setup
    try:
        with comm.use(rec):
            summary = training.pretrain(parse_run_config(argv, world_size=world_size), stream=io.StringIO())
    finally:
        training.setup = real_setup

    def label(group):
        for name, g in groups.items():
            if g is group and g is not None:
                return name
        return "world" if group is None else "other"

    events = [
        (e.what, e.name, label(e.group) if e.what != "mark" else None, e.waits_for_others, e.detail) for e in rec.events
    ]
    return {"events": events, "losses": list(summary.losses)}


def _boundaries(events: list) -> tuple[list[list], list[list]]:
    """For each checked iteration: the events from its last compute mark to its step mark, and from that step mark
    to the next iteration's first compute mark (all included)."""
    before, after, last_compute, step_at = [], [], None, None
    for i, (what, name, _, _, detail) in enumerate(events):
        if what == "mark" and name == "compute":
            if step_at is not None:
                after.append(events[step_at : i + 1])
                step_at = None
            last_compute = i
        elif what == "mark" and name == "step":
            assert last_compute is not None, "a step before any compute action"
            if detail < ITERS:
                before.append(events[last_compute : i + 1])
                step_at = i
            last_compute = None
    return before, after


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_nothing_waits_for_another_rank_between_the_last_compute_and_the_step(tied: bool, tmp_path) -> None:
    argv = BASE + ["--save", str(tmp_path / "ckpt")] + ([] if tied else ["--untie-embeddings-and-output-weights"])
    results = run_multiprocess(_recorded_run, 2, args=(argv,), timeout_s=240)
    assert results[0]["losses"] == results[1]["losses"] and len(results[0]["losses"]) == ITERS
    assert all(math.isfinite(x) for x in results[0]["losses"])
    for rank, res in enumerate(results):
        windows, next_starts = _boundaries(res["events"])
        assert len(windows) == len(next_starts) == ITERS - 1, f"rank {rank}: {len(windows)} checked iterations"
        for window in next_starts:  # step -> next compute: the flags' reductions are started, none is called blocking
            blocking = [name for what, name, _, waits, _ in window if what == "call" and waits]
            assert blocking == [], f"rank {rank}: a blocking call after the step: {blocking}\n{window}"
        stage = rank  # one stage per rank (zb-h1, pp = 2)
        for window in windows:
            waits = [(name, group) for what, name, group, waits, _ in window if waits]
            if not tied:
                assert waits == [], f"rank {rank} waits for another rank before its step: {waits}\n{window}"
                continue
            assert waits == [("all_reduce", "embedding")], f"rank {rank}: {waits}\n{window}"
            # ... and the copy's all-reduce started right after its stage's last W (microbatch order: mb m-1).
        starts = [
            i
            for i, (what, name, group, _, _) in enumerate(res["events"])
            if what == "call" and name == "all_reduce" and group == "embedding"
        ]
        if tied:
            assert len(starts) >= ITERS
            for i in starts:
                what, name, _, _, detail = res["events"][i - 1]
                assert (what, name) == ("mark", "compute") and detail[0] == "W" and detail[1:] == (stage, 3), (
                    f"rank {rank}: the tied gradient sum did not start right after stage {stage}'s last W: "
                    f"{res['events'][i - 3 : i + 1]}"
                )
        # The loss's pipeline sums, the signal flags and the time-limit flags of the unchecked iterations were
        # started, not waited for.
        calls = [(name, group, waits) for what, name, group, waits, _ in res["events"] if what == "call"]
        assert calls.count(("all_reduce", "pp", False)) == ITERS, calls
        assert calls.count(("all_reduce", "world", False)) == 2 * (ITERS - 1), calls
