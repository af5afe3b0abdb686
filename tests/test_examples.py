"""The launch scripts in examples/: they parse, refuse to run without what they need, and (slow) really train."""

import os
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPTS = ["pretrain_gpt_single_node.sh", "pretrain_gpt_multi_node.sh", "pretrain_gpt_slurm.sh"]
QUICK = {"TRAIN_ITERS": "2", "LOG_INTERVAL": "1", "EVAL_INTERVAL": "100", "OMP_NUM_THREADS": "1"}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "NNODES", "NODE_RANK"))}
    env.update(QUICK)
    env.update(extra)
    return env


@pytest.mark.parametrize("script", SCRIPTS + ["gpt_common.sh"])
def test_scripts_parse(script):
    path = EXAMPLES / script
    assert path.exists()
    subprocess.run(["bash", "-n", str(path)], check=True)
    if script != "gpt_common.sh":
        assert os.access(path, os.X_OK), f"{script} must be executable"
        assert "pretrain_gpt.py" in path.read_text()


def test_multi_node_and_slurm_say_what_is_missing():
    res = subprocess.run([str(EXAMPLES / "pretrain_gpt_multi_node.sh")], env=_env(), capture_output=True, text=True)
    assert res.returncode != 0 and "set MASTER_ADDR" in res.stderr
    res = subprocess.run([str(EXAMPLES / "pretrain_gpt_slurm.sh")], env=_env(), capture_output=True, text=True)
    assert res.returncode != 0 and "run this through sbatch" in res.stderr


def _example_args(world: int, **env: str) -> list[str]:
    """The flags an example passes to pretrain_gpt.py on ``world`` ranks (gpt_common.sh's, with its global batch)."""
    script = (
        f'source "{EXAMPLES}/gpt_common.sh"; '
        f'printf "%s\\n" "${{GPT_ARGS[@]}}" --global-batch-size "$(global_batch_size {world})" "${{DATA_ARGS[@]}}"'
    )
    res = subprocess.run(["bash", "-c", script], env={**_env(), **env}, capture_output=True, text=True, check=True)
    return res.stdout.split()


@pytest.mark.parametrize(
    "world,env",
    [
        (16, {}),  # 2 nodes x 8 GPUs, the multi-node and SLURM defaults
        (16, {"TP": "8", "MODEL_CONFIG": "gpt-1.3b"}),
        (16, {"TP": "2", "PP": "4", "MODEL_CONFIG": "gpt-1.3b"}),
        (32, {"TP": "8", "PP": "2", "MBS": "1", "MODEL_CONFIG": "gpt-2.7b"}),
        (4, {"TP": "2"}),  # the single-node default on CPU
    ],
)
def test_default_global_batch_divides_on_the_layout(world: int, env: dict[str, str]) -> None:
    from megatron.arguments import parse_run_config

    argv = _example_args(world, **env)
    run = parse_run_config(
        [
            *argv,
            "--tensor-model-parallel-size",
            env.get("TP", "1"),
            "--pipeline-model-parallel-size",
            env.get("PP", "1"),
        ],
        world_size=world,
    )
    assert run.num_microbatches >= max(4, 2 * run.parallel.pp_size)


def _final_loss(output: str) -> str:
    lines = [line for line in output.splitlines() if "iteration        2/       2" in line]
    assert lines, output[-3000:]
    return lines[-1].split("lm loss:")[1].split("|")[0].strip()


@pytest.mark.slow
def test_single_node_script_trains():
    res = subprocess.run(
        [str(EXAMPLES / "pretrain_gpt_single_node.sh")],
        env=_env(NPROC="4", TP="2"),
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "tp=2" in res.stdout and "dp=2" in res.stdout
    _final_loss(res.stdout)


@pytest.mark.slow
def test_multi_node_script_on_two_local_nodes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    common = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NNODES="2", NPROC_PER_NODE="2", TP="2", RDZV_ID="t")
    procs = [
        subprocess.Popen(
            [str(EXAMPLES / "pretrain_gpt_multi_node.sh")],
            env=_env(NODE_RANK=str(n), **common),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for n in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "world=4" in outs[0] or "world=4" in outs[1]
    _final_loss(outs[0] + outs[1])
