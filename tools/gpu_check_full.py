"""``python tools/gpu_check.py --full``: the prepared GPU check, as a plan of guarded steps with one time budget.

Each step is a subprocess with its own timeout, cut to what is left of ``--budget`` (default 285 s, so the whole
check ends within 5 minutes, Triton compilation included); a step that fails, times out or is never started is
reported as such and the steps after it still run.  The report (``gpu_check.md`` and ``gpu_check.json`` in ``--out``)
is written after every step, so even a check killed from outside leaves what it did.

Steps, in order of importance:

1. ``kernels``: ``tools/gpu_check_kernels.py``: every Triton kernel against its torch reference in native bf16 and
   timed against the unfused torch path at GPT-2 XL layer shapes (micro-batch 2);
2. ``stage``: ``tools/gpu_check.py``: one stage of 2 GPT-2 XL layers (hidden 1600, 25 heads, seq 1024,
   micro-batch 2) with the kernels on: F, B, W, BW, MFU against the device's dense bf16 peak, (B + W) / BW;
3. ``train_nccl``: ``pretrain_gpt.py`` through torchrun at world 1 with NCCL in bf16: the kernels (cross-entropy
   fusion on), the distributed optimizer, gradient clipping, a checkpoint saved at its last iteration;
4. ``resume_nccl``: the same run continued from that checkpoint (load, two more iterations);
5. ``pp2_gloo``: pp = 2 with zb-auto, optimizer post-validation and a profiling window (re-planning at its end), on
   gloo with the GPU hidden (one GPU allows one NCCL rank, and gloo cannot send CUDA tensors).

Targets (issue 19), each reported pass / fail / not measured: every kernel correct; each fused kernel within 3% of
its torch path or faster; the W kernel no slower than a cuBLAS bf16 GEMM + fp32 add; (B + W) / BW <= 1.05; and the
training steps finishing with finite losses.  The plan, the budget, the parsing and the report are pure Python and
tested on CPU (``tests/test_gpu_check_full.py``).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 285.0
MIN_STEP_S = 10.0  # a step is not started with less than this left
SPLIT_TARGET = 1.05  # (B + W) / BW
TAIL_LINES = 40


def train_model(hidden: int, seq: int) -> list[str]:
    """A small GPT for the training steps (4 layers, 8 heads, mock data, bf16, clipping)."""
    return (
        f"--num-layers 4 --hidden-size {hidden} --num-attention-heads 8 --seq-length {seq} "
        f"--max-position-embeddings {seq} --vocab-size 8192 --mock-data --micro-batch-size 2 --lr 1e-3 "
        "--log-interval 1 --eval-iters 1 --bf16 --clip-grad 1.0"
    ).split()


@dataclass
class Step:
    name: str
    title: str
    command: list[str]
    timeout_s: float
    backend: str  # what it exercises: "cuda" (no collectives), "nccl", "gloo"
    env: dict[str, str] = field(default_factory=dict)
    parse: str = "training"  # "kernels" | "stage" | "training"
    artifact: str | None = None  # a JSON file the step writes
    expect: tuple[str, ...] = ()  # lines the log must contain (regular expressions)
    only_if_failed: str | None = None  # a fallback: run only when this step did not pass


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def plan(work: str, *, micro_batch: int = 2) -> list[Step]:
    """The steps of the full check; ``work`` holds their files (checkpoints, JSON)."""
    py, ckpt, kernels_json = sys.executable, os.path.join(work, "checkpoint"), os.path.join(work, "kernels.json")
    train = ["pretrain_gpt.py", *train_model(512, 512), "--use-distributed-optimizer", "--cross-entropy-loss-fusion"]
    first = [*train, *"--global-batch-size 4 --train-iters 4 --eval-interval 4 --save-interval 4 --save".split(), ckpt]
    stage = f"--layers 2 --micro-batch {micro_batch} --warmup 3 --repeats 10 --kernels auto --out".split()
    pp2 = (
        "--global-batch-size 8 --train-iters 5 --eval-interval 5 --pipeline-model-parallel-size 2 "
        "--pipeline-schedule zb-auto --enable-optimizer-post-validation "
        "--zero-bubble-pipeline-timers-start-iter 1 --zero-bubble-pipeline-timers-end-iter 3"
    ).split()
    saved = (r"backend=nccl", r"saved checkpoint at iteration\s+4")
    return [
        Step(
            "kernels",
            "Triton kernels vs torch (bf16, GPT-2 XL shapes)",
            [py, "tools/gpu_check_kernels.py", "--json", kernels_json, "--micro-batch", str(micro_batch)],
            120,
            "cuda",
            parse="kernels",
            artifact=kernels_json,
        ),
        Step(
            "stage",
            "one stage's F, B, W, BW (2 GPT-2 XL layers, kernels on)",
            [py, "tools/gpu_check.py", *stage, os.path.join(work, "stage")],
            60,
            "cuda",
            parse="stage",
            artifact=os.path.join(work, "stage", "gpu_check.json"),
        ),
        Step(
            "train_nccl",
            "pretrain_gpt.py, world 1, NCCL, bf16: kernels, distributed optimizer, clipping, checkpoint save",
            [*torchrun(1), *first],
            60,
            "nccl",
            expect=saved,
        ),
        Step(
            "train_nccl_torch",
            "the same with --kernels torch, only if train_nccl failed (is it the kernels or NCCL?)",
            [*torchrun(1), *first, "--kernels", "torch"],
            45,
            "nccl",
            expect=saved,
            only_if_failed="train_nccl",
        ),
        Step(
            "resume_nccl",
            "the same run loaded from its checkpoint (NCCL)",
            [*torchrun(1), *train, *"--global-batch-size 4 --train-iters 6 --eval-interval 6 --load".split(), ckpt],
            45,
            "nccl",
            expect=(r"backend=nccl", r"loaded checkpoint .*\(iteration 4\)", r"iteration\s+6/\s*6"),
        ),
        Step(
            "pp2_gloo",
            "pp = 2, zb-auto, post-validation, profiling window + re-plan (gloo, GPU hidden)",
            [*torchrun(2), "pretrain_gpt.py", *train_model(128, 128), *pp2],
            60,
            "gloo",
            env={"CUDA_VISIBLE_DEVICES": ""},
            expect=(r"backend=gloo", r"optimizer post-validation: on", r"replanned zb-auto"),
        ),
    ]


# --------------------------------------------------------------------------------------------------- running
@dataclass
class Outcome:
    rc: int | None  # None: not started or killed
    seconds: float
    output: str
    timed_out: bool = False
    error: str | None = None  # could not start


def run_command(command: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None) -> Outcome:
    """Run ``command`` in its own process group; on timeout the whole group (torchrun and its ranks) is ended."""
    full_env = {**os.environ, **(env or {})}
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(
            list(command), cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
    except OSError as exc:
        return Outcome(None, 0.0, "", error=f"{type(exc).__name__}: {exc}")
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return Outcome(proc.returncode, time.perf_counter() - t0, out or "")
    except subprocess.TimeoutExpired:
        out = _end_group(proc)
        return Outcome(None, time.perf_counter() - t0, out, timed_out=True)


def _end_group(proc: subprocess.Popen) -> str:
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            out, _ = proc.communicate(timeout=grace)
            return out or ""
        except subprocess.TimeoutExpired:
            continue
    return ""


def step_timeout(step: Step, remaining_s: float) -> float | None:
    """The timeout a step gets with ``remaining_s`` of the budget left, or ``None``: do not start it."""
    t = min(step.timeout_s, remaining_s)
    return t if t >= MIN_STEP_S else None


# --------------------------------------------------------------------------------------------------- parsing
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([-+0-9.eEnaif]+)")
LAYOUT = re.compile(r"backend=(\w+), device=([\w:]+)")


def parse_training(output: str) -> dict:
    losses = {int(i): float(v) for i, v in LOSS.findall(output)}
    layout = LAYOUT.search(output)
    kernels = next((line.strip() for line in output.splitlines() if line.strip().startswith("kernels:")), None)
    return {
        "losses": losses,
        "backend_seen": layout.group(1) if layout else None,
        "device": layout.group(2) if layout else None,
        "kernels_line": kernels,
    }


def load_json(path: str | None) -> dict | None:
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def judge(step: Step, outcome: Outcome) -> dict:
    """One step's result: status (pass / fail / timeout / error), what it measured, the log's tail."""
    tail = "\n".join(outcome.output.splitlines()[-TAIL_LINES:])
    result: dict = {"name": step.name, "title": step.title, "backend": step.backend, "rc": outcome.rc,
                    "seconds": round(outcome.seconds, 1), "log_tail": tail}  # fmt: skip
    problems: list[str] = []
    if outcome.error:
        problems.append(f"could not start: {outcome.error}")
    elif outcome.timed_out:
        problems.append(f"timed out after {outcome.seconds:.0f} s")
    elif outcome.rc != 0:
        problems.append(f"exit code {outcome.rc}")
    if step.parse == "training":
        parsed = parse_training(outcome.output)
        result.update(parsed)
        if not parsed["losses"] and not problems:
            problems.append("no iteration line in the log")
        if any(not math.isfinite(v) for v in parsed["losses"].values()):
            problems.append("a loss is not finite")
        problems += [f"log lacks /{pattern}/" for pattern in step.expect if not re.search(pattern, outcome.output)]
    else:
        data = load_json(step.artifact)
        result[step.parse] = data
        if data is None and not problems:
            problems.append(f"no report at {step.artifact}")
        elif step.parse == "kernels" and data is not None and data.get("errors"):
            problems += data["errors"]
    result["problems"] = problems
    result["status"] = "timeout" if outcome.timed_out else "error" if outcome.error else "fail" if problems else "pass"
    return result


def skipped(step: Step, why: str, *, status: str = "skipped") -> dict:
    return {"name": step.name, "title": step.title, "backend": step.backend, "status": status, "problems": [why]}


def all_passed(report: dict) -> bool:
    """Every step passed (a fallback that was not needed counts as passed)."""
    return all(s["status"] in ("pass", "not needed") for s in report["steps"])


# ---------------------------------------------------------------------------------------------------- targets
def _row(target: str, value: str | None, status: str) -> dict:
    return {"target": target, "value": value, "status": status}


def _kernel_rows(case: dict) -> list[dict]:
    name = case["name"]
    if "error" in case:
        return [_row(f"{name}: runs", case["error"][:120], "fail")]
    err = max(case["rel_err"]) if case["rel_err"] else None
    if name.startswith("W kernel"):
        what = f"{name}: matches the fp32 reference (rel. err <= {case['tolerance']:g})"
    else:
        what = f"{name}: matches its fp32 reference (rel. err <= {case['tolerance']:g} or 2x torch's)"
    rows = [_row(what, None if err is None else f"{err:.2e}", "pass" if case["correct"] else "fail")]
    ratio = case.get("ratio")
    value = None if ratio is None else f"{ratio:.3f} ({case['fused_ms']:.3f} / {case['torch_ms']:.3f} ms)"
    status = "not measured" if ratio is None else "pass" if case["target_met"] else "fail"
    rows.append(_row(f"{name}: {case['target_name']} (ratio <= {case['target']:g})", value, status))
    return rows


def targets(steps: Sequence[dict]) -> list[dict]:
    """The benchmark and correctness targets, each ``{"target", "value", "status"}`` (pass / fail / not measured)."""
    by_name = {s["name"]: s for s in steps}
    rows: list[dict] = []
    kernels = (by_name.get("kernels") or {}).get("kernels") or {}
    for case in kernels.get("cases", []):
        rows += _kernel_rows(case)
    if not kernels.get("cases"):
        rows.append(_row("kernels: correct and within their speed targets", None, "not measured"))
    stage = (by_name.get("stage") or {}).get("stage") or {}
    split = (stage.get("rows") or {}).get("split", {}).get("b_plus_w_over_bw")
    status = "not measured" if split is None else "pass" if split <= SPLIT_TARGET else "fail"
    rows.append(
        _row(f"(B + W) / BW of a layer stack <= {SPLIT_TARGET}", None if split is None else f"{split:.3f}", status)
    )
    for name in ("train_nccl", "train_nccl_torch", "resume_nccl", "pp2_gloo"):
        s = by_name.get(name)
        if s is None or s["status"] == "not needed":
            continue
        value = ", ".join(f"{i}: {v:.4f}" for i, v in sorted((s.get("losses") or {}).items())) or None
        status = {"pass": "pass", "skipped": "not measured"}.get(s["status"], "fail")
        rows.append(_row(f"{name}: finishes, finite losses, expected log lines", value, status))
    return rows


def nccl_coverage(steps: Sequence[dict]) -> dict[str, list[str]]:
    """What ran with NCCL and what did not: a training step counts only if it passed and its own start-up line said
    ``backend=nccl``."""
    ran, not_ran = [], []
    for s in steps:
        line = f"{s['name']}: {s['title']} ({s['status']})"
        if s["status"] == "not needed":
            continue
        if s["backend"] == "cuda":
            not_ran.append(f"{line}: CUDA only, no collectives")
        elif s["status"] == "pass" and s.get("backend_seen") == "nccl":
            ran.append(line)
        else:
            seen = s.get("backend_seen")
            not_ran.append(line + (f": ran on {seen}" if seen and seen != "nccl" else ""))
    not_ran.append("tp > 1, dp > 1 and pipeline point-to-point on NCCL: they need two or more GPUs")
    return {"nccl": ran, "not_nccl": not_ran}


# ----------------------------------------------------------------------------------------------------- report
def assemble(env: dict, steps: Sequence[dict], *, budget_s: float, elapsed_s: float, stage_summary: str | None) -> dict:
    return {
        "environment": env,
        "budget_s": budget_s,
        "elapsed_s": round(elapsed_s, 1),
        "steps": list(steps),
        "targets": targets(steps),
        "coverage": nccl_coverage(steps),
        "stage_summary": stage_summary,
    }


def to_markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# GPU check (full)",
        "",
        f"Device: {env.get('device_name')}; torch {env.get('torch')}, CUDA {env.get('cuda')}, Triton "
        f"{env.get('triton')}, python {env.get('python')}; {env.get('date')}. Took {report['elapsed_s']:.0f} s "
        f"of a {report['budget_s']:.0f} s budget. apex's fused weight-gradient extension: "
        f"{'installed' if env.get('apex_weight_grad') else 'not installed'}; Transformer Engine: "
        f"{env.get('transformer_engine') or 'not installed'}.",
        "",
        "## Steps",
        "",
        "| step | what | backend | status | seconds | problems |",
        "|---|---|---|---|---|---|",
    ]
    for s in report["steps"]:
        problems = "; ".join(s.get("problems") or []).replace("|", "/")[:300]
        lines.append(
            f"| {s['name']} | {s['title']} | {s['backend']} | {s['status']} | {s.get('seconds', '-')} | {problems} |"
        )
    lines += ["", "## Targets", "", "| target | value | status |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['value'] or '-'} | {t['status']} |" for t in report["targets"]]
    if report.get("stage_summary"):
        lines += ["", "## One stage", "", report["stage_summary"].strip()]
    cov = report["coverage"]
    lines += ["", "## NCCL coverage", "", "Ran under NCCL:", ""]
    lines += [f"- {x}" for x in cov["nccl"]] or ["- nothing"]
    lines += ["", "Did not run under NCCL:", ""] + [f"- {x}" for x in cov["not_nccl"]]
    kernels_line = next((s.get("kernels_line") for s in report["steps"] if s.get("kernels_line")), None)
    if kernels_line:
        lines += ["", f"Training start-up: `{kernels_line}`"]
    lines.append("")
    return "\n".join(lines)


def write(report: dict, out_dir: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    json_path, md_path = os.path.join(out_dir, "gpu_check.json"), os.path.join(out_dir, "gpu_check.md")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(md_path, "w") as f:
        f.write(to_markdown(report))
    return json_path, md_path


def environment() -> dict:
    import platform

    import torch

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    cuda = torch.cuda.is_available()
    sys.path.insert(0, REPO)
    from megatron.kernels.vendor import apex_weight_grad_available, transformer_engine_version

    return {
        "apex_weight_grad": apex_weight_grad_available(),
        "transformer_engine": transformer_engine_version(),
        "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def run_full(
    out_dir: str,
    *,
    budget_s: float = BUDGET_S,
    micro_batch: int = 2,
    steps: Sequence[Step] | None = None,
    runner: Callable[..., Outcome] = run_command,
    env: dict | None = None,
    say: Callable[[str], None] = print,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """Run the plan within ``budget_s``; the report is rewritten after each step.  Returns it."""
    t0 = clock()
    work = tempfile.mkdtemp(prefix="gpu_check_")
    if env is None:
        try:
            env = environment()
        except Exception as exc:  # noqa: BLE001  (a broken optional library must not stop the check)
            env = {"device_name": f"unknown ({type(exc).__name__}: {exc})"}
    results: list[dict] = []
    report: dict = {}
    try:
        for step in steps if steps is not None else plan(work, micro_batch=micro_batch):
            remaining = budget_s - (clock() - t0)
            timeout = step_timeout(step, remaining)
            passed = {r["name"] for r in results if r["status"] == "pass"}
            if step.only_if_failed is not None and step.only_if_failed in passed:
                results.append(skipped(step, f"{step.only_if_failed} passed", status="not needed"))
            elif timeout is None:
                results.append(skipped(step, f"not started: {remaining:.0f} s of the budget left"))
            else:
                say(f"gpu_check --full: {step.name} ({step.title}), up to {timeout:.0f} s ...")
                results.append(judge(step, runner(step.command, timeout_s=timeout, env=step.env)))
                say(f"gpu_check --full: {step.name}: {results[-1]['status']} in {results[-1]['seconds']} s")
            stage = next((r.get("stage") for r in results if r["name"] == "stage" and r.get("stage")), None)
            summary = _stage_markdown(stage)
            report = assemble(env, results, budget_s=budget_s, elapsed_s=clock() - t0,
                              stage_summary=summary)  # fmt: skip
            write(report, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _stage_markdown(stage: dict | None) -> str | None:
    if not stage:
        return None
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gpu_check

        return gpu_check.to_markdown(stage).split("\n", 2)[2]  # without its title
    except Exception as exc:  # noqa: BLE001
        return f"(stage report could not be formatted: {exc})"
