"""tooling/bench.py's output: every default section runs and reports at tiny sizes; a failing section is one
line and the others still report; the profiler's own log lines are silenced at their source (libkineto).

    python -m pytest -q tests/test_bench.py
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = ("import torch\nwith torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):\n"
           "    torch.ones(3) + 1\n")


def run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


def test_bench_silences_the_profiler_log():
    noisy = run(PROFILE)
    assert "profiler_start" in noisy or "Completed Stage" in noisy     # control: torch's profiler logs each run
    quiet = run("from tooling import bench\n" + PROFILE)
    assert "profiler_start" not in quiet and "Completed Stage" not in quiet and "USDT" not in quiet


# `python -m tooling.bench` at the smallest sizes its flags allow (about 20 s on one thread, ep's torchrun included)
TINY_ARGS = ["--prompts=2", "--min-prompt-len=2", "--max-prompt-len=4", "--max-new-tokens=4", "--repeats=1",
             "--warmup=0", "--score-batch=2", "--score-len=8", "--pack-seqs=4", "--pack-micro-batch=2",
             "--micro-batch-tokens=256", "--moe-tokens=64"]
# a row each default section ends with, at those sizes
LAST_ROWS = {"rollout": "rollout ours / no-cache", "forward": "forward score (2, 8)", "fast": "trainer invariant / fast",
             "packing": "trainer packed / padded", "moe": "moe fused / per-expert loop",
             "ep": "ep moe forward+backward EP=2 / EP=1", "decode": "decode step ms, 256 / 16 sequences"}


def test_bench_default_sections_all_report():
    """The README's `python -m tooling.bench` at tiny sizes: every section of bench.DEFAULT prints its table and
    none fails, so a section left behind by an API change fails here, not minutes into a measured run.
    ep's worker exits non-zero if EP=2 and EP=1 differ in any bit; rollout checks its greedy tokens."""
    from tooling import bench
    sections = bench.DEFAULT.split(",")
    assert sorted(sections) == sorted(LAST_ROWS), "a default section without a row to look for here"
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    r = subprocess.run([sys.executable, "-m", "tooling.bench", *TINY_ARGS], cwd=ROOT,
                       env={**env, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "failed" not in out and "DIFFER" not in out, out[-4000:]
    for name in sections:
        table = r.stdout.split(f"\n{name} section, ", 1)
        assert len(table) == 2, f"no {name} table:\n{r.stdout[-4000:]}"
        assert LAST_ROWS[name] in table[1].split("\n\n")[0], f"{name}'s table lacks its rows:\n{table[1]}"
    assert "tokens identical to ours" in r.stdout


def test_a_failing_section_is_one_line_and_the_others_report(monkeypatch, capsys):
    """A section that raises (an error, or SystemExit for bad input) prints `section NAME failed: TYPE:
    message` and no traceback; the sections before and after it print their rows; the exit is 1."""
    from tooling import bench

    def broken(args):
        raise AttributeError("'MicroBatch' object has no attribute 'indices'")

    def refused(args):
        raise SystemExit("--lab-runs: no run named 'x'")
    monkeypatch.setitem(bench.BENCHMARKS, "before", lambda args: [("before row", 1.5, "")])
    monkeypatch.setitem(bench.BENCHMARKS, "broken", broken)
    monkeypatch.setitem(bench.BENCHMARKS, "refused", refused)
    monkeypatch.setitem(bench.BENCHMARKS, "after", lambda args: [("after row", 2.0, "ratio")])
    with pytest.raises(SystemExit) as e:
        bench.main(["--only", "before,broken,refused,after"])
    assert e.value.code == 1
    out, err = capsys.readouterr()
    assert "before row" in out and "after row" in out and "2.00x" in out
    assert "section broken failed: AttributeError: 'MicroBatch' object has no attribute 'indices'" in err.splitlines()
    assert "section refused failed: SystemExit: --lab-runs: no run named 'x'" in err.splitlines()
    assert "2 of 4 sections failed: broken, refused" in err and "Traceback" not in out + err
    with pytest.raises(SystemExit):
        bench.main(["--only", "broken,after", "--traceback"])
    out, err = capsys.readouterr()
    assert "Traceback" in err and "in broken" in err and "after row" in out


def test_bench_window_holds_less_kv_with_the_same_bits():
    """The window section: the pool and no pool give the same outputs (else a row says DIFFER), and the
    pool holds less KV at its peak (2 of tiny-gpt-oss's 4 layers slide: less than half is impossible)."""
    out = run("from tooling import bench\nbench.main(['--only', 'window', '--prompts=4', '--window-new-tokens=60', "
              "'--repeats=1', '--warmup=0'])")
    assert "DIFFER" not in out, out
    ratio = float(next(ln for ln in out.splitlines() if "KV held, no pool / pool" in ln).split()[-1].rstrip("x"))
    assert 1.0 < ratio <= 2.0, out


def test_bench_reduce_errors_hold_exact_to_half_an_ulp():
    """bench.sum_errors on 12 micro-batches of cancelling terms: exact is the sum rounded once (at most
    half an fp32 ulp off the fp64 sum, nowhere worse than an fp32 sum); control: fp32 sums lose more."""
    import torch
    from tooling import bench
    g = torch.Generator().manual_seed(0)
    big = torch.randn(12, 4096, generator=g) * 10.0 ** torch.randint(-3, 3, (12, 1), generator=g)
    grads = [[row[:1024].clone(), row[1024:].view(3, 1024).clone()] for row in big - big.mean(0)]   # sums near 0
    out = bench.sum_errors(grads)
    assert out["exact"][1] <= 0.5 and all(worse == 0 for name, (_, _, worse) in out.items() if name != "exact")
    assert all(out[name][1] > 4 for name in out if name != "exact")
