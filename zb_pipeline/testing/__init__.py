"""Test helpers shared by every multi-rank test: spawned gloo process groups and torchrun launches with timeouts."""

from zb_pipeline.testing.harness import MultiProcessError, TorchrunResult, run_multiprocess, run_torchrun

__all__ = ["MultiProcessError", "TorchrunResult", "run_multiprocess", "run_torchrun"]
