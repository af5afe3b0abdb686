"""--manual-gc: Python's collector off during iterations, collections at iteration boundaries, numerics unchanged."""

from __future__ import annotations

import gc
import io
import weakref

import pytest
import torch

from megatron.arguments import parse_run_config
from megatron.config.errors import ConfigError
from megatron.garbage_collection import ManualGC
from megatron.training import pretrain

ARGV = [
    "--model-config", "gpt-tiny", "--seq-length", "16", "--vocab-size", "64", "--mock-data",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6", "--lr", "5e-3",
    "--log-interval", "3", "--eval-interval", "3", "--eval-iters", "1",
    "--hidden-dropout", "0", "--attention-dropout", "0",
]  # fmt: skip


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def restore_gc():
    was = gc.isenabled()
    yield
    gc.unfreeze()
    if was:
        gc.enable()


def test_policy_collects_only_at_boundaries(restore_gc):
    pol = ManualGC(interval=2)
    pol.start()
    assert not gc.isenabled() and gc.get_freeze_count() > 0
    dead = [_cycle() for _ in range(2000)]  # far past the automatic threshold: nothing runs on its own
    assert all(r() is not None for r in dead)
    pol.after_iteration(1)  # young collection: the iteration's cycles go
    assert all(r() is None for r in dead)
    # A cycle that was alive through a young collection sits in the oldest generation: once garbage, only a full
    # collection frees it.
    keep = _Node()
    keep.other = _Node()
    keep.other.other = keep
    old = weakref.ref(keep)
    pol.after_iteration(1)
    del keep
    pol.after_iteration(1)  # young again
    assert old() is not None
    pol.after_iteration(2)  # every 2 iterations: everything
    assert old() is None
    assert pol.collections == 5 and pol.seconds > 0  # start + four boundaries
    pol.stop()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_policy_keeps_a_disabled_collector_disabled(restore_gc):
    gc.disable()
    pol = ManualGC()
    pol.start()
    pol.stop()
    assert not gc.isenabled()


def test_flags_are_validated():
    with pytest.raises(ConfigError, match="only apply with --manual-gc"):
        parse_run_config([*ARGV, "--manual-gc-interval", "5"])
    with pytest.raises(ConfigError, match="only apply with --manual-gc"):
        parse_run_config([*ARGV, "--no-manual-gc-eval"])
    with pytest.raises(ConfigError, match="--manual-gc-interval=-1 must be >= 0"):
        parse_run_config([*ARGV, "--manual-gc", "--manual-gc-interval", "-1"])
    t = parse_run_config([*ARGV, "--manual-gc", "--manual-gc-interval", "5", "--no-manual-gc-eval"]).training
    assert (t.manual_gc, t.manual_gc_interval, t.manual_gc_eval) == (True, 5, False)


def test_training_with_manual_gc_matches_and_restores_the_collector(restore_gc, monkeypatch):
    torch.set_num_threads(1)
    calls: list[str] = []
    for name in ("start", "after_iteration", "around_evaluation", "stop"):
        orig = getattr(ManualGC, name)

        def spy(self, *args, _orig=orig, _name=name):
            calls.append(_name)
            if _name == "after_iteration":  # the collector stays off for the whole loop
                assert not gc.isenabled()
            return _orig(self, *args)

        monkeypatch.setattr(ManualGC, name, spy)
    plain_log, manual_log = io.StringIO(), io.StringIO()
    plain = pretrain(parse_run_config(ARGV), stream=plain_log)
    assert calls == []
    manual = pretrain(parse_run_config([*ARGV, "--manual-gc", "--manual-gc-interval", "2"]), stream=manual_log)
    # start + 6 boundaries + 4 around the validations; the run summary says so
    assert "manual gc: 11 collections" in manual_log.getvalue() and "manual gc" not in plain_log.getvalue()
    assert manual.losses == plain.losses and manual.validation_losses == plain.validation_losses
    assert calls.count("after_iteration") == 6 and calls[0] == "start" and calls[-1] == "stop"
    assert calls.count("around_evaluation") == 4  # validations at iterations 3 and 6, each bracketed
    assert gc.isenabled() and gc.get_freeze_count() == 0
