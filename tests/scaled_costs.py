"""The profiling-window tests' "measured" costs: the analytic model's, every time x ``KT`` and every byte x ``KM``."""

import dataclasses

from zb_pipeline.schedule.stage_planner import ModelCosts, PartCosts

KT, KM = 3.0, 1.25  # the "measured" costs: the analytic ones in ms (x KT per GFLOP) and bytes x KM


def scaled_costs(model: ModelCosts) -> ModelCosts:
    """``model`` with every time scaled by ``KT`` and every byte count by ``KM`` (its options' runs and block kept)."""

    def part(q: PartCosts) -> PartCosts:
        return PartCosts(f=q.f * KT, b=q.b * KT, w=q.w * KT, mem_f=q.mem_f * KM, mem_b=q.mem_b * KM)

    rec = tuple(
        dataclasses.replace(
            o,
            b_extra=o.b_extra * KT,
            mem_f=o.mem_f * KM,
            mem_b=o.mem_b * KM,
            transient=o.transient * KM,
            transient_bw=o.transient_bw * KM,
        )  # fmt: skip
        for o in model.recompute
    )
    return dataclasses.replace(
        model, layer=part(model.layer), embedding=part(model.embedding), head=part(model.head), recompute=rec
    )
