"""tools/gpu_check.py: FLOP counting, MFU math, report formatting, arguments, and the F/B/W measurement on CPU."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from megatron.kernels.triton_runtime import import_triton, triton_importable

if triton_importable():  # Triton chooses compiling or interpreting at its first import, and FlopCounterMode imports
    import_triton()  # it: let megatron.kernels choose first, or every later kernel test in this session fails
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import gpu_check as gc  # noqa: E402

SHAPE = gc.StackShape(layers=2, hidden=32, heads=4, seq=16, micro_batch=2)


def test_linear_flops_match_torch_flop_counter():
    """The linears of a forward, and of a plain autograd backward (2x: input and weight gradients)."""
    torch.set_num_threads(1)
    stage = gc.build_stack(SHAPE, torch.device("cpu"), torch.float32)
    for p in stage.parameters():
        del p.main_grad  # plain autograd backward, so that the counter sees the weight-gradient matmuls
    x = torch.randn(SHAPE.seq, SHAPE.micro_batch, SHAPE.hidden, requires_grad=True)
    with FlopCounterMode(display=False) as fwd:
        y = stage(x)
    with FlopCounterMode(display=False) as bwd:
        y.backward(torch.randn_like(y))
    # the CPU attention kernel is not counted by FlopCounterMode: only the linears are
    assert fwd.get_total_flops() == gc.linear_flops(SHAPE) * SHAPE.layers
    assert bwd.get_total_flops() == 2 * gc.linear_flops(SHAPE) * SHAPE.layers


def test_attention_flops_are_half_the_full_products():
    b, s, n, d = SHAPE.micro_batch, SHAPE.seq, SHAPE.heads, SHAPE.hidden // SHAPE.heads
    q, k, v = (torch.randn(b, n, s, d) for _ in range(3))
    with FlopCounterMode(display=False) as fc:
        torch.matmul(torch.matmul(q, k.transpose(-1, -2)).softmax(-1), v)
    assert 2 * gc.attention_flops(SHAPE) == fc.get_total_flops()


def test_action_flops_split():
    f = gc.action_flops(SHAPE)
    lin, att = gc.linear_flops(SHAPE) * SHAPE.layers, gc.attention_flops(SHAPE) * SHAPE.layers
    assert f == {"F": lin + att, "B": lin + 2 * att, "W": lin, "BW": 2 * lin + 2 * att}
    # GPT-2 XL widths: 24 * tokens * h^2 per layer of linears (4x MLP)
    xl = gc.StackShape(layers=1, hidden=1600, heads=25, seq=1024, micro_batch=1)
    assert gc.linear_flops(xl) == 24 * 1024 * 1600**2


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H20", 148.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10G", 70.0),
        ("Some Future GPU", None),
    ],
)
def test_peak_table(name, peak):
    assert gc.peak_tflops_for(name) == peak


def test_mfu_math():
    assert gc.mfu(989e12, 1.0, 989.0) == pytest.approx(1.0)
    assert gc.mfu(10**12, 0.01, 1000.0) == pytest.approx(0.1)
    assert gc.mfu(10**12, 1.0, None) is None


def test_summarize_and_report(tmp_path):
    times = {"F": [0.010, 0.012, 0.011], "BW": [0.020, 0.022, 0.021], "B": [0.012] * 3, "W": [0.010] * 3}
    rows = gc.summarize(SHAPE, times, peak_tflops=100.0)
    flops = gc.action_flops(SHAPE)
    assert rows["F"]["median_ms"] == pytest.approx(11.0)
    assert rows["F"]["tflops"] == pytest.approx(flops["F"] / 0.011 / 1e12)
    assert rows["BW"]["mfu"] == pytest.approx(flops["BW"] / 0.021 / 100e12)
    assert rows["split"]["b_plus_w_over_bw"] == pytest.approx(22.0 / 21.0)
    assert rows["split"]["w_share_of_b_plus_w"] == pytest.approx(10.0 / 22.0)
    report = {
        "shape": gc.asdict(SHAPE),
        "device": "cuda",
        "dtype": "bfloat16",
        "warmup": 1,
        "repeats": 3,
        "peak_tflops": 100.0,
        "rows": rows,
        "times_s": times,
        "peak_memory_bytes": 3 * 2**30,
        "environment": {"device_name": "NVIDIA X", "python": "3", "torch": "2", "cuda": "12", "date": "d"},
    }
    json_path, md_path = gc.write_report(report, str(tmp_path))
    md = open(md_path).read()
    assert "| F | 11.000 |" in md and "(B + W) / BW = 1.048" in md and "3.00 GiB" in md
    assert json.load(open(json_path))["rows"]["split"]["b_plus_w_over_bw"] == pytest.approx(22.0 / 21.0)


def test_measurement_path_on_cpu(tmp_path):
    """The real measurement code (build, F, BW, B under defer, W from the store) on a tiny fp32 stack."""
    torch.set_num_threads(1)
    report = gc.run_check(SHAPE, device="cpu", dtype="float32", warmup=1, repeats=2, peak_tflops=1.0)
    assert all(len(report["times_s"][a]) == 2 and min(report["times_s"][a]) > 0 for a in gc.ACTIONS)
    assert report["rows"]["W"]["mfu"] is not None and report["rows"]["split"]["b_plus_w_over_bw"] > 0
    json_path, md_path = gc.write_report(report, str(tmp_path))
    assert os.path.exists(json_path) and "| W |" in open(md_path).read()


def test_split_backward_gives_the_full_backward_gradients():
    """What is timed as B + W computes the same main_grad as the full backward that BW times."""
    torch.set_num_threads(1)
    from zb_pipeline.runtime.weight_grad_store import WeightGradStore, bind_weight_grad_store

    stage = gc.build_stack(SHAPE, torch.device("cpu"), torch.float32)
    store = WeightGradStore()
    bind_weight_grad_store(stage, store)
    x0 = torch.randn(SHAPE.seq, SHAPE.micro_batch, SHAPE.hidden)
    dy = torch.randn_like(x0)
    gc._one_round(stage, store, gc._Timer(torch.device("cpu")), x0, dy, microbatch=0)
    # one full backward and one split backward of the same microbatch: every main_grad holds two equal halves
    full = {}
    for name, p in stage.named_parameters():
        full[name] = p.main_grad.clone()
        p.main_grad.zero_()
    stage(x0.requires_grad_(True)).backward(dy)
    for name, p in stage.named_parameters():
        if getattr(p, "zb_deferrable", False):
            assert torch.allclose(full[name], 2 * p.main_grad, rtol=1e-5, atol=1e-6), name


def test_arguments(capsys):
    assert gc.main(["--device", "cpu", "--hidden", "30", "--heads", "4"]) == 2
    assert "divisible" in capsys.readouterr().err
    assert gc.main(["--device", "cpu", "--tiny", "--repeats", "0"]) == 2
    assert gc.main(["--device", "cpu", "--tiny", "--peak-tflops", "-1"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_one_line_and_exit_0(capsys, tmp_path):
    assert gc.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA" in out
    assert not os.listdir(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_check_on_cuda(tmp_path):
    assert gc.main(["--out", str(tmp_path), "--layers", "2", "--repeats", "3", "--warmup", "1"]) == 0
    report = json.load(open(tmp_path / "gpu_check.json"))
    assert report["rows"]["split"]["b_plus_w_over_bw"] > 0
