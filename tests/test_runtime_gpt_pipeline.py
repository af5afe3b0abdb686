"""The trainer's pipeline entry point (megatron.pipeline): flag mapping, and GPT stages on a ParallelContext against
the pp = 1 model -- bit-identical untied, within 1e-5 (norm-wise) tied, where the two embedding copies' gradients
are summed in a different order than the single model accumulates them."""

from __future__ import annotations

import argparse
from datetime import timedelta

import numpy as np
import pytest
import torch
from model_configs import pipeline_config

from megatron.config.errors import ConfigError
from megatron.model import GPTConfig, build_gpt_model
from megatron.parallel.context import ParallelContext
from megatron.pipeline import ScheduleConfig, add_schedule_args, build_gpt_pipeline
from zb_pipeline.schedule.plan_file import save_plan
from zb_pipeline.schedule.registry import generate
from zb_pipeline.testing import run_multiprocess

M, B = 3, 2


def _config(tied: bool, num_layers: int = 4) -> GPTConfig:
    return pipeline_config(num_layers, tied=tied)


def _batches() -> list[dict[str, torch.Tensor]]:
    out = []
    for k in range(M):
        g = torch.Generator().manual_seed(500 + k)
        t = torch.randint(0, 61, (B, 7), generator=g)
        mask = torch.ones(B, 6)
        mask[0, k % 6] = 0.0
        out.append({"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(), "loss_mask": mask})
    return out


def _pipeline_rank(rank: int, world_size: int, schedule: str, tied: bool) -> dict:
    torch.set_num_threads(1)
    cfg = ScheduleConfig(schedule=schedule, p2p_check=True)
    chunks = cfg.chunks(num_layers=4, pp=world_size)
    placement = "v" if schedule in ("zb-v", "v-half", "v-min") else "loop"
    ctx = ParallelContext.initialize(pp=world_size, timeout=timedelta(seconds=30), chunks=chunks, placement=placement)
    pipe = build_gpt_pipeline(ctx, _config(tied), cfg, num_microbatches=M, micro_batch_size=B, seed=11)
    total = pipe.forward_backward(_batches())
    grads: dict[str, list[np.ndarray]] = {}
    for stage in pipe.stages.values():
        for n, p in stage.named_parameters():
            grads.setdefault(stage.global_name(n), []).append(p.grad.numpy().copy())
    return {"total": total.item(), "grads": grads}


def _reference(tied: bool) -> tuple[float, dict[str, np.ndarray]]:
    model = build_gpt_model(_config(tied), seed=11)
    total = torch.zeros((), dtype=torch.float64)
    for batch in _batches():
        per_token = model(batch["tokens"], labels=batch["labels"])
        mask = batch["loss_mask"]
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        (loss / M).backward()
        total += loss.detach().double()
    return total.item(), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "schedule,tied",
    [
        pytest.param("zb-h1", False, marks=pytest.mark.slow),
        ("zb-v", True),
        pytest.param("1f1b", True, marks=pytest.mark.slow),
    ],
)
def test_gpt_pipeline_matches_pp1(schedule: str, tied: bool) -> None:
    results = run_multiprocess(_pipeline_rank, 2, args=(schedule, tied), timeout_s=120)
    ref_total, ref = _reference(tied)
    assert results[0]["total"] == results[1]["total"] == ref_total
    got: dict[str, list[np.ndarray]] = {}
    for r in results:
        for name, arrs in r["grads"].items():
            got.setdefault(name, []).extend(arrs)
    assert set(got) == set(ref)
    for name, ref_grad in ref.items():
        for g in got[name]:  # a tied embedding has two copies: both must hold the summed gradient
            if tied and name == "embedding.word_embeddings.weight":
                rel = np.linalg.norm(g - ref_grad) / np.linalg.norm(ref_grad)
                assert rel <= 1e-5, (name, rel)
            else:
                assert np.array_equal(g, ref_grad), (schedule, name, np.abs(g - ref_grad).max())


def _flags(*argv: str) -> ScheduleConfig:
    parser = add_schedule_args(argparse.ArgumentParser())
    return ScheduleConfig.from_flags(parser.parse_args(list(argv)))


def test_schedule_flags_map_the_reference_forks_flags(tmp_path) -> None:
    assert _flags().schedule == "zb-h1"
    assert _flags("--pipeline-schedule", "zb-h2").schedule == "zb-h2"
    assert _flags("--enable-zero-bubble").schedule == "zb-auto"
    assert _flags("--zero-bubble-v-schedule").schedule == "zb-v"
    for setup, name in (("zb", "zb-v"), ("half", "v-half"), ("min", "v-min")):
        assert _flags("--zero-bubble-v-schedule", "--zero-bubble-v-schedule-mem-setup", setup).schedule == name
    cfg = _flags("--enable-zero-bubble", "--zero-bubble-max-pending-backward", "3", "--enable-exactly-numeric-match")
    assert (cfg.schedule, cfg.mem_limit, cfg.exactly_numeric_match) == ("zb-auto", 3.0, True)
    assert _flags("--enable-zero-bubble", "--zero-bubble-max-pending-backward", "auto").mem_limit_auto
    cfg = _flags("--num-layers-per-virtual-pipeline-stage", "2")
    assert cfg.schedule == "interleaved-1f1b" and cfg.chunks(num_layers=8, pp=2) == 2
    assert _flags("--zero-bubble-v-schedule").chunks(num_layers=8, pp=2) == 2
    with pytest.raises(ConfigError, match="contradicts"):
        _flags("--pipeline-schedule", "1f1b", "--enable-zero-bubble")
    with pytest.raises(ConfigError, match="max-pending-backward"):
        _flags("--zero-bubble-max-pending-backward", "lots")
    with pytest.raises(ConfigError, match="multiple of"):
        _flags("--num-layers-per-virtual-pipeline-stage", "3").chunks(num_layers=8, pp=2)
    plan = tmp_path / "plan.json"
    save_plan(generate("zb-h1", 2, 3), plan)
    from_file = _flags("--schedule-file", str(plan)).build_schedule(pp=2, num_microbatches=3, num_layers=4)
    assert from_file == generate("zb-h1", 2, 3)
    with pytest.raises(ConfigError, match="is for p=2, m=3"):
        _flags("--schedule-file", str(plan)).build_schedule(pp=2, num_microbatches=4, num_layers=4)
