"""tools/run_benchmarks.py: each benchmark in its own subprocess, past failures and timeouts, then an index."""

from __future__ import annotations

import os
import sys
import textwrap

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import run_benchmarks as rb  # noqa: E402

OK_SCRIPT = """
import argparse, os
ap = argparse.ArgumentParser()
ap.add_argument("--out")
ap.add_argument("--quick", action="store_true")
a = ap.parse_args()
open(os.path.join(a.out, "fake.md"), "w").write("quick" if a.quick else "full")
print("done")
"""
NO_FLAGS_SCRIPT = """
import sys
assert len(sys.argv) == 1 or sys.argv[1] == "--help", sys.argv
print("usage: plain.py")
"""
FAIL_SCRIPT = "import sys; print('boom'); sys.exit(3)"
HANG_SCRIPT = """
import sys, time
if "--help" in sys.argv:
    print("usage: hang.py [--out OUT]"); sys.exit(0)
time.sleep(60)
"""


def _script(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_driver_runs_past_failures_and_writes_the_index(tmp_path, monkeypatch):
    out = tmp_path / "results"
    benches = [
        rb.Benchmark("ok", _script(tmp_path, "ok.py", OK_SCRIPT), "writes a result"),
        rb.Benchmark("plain", _script(tmp_path, "plain.py", NO_FLAGS_SCRIPT), "takes no flags"),
        rb.Benchmark("fail", _script(tmp_path, "fail.py", FAIL_SCRIPT), "exits 3"),
        rb.Benchmark("hang", _script(tmp_path, "hang.py", HANG_SCRIPT), "sleeps", quick_timeout_s=2.0),
        rb.Benchmark("absent", str(tmp_path / "absent.py"), "not written yet"),
    ]
    monkeypatch.setattr(rb, "BENCHMARKS", benches)
    assert rb.main(["--out", str(out), "--quick"]) == 1  # fail and hang count; absent does not
    assert (out / "fake.md").read_text() == "quick"
    readme = (out / "README.md").read_text()
    for needle in ("| ok | ", "failed (exit 3)", "timeout (2 s)", "not present yet", "[fake.md](fake.md) (this run)"):
        needle = needle.replace("| ok | ", "writes a result | ok |")
        assert needle in readme, needle
    assert "python " in readme and "torch " in readme and "numpy " in readme
    assert "boom" in (out / "logs" / "fail.log").read_text()
    assert "done" in (out / "logs" / "ok.log").read_text()


def test_only_and_skipped(tmp_path, monkeypatch):
    out = tmp_path / "results"
    nocuda = _script(tmp_path, "nocuda.py", "print('x: no CUDA device available; nothing to check.')")
    benches = [
        rb.Benchmark("ok", _script(tmp_path, "ok.py", OK_SCRIPT), "writes a result"),
        rb.Benchmark("gpu", nocuda, "needs a GPU", skipped_marker="no CUDA device available"),
        rb.Benchmark("fail", _script(tmp_path, "fail.py", FAIL_SCRIPT), "exits 3"),
    ]
    monkeypatch.setattr(rb, "BENCHMARKS", benches)
    assert rb.main(["--out", str(out), "--only", "ok", "gpu"]) == 0  # a skip is not a failure
    assert (out / "fake.md").read_text() == "full"
    assert "skipped (no CUDA device available)" in (out / "README.md").read_text()
    assert "exits 3" not in (out / "README.md").read_text()


def test_flags_come_from_help(tmp_path):
    ok = _script(tmp_path, "ok.py", OK_SCRIPT)
    flags = rb.supported_flags(sys.executable, ok)
    assert {"--out", "--quick"} <= flags
    cmd = rb.build_command(sys.executable, rb.Benchmark("x", ok, ""), "/o", quick=True, flags=flags)
    assert cmd[-3:] == ["--out", "/o", "--quick"]
    assert rb.build_command(sys.executable, rb.Benchmark("x", ok, ""), "/o", quick=True, flags=set())[2:] == []
