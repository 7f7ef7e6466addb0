"""bench.py's output: the profiler's own log lines are silenced at their source (libkineto).

    python -m pytest -q tests/test_bench.py
"""
from __future__ import annotations

import os
import subprocess
import sys

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
    quiet = run("import bench\n" + PROFILE)
    assert "profiler_start" not in quiet and "Completed Stage" not in quiet and "USDT" not in quiet


def test_bench_ep_runs_both_degrees_and_checks_their_bits():
    """The ep section's torchrun job (2 ranks, gloo): rows for EP=1 and EP=2; the worker exits non-zero
    if the two outputs differ in any bit."""
    out = run("import bench\nbench.main(['--only', 'ep', '--moe-tokens=64', '--repeats=1', '--warmup=0'])")
    for label in ("ep moe forward EP=1", "ep moe forward EP=2 / EP=1", "ep moe forward+backward EP=2"):
        assert label in out, out


def test_bench_window_holds_less_kv_with_the_same_bits():
    """The window section: the pool and no pool give the same outputs (else a row says DIFFER), and the
    pool holds less KV at its peak (2 of tiny-gpt-oss's 4 layers slide: less than half is impossible)."""
    out = run("import bench\nbench.main(['--only', 'window', '--prompts=4', '--window-new-tokens=60', "
              "'--repeats=1', '--warmup=0'])")
    assert "DIFFER" not in out, out
    ratio = float(next(ln for ln in out.splitlines() if "KV held, no pool / pool" in ln).split()[-1].rstrip("x"))
    assert 1.0 < ratio <= 2.0, out


def test_bench_reduce_errors_hold_exact_to_half_an_ulp():
    """bench.sum_errors on 12 micro-batches of cancelling terms: exact is the sum rounded once (at most
    half an fp32 ulp off the fp64 sum, nowhere worse than an fp32 sum); control: fp32 sums lose more."""
    import torch
    import bench
    g = torch.Generator().manual_seed(0)
    big = torch.randn(12, 4096, generator=g) * 10.0 ** torch.randint(-3, 3, (12, 1), generator=g)
    grads = [[row[:1024].clone(), row[1024:].view(3, 1024).clone()] for row in big - big.mean(0)]   # sums near 0
    out = bench.sum_errors(grads)
    assert out["exact"][1] <= 0.5 and all(worse == 0 for name, (_, _, worse) in out.items() if name != "exact")
    assert all(out[name][1] > 4 for name in out if name != "exact")
