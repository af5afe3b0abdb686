"""Every ```bash block in README.md and docs/*.md runs, exactly as written, and succeeds.

How a block runs
  * Each block is one test. It runs with ``bash`` under ``set -euo pipefail``, from the root of a fresh temporary
    working copy of the repository. The copy holds the files git tracks, the untracked files git does not ignore,
    and the built C++ extensions. Its ``.venv`` links to the interpreter's venv and has its own install stamp, so
    ``make`` in a block never reinstalls anything. Whatever a block writes (``runs/``, ``out/``, ``data/``,
    checkpoints) lands in the copy and goes with it. Blocks do not share files: each one starts from a clean copy.
  * ``PATH`` starts with ``.venv/bin``, so ``python``, ``torchrun`` and ``zb-schedule`` are the venv's.
  * The sizes are the ones written in the block, plus these environment variables, which the commands already read:
      - ``TRAIN_ITERS=2``: ``make train`` (tools/make_train.py) and the scripts in ``examples/``;
      - ``PYTEST_ARGS=tests/test_ir.py``: ``make test`` inside a block runs that one small file, never the whole
        suite. ``ZB_DOC_TEST=1`` is also set, and this module skips itself when it sees it, so the doc test cannot
        recurse into itself;
      - ``PET_MASTER_PORT`` / ``MASTER_PORT``: a free port, used as torchrun's default ``--master-port`` and by the
        example scripts, so a block never collides with another job on port 29500.
  * A block may start background jobs (the two-node example does). When the block ends, its whole process group
    is killed.

What may skip
  A block that needs SLURM, a GPU or a full ``make bench`` is marked by the line right above its fence:
  ``<!-- not-run: REASON -->``. REASON must mention SLURM, GPU or make bench (``test_not_run_reasons``); any other
  block must run. Shell blocks must be tagged ``bash`` (not ``sh``/``shell``/``console``), so that none slips past.

Slow blocks
  ``SLOW`` lists the blocks that are too slow for ``make test``'s budget. They carry ``@pytest.mark.slow`` and run in
  ``make test-slow``. On the shared 2-core machine the default blocks take about 50-60 s together and the slow ones
  about two minutes more. To measure: ``pytest --durations=0 tests/test_docs_commands.py`` (add ``-m "not slow"``
  for the default set).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

if os.environ.get("ZB_DOC_TEST"):  # running inside a doc block's `make test`: never recurse
    pytest.skip("inside a documentation block", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN_REASONS = ("slurm", "gpu", "make bench")
BLOCK_TIMEOUT_S = 540
SMALL_ENV = {"TRAIN_ITERS": "2", "PYTEST_ARGS": "tests/test_ir.py", "ZB_DOC_TEST": "1", "OMP_NUM_THREADS": "1"}

# Blocks run only by `make test-slow`: (doc file relative to the repo, a string in the block) -> why.  The README's
# blocks, the data walk-through and the docs' quick CLI blocks stay in `make test` (45-65 s together); these
# reference walk-throughs each start 2-4 torchrun ranks or several processes in a row (seconds measured on the shared
# 2-core machine).
SLOW: dict[tuple[str, str], str] = {
    ("docs/planner.md", "--recompute-granularity auto"): "a 2-rank run, the planner's recompute choice (~15 s)",
    ("docs/checkpoints.md", "checkpoint_convert"): "two tp=2 trainings, a conversion, a third training (~45 s)",
    ("docs/pipeline-runtime.md", "--emulate-compute"): "4 ranks with emulated compute, then the trace (~25 s)",
    ("docs/pipeline-runtime.md", "zb_profile.json"): "a 2-rank run with a profiling window and re-planning (~20 s)",
    ("docs/post-validation.md", "make_train.py"): "12 iterations of make train's 4-rank run (~25 s)",
    ("docs/benchmarks.md", "bench_schedules.py"): "the quick schedule benchmark and the B/W split timing (~15 s)",
    ("docs/training.md", "make_train.py"): "make train's 4 ranks for 4 iterations (~11 s)",
    ("docs/training.md", "--sequence-parallel"): "4 ranks, tp 2 x pp 2 (~10 s)",
    ("docs/training.md", "--schedule-file"): "2 ranks running a plan file (~6 s)",
    ("docs/recompute.md", "--recompute-granularity"): "2 ranks, zb-h1 with full recomputation (~15 s)",
    ("docs/gpu.md", "--device cpu"): "the GPU check's measurement on CPU (~5 s)",
    ("docs/planner.md", "planner_ckpt"): "a 2-rank zb-v run with a profiling window, then the plan from it (~20 s)",
    ("docs/data.md", "prepare_default_corpus"): "builds the default corpus and its tokenizer (2-6 s)",
    ("docs/huggingface.md", "--export-hf"): "trains, generates twice, exports, loads in transformers, imports (~20 s)",
}

FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[^`\s]*)\s*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(?P<reason>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None  # the REASON of a `<!-- not-run: REASON -->` line right above the fence

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file (indented fences, e.g. inside list items, included)."""
    lines = path.read_text().splitlines()
    rel = str(path.relative_to(ROOT))
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = len(m["indent"]), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"{rel}:{start + 1}: code fence never closed")
        above = NOT_RUN.match(lines[start - 1]) if start > 0 else None
        code = "\n".join(body) + "\n"
        blocks.append(Block(rel, start + 1, m["lang"], code, above["reason"] if above else None))
        i += 1
    return blocks


ALL_BLOCKS = [b for f in DOC_FILES for b in parse_blocks(f)]
BASH_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "bash"]


def _slow_reason(block: Block) -> str | None:
    for (path, needle), why in SLOW.items():
        if block.path == path and needle in block.code:
            return why
    return None


def _params() -> list:
    out = []
    for b in BASH_BLOCKS:
        marks = [pytest.mark.slow] if _slow_reason(b) else []
        out.append(pytest.param(b, id=b.id, marks=marks))
    return out


# ---------------------------------------------------------------------------------------------------- the copy


def _venv() -> Path:
    venv = ROOT / ".venv"
    if (venv / "bin" / "python").exists():
        return venv
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix)
    pytest.skip("the doc commands need the project's venv (make setup)")


def make_working_copy(dest: Path) -> Path:
    """A copy of the working tree in ``dest``: git's tracked and unignored files, the built extensions, a venv link."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, check=True, capture_output=True,
        ).stdout.decode()  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"needs a git checkout to copy the working tree ({err})")
    files = [f for f in listed.split("\0") if f]
    files += [str(p.relative_to(ROOT)) for d in ("megatron", "zb_pipeline") for p in (ROOT / d).rglob("*.so")]
    for rel in files:
        src = ROOT / rel
        if not src.is_file():  # tracked but deleted in the working tree
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)  # keeps mtimes, so make sees what the real tree's make sees
    venv = _venv()
    link_dir = dest / ".venv"
    link_dir.mkdir()
    for entry in venv.iterdir():
        if entry.name != ".zb-installed":
            (link_dir / entry.name).symlink_to(entry)
    (link_dir / ".zb-installed").touch()  # newer than every source: make never reinstalls into the real venv
    return dest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def block_env(copy: Path) -> dict[str, str]:
    drop = ("SLURM_", "MASTER_", "PET_", "NNODES", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_RANK", "PYTEST_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    port = str(_free_port())
    env.update(SMALL_ENV)
    env.update(
        PATH=f"{copy / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(copy / ".venv"),
        PYTHONPATH=str(copy),
        PET_MASTER_PORT=port,
        MASTER_PORT=port,
        MPLBACKEND="Agg",
    )
    env.pop("MAKEFLAGS", None)
    env.pop("MFLAGS", None)
    env.pop("MAKELEVEL", None)
    return env


def run_block(block: Block, workdir: Path) -> tuple[int, str, float]:
    """(exit code, combined output, seconds) of one block, run in a fresh copy under ``workdir``."""
    copy = make_working_copy(workdir / "repo")
    script = "set -euo pipefail\n" + block.code
    start = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=copy,
        env=block_env(copy),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[doc test] killed after {BLOCK_TIMEOUT_S} s"
    finally:
        try:  # background jobs the block left behind
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, out, time.monotonic() - start


# ---------------------------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("block", _params())
def test_bash_block_runs(block: Block, tmp_path: Path) -> None:
    if block.not_run is not None:
        pytest.skip(f"not-run: {block.not_run}")
    code, out, seconds = run_block(block, tmp_path)
    assert code == 0, (
        f"{block.id}: the block exited with {code} after {seconds:.0f} s\n--- block ---\n{block.code}"
        f"--- output (last 6000 characters) ---\n{out[-6000:]}"
    )


def test_blocks_were_found() -> None:
    assert (ROOT / "docs").is_dir(), "docs/ is missing"
    readme = [b for b in BASH_BLOCKS if b.path == "README.md"]
    assert any("make train" in b.code and "make test" in b.code for b in readme), "README shows the two commands"
    assert len(BASH_BLOCKS) >= 10


def test_not_run_reasons() -> None:
    """`not-run` only above a bash block, and only for SLURM, a GPU or `make bench`."""
    problems = []
    for f in DOC_FILES:
        lines = f.read_text().splitlines()
        fences = {b.line for b in parse_blocks(f)}
        for i, line in enumerate(lines):
            m = NOT_RUN.match(line)
            if line.lstrip().startswith("<!--") and "not-run" in line and not m:
                problems.append(f"{f.name}:{i + 1}: malformed marker (write <!-- not-run: REASON -->)")
            elif m and (i + 2) not in fences:
                problems.append(f"{f.name}:{i + 1}: a not-run marker must sit on the line right above a fence")
    for b in ALL_BLOCKS:
        if b.not_run is None:
            continue
        if b.lang != "bash":
            problems.append(f"{b.id}: not-run above a {b.lang or 'plain'} block (only bash blocks run)")
        if not any(word in b.not_run.lower() for word in NOT_RUN_REASONS):
            problems.append(f"{b.id}: not-run reason {b.not_run!r} must mention SLURM, GPU or make bench")
    assert not problems, "\n".join(problems)


def test_shell_blocks_are_tagged_bash() -> None:
    wrong = [f"{b.id}: ```{b.lang}" for b in ALL_BLOCKS if b.lang in ("sh", "shell", "console", "zsh", "shell-session")]
    assert not wrong, "tag shell commands ```bash so that the doc test runs them:\n" + "\n".join(wrong)


def test_slow_list_matches_blocks() -> None:
    for (path, needle), why in SLOW.items():
        hits = [b for b in BASH_BLOCKS if b.path == path and needle in b.code]
        assert len(hits) == 1, f"SLOW entry ({path!r}, {needle!r}) matches {len(hits)} blocks ({why})"


def test_links_and_images_resolve() -> None:
    """Relative links and embedded images in README.md and docs/ point at files that exist."""
    link = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
    missing = []
    for f in DOC_FILES:
        text = re.sub(r"```.*?```", "", f.read_text(), flags=re.S)
        for target in link.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = (f.parent / target.split("#")[0]).resolve()
            if not path.exists():
                missing.append(f"{f.relative_to(ROOT)}: {target}")
    assert not missing, "links to missing files:\n" + "\n".join(missing)


def test_every_registered_schedule_is_documented() -> None:
    """Every built-in schedule (a test may register its own, e.g. tests/toy_schedule.py, in the same process)."""
    from zb_pipeline.schedule import registry

    page = (ROOT / "docs" / "schedules.md").read_text()
    builtin = [n for n in registry.available() if registry.get(n).fn.__module__.startswith(registry.BUILTIN_PACKAGE)]
    assert "zb-h1" in builtin
    absent = [n for n in builtin if f"`{n}`" not in page]
    assert not absent, f"docs/schedules.md does not describe: {absent}"
