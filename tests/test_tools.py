"""The tools (tools/): gpu_check.py's process handling and sweep logic, and compile_check.py's verdict.

    python -m pytest -q tests/test_tools.py

Nothing here needs a GPU. gpu_check.py runs under the Triton interpreter at tiny shapes (--cpu-smoke),
its sweep with stubbed kernels and timings, and its child processes are checked through /proc.
compile_check.py compiles for sm_90 with the ptxas that ships with Triton (skipped where triton has no
NVIDIA backend).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")      # before kernels_triton applies @triton.jit
pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

import gpu_check  # noqa: E402
from kernels_triton import ops as kt     # noqa: E402
from kernels_triton import moe as ktm    # noqa: E402
from kernels_triton import vocab as ktv  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---------------------------------------------------------------------------------------------------
# gpu_check.py
# ---------------------------------------------------------------------------------------------------
@pytest.mark.skipif(CUDA, reason="on a GPU run tools/gpu_check.py itself")
def test_gpu_check_script_runs_on_cpu(tmp_path):
    """tools/gpu_check.py: without CUDA it says so (exit 2); its sweep and benchmark code run at tiny
    shapes, and the sweep's choice is written as a tuning file that kernels_triton.tuning.load_tuning accepts."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "tools/gpu_check.py"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "no CUDA device" in r.stderr
    out = tmp_path / "tuning.json"
    r = subprocess.run([sys.executable, "tools/gpu_check.py", "--cpu-smoke", "--tuning-out", str(out)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout[r.stdout.index("triton/base"):]
    assert "matmul" in table and "moe fwd" in table and "attn decode" in table and "error" not in table
    assert "error" not in r.stdout[:r.stdout.index("triton/base")]        # no sweep candidate failed
    tuning = json.loads(out.read_text())
    assert set(tuning) == {"mm", "moe", "attn", "attn_keys", "attn_split_below"}
    assert set(tuning["attn"]) == set(kt.ATTN_TABLE)
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):   # the table's M bounds; the
        rows = [tuple(row) for row in tuning["mm"][name]]                           # rows not timed (M > 1) as
        assert [r[0] for r in rows] == [r[0] for r in kt.MM_TABLE[dtype]] and rows[1:] == list(kt.MM_TABLE[dtype][1:])   # committed
    # with its time budget spent at once, the sweep times nothing and keeps every table as committed
    r = subprocess.run([sys.executable, "tools/gpu_check.py", "--cpu-smoke", "--sweep", "--sweep-budget", "0",
                        "--tuning-out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "time budget spent" in r.stdout, r.stderr[-3000:]
    committed = {"moe": {"bfloat16": list(ktm.MOE_TILES[torch.bfloat16])},
                 "mm": {name: [list(row) for row in kt.MM_TABLE[dtype]]
                        for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32))},
                 "attn_keys": kt.ATTN_KEYS, "attn": {k: list(v) for k, v in kt.ATTN_TABLE.items()},
                 "attn_split_below": kt.ATTN_SPLIT_BELOW}
    assert json.loads(out.read_text()) == committed


def test_gpu_check_sweep_times_splits_and_backward_with_the_chosen_forward(monkeypatch, tables):
    """The tuning applies the attention choices together, so the sweep must time the key splits and the
    backward configs with the forward config and key tile it chose (ATTN_KEYS is the backward's tile
    too), not with the committed ones (64 keys, (64, 4, 2)). Nothing is launched: timings are stubbed."""
    monkeypatch.setattr(gpu_check, "ATTN_KEY_CANDIDATES", (128,))
    monkeypatch.setattr(gpu_check, "ATTN_FWD_CANDIDATES", [(64, 8, 2)])
    monkeypatch.setattr(gpu_check, "ATTN_BWD_CANDIDATES", [(64, 4, 2)])
    monkeypatch.setattr(gpu_check, "decode_equals_prefill", lambda *a, **k: True)
    timed = []

    def ms(fn):                                      # what each timing would run with
        timed.append((kt.ATTN_KEYS, kt.ATTN_TABLE["fwd"]))
        return 1.0
    committed = (kt.ATTN_KEYS, dict(kt.ATTN_TABLE), kt.ATTN_SPLIT_BELOW, kt.ATTN_SPLIT)
    tuning = gpu_check.sweep_attention("cpu", gpu_check.Clock("cpu", None, ms))
    assert (tuning["attn_keys"], tuning["attn"]["fwd"]) == (128, [64, 8, 2]) and committed[0] == 64
    assert len(timed) == 2 + 2 * 2 + 2, timed           # prefill + decode, 2 split shapes x 2, 2 backward
    assert all(t == (128, (64, 8, 2)) for t in timed), timed
    assert (kt.ATTN_KEYS, kt.ATTN_TABLE, kt.ATTN_SPLIT_BELOW, kt.ATTN_SPLIT) == committed   # restored


def test_gpu_check_sweep_failure_costs_neither_the_other_shapes_nor_the_table(monkeypatch, tmp_path, capsys):
    """One GPU call: a split shape that fails is reported and skipped (the others still decide), and a
    sweep that fails writes and applies nothing and returns False (main then runs the table anyway)."""

    def attention(q, *a):
        if q.shape[0] == 2:
            raise RuntimeError("out of resources")
    monkeypatch.setattr(kt, "paged_attention", attention)
    clock = gpu_check.Clock("cpu", None, lambda fn: (fn(), 1.0)[1])
    assert gpu_check.sweep_splits("cpu", clock, 4, 2, 16) == 1 * 2    # B=1 alone
    assert "B=2 ctx=512: error RuntimeError: out of resources" in capsys.readouterr().out

    def broken(dev="cuda", budget_s=None):
        raise RuntimeError("boom")
    monkeypatch.setattr(gpu_check, "sweep", broken)
    before = (repr(kt.MM_TABLE), dict(kt.ATTN_TABLE), kt.ATTN_KEYS, kt.ATTN_SPLIT_BELOW, dict(ktm.MOE_TILES))
    assert gpu_check.sweep_and_tune(str(tmp_path / "t.json")) is False
    assert "the sweep failed (RuntimeError: boom)" in capsys.readouterr().out and not (tmp_path / "t.json").exists()
    assert (repr(kt.MM_TABLE), dict(kt.ATTN_TABLE), kt.ATTN_KEYS, kt.ATTN_SPLIT_BELOW, dict(ktm.MOE_TILES)) == before


def test_gpu_check_warmup_compiles_a_section_and_is_stopped_at_its_deadline(capsys):
    """The sweep's compile warm-up: `--warm SECTION` runs one section's candidates once (here under the
    interpreter, a smoke run of that path); a warm-up process still running at the deadline is stopped
    (its whole process group), so nothing of it runs while the sweep times."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "tools/gpu_check.py", "--cpu-smoke", "--warm", "moe"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    quick, slow = gpu_check.child(["true"], env, quiet=True), gpu_check.child(["sleep", "60"], env, quiet=True)
    t0 = time.time()
    gpu_check.finish_warmup([quick, slow], deadline=time.time() + 1.0)
    assert time.time() - t0 < 10 and quick.returncode == 0 and slow.returncode == -9
    assert "1 of 2 sweep sections compiled" in capsys.readouterr().out
    gpu_check.stop(quick)                                            # a finished one: nothing to do


def alive(pid: int) -> bool:
    """Whether process pid runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.time() + within
    while alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    return not alive(pid)


REPORTS_WHEN_INTERRUPTED = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)     # as under gpu_check (its SIGINT is caught)
g = subprocess.Popen(["sh", "-c", "trap '' INT; exec sleep 60"])    # ignores SIGINT: only the kill stops it
open(sys.argv[1], "w").write(str(g.pid))
try:
    time.sleep(60)
except KeyboardInterrupt:
    print("the tests' report so far", flush=True)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_gpu_check_stop_lets_the_tests_report_then_kills_their_group(tmp_path, capfd):
    """At the tests' time limit gpu_check stops pytest with SIGINT first (pytest then prints the failures so
    far, which a kill loses) and SIGKILLs what is left of its process group (xdist workers, a grandchild
    that ignores SIGINT). Control: stopped without grace, the same child reports nothing."""
    for grace in (20, 0):
        pidfile = tmp_path / f"pid{grace}"
        p = gpu_check.child([sys.executable, "-c", REPORTS_WHEN_INTERRUPTED, str(pidfile)], dict(os.environ))
        deadline = time.time() + 30
        while not (pidfile.exists() and pidfile.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        grandchild = int(pidfile.read_text())
        t0 = time.time()
        gpu_check.stop(p, grace=grace)
        assert time.time() - t0 < 10 and gone(grandchild)
        reported = "the tests' report so far" in capfd.readouterr().out
        assert (reported, p.returncode) == ((True, 0) if grace else (False, -9))


GUARDED = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)     # as from a terminal, even if SIGINT came ignored
sys.path.insert(0, "tools")
import gpu_check
if sys.argv[1] != "unguarded":
    gpu_check.guard_children()
p = gpu_check.child(["sleep", "60"], dict(os.environ), quiet=True)
print(p.pid, flush=True)
if sys.argv[1] == "raise":
    raise BrokenPipeError("stdout closed: tee was stopped")
time.sleep(60)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
@pytest.mark.parametrize("how, sig, rc", [("SIGTERM", signal.SIGTERM, 128 + signal.SIGTERM),
                                         ("SIGINT", signal.SIGINT, 128 + signal.SIGINT), ("raise", None, 1),
                                         ("unguarded", signal.SIGINT, -signal.SIGINT)])
def test_gpu_check_children_stop_with_it(how, sig, rc):
    """gpu_check's children (pytest, the warm-ups) run in sessions of their own, so neither Ctrl-C nor
    gpu_check.sh's limit reaches them: guard_children stops them when gpu_check gets SIGTERM or SIGINT, or
    dies of an exception. Control ("unguarded"): without it the child outlives its parent."""
    r = subprocess.Popen([sys.executable, "-c", GUARDED, how], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    pid = int(r.stdout.readline())
    if sig is not None:
        r.send_signal(sig)
    r.wait(timeout=120)                 # its exit tears down torch and triton: slow on a loaded 2-core machine
    try:
        assert r.returncode == rc and gone(pid, within=0 if how == "unguarded" else 10) == (how != "unguarded")
    finally:
        if alive(pid):
            os.killpg(pid, signal.SIGKILL)


def test_gpu_check_moe_sweep_skips_a_config_whose_rows_depend_on_the_batch(monkeypatch):
    """The MoE sweep may pick a config with other bits than MOE_TILES' (sampler and trainer share it),
    but not one under which a token's row differs between a decode step's batch and a training step's:
    here the fastest candidate scales its output by the batch size. Kernels and timings are stubbed."""
    fast, slow = (32, 64, 64, 4, 3), (64, 64, 64, 4, 3)
    monkeypatch.setattr(gpu_check, "MOE_CANDIDATES", [fast, slow])

    def moe(x, w13, w2, ids, wts):
        return x * x.shape[0] if ktm.MOE_TILES[torch.bfloat16] == fast else x.clone()
    monkeypatch.setattr(ktm, "moe_experts", moe)
    saved = ktm.MOE_TILES[torch.bfloat16]

    def ms(fn):
        return 1.0 if ktm.MOE_TILES[torch.bfloat16] == fast else 2.0
    assert gpu_check.sweep_moe("cpu", gpu_check.Clock("cpu", None, ms)) == list(slow)
    assert ktm.MOE_TILES[torch.bfloat16] == saved


# ---------------------------------------------------------------------------------------------------
# compile_check.py
# ---------------------------------------------------------------------------------------------------
def _ptxas():
    try:
        import triton
        return os.path.exists(triton.knobs.nvidia.ptxas.path)
    except Exception:                       # no NVIDIA backend in this triton build (e.g. macOS)
        return False


@pytest.mark.skipif(not _ptxas(), reason="triton has no NVIDIA backend / ptxas here")
def test_kernels_compile_for_sm90_one_binary_per_call_site():
    """tools/compile_check.py: every kernel the trainer and sampler launch compiles to an sm_90 cubin
    (bf16, the GPU's compute dtype, Qwen3-30B-A3B layer shapes: ptxas takes about a second a binary, and
    the tool's default adds fp32's as many) within the shared-memory limit and without spills, and
    trainer prefill, rollout prefill and decode at several batch sizes get the same binary per call site."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KERNELS_BACKEND")}
    r = subprocess.run([sys.executable, "tools/compile_check.py", "--dtype=bfloat16"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "share each forward binary: yes; 0 problem(s)" in r.stdout
    kernels_of_backend = [name for mod in (kt, ktm, ktv) for name in vars(mod) if name.endswith("_kernel")]
    assert len(kernels_of_backend) >= 10                     # (the listing itself works)
    for name in kernels_of_backend:                          # every kernel the backend defines
        assert f"\n{name} " in r.stdout, f"{name} was not compiled"
    # the control: with the matmul's row count specialized again, the same check must object
    r = subprocess.run([sys.executable, "tools/compile_check.py", "--control"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "(_matmul_kernel) compiles another binary" in r.stdout, r.stdout[-2000:]
