"""``tools/gpu_check.py --full`` without a GPU: the plan, the budget, timeouts that end whole process groups, log
parsing, targets and the report; the kernel comparisons and the kernel-enabled stage run through Triton's
interpreter at tiny shapes (the same code the GPU runs natively)."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import gpu_check as gc  # noqa: E402
import gpu_check_full as full  # noqa: E402

from megatron.arguments import parse_run_config  # noqa: E402
from megatron.kernels.triton_runtime import interpreter_problem  # noqa: E402

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or interpreter_problem() is not None, reason=f"interpreter: {interpreter_problem()}"
)

LOG = """layout: world=1, tp=1, pp=1, dp=1, sequence-parallel=False, micro-batch=2, global-batch=4, microbatches/rank=2, backend=nccl, device=cuda:0
kernels: triton, compiled for CUDA (--kernels auto on CUDA): W kernel (fp32 into main_grad), LayerNorm (weight grads in B)
 iteration        1/       4 | consumed samples:            4 | elapsed time per iteration (ms): 54.7 | lm loss: 4.862160E+00 | loss scale: 1.0 |
 iteration        4/       4 | consumed samples:           16 | elapsed time per iteration (ms): 28.1 | lm loss: 4.760160E+00 | loss scale: 1.0 |
saved checkpoint at iteration       4 to /tmp/x/checkpoint
"""  # noqa: E501


def test_plan_fits_five_minutes_and_its_commands_parse(tmp_path):
    steps = full.plan(str(tmp_path))
    assert [s.name for s in steps] == ["kernels", "stage", "train_nccl", "train_nccl_torch", "resume_nccl", "pp2_gloo"]
    assert steps[3].only_if_failed == "train_nccl" and steps[3].command[-2:] == ["--kernels", "torch"]
    assert full.BUDGET_S <= 290 and all(s.timeout_s <= full.BUDGET_S for s in steps)
    root = os.path.dirname(full.__file__)
    for s in steps:
        script = next(a for a in s.command if a.endswith(".py"))
        assert os.path.exists(os.path.join(os.path.dirname(root), script)), script
        if s.parse != "training":
            continue
        nproc = int(s.command[s.command.index("--nproc-per-node") + 1])
        argv = s.command[s.command.index("pretrain_gpt.py") + 1 :]
        run = parse_run_config(argv, world_size=nproc)  # the flags are right (typos would exit 2 on the GPU)
        assert run.precision.params_dtype == torch.bfloat16
    pp2 = steps[-1]
    assert pp2.env == {"CUDA_VISIBLE_DEVICES": ""} and "--enable-optimizer-post-validation" in pp2.command
    assert all("backend=nccl" in s.expect for s in steps if s.backend == "nccl")


def test_step_timeout_is_cut_to_the_budget():
    step = full.Step("x", "x", ["true"], 60, "cuda")
    assert full.step_timeout(step, 300) == 60 and full.step_timeout(step, 30) == 30
    assert full.step_timeout(step, full.MIN_STEP_S - 1) is None


def test_timeout_ends_the_whole_process_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('started', flush=True); time.sleep(60)"
    )
    t0 = time.perf_counter()
    out = full.run_command([sys.executable, "-c", code], timeout_s=1.5)
    assert out.timed_out and out.rc is None and time.perf_counter() - t0 < 15 and "started" in out.output
    child = int(pid_file.read_text())
    for _ in range(50):  # the grandchild got SIGTERM with its group
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"child {child} still running")
    ok = full.run_command([sys.executable, "-c", "print('hi')"], timeout_s=30)
    assert ok.rc == 0 and ok.output.strip() == "hi" and not ok.timed_out
    assert full.run_command(["/no/such/binary"], timeout_s=5).error


def test_parse_training_log():
    parsed = full.parse_training(LOG)
    assert parsed["losses"] == {1: 4.86216, 4: 4.76016}
    assert parsed["backend_seen"] == "nccl" and parsed["device"] == "cuda:0"
    assert parsed["kernels_line"].startswith("kernels: triton, compiled for CUDA")


def _kernels_json(path):
    case = dict(shape="s", rel_err=[1e-3], torch_rel_err=[1e-3], tolerance=2e-2, first_call_s=1.0, torch_ms=1.0)
    cases = [
        dict(case, name="LayerNorm", correct=True, fused_ms=0.9, ratio=0.9, target=1.03, target_met=True,
             target_name="fused within 3% of torch or faster"),
        dict(case, name="W kernel (fc1)", correct=True, fused_ms=1.2, ratio=1.2, target=1.0, target_met=False,
             target_name="no slower than cuBLAS GEMM + fp32 add", tolerance=1e-4),
        {"name": "cross-entropy", "shape": "s", "error": "RuntimeError: boom"},
    ]  # fmt: skip
    path.write_text(json.dumps({"cases": cases, "errors": ["cross-entropy: RuntimeError: boom"]}))


def test_run_full_reports_every_step_even_failed_timed_out_and_skipped(tmp_path):
    _kernels_json(tmp_path / "kernels.json")
    stage = {"rows": {"split": {"b_plus_w_over_bw": 1.02}}}
    (tmp_path / "stage.json").write_text(json.dumps(stage))
    steps = [
        full.Step("kernels", "kernels", ["k"], 100, "cuda", parse="kernels", artifact=str(tmp_path / "kernels.json")),
        full.Step("stage", "stage", ["s"], 100, "cuda", parse="stage", artifact=str(tmp_path / "stage.json")),
        full.Step("train_nccl", "train", ["t"], 100, "nccl", expect=("backend=nccl", "saved checkpoint")),
        full.Step("train_nccl_torch", "fallback", ["f"], 100, "nccl", only_if_failed="train_nccl"),
        full.Step("resume_nccl", "resume", ["r"], 100, "nccl"),
        full.Step("pp2_gloo", "pp2", ["p"], 100, "gloo"),
    ]
    clock = {"t": 0.0}
    outcomes = {
        "k": full.Outcome(0, 30, "done"),
        "s": full.Outcome(0, 20, "done"),
        "t": full.Outcome(0, 20, LOG),
        "r": full.Outcome(None, 100, "hung", timed_out=True),
    }

    def runner(command, *, timeout_s, env):
        out = outcomes[command[0]]
        clock["t"] += out.seconds
        return out

    lines = []
    report = full.run_full(
        str(tmp_path / "out"), budget_s=175, steps=steps, runner=runner, env={"device_name": "NVIDIA H200"},
        say=lines.append, clock=lambda: clock["t"],
    )  # fmt: skip
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert status == {"kernels": "fail", "stage": "pass", "train_nccl": "pass", "train_nccl_torch": "not needed",
                      "resume_nccl": "timeout", "pp2_gloo": "skipped"}  # fmt: skip
    assert not full.all_passed(report)
    assert report["steps"][-1]["problems"] == ["not started: 5 s of the budget left"]
    assert lines[0] == "gpu_check --full: kernels (kernels), up to 100 s ..."
    t = {row["target"]: row["status"] for row in report["targets"]}
    assert t["LayerNorm: fused within 3% of torch or faster (ratio <= 1.03)"] == "pass"
    assert t["W kernel (fc1): no slower than cuBLAS GEMM + fp32 add (ratio <= 1)"] == "fail"
    assert t["cross-entropy: runs"] == "fail" and t["(B + W) / BW of a layer stack <= 1.05"] == "pass"
    assert t["train_nccl: finishes, finite losses, expected log lines"] == "pass"
    assert t["resume_nccl: finishes, finite losses, expected log lines"] == "fail"
    assert report["coverage"]["nccl"] == ["train_nccl: train (pass)"]
    assert any(x.startswith("resume_nccl") for x in report["coverage"]["not_nccl"])
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "| resume_nccl | resume | nccl | timeout |" in md and "Ran under NCCL" in md
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text())["steps"][0]["name"] == "kernels"


def test_steps_past_the_budget_are_skipped_not_started(tmp_path):
    started = []
    steps = [full.Step(f"s{i}", "t", [f"c{i}"], 100, "gloo") for i in range(2)]

    def slow(command, *, timeout_s, env):
        started.append(command[0])
        time.sleep(0.3)
        return full.Outcome(0, 0.3, LOG)

    report = full.run_full(str(tmp_path), budget_s=full.MIN_STEP_S + 0.2, steps=steps, runner=slow, env={},
                           say=lambda _: None)  # fmt: skip
    assert started == ["c0"] and [s["status"] for s in report["steps"]][1] == "skipped"


@needs_interpreter
def test_kernel_cases_run_and_agree_through_the_interpreter(tmp_path):
    import gpu_check_kernels as gk

    out = tmp_path / "k.json"
    report = gk.run_cases(gk.TINY, device="cpu", dtype="bfloat16", warmup=0, repeats=1, out=str(out))
    names = [c["name"] for c in report["cases"]]
    assert names == ["W kernel (qkv)", "W kernel (fc1)", "W kernel (fc2)", "LayerNorm", "RMSNorm", "bias + GeLU",
                     "bias + SwiGLU", "cross-entropy"]  # fmt: skip
    assert report["errors"] == [] and all(c["correct"] for c in report["cases"]), report
    w = report["cases"][0]
    assert max(w["rel_err"]) <= gk.W_TOLERANCE < max(w["torch_rel_err"])  # fp32 accumulation vs a bf16 GEMM
    assert json.loads(out.read_text())["cases"][-1]["name"] == "cross-entropy"


@needs_interpreter
def test_stage_with_the_kernels_on(tmp_path):
    torch.set_num_threads(1)
    shape = gc.StackShape(layers=1, hidden=32, heads=4, seq=16, micro_batch=2)
    report = gc.run_check(shape, device="cpu", dtype="float32", warmup=0, repeats=1, peak_tflops=1.0, kernels="triton")
    assert report["kernels"].startswith("triton, Triton interpreter on CPU")
    assert report["rows"]["split"]["b_plus_w_over_bw"] > 0
    assert "Kernels: triton" in gc.to_markdown(report)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_full_without_cuda_one_line_and_exit_0(capsys, tmp_path):
    assert gc.main(["--full", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no CUDA" in out and not os.listdir(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_full_check_on_cuda(tmp_path):
    """The whole prepared check on this machine's GPU (about 5 minutes): every step passes."""
    rc = gc.main(["--full", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 0, [(s["name"], s["status"], s["problems"]) for s in report["steps"]]
    assert any(line.startswith("train_nccl") for line in report["coverage"]["nccl"])


def test_a_fallback_runs_only_when_its_step_failed(tmp_path):
    steps = [
        full.Step("train_nccl", "t", ["t"], 30, "nccl", expect=("backend=nccl",)),
        full.Step("train_nccl_torch", "f", ["f"], 30, "nccl", expect=("backend=nccl",), only_if_failed="train_nccl"),
    ]
    outputs = {"t": full.Outcome(1, 1.0, "Traceback: triton compile error"), "f": full.Outcome(0, 1.0, LOG)}
    report = full.run_full(str(tmp_path), budget_s=100, steps=steps, env={}, say=lambda _: None,
                           runner=lambda c, *, timeout_s, env: outputs[c[0]])  # fmt: skip
    assert [s["status"] for s in report["steps"]] == ["fail", "pass"]
    assert report["coverage"]["nccl"] == ["train_nccl_torch: f (pass)"]
    outputs["t"] = full.Outcome(0, 1.0, LOG)
    report = full.run_full(str(tmp_path), budget_s=100, steps=steps, env={}, say=lambda _: None,
                           runner=lambda c, *, timeout_s, env: outputs[c[0]])  # fmt: skip
    assert [s["status"] for s in report["steps"]] == ["pass", "not needed"] and full.all_passed(report)
    assert [t["target"] for t in report["targets"]][-1] == "train_nccl: finishes, finite losses, expected log lines"
