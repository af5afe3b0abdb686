"""The communication layer (``zb_pipeline.comm``): the only caller of ``torch.distributed``, device-correct, NCCL-safe.

- Source: nothing in ``megatron/`` or ``zb_pipeline/`` outside ``zb_pipeline/comm/`` (and the test harness
  ``zb_pipeline/testing/``) names ``torch.distributed`` -- no import, no ``torch.distributed.x`` attribute, no
  ``import_module("torch.distributed")`` -- read from the AST; the checker is tried on small sources first.
- NCCL rules on a CPU machine (a fake backend underneath the layer, the group declared NCCL with
  ``comm.pretend``): the P2P layer's and the reducer's waits never pass a timeout (gloo's do); a tensor on another
  device is refused with one line; host numbers (the SIGTERM flag, counts, limits) are staged on the group's
  device; ``init_process_group`` turns on asynchronous error handling; the barrier names the device.
- Training iterations on gloo with every call of the layer checked (``DeviceCheckingBackend``: each tensor on the
  group's device as the layer resolves it, and on the context's device) and every tensor factory call of our
  modules without ``device=`` recorded (``ExplicitDeviceMode``), which must find none: pp = 2 x tp = 2 with zb-auto
  re-planned in a profiling window under a memory limit, post-validation, clipping and ``--exit-signal-handler``
  (SIGTERM saves a checkpoint and stops); dp = 2 with the distributed optimizer.  The gradient statistics cost at
  most one host read per synchronised step (two with post-validation: the local decision and the validation).
"""

from __future__ import annotations

import ast
import io
import math
import os
import re
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from zb_pipeline import comm
from zb_pipeline.testing.harness import run_multiprocess

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatron", "zb_pipeline")
LAYER = "zb_pipeline/comm/"
EXEMPT = ("zb_pipeline/testing/",)  # the multi-rank test harness talks to torch.distributed directly
# Uses of torch.distributed allowed outside the layer, as "path: what".  None: annotations use comm.ProcessGroup,
# queries comm.is_initialized()/world_size()/rank().
ALLOWED: frozenset[str] = frozenset()


# ------------------------------------------------------------------------------------------ (b) the source rule
def distributed_uses(source: str, path: str = "<src>") -> list[str]:
    """Every place ``source`` names ``torch.distributed``: ``"path:line what"``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        what = None
        if isinstance(node, ast.Import):
            names = [
                a.name for a in node.names if a.name == "torch.distributed" or a.name.startswith("torch.distributed.")
            ]
            what = f"import {names[0]}" if names else None
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "torch.distributed" or node.module.startswith("torch.distributed."):
                what = f"from {node.module} import ..."
            elif node.module == "torch" and any(a.name == "distributed" for a in node.names):
                what = "from torch import distributed"
        elif isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name):
            what = f"{node.value.id}.distributed" if node.value.id == "torch" else None
        elif isinstance(node, ast.Call):
            strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            hit = [s for s in strings if s == "torch.distributed" or s.startswith("torch.distributed.")]
            what = f"a call naming {hit[0]!r}" if hit else None
        if what is not None:
            found.append(f"{path}:{node.lineno} {what}")
    return sorted(set(found), key=lambda s: (s.split()[0].rsplit(":", 1)[0], int(s.split()[0].rsplit(":", 1)[1])))


def test_the_source_checker_finds_every_form() -> None:
    bad = {
        "import torch.distributed as dist": "import torch.distributed",
        "import torch.distributed.rpc": "import torch.distributed.rpc",
        "from torch.distributed import all_reduce": "from torch.distributed import",
        "from torch.distributed.fsdp import X": "from torch.distributed.fsdp import",
        "from torch import nn, distributed": "from torch import distributed",
        "import torch\ntorch.distributed.all_reduce(t)": "torch.distributed",
        "import importlib\nimportlib.import_module('torch.distributed')": "a call naming",
    }
    for src, what in bad.items():
        uses = distributed_uses(src)
        assert uses and what in uses[0], (src, uses)
    clean = "import torch\nfrom zb_pipeline import comm\n'''torch.distributed in a docstring'''\ncomm.all_reduce(t)\n"
    assert distributed_uses(clean) == []


def test_only_the_layer_calls_torch_distributed() -> None:
    offenders = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(LAYER) or rel.startswith(EXEMPT):
                continue
            offenders += [u for u in distributed_uses(path.read_text(encoding="utf-8"), rel) if u not in ALLOWED]
    assert not offenders, "torch.distributed outside zb_pipeline.comm (route it through the layer):\n" + "\n".join(
        offenders
    )
    layer = [u for p in sorted((ROOT / LAYER).glob("*.py")) for u in distributed_uses(p.read_text(), p.name)]
    assert layer and all(u.startswith("backend.py:") for u in layer), f"only comm/backend.py imports it: {layer}"


# ------------------------------------------------------------------------------- NCCL rules with a fake backend
class _Work:
    def __init__(self, waits: list) -> None:
        self.waits = waits

    def wait(self, *args, **kwargs) -> bool:
        self.waits.append((args, kwargs))
        return True

    def is_completed(self) -> bool:
        return False  # so the P2P layer keeps its sends until finish() or drain() waits for them


class _StopError(Exception):
    pass


class _FakeDist:
    """What the layer calls, recording: posts return works that record how they were waited for."""

    class ReduceOp:
        SUM, MAX, MIN = "sum", "max", "min"

    class P2POp:
        def __init__(self, op, tensor, peer, group=None, tag=0) -> None:
            self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag

    def __init__(self) -> None:
        self.waits: list = []
        self.calls: list = []

    def _post(self, name, t, peer, group=None, tag=0):
        self.calls.append((name, t.device, peer))
        return _Work(self.waits)

    def isend(self, t, peer, group=None, tag=0):
        return self._post("isend", t, peer)

    def irecv(self, t, peer, group=None, tag=0):
        return self._post("irecv", t, peer)

    def batch_isend_irecv(self, ops):
        return [self._post(op.op.__name__, op.tensor, op.peer) for op in ops]

    def all_reduce(self, t, op=None, group=None, async_op=False):
        self.calls.append(("all_reduce", t.device, op))
        if not async_op:
            raise _StopError  # a device tensor (meta) cannot be read back; the call is what the test looks at
        return _Work(self.waits)

    def barrier(self, group=None, **kwargs):
        self.calls.append(("barrier", kwargs))

    def init_process_group(self, backend, **kwargs):
        self.calls.append(("init", backend, kwargs))


def _p2p_round(group: object, device: str):
    """One send and one receive through PipelineP2P over ``group``: post, take, finish, then a drained batch."""
    from zb_pipeline.runtime.p2p import PipelineP2P, TensorSpec
    from zb_pipeline.schedule.ir import Action, Kind
    from zb_pipeline.schedule.lowering import CommBatch

    p2p = PipelineP2P(pp_rank=0, boundary_specs=[TensorSpec((2, 3))], group=group, pp_ranks=(0, 1), timeout_s=5)
    assert p2p.device == torch.device(device)
    send, recv = Action(0, Kind.SEND_F, 0, peer=1), Action(0, Kind.RECV_B, 0, peer=1)
    p2p.post(CommBatch((send, recv)), lambda a: torch.zeros(2, 3, device=device))
    p2p.take(Kind.RECV_B, 0, 0, Action(0, Kind.B, 0))
    p2p.finish()
    p2p.post(CommBatch((send, recv)), lambda a: torch.zeros(2, 3, device=device))
    p2p.drain()


def test_nccl_waits_pass_no_timeout_and_gloo_waits_do() -> None:
    group = object()
    fake = _FakeDist()
    with comm.use(fake), comm.pretend(group, backend="nccl", device="meta"):
        _p2p_round(group, "meta")
        comm.wait(_Work(fake.waits), group=group, timeout=timedelta(seconds=3))
    assert [c[0] for c in fake.calls] == ["isend", "irecv"] * 2 and {c[1].type for c in fake.calls} == {"meta"}
    assert len(fake.waits) == 5 and all(w == ((), {}) for w in fake.waits), fake.waits

    fake = _FakeDist()
    with comm.use(fake), comm.pretend(group, backend="gloo", device="cpu"):
        _p2p_round(group, "cpu")
    assert len(fake.waits) == 4 and all(isinstance(w[0][0], timedelta) for w in fake.waits), fake.waits


class _DirectFake(_FakeDist):
    """A fake that offers the link a process group (``direct_group``): its ``send``/``recv`` take group ranks."""

    def __init__(self, error: BaseException | None = None) -> None:
        super().__init__()
        self.error, self.rank_lookups = error, 0

    def get_group_rank(self, group, global_rank: int) -> int:
        self.rank_lookups += 1
        return global_rank - 10  # the group holds global ranks 10, 11, ...

    def get_rank(self, group=None) -> int:
        return 10

    def get_process_group_ranks(self, group) -> list[int]:
        return [10, 11, 12]

    def direct_group(self, group):
        fake = self

        class _PG:
            def send(self, tensors, group_peer, tag):
                return fake._direct("send", tensors, group_peer, tag)

            def recv(self, tensors, group_peer, tag):
                return fake._direct("recv", tensors, group_peer, tag)

        return _PG()

    def _direct(self, name, tensors, group_peer, tag):
        if self.error is not None:
            raise self.error
        self.calls.append((name, tensors[0].device, group_peer, tag))
        return _Work(self.waits)


def test_a_link_calls_the_process_group_with_group_ranks_and_keeps_the_layers_rules() -> None:
    """``comm.P2PLink``: the process group's own send/recv with the peer's group rank (looked up once), the device
    check, torch.distributed's own call for a tensor subclass and for a complex tensor on NCCL, a host timeout on
    gloo only, and a peer error named."""
    group = object()
    fake = _DirectFake()
    with comm.use(fake), comm.pretend(group, backend="gloo", device="cpu"):
        link = comm.P2PLink(group)
        for _ in range(2):
            link.wait(link.isend(torch.ones(2), 11, tag=1), timedelta(seconds=3))
            link.wait(link.irecv(torch.zeros(2, dtype=torch.complex64), 12), timedelta(seconds=3))  # gloo: bytes
        link.isend(torch.nn.Parameter(torch.ones(2)), 11)  # a subclass: torch.distributed's isend
        _, buf = link.irecv_new((3, 1), torch.float64, 12)  # a new buffer on the group's device
    assert fake.calls[:4] == [("send", torch.device("cpu"), 1, 1), ("recv", torch.device("cpu"), 2, 0)] * 2
    assert fake.calls[4:] == [("isend", torch.device("cpu"), 11), ("recv", torch.device("cpu"), 2, 0)]
    assert fake.rank_lookups == 2 and buf.shape == (3, 1) and buf.dtype == torch.float64
    assert len(fake.waits) == 4 and all(isinstance(w[0][0], timedelta) for w in fake.waits)

    fake = _DirectFake()
    with comm.use(fake), comm.pretend(group, backend="nccl", device="meta"):
        link = comm.P2PLink(group)
        with pytest.raises(comm.CommDeviceError, match=r"isend: .* on cpu cannot go over a nccl group.*meta"):
            link.isend(torch.ones(2), 11)
        link.wait(link.irecv(torch.zeros(2, device="meta"), 11), timedelta(seconds=3))
        link.isend(torch.zeros(2, dtype=torch.complex64, device="meta"), 11)  # NCCL: torch.distributed's real view
        _, buf = link.irecv_new((2,), torch.complex64, 11)
    assert fake.calls == [
        ("recv", torch.device("meta"), 1, 0),
        ("isend", torch.device("meta"), 11),
        ("irecv", torch.device("meta"), 11),
    ]
    assert fake.waits == [((), {})]  # stream-side on NCCL: no timeout

    reset = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:8627: Connection reset by peer. More text.")
    with comm.use(_DirectFake(reset)), comm.pretend(group, backend="gloo", device="cpu"):
        with pytest.raises(comm.PeerFailedError) as err:
            comm.P2PLink(group).isend(torch.ones(2), 11)
    got = (err.value.op, err.value.peers, err.value.members, err.value.timed_out)
    assert got == ("isend", (11,), (10, 11, 12), False)
    bad = RuntimeError("Tensors must be contiguous")
    with comm.use(_DirectFake(bad)), comm.pretend(group, backend="gloo", device="cpu"):
        with pytest.raises(RuntimeError) as plain:
            comm.P2PLink(group).irecv(torch.ones(2), 11)
    assert plain.value is bad


def test_the_reducer_waits_without_a_timeout_on_nccl() -> None:
    from megatron.parallel.data_parallel import DataParallelReducer

    group, fake = object(), _FakeDist()
    model = torch.nn.Linear(3, 2).to("meta")
    with comm.use(fake), comm.pretend(group, backend="nccl", device="meta"):
        reducer = DataParallelReducer(model, dp_group=group, dp_size=2, dp_rank=0, bucket_numel=4)
        reducer.zero_grad()
        reducer.prepare_microbatch(is_last=True)
        reducer.finish()
    assert [c[0] for c in fake.calls] == ["all_reduce", "all_reduce"] and fake.calls[0][1].type == "meta"
    assert fake.waits == [((), {}), ((), {})]


def test_a_tensor_on_another_device_is_refused_with_one_line() -> None:
    from zb_pipeline.runtime.p2p import PipelineP2P, TensorSpec

    group, fake = object(), _FakeDist()
    with comm.use(fake), comm.pretend(group, backend="nccl", device="meta"):
        for call in (
            lambda: comm.all_reduce(torch.ones(2), group=group),
            lambda: comm.isend(torch.ones(2), 1, group=group),
            lambda: comm.all_gather([torch.ones(2, device="meta")], torch.ones(2), group=group),
        ):
            with pytest.raises(comm.CommDeviceError, match=r"on cpu cannot go over a nccl group.*meta") as err:
                call()
            assert "\n" not in str(err.value)
        with pytest.raises(comm.CommDeviceError, match="pass the ParallelContext's device"):
            PipelineP2P(pp_rank=0, boundary_specs=[TensorSpec((2,))], group=group, pp_ranks=(0, 1), device="cpu")
    assert fake.calls == []
    cuda0 = comm.GroupPlacement("nccl", torch.device("cuda", 0))
    assert cuda0.accepts(torch.device("cuda", 0)) and not cuda0.accepts(torch.device("cuda", 1))
    assert not cuda0.accepts(torch.device("cpu"))


def test_host_numbers_are_staged_on_the_group_device() -> None:
    from megatron.signal_handler import ExitSignalHandler

    fake = _FakeDist()
    with comm.use(fake), comm.pretend(None, backend="nccl", device="meta"):  # None: the default group
        with pytest.raises(_StopError):
            ExitSignalHandler().should_exit(distributed=True)
        with pytest.raises(_StopError):
            comm.all_reduce_values([3, 0, 5], op="min", dtype=torch.int64)
    assert [(c[0], c[1].type, c[2]) for c in fake.calls] == [
        ("all_reduce", "meta", "max"),
        ("all_reduce", "meta", "min"),
    ]


def test_nccl_init_turns_on_async_error_handling_and_the_barrier_names_the_device(monkeypatch) -> None:
    monkeypatch.delenv(comm.groups.NCCL_ASYNC_ERROR_HANDLING, raising=False)
    fake = _FakeDist()
    timeout = timedelta(seconds=7)
    with comm.use(fake):
        comm.init_process_group("nccl", rank=0, world_size=1, timeout=timeout)
    assert os.environ[comm.groups.NCCL_ASYNC_ERROR_HANDLING] == "1"
    assert fake.calls == [("init", "nccl", {"rank": 0, "world_size": 1, "timeout": timeout})]
    monkeypatch.setenv(comm.groups.NCCL_ASYNC_ERROR_HANDLING, "3")  # the user's choice stays
    with comm.use(fake):
        comm.init_process_group("nccl", rank=0, world_size=1, timeout=timeout)
    assert os.environ[comm.groups.NCCL_ASYNC_ERROR_HANDLING] == "3"

    group, fake = object(), _FakeDist()
    with comm.use(fake), comm.pretend(group, backend="nccl", device="cuda:1"):
        comm.barrier(group=group)
    with comm.use(fake), comm.pretend(group, backend="gloo", device="cpu"):
        comm.barrier(group=group)
    assert fake.calls == [("barrier", {"device_ids": [1]}), ("barrier", {})]


def test_the_instruments_catch_what_they_should(tmp_path) -> None:
    """The wrapper refuses a CPU tensor on a group declared NCCL; the mode records a factory without a device made
    from "our" code, and host reads, but nothing from elsewhere."""
    from zb_pipeline.testing.device_checks import DeviceCheckingBackend, ExplicitDeviceMode

    group = object()
    checking = DeviceCheckingBackend(_FakeDist())
    with comm.use(checking), comm.pretend(group, backend="nccl", device="meta"):
        with pytest.raises(AssertionError, match="reached a nccl group whose device is meta"):
            checking.check("all_reduce", [torch.ones(1)], group)
        comm.wait(comm.isend(torch.ones(1, device="meta"), 1, group=group), group=group)
    assert checking.calls == {("isend", "nccl"): 1}

    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "mod.py").write_text(
        "import torch\n"
        "def make():\n"
        "    a = torch.zeros(2)\n"
        "    b = torch.ones(2, device='cpu')\n"
        "    return a.tolist(), float(b[0])\n"
    )
    namespace: dict = {}
    exec(compile((ours / "mod.py").read_text(), str(ours / "mod.py"), "exec"), namespace)
    mode = ExplicitDeviceMode([str(ours) + os.sep])
    with mode:
        namespace["make"]()
        torch.zeros(3)  # this test file is not "ours"
    assert len(mode.violations) == 1 and "mod.py:3 make: torch.zeros without device=" in mode.violations[0]
    assert [(r.name, r.line) for r in mode.reads] == [("tolist", 5), ("__float__", 5)]


# -------------------------------------------------------------------------- (a) checked training iterations
BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
    "--vocab-size", "120", "--mock-data", "--micro-batch-size", "1", "--lr", "1e-2", "--lr-warmup-iters", "1",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "5", "--eval-iters", "0",
    "--log-interval", "1", "--distributed-timeout-seconds", "60", "--clip-grad", "1.5",
]  # fmt: skip
GRAD_STAT_FILES = ("megatron/optimizer/", "zb_pipeline/optim/")


def _checked_run(rank: int, world_size: int, argv: list[str], sigterm_after: int | None) -> dict:
    """``pretrain(argv)`` with the layer's calls device-checked and our factory calls and host reads recorded from
    the end of set-up (parameters are built on the host, then moved) to the end of the run."""
    import torch.distributed as dist

    import megatron
    import zb_pipeline
    from megatron import training
    from megatron.arguments import parse_run_config
    from zb_pipeline.testing.device_checks import DeviceCheckingBackend, ExplicitDeviceMode, package_dirs

    torch.set_num_threads(1)
    mode = ExplicitDeviceMode(package_dirs(megatron, zb_pipeline))
    checking = DeviceCheckingBackend(dist)
    real_setup, real_step = training.setup, training.train_step
    state = {"entered": False, "steps": 0, "device": None}

    def setup(run, ctx, **kwargs):
        checking.expected_device = state["device"] = ctx.device
        tr = real_setup(run, ctx, **kwargs)
        mode.__enter__()  # start-up summary, iterations, signal checks, saving, the end of the run
        state["entered"] = True
        return tr

    def train_step(tr, **kwargs):
        mode.tag = tr.iteration + 1
        res = real_step(tr, **kwargs)
        state["steps"] += 1
        if tr.iteration == sigterm_after and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
        return res

    training.setup, training.train_step = setup, train_step
    out = io.StringIO()
    try:
        with comm.use(checking):
            summary = training.pretrain(parse_run_config(argv, world_size=world_size), stream=out)
    finally:
        if state["entered"]:
            mode.__exit__(None, None, None)
        training.setup, training.train_step = real_setup, real_step
    root = str(ROOT) + os.sep
    stat_reads = [
        f"{r.file.removeprefix(root)}:{r.line} {r.function} {r.name}"
        for r in mode.reads
        if r.file.removeprefix(root).startswith(GRAD_STAT_FILES)
    ]
    return {
        "violations": mode.violations,
        "calls": dict(checking.calls),
        "tensors": checking.tensors,
        "steps": state["steps"],
        "iterations": summary.iterations,
        "losses": list(summary.losses),
        "stat_reads": stat_reads,
        "device": str(state["device"]),
        "log": out.getvalue(),
    }


def _check(results: list[dict], *, reads_per_step: int, first_validation: int = 0) -> None:
    """No factory call without a device; finite losses; at most ``reads_per_step`` host reads of gradient statistics
    per step, plus ``first_validation`` (post-validation checks, at the first iteration, that no rank has a step
    pending)."""
    for rank, res in enumerate(results):
        assert not res["violations"], f"rank {rank}: tensors created without device=:\n" + "\n".join(res["violations"])
        assert res["device"] == "cpu" and res["tensors"] > 0
        assert all(math.isfinite(x) for x in res["losses"])
        steps = res["steps"]
        assert len(res["stat_reads"]) <= reads_per_step * steps + first_validation, (
            f"rank {rank}: {len(res['stat_reads'])} host reads of gradient statistics in {steps} steps:\n"
            + "\n".join(res["stat_reads"])
        )


def test_pp2_tp2_iterations_keep_every_tensor_on_the_context_device(tmp_path) -> None:
    """zb-auto under a memory limit, re-planned after a profiling window; post-validation; clipping; SIGTERM after
    iteration 4 saves a checkpoint and stops (train-iters 6)."""
    argv = [
        *BASE, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
        "--train-iters", "6", "--pipeline-schedule", "zb-auto", "--zero-bubble-max-pending-backward", "3",
        "--zero-bubble-pipeline-timers-start-iter", "1", "--zero-bubble-pipeline-timers-end-iter", "3",
        "--enable-optimizer-post-validation", "--exit-signal-handler", "--save", str(tmp_path / "ckpt"),
    ]  # fmt: skip
    results = run_multiprocess(_checked_run, 4, args=(argv, 4), timeout_s=240)
    _check(results, reads_per_step=2, first_validation=1)
    for res in results:
        assert res["iterations"] == 4
        kinds = {name for name, _ in res["calls"]}
        assert {"all_reduce", "all_gather", "isend", "irecv"} <= kinds, kinds
    log = "".join(res["log"] for res in results)
    assert "exiting program after receiving SIGTERM, at iteration 4" in log
    assert "replanned zb-auto (p=2, m=4) from profiled costs" in log and "(limit " in log  # the memory limit
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


def test_dp2_distributed_optimizer_iterations_keep_every_tensor_on_the_context_device() -> None:
    argv = [*BASE, "--global-batch-size", "4", "--train-iters", "3", "--use-distributed-optimizer", "--bf16"]
    results = run_multiprocess(_checked_run, 2, args=(argv, None), timeout_s=180)
    _check(results, reads_per_step=1)
    for res in results:
        assert res["iterations"] == 3
        kinds = {name for name, _ in res["calls"]}
        assert {"all_reduce", "reduce_scatter_single", "all_gather_single"} <= kinds or {
            "all_reduce",
            "reduce_scatter_tensor",
            "all_gather_into_tensor",
        } <= kinds, kinds


@pytest.mark.slow
def test_pp2_dp2_distributed_optimizer_with_post_validation_slow() -> None:
    argv = [
        *BASE, "--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--train-iters", "4",
        "--use-distributed-optimizer", "--fp16", "--pipeline-schedule", "zb-h1", "--enable-optimizer-post-validation",
    ]  # fmt: skip
    results = run_multiprocess(_checked_run, 4, args=(argv, None), timeout_s=300)
    _check(results, reads_per_step=2, first_validation=1)


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(("gpus", "local_world", "local_rank", "message"), [
    (2, "4", "0", "this node runs 4 processes and sees 2 GPU(s); launch with torchrun --nproc-per-node 2"),
    (2, None, "3", "this node runs 4 processes and sees 2 GPU(s)"),
    (0, "1", "0", "the nccl backend needs CUDA GPUs but this process sees none"),
])  # fmt: skip
def test_more_nccl_processes_than_gpus_is_one_line_before_any_rendezvous(
    monkeypatch, gpus, local_world, local_rank, message
) -> None:
    from megatron.config.errors import ConfigError
    from megatron.parallel.context import ParallelContext

    for name, value in (("WORLD_SIZE", "4"), ("RANK", local_rank), ("LOCAL_RANK", local_rank)):
        monkeypatch.setenv(name, value)
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device before the check"))
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        ParallelContext.initialize(backend="nccl", timeout=timedelta(seconds=5))
    assert "\n" not in str(err.value) and not comm.is_initialized()
