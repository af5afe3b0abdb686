"""The schedule tools' size limits (``zb_pipeline.schedule.limits``): shapes and plan files over them, and costs whose
sums overflow, are refused up front with one line and exit status 2 -- by the CLI, the registry and the trainer --
and what lowering, validation and simulation build grows with the actions, not with p x p."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from zb_pipeline.schedule import limits, registry
from zb_pipeline.schedule.costs import StageCosts
from zb_pipeline.schedule.plan_file import PlanFileError, load_plan, save_plan
from zb_pipeline.schedule.simulate import simulate
from zb_pipeline.schedule.validate import check_and_lower

ROOT = Path(__file__).resolve().parents[1]
# Generous on a loaded machine: the unbounded tools took minutes and the machine's whole memory.
CLI_SECONDS = 30.0
CLI_MEMORY = 2 << 30  # address-space cap of the CLI subprocess: a runaway fails fast instead of swapping


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CLI_MEMORY, CLI_MEMORY))


def _cli(*args: str) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "zb_pipeline.schedule", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_cap_memory,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0


def _write_wide_plan(path: Path, num_ranks: int) -> None:
    """A well-formed one-microbatch plan over ``num_ranks`` ranks (written as text: no Schedule of that size)."""
    ranks = ",\n".join(f'    ["{r}F0", "{r}BW0"]' for r in range(num_ranks))
    path.write_text(
        "{\n"
        '  "schedule": "wide",\n'
        f'  "num_ranks": {num_ranks},\n'
        f'  "num_stages": {num_ranks},\n'
        '  "num_microbatches": 1,\n'
        f'  "stage_to_rank": {json.dumps(list(range(num_ranks)))},\n'
        '  "ranks": [\n' + ranks + "\n  ]\n}\n",
        encoding="utf-8",
    )


@pytest.fixture(scope="module")
def wide_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("limits") / "wide.json"
    _write_wide_plan(path, 20000)
    return path


CASES = [
    (["simulate", "zb-h1", "-p", "100000", "-m", "10"], "4096 pipeline ranks"),
    (["simulate", "1f1b", "-p", "100000", "-m", "10"], "4096 pipeline ranks"),
    (["simulate", "zb-h1", "-p", "4", "-m", "1000000"], "65536 microbatches"),
    (["simulate", "zb-h1", "-p", "100000", "-m", "1000000"], "pipeline ranks"),
    (["simulate", "1f1b", "-p", "512", "-m", "8192"], "actions, over the limit of 4000000; use m <= 2604"),
    (["compare", "-p", "100000", "-m", "10"], "4096 pipeline ranks"),
    (["compare", "-p", "4", "-m", "1000000"], "65536 microbatches"),
    (["show", "zb-v", "-p", "100000", "-m", "8"], "4096 pipeline ranks"),
    (["show", "zb-v", "-p", "4", "-m", "1000000"], "65536 microbatches"),
    (["simulate", "zb-h1", "-p", "4", "-m", "10", "--cost-f", "1e308"], "not a finite number"),
    (["simulate", "zb-h1", "-p", "4", "-m", "10", "--mem-f", "1e308"], "not a finite number"),
    (["validate", "WIDE"], "20000 ranks, over the limit of 4096"),
]


@pytest.mark.parametrize("args,reason", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_cli_refuses_with_one_line_and_exit_2(args: list[str], reason: str, wide_plan: Path) -> None:
    args = [str(wide_plan) if a == "WIDE" else a for a in args]
    rc, out, err, seconds = _cli(*args)
    assert rc == 2, (rc, out[-500:], err[-2000:])
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("zb-schedule: error: "), err[-2000:]
    assert reason in lines[0]
    assert seconds < CLI_SECONDS


def test_validate_refuses_plan_file_costs_that_overflow(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    save_plan(registry.generate("zb-h1", 2, 4), plan)
    rc, out, err, _ = _cli("validate", str(plan), "--cost-w", "1e308")
    assert rc == 2 and out == "" and len(err.splitlines()) == 1
    assert "not a finite number" in err


def test_limits_allow_the_benchmark_shapes_and_refuse_beyond() -> None:
    for name in ("1f1b", "zb-h1"):
        registry.check_limits(name, 512, 2048)  # about 3 million actions: allowed
        with pytest.raises(limits.LimitError, match="4096 pipeline ranks"):
            registry.check_limits(name, 100000, 10)
        with pytest.raises(limits.LimitError, match="65536 microbatches"):
            registry.check_limits(name, 4, 1000000)
    registry.check_limits("zb-h1", limits.MAX_RANKS, 1)
    registry.check_limits("zb-h1", 1, limits.MAX_MICROBATCHES)


def test_per_schedule_limits_come_from_the_registry() -> None:
    tighter = [name for name in registry.available() if registry.get(name).max_actions is not None]
    assert tighter, "the searched generators state their own action limits"
    for name in tighter:
        spec = registry.get(name)
        c = spec.default_chunks
        per_mb = 3 * 8 * c  # p = 8
        fits = spec.max_actions // per_mb
        registry.check_limits(name, 8, fits)
        with pytest.raises(limits.LimitError, match=f"over the limit of {spec.max_actions}; use m <= {fits} at p=8"):
            registry.check_limits(name, 8, fits + 1)


def test_registry_refuses_costs_whose_sums_overflow() -> None:
    for kw in (dict(f=1e308), dict(b=1e308, w=1e308), dict(mem_f=1e308), dict(comm=1e308)):
        costs = StageCosts.build(num_ranks=4, **kw)
        with pytest.raises(limits.LimitError, match="not a finite number"):
            registry.generate("zb-h1", 4, 8, costs=costs)
    # each value is finite, only the sum over the plan overflows
    costs = StageCosts.build(num_ranks=4, f=1e307)
    with pytest.raises(limits.LimitError, match="overflow"):
        registry.generate("zb-h1", 4, 8, costs=costs)
    registry.generate("zb-h1", 4, 8, costs=StageCosts.build(num_ranks=4, f=1e300))


def test_trainer_plan_building_gives_one_line_config_error(tmp_path: Path) -> None:
    from megatron.config.errors import ConfigError
    from megatron.pipeline.layout import pipeline_layout
    from megatron.pipeline.schedule_flags import ScheduleConfig
    from zb_pipeline.runtime.runtime import PlanSource

    def refused(fn, match: str) -> None:
        with pytest.raises(ConfigError) as info:
            fn()
        assert "\n" not in str(info.value) and match in str(info.value)

    refused(lambda: pipeline_layout(ScheduleConfig(), pp=100000, num_microbatches=8, num_layers=100000), "4096")
    refused(lambda: pipeline_layout(ScheduleConfig(), pp=4, num_microbatches=1000000, num_layers=8), "65536")
    wide = tmp_path / "wide.json"
    _write_wide_plan(wide, 20000)
    config = ScheduleConfig(schedule_file=str(wide))
    refused(lambda: pipeline_layout(config, pp=20000, num_microbatches=1, num_layers=20000), "20000 ranks")
    # re-planning from measured costs whose sums overflow (the runtime's PlanSource asks the registry)
    huge = StageCosts.build(num_ranks=2, f=1e308)
    refused(
        lambda: ScheduleConfig(schedule="zb-auto").build_schedule(pp=2, num_microbatches=4, num_layers=4, costs=huge),
        "finite",
    )
    with pytest.raises(limits.LimitError):
        PlanSource("zb-auto", num_ranks=2).replanned(costs=huge, mem_limit=None).schedule(4)


def test_trainer_flags_with_a_million_microbatches_exit_2() -> None:
    from megatron.arguments import parse_run_config
    from megatron.config.errors import ConfigError

    argv = [
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--vocab-size", "120", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "1000000",
        "--train-iters", "1", "--lr", "1e-3", "--pipeline-model-parallel-size", "2",
    ]  # fmt: skip
    with pytest.raises(ConfigError) as info:
        parse_run_config(argv, world_size=2)
    assert "\n" not in str(info.value) and "65536 microbatches" in str(info.value)


def test_plan_file_refused_by_size_before_it_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = tmp_path / "plan.json"
    save_plan(registry.generate("1f1b", 2, 2), plan)
    monkeypatch.setattr(limits, "MAX_PLAN_FILE_BYTES", 10)
    with pytest.raises(PlanFileError, match="over the limit of 10 bytes"):
        load_plan(plan)


def _traced_peak(p: int, m: int) -> int:
    sched = registry.generate("1f1b", p, m)  # the registry's cached plan: other tests may have used it before
    costs = StageCosts.build(num_ranks=p)
    check_and_lower(sched, costs=costs)  # so both sizes are measured warm, whatever ran earlier in the session
    simulate(sched, costs)
    tracemalloc.start()
    try:
        check_and_lower(sched, costs=costs)
        simulate(sched, costs)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_validation_and_simulation_memory_grows_with_actions_not_p_squared() -> None:
    """8x the ranks at a fixed m is 8x the actions: the peak memory of validate + lower + simulate (measured warm)
    grows about 13x (hash tables step up in powers of two); p x p tables would make it about 64x."""
    small, large = _traced_peak(64, 4), _traced_peak(512, 4)
    assert large / small < 24.0, (small, large)
