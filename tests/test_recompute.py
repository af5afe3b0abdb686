"""Activation recomputation (``--recompute-*``) composed with the B/W split: same training to the bit, less memory.

- One process: a GPT with dropout on, B inside a deferring ``WeightGradStore`` then W, gives bit-identical gradients
  and leaves the RNG stream where it was, for each granularity and method; a user's module under the generic split
  with ``Recompute`` too, with W never recomputing (the forward runs once in F and once in B).
- The trainer (gloo, CPU, dropout on): losses with recompute equal the losses without it, bit for bit, for the same
  schedule; a run resumed from a checkpoint taken under recompute equals the uninterrupted one.
- Bad flags: one line at parse time (``pretrain_gpt.py`` turns it into exit 2 before any collective).
"""

from __future__ import annotations

import pytest
import torch
from training_runs import WINDOW, pretrain_rank

from zb_pipeline.testing.harness import run_multiprocess

STEPS = 3
BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
    "--vocab-size", "120", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", str(STEPS), "--lr", "3e-3", "--lr-warmup-iters", "1", "--weight-decay", "0.1",
    "--attention-dropout", "0.1", "--hidden-dropout", "0.1", "--seed", "7", "--eval-iters", "0",
    "--log-interval", "1", "--distributed-timeout-seconds", "60",
]  # fmt: skip
SELECTIVE = ["--recompute-activations"]
FULL_UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"]
FULL_BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]


# ------------------------------------------------------------------------------------------------ one process
def _gpt_grads(recompute: list[str], *, defer: bool) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor]:
    from megatron.arguments import parse_run_config
    from megatron.model import build_gpt_model
    from megatron.model.recompute import apply_recompute
    from zb_pipeline.runtime.weight_grad_store import WeightGradStore, bind_weight_grad_store

    run = parse_run_config(["--num-layers", "3", *BASE[2:], *recompute])
    torch.manual_seed(0)
    model = build_gpt_model(run.model, seed=3)
    apply_recompute(model, run.recompute)
    store = WeightGradStore()
    bind_weight_grad_store(model, store)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for mb in range(2):
        ids = torch.randint(0, 120, (2, 16), generator=gen)
        loss = model(ids, torch.roll(ids, 1, 1)).mean()
        losses.append(loss.item())
        if defer:
            with store.defer(0, mb):
                loss.backward()
        else:
            loss.backward()
    for mb in range(2):
        store.run(0, mb)
    store.assert_empty()
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}, torch.rand(4)


@pytest.mark.parametrize("defer", [True, False], ids=["B-then-W", "BW"])
def test_gpt_gradients_bit_identical_for_each_granularity_and_method(defer: bool) -> None:
    ref = _gpt_grads([], defer=defer)
    for flags in (SELECTIVE, FULL_UNIFORM, FULL_BLOCK):
        losses, grads, after = _gpt_grads(flags, defer=defer)
        assert losses == ref[0], flags
        assert torch.equal(after, ref[2]), flags  # the RNG stream continues where it would have
        assert grads.keys() == ref[1].keys()
        assert all(torch.equal(grads[n], ref[1][n]) for n in grads), (
            flags,
            [n for n in grads if not torch.equal(grads[n], ref[1][n])],
        )


class _Block(torch.nn.Module):
    """A user's block: plain ``nn.Linear``s and a dropout, nothing deferrable; counts its forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.fc2(torch.nn.functional.dropout(torch.relu(self.fc1(x)), 0.3))


def test_generic_split_with_recompute_defers_plain_params_to_w_and_w_never_recomputes() -> None:
    from zb_pipeline.runtime.generic_split import GenericSplit
    from zb_pipeline.runtime.recompute import Recompute
    from zb_pipeline.runtime.weight_grad_store import WeightGradStore

    def run(wrap: bool) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
        torch.manual_seed(5)
        blocks = [_Block(), _Block()]
        stage = torch.nn.Sequential(*(Recompute(b) if wrap else b for b in blocks))
        store = WeightGradStore()
        split = GenericSplit(stage, store)
        x = torch.randn(4, 8, requires_grad=True)
        y = stage(x)
        with store.defer(0, 0):
            (gx,) = split.backward_input([y], [torch.ones_like(y)], [x])
        calls_after_b = [b.calls for b in blocks]
        assert all(p.grad is None for p in stage.parameters())  # every weight gradient waits for W
        store.run(0, 0)
        assert [b.calls for b in blocks] == calls_after_b  # W recomputed nothing
        return [p.grad for p in stage.parameters()], gx, calls_after_b

    ref, ref_gx, ref_calls = run(False)
    got, gx, calls = run(True)
    assert ref_calls == [1, 1] and calls == [2, 2]  # F once, B's recompute once
    assert torch.equal(gx, ref_gx)
    assert len(got) == len(ref) == 8 and all(torch.equal(a, b) for a, b in zip(got, ref))


def test_generic_split_first_stage_with_recompute_and_no_input_gradient() -> None:
    """A recomputed block whose input needs no gradient (a first stage): its weights still get their gradients."""
    from zb_pipeline.runtime.generic_split import GenericSplit
    from zb_pipeline.runtime.recompute import Recompute
    from zb_pipeline.runtime.weight_grad_store import WeightGradStore

    def run(wrap: bool) -> list[torch.Tensor]:
        torch.manual_seed(6)
        block = _Block()
        stage = torch.nn.Sequential(Recompute(block) if wrap else block)
        store = WeightGradStore()
        split = GenericSplit(stage, store)
        y = stage(torch.randn(4, 8))
        with store.defer(0, 0):
            split.backward_input([y], [torch.ones_like(y)], [])
        store.run(0, 0)
        assert block.calls == (2 if wrap else 1)
        return [p.grad for p in stage.parameters()]

    ref, got = run(False), run(True)
    assert len(got) == len(ref) == 4 and all(g is not None and torch.equal(g, r) for g, r in zip(got, ref))


# ------------------------------------------------------------------------------------------------ the trainer
def _losses(argv: list[str], world_size: int) -> list[float]:
    results = [r["losses"] for r in run_multiprocess(pretrain_rank, world_size, args=(argv,), timeout_s=240)]
    assert all(r == results[0] for r in results)
    return results[0]


def _pp(schedule: str) -> list[str]:
    return ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule]


def test_zb_h1_selective_bit_identical_and_resume_under_recompute_is_bit_exact(tmp_path) -> None:
    """zb-h1, pp = 2, dropout on: selective recompute gives the losses of no recompute, to the bit; 2 steps that save
    under recompute then 2 loaded ones give the 4 uninterrupted steps."""
    from megatron import checkpoint_files as cf

    argv = [*BASE, "--train-iters", "4", *_pp("zb-h1")]
    plain = _losses(argv, 2)
    ckpt = str(tmp_path / "ckpt")
    first = _losses([*argv, *SELECTIVE, "--save", ckpt, "--exit-interval", "2"], 2)
    assert cf.read_tracker(ckpt) == 2
    second = _losses([*argv, *SELECTIVE, "--load", ckpt], 2)
    assert first + second == plain, (first, second, plain)


def test_zb_v_full_block_tp2_bit_identical() -> None:
    """zb-v (V placement: both tied copies on rank 0), pp = 2 x tp = 2, full block recompute of one layer per
    virtual stage (each holds one): the same losses, to the bit, as without recompute."""
    argv = [*BASE, "--tensor-model-parallel-size", "2", *_pp("zb-v")]
    assert _losses([*argv, *FULL_BLOCK], 4) == _losses(argv, 4)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "zb-auto", "zb-v"])
@pytest.mark.parametrize("pp", [2, 4])
def test_every_granularity_and_method_bit_identical_slow(schedule: str, pp: int) -> None:
    """The grid: each granularity and method, pp = 2 and 4, tp = 2 at pp = 2 (world 4), sequence parallelism and
    distributed saved activations in the mix."""
    tp = 2 if pp == 2 else 1
    layers = "8" if schedule == "zb-v" and pp == 4 else "4"
    argv = [*BASE, "--num-layers", layers, "--tensor-model-parallel-size", str(tp)]
    argv += ["--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", schedule]
    plain = _losses(argv, pp * tp)
    variants = [SELECTIVE, FULL_BLOCK, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                        "--recompute-num-layers", "1"]]  # fmt: skip
    if tp > 1:
        variants.append([*FULL_BLOCK, "--distribute-saved-activations"])
    for flags in variants:
        assert _losses([*argv, *flags], pp * tp) == plain, (schedule, pp, flags)
    if tp > 1:
        sp = [*argv, "--sequence-parallel"]
        assert _losses([*sp, *FULL_BLOCK], pp * tp) == _losses(sp, pp * tp), (schedule, "sp")


@pytest.mark.slow
def test_post_validation_and_pp1_bit_identical_slow() -> None:
    post = [*BASE, *_pp("zb-h1"), "--enable-optimizer-post-validation"]
    assert _losses([*post, *FULL_UNIFORM], 2) == _losses(post, 2)
    assert _losses([*BASE, *SELECTIVE], 1) == _losses(BASE, 1)


@pytest.mark.slow
def test_zb_auto_replans_from_a_profile_measured_under_recompute_slow(tmp_path) -> None:
    """zb-auto re-planned at the end of a profiling window under full recompute: the saved profile carries the B
    transients, the re-planned plan's predicted peak fits the limit of 2 measured microbatches (plus one transient),
    and the losses stay those of the same run without recompute (within 1e-4: the two runs may re-plan differently
    from their own timings)."""
    from zb_pipeline.schedule.memory import peak_memory
    from zb_pipeline.schedule.profile import Profile, mem_limit_for_microbatches
    from zb_pipeline.schedule.registry import generate

    argv = [*BASE, "--train-iters", "5", "--pipeline-model-parallel-size", "2", "--enable-zero-bubble", *WINDOW]
    argv += ["--zero-bubble-max-pending-backward", "2"]
    plain = run_multiprocess(pretrain_rank, 2, args=(argv,), timeout_s=240)[0]["losses"]
    save = str(tmp_path / "ckpt")
    got = run_multiprocess(pretrain_rank, 2, args=([*argv, *FULL_UNIFORM, "--save", save],), timeout_s=240)
    assert "replanned zb-auto" in "".join(r["log"] for r in got)
    losses = got[0]["losses"]
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(losses, plain)) and len(losses) == len(plain)
    profile = Profile.load(f"{save}/zb_profile.json")
    assert all(t > 0 for t in profile.mem_b_transient)
    limit = mem_limit_for_microbatches(profile, 2)
    costs = profile.to_stage_costs()
    plan = generate("zb-auto", 2, 4, costs=costs, mem_limit=limit)
    assert max(peak_memory(plan, costs)) <= limit * (1 + 1e-9)


# ------------------------------------------------------------------------------------------------ bad input
def _error(extra: list[str], world_size: int = 2) -> str:
    from megatron.arguments import parse_run_config
    from megatron.config.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_run_config([*BASE, *extra], world_size=world_size)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_flags_have_megatrons_meanings() -> None:
    from megatron.arguments import parse_run_config

    run = parse_run_config([*BASE, *SELECTIVE])
    assert (run.recompute.granularity, run.recompute.segments(4)) == ("selective", ())
    run = parse_run_config([*BASE, *FULL_UNIFORM])
    assert run.recompute.segments(4) == ((0, 2), (2, 4)) and run.recompute.segments(3) == ((0, 2), (2, 3))
    run = parse_run_config([*BASE, *FULL_BLOCK])
    assert run.recompute.segments(4) == ((0, 1),)
    assert not parse_run_config(BASE).recompute.enabled


def test_contradictions_and_too_many_layers_are_one_line_errors() -> None:
    assert "contradicts" in _error([*SELECTIVE, "--recompute-granularity", "full"])
    assert "needs --recompute-method" in _error(["--recompute-granularity", "full"])
    assert "apply to --recompute-granularity full" in _error([*SELECTIVE, "--recompute-method", "block"])
    assert "apply to --recompute-granularity full" in _error(["--recompute-num-layers", "2"])
    assert "invalid choice" in _error(["--recompute-method", "zigzag"])
    too_many = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"]
    assert "use at most 2" in _error([*too_many, *_pp("zb-h1")])  # 4 layers over 2 stages
    assert "use at most 1" in _error([*too_many, *_pp("zb-v")])  # 4 virtual stages of 1 layer
    assert "needs --recompute-granularity full" in _error([*SELECTIVE, "--distribute-saved-activations"])
    assert "tensor-model-parallel-size > 1" in _error([*FULL_BLOCK, "--distribute-saved-activations"])
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert "--sequence-parallel" in _error([*FULL_BLOCK, "--distribute-saved-activations", *tp2])


def _saved_bytes_of_forward(flags: list[str]) -> int:
    """Bytes autograd keeps from one training forward of the whole model built from ``flags``."""
    from megatron.arguments import parse_run_config
    from megatron.model.gpt import build_gpt_stages
    from megatron.model.recompute import apply_recompute

    run = parse_run_config([*BASE, *flags])
    (stage,) = build_gpt_stages(run.model, 1, seed=3)
    apply_recompute(stage, run.recompute)
    tokens = torch.randint(
        0, run.model.vocab_size, (2, run.model.seq_length), generator=torch.Generator().manual_seed(1)
    )
    kept: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(tokens, tokens)
    return sum(kept)


def test_each_recompute_flag_changes_what_the_forward_keeps() -> None:
    """Fails if a --recompute-* flag were parsed but not applied: each choice keeps a different amount."""
    none = _saved_bytes_of_forward([])
    selective = _saved_bytes_of_forward(SELECTIVE)
    block1 = _saved_bytes_of_forward(FULL_BLOCK)
    block2 = _saved_bytes_of_forward([*FULL_BLOCK[:-1], "2"])
    uniform2 = _saved_bytes_of_forward(FULL_UNIFORM)
    assert selective < none
    assert block2 < block1 < none  # --recompute-num-layers: more layers recomputed, less kept
    assert uniform2 < block2  # --recompute-method: uniform 2 covers all 4 layers, block 2 only the first two
