"""GPU check of the Triton backend: its tests on CUDA (bf16 and fp32), a sweep of tile configs, a timing table.

    python tools/gpu_check.py               # tests, sweep, then the table with the sweep's configs; ~4 minutes
    python tools/gpu_check.py --tuning-out tuning.json   # ... and write the sweep's choice (kernels_triton/tuning.py)
    python tools/gpu_check.py --bench-only  # only the sweep + table;  --tests-only: only the tests
    python tools/gpu_check.py --sweep       # only the sweep;  --no-sweep: tests + table (of the committed tables,
                                            # or of --tuning FILE's)
    python tools/gpu_check.py --quick       # smaller benchmark shapes
    bash tools/gpu_check.sh                 # the whole GPU check: this, the sampler's CUDA tests, bench --only gpu

The tests are tests/test_triton.py run on CUDA (the interpreter tests on the GPU, plus the `gpu`
tests in bf16 and fp32 at larger shapes); while they run, three processes compile the sweep's
candidates into Triton's cache (--warm). The sweep times candidate tile configs at the real shapes and
keeps, per table, the fastest that keeps the contract: a matmul config must give the table config's
bits (it varies with M), an attention forward config must give decode the bits of prefill (also
through parallel key splits); the MoE config and the backward configs are free (one config serves
sampler and trainer alike). Those choices are applied to this process, so the table times them. The
table times each Triton kernel against its batch-variant baseline in the same run and prints the ratio
(triton ms / baseline ms; > 1 means Triton is slower), at the real model's shapes (Qwen3-30B-A3B):
matmul (q_proj, o_proj, LM head, router at M = 1, 16, 128, 4096) vs cuBLAS, fused MoE forward and
forward+backward vs torch._grouped_mm, paged attention (prefill, forward+backward, decode) vs torch SDPA
and flash-attn (where installed), RMSNorm, token log-probs and the sampler's draw vs plain torch.
Exit status: the tests' (0 when they pass), 2 without a CUDA device.
"""
from __future__ import annotations

import argparse
import atexit
import importlib.util
import itertools
import os
import signal
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)                   # kernels*, imported where used (after TRITON_INTERPRET is set)


def main() -> int:
    ap = argparse.ArgumentParser(description="Triton backend GPU check: tests on CUDA, then timings vs torch baselines.")
    ap.add_argument("--tests-only", action="store_true", help="run tests/test_triton.py on CUDA, no timings")
    ap.add_argument("--bench-only", action="store_true", help="no tests: the sweep (unless --no-sweep), then the table")
    ap.add_argument("--quick", action="store_true", help="smaller benchmark shapes")
    ap.add_argument("--sweep", action="store_true", help="only the sweep of candidate tile configs (matmul, attention)")
    ap.add_argument("--no-sweep", action="store_true", help="tests and table, without the sweep")
    ap.add_argument("--test-timeout", type=int, default=360, help="seconds allowed for the tests (default 360)")
    ap.add_argument("--tuning-out", metavar="FILE",
                    help="also write the sweep's choice of tile configs here (JSON; the table always times it)")
    ap.add_argument("--tuning", metavar="FILE", help="time the table with this tuning (kernels_triton/tuning.py)")
    ap.add_argument("--sweep-budget", type=float, metavar="S",
                    help="seconds the sweep may take; then it keeps what it has timed (the table still runs)")
    ap.add_argument("--warm", choices=SWEEP_SECTIONS, help=argparse.SUPPRESS)   # start_warmup's processes
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="developers: run the benchmark code once on CPU (Triton interpreter, tiny shapes, no timings)")
    args = ap.parse_args()

    import torch
    if args.warm:                      # compile one sweep section's candidates: run each once, time nothing
        sweep(dev="cpu" if args.cpu_smoke else "cuda", sections=(args.warm,), timer=lambda fn: (fn(), 0.0)[1])
        return 0
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        tune(sweep(dev="cpu", budget_s=args.sweep_budget), args.tuning_out)
        if not args.sweep:                                            # --sweep: only the sweep, as on a GPU
            bench(quick=True, dev="cpu")
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False). This check needs one GPU; "
              "on a CPU run `python -m pytest -q tests/test_triton.py` (the Triton interpreter tests).", file=sys.stderr)
        return 2
    print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    guard_children()
    rc = 0
    if args.tuning:
        try:
            tune(None, args.tuning)
        except ValueError as e:
            print(f"gpu_check: error: {e}", file=sys.stderr)
            return 2
    if args.sweep:
        return 0 if sweep_and_tune(args.tuning_out, args.sweep_budget) else 1
    if not args.bench_only:
        t0 = time.time()
        env = {k: v for k, v in os.environ.items() if k not in ("KERNELS_BACKEND", "TRITON_INTERPRET")}
        warmup = [] if args.tests_only or args.no_sweep else start_warmup(env)
        # in 8 processes where pytest-xdist is installed: compiling the kernels is most of the time
        workers = ["-n", "8"] if importlib.util.find_spec("xdist") else []
        # -v: after a time limit the log still names every test that finished. The sm_90 compile check
        # (tests/test_tools.py) is not among them: it needs no GPU and the CPU suite runs it
        tests = child([sys.executable, "-m", "pytest", "-v", "-rfEs", *workers, "tests/test_triton.py"], env)
        try:
            rc = tests.wait(timeout=args.test_timeout)
        except subprocess.TimeoutExpired:
            stop(tests, grace=10)                # pytest prints the failures so far, which a kill would lose
            print(f"gpu_check: tests timed out after {args.test_timeout}s", flush=True)
            rc = 1
        print(f"gpu_check: tests {'passed' if rc == 0 else 'FAILED'} in {time.time() - t0:.0f}s", flush=True)
        if warmup:
            finish_warmup(warmup, deadline=t0 + args.test_timeout)
    if not args.tests_only:
        if not args.no_sweep and not sweep_and_tune(args.tuning_out, args.sweep_budget):   # first: the table times its choice
            rc = 1
        bench(args.quick)
    return rc


def sweep_and_tune(path: str | None, budget_s: float | None = None) -> bool:
    """The sweep, then its choice applied (and written to path). A sweep that fails is reported and
    applies nothing (every sweep restores the tables it tries), so the table still runs: the one GPU
    call keeps it."""
    try:
        tune(sweep(budget_s=budget_s), path)
    except Exception as e:                                   # report, keep the rest of the run
        traceback.print_exc(file=sys.stdout)
        print(f"\ngpu_check: the sweep failed ({type(e).__name__}: {str(e)[:200]})", flush=True)
        return False
    return True


def tune(tuning: dict | None, path: str | None) -> None:
    """Apply the sweep's tuning (and write it to path, if given) or, with tuning None, path's: the table
    and whatever runs next in this process time those configs."""
    import json
    from kernels_triton.tuning import load_tuning
    written = tuning is not None and path
    tuning = load_tuning(path if tuning is None else tuning)     # checked (and applied) before written
    if written:
        with open(path, "w") as f:                                   # one line per table
            f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in tuning.items()) + "\n}\n")
    print(f"\ngpu_check: tile configs now {json.dumps(tuning)}" + (f" (in {path})" if path else ""), flush=True)


# ---------------------------------------------------------------------------------------------------
# inputs shared by the table and the sweep
# ---------------------------------------------------------------------------------------------------
# the model's linear layers (Qwen3-30B-A3B): (name, K in, N out), timed at decode to prefill row counts
MM_SHAPES = (("q_proj", 2048, 4096), ("o_proj", 4096, 2048), ("lm_head", 2048, 151936), ("router", 2048, 128))
MM_ROWS = (1, 16, 128, 4096)


def attention_inputs(B, T, H, KVH, D, dtype, dev):
    """q (B, T, H, D), k, v (B, T, KVH, D), and the trainer's page layout of them (pages of 16)."""
    import torch
    q = torch.randn(B, T, H, D, device=dev, dtype=dtype)
    k, v = torch.randn(B, T, KVH, D, device=dev, dtype=dtype), torch.randn(B, T, KVH, D, device=dev, dtype=dtype)
    kp, vp = k.reshape(-1, 16, KVH, D), v.reshape(-1, 16, KVH, D)
    bt = torch.arange(kp.shape[0], device=dev).view(B, -1)
    return q, k, v, kp, vp, bt, torch.arange(T, device=dev).expand(B, T)


def attention_fwd_bwd(att, which):
    """A callable running forward + backward of causal attention: "triton", "sdpa" or flash_attn_func."""
    import torch
    import torch.nn.functional as F
    from kernels_triton import ops as kt
    q, k, v, kp, vp, bt, pos = att
    B, T, H, D = q.shape
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    g = torch.randn_like(q)

    def run():
        if which == "triton":
            kpg, vpg = kg.reshape(-1, 16, k.shape[2], D), vg.reshape(-1, 16, k.shape[2], D)
            o = kt.paged_attention(qg, kpg, vpg, bt, pos, D ** -0.5)
        elif which == "sdpa":
            o = F.scaled_dot_product_attention(qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2),
                                               is_causal=True, enable_gqa=True).transpose(1, 2)
        else:
            o = which(qg, kg, vg, causal=True)
        return torch.autograd.grad(o, (qg, kg, vg), g)
    return run


def decode_inputs(B, ctx, H, KVH, D, dev):
    """One query per sequence at position ctx - 1 over a paged cache of 256-key pages (flash-attn's
    minimum), and the same keys dense for SDPA."""
    import torch
    q = torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16)
    kc = torch.randn(B * ctx // 256, 256, KVH, D, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.randperm(kc.shape[0], device=dev).view(B, -1).int()
    pos = torch.full((B, 1), ctx - 1, device=dev)
    kd = kc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()             # dense (B, KVH, ctx, D)
    vd = vc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
    return q, kc, vc, bt, pos, kd, vd


# ---------------------------------------------------------------------------------------------------
# benchmarks
# ---------------------------------------------------------------------------------------------------
class Timings:
    """The timing table's rows, each a Triton call timed beside its baselines in the same run.
    tiny (dev="cpu"): a smoke run at tiny shapes, one call each, no timing."""

    def __init__(self, tiny: bool):
        self.tiny, self.rows = tiny, []

    def ms(self, fn) -> float:
        if self.tiny:
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
        from triton.testing import do_bench
        return do_bench(fn, warmup=10, rep=40, return_mode="median")

    def row(self, op, shape, dtype, tri, baselines) -> None:
        """tri: the Triton callable; baselines: {name: callable or None}. Each timed here, same run."""
        try:
            t = self.ms(tri)
        except Exception as e:                                            # report, keep going
            self.rows.append((op, shape, str(dtype).removeprefix("torch."), f"error: {type(e).__name__}", "", "", ""))
            print("  " + "  ".join(self.rows[-1]), flush=True)
            return
        for name, fn in baselines.items():
            try:
                b = self.ms(fn) if fn is not None else None
            except Exception as e:
                b, name = None, f"{name} (error: {type(e).__name__}: {str(e)[:60]})"
            self.rows.append((op, shape, str(dtype).removeprefix("torch."), f"{t:.3f}", name,
                              "n/a" if b is None else f"{b:.3f}", "n/a" if b is None else f"{t / b:.2f}"))
            print("  " + "  ".join(self.rows[-1]), flush=True)    # now: a time limit may cut the table short

    def print(self) -> None:
        head = ("op", "shape", "dtype", "triton ms", "baseline", "base ms", "triton/base")
        widths = [max(len(str(r[i])) for r in self.rows + [head]) for i in range(len(head))]
        print()
        for r in [head, tuple("-" * w for w in widths)] + self.rows:
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def flash_attn_fns():
    """(flash_attn_func, flash_attn_with_kvcache, its name) or Nones where flash-attn is not installed."""
    try:
        import flash_attn
        from flash_attn import flash_attn_func, flash_attn_with_kvcache
        return flash_attn_func, flash_attn_with_kvcache, f"flash-attn {flash_attn.__version__}"
    except Exception:                                                     # not installed or broken
        return None, None, None


def bench(quick: bool, dev: str = "cuda") -> None:
    """The timing table. dev="cpu": a smoke run of this code at tiny shapes, one call each, no timing."""
    import torch
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    t = Timings(dev == "cpu")
    bench_matmul(t, dev)
    bench_moe(t, quick, dev)
    att = bench_attention(t, quick, dev)
    bench_row_ops(t, quick, dev)
    t.print()
    flash_decode_check(att, dev)


def bench_matmul(t: Timings, dev: str) -> None:
    """matmul: the model's real shapes (Qwen3-30B-A3B), rows M of decode to prefill."""
    import torch
    from kernels_triton import ops as kt
    bf16, fp32 = torch.bfloat16, torch.float32
    for name, K, N in MM_SHAPES:
        if t.tiny:
            K, N = min(K, 64), min(N, 96)
        w = torch.randn(N, K, device=dev, dtype=bf16)
        for M in ((1, 16) if t.tiny else MM_ROWS):
            x = torch.randn(M, K, device=dev, dtype=bf16)
            t.row("matmul " + name, f"M={M} K={K} N={N}", bf16, lambda: kt.linear(x, w), {"cuBLAS": lambda: x @ w.T})
    K = N = 64 if t.tiny else 4096
    w = torch.randn(N, K, device=dev)
    for M in ((1,) if t.tiny else (1, 128, 4096)):
        x = torch.randn(M, K, device=dev)
        t.row("matmul", f"M={M} K={K} N={N}", fp32, lambda: kt.linear(x, w), {"cuBLAS": lambda: x @ w.T})


def bench_moe(t: Timings, quick: bool, dev: str) -> None:
    """The fused MoE, forward and forward+backward, against torch._grouped_mm."""
    import torch
    import torch.nn.functional as F
    import kernels
    from kernels_triton import moe as ktm
    bf16 = torch.bfloat16
    M, E, k, D, I = (16, 4, 2, 32, 32) if t.tiny else (1024, 32, 4, 1024, 512) if quick else (4096, 128, 8, 2048, 768)
    x = torch.randn(M, D, device=dev, dtype=bf16)
    w13 = (torch.randn(E, 2 * I, D, device=dev) * 0.02).to(bf16)
    w2 = (torch.randn(E, D, I, device=dev) * 0.02).to(bf16)
    ids, wts, _ = kernels.route(torch.randn(M, E, device=dev), k, True)

    def grouped(x, w13, w2, ids, wts):       # the same math with torch._grouped_mm (differentiable)
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
        h = torch._grouped_mm(x[order // k], w13.transpose(1, 2), offs=offs)      # (M*k, 2I)
        y = torch._grouped_mm(F.silu(h[:, :I]) * h[:, I:], w2.transpose(1, 2), offs=offs)
        y = y.float() * wts.reshape(-1)[order, None]
        out = torch.zeros(M * k, D, device=x.device).index_copy(0, order, y)
        return out.view(M, k, D).sum(1).to(x.dtype)
    has_grouped = hasattr(torch, "_grouped_mm")
    t.row("moe fwd", f"M={M} E={E} k={k} D={D} I={I}", bf16, lambda: ktm.moe_experts(x, w13, w2, ids, wts),
          {"torch._grouped_mm": (lambda: grouped(x, w13, w2, ids, wts)) if has_grouped else None})
    params = [p.clone().requires_grad_() for p in (x, w13, w2, wts)]
    gy = torch.randn(M, D, device=dev, dtype=bf16)

    def fwd_bwd(f):
        return lambda: torch.autograd.grad(f(*params[:3], ids, params[3]), params, gy)
    t.row("moe fwd+bwd", f"M={M} E={E} k={k} D={D} I={I}", bf16, fwd_bwd(ktm.moe_experts),
          {"torch._grouped_mm fwd+bwd": fwd_bwd(grouped) if has_grouped and not t.tiny else None})   # no CPU backward


def bench_attention(t: Timings, quick: bool, dev: str):
    """Attention: prefill and forward+backward against SDPA (and flash-attn if installed), decode against
    a long paged context. Returns the bf16 prefill inputs (for flash_decode_check)."""
    import torch
    import torch.nn.functional as F
    from kernels_triton import ops as kt
    bf16, fp32 = torch.bfloat16, torch.float32
    flash_attn_func, flash_attn_with_kvcache, fa = flash_attn_fns()
    B, T, H, KVH, Dh = (1, 80, 4, 2, 16) if t.tiny else (2, 1024, 32, 4, 128) if quick else (4, 2048, 32, 4, 128)
    shape = f"B={B} T={T} H={H} KVH={KVH} D={Dh}"
    for dtype in (bf16, fp32):
        att = attention_inputs(B, T, H, KVH, Dh, dtype, dev)
        q, kk, vv, kp, vp, bt, pos = att
        qt, kt_, vt = q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2)
        base = {"torch SDPA": lambda: F.scaled_dot_product_attention(qt, kt_, vt, is_causal=True, enable_gqa=True)}
        if fa and dtype == bf16:
            base[fa] = lambda: flash_attn_func(q, kk, vv, causal=True)
        t.row("attn prefill", shape, dtype, lambda: kt.paged_attention(q, kp, vp, bt, pos, Dh ** -0.5), base)
        if dtype == bf16:
            prefill = att
            fb = {"torch SDPA": attention_fwd_bwd(att, "sdpa")}
            if fa:
                fb[fa] = attention_fwd_bwd(att, flash_attn_func)
            t.row("attn fwd+bwd", shape, dtype, attention_fwd_bwd(att, "triton"), fb)
    # decode: one new query per sequence against a long paged context
    Bd, ctx = (2, 256) if t.tiny else (32, 1024) if quick else (64, 2048)
    qd, kc, vc, btd, posd, kd, vd = decode_inputs(Bd, ctx, H, KVH, Dh, dev)
    base = {"torch SDPA (dense KV)": lambda: F.scaled_dot_product_attention(qd.transpose(1, 2), kd, vd, enable_gqa=True)}
    if fa:
        seqlens = torch.full((Bd,), ctx, device=dev, dtype=torch.int32)
        base[f"{fa} paged"] = lambda: flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=seqlens, block_table=btd)
    t.row("attn decode", f"B={Bd} ctx={ctx} H={H} KVH={KVH} D={Dh}", bf16,
          lambda: kt.paged_attention(qd, kc, vc, btd, posd, Dh ** -0.5), base)
    # the tail of a rollout: a few long sequences (the key splits run in parallel, ATTN_SPLIT_BELOW)
    Bl, ctxl = (1, 512) if t.tiny else (4, 16384)
    ql, kcl, vcl, btl, posl, kdl, vdl = decode_inputs(Bl, ctxl, H, KVH, Dh, dev)
    t.row("attn decode, few long", f"B={Bl} ctx={ctxl} H={H} KVH={KVH} D={Dh}", bf16,
          lambda: kt.paged_attention(ql, kcl, vcl, btl, posl, Dh ** -0.5),
          {"torch SDPA (dense KV)": lambda: F.scaled_dot_product_attention(ql.transpose(1, 2), kdl, vdl, enable_gqa=True)})
    bench_mla(t, quick, dev)
    return prefill


def bench_mla(t: Timings, quick: bool, dev: str) -> None:
    """MLA's absorbed attention at Moonlight-16B-A3B's sizes: 16 heads over one 576-dim latent head whose
    values are its keys (one page tensor; the head split 512 + 64, the wide heads' layout), prefill and
    decode, against SDPA over the same keys."""
    import torch
    import torch.nn.functional as F
    from kernels_triton import ops as kt
    H, D = (4, 48) if t.tiny else (16, 576)
    B, T = (1, 80) if t.tiny else (2, 1024) if quick else (4, 2048)
    q, k, _, kp, _, bt, pos = attention_inputs(B, T, H, 1, D, torch.bfloat16, dev)
    kt_ = k.transpose(1, 2)
    t.row("attn prefill MLA", f"B={B} T={T} H={H} latent D={D}", torch.bfloat16,
          lambda: kt.paged_attention(q, kp, kp, bt, pos, 192 ** -0.5),
          {"torch SDPA": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), kt_, kt_, is_causal=True,
                                                                 scale=192 ** -0.5, enable_gqa=True)})
    Bd, ctx = (2, 256) if t.tiny else (32, 1024) if quick else (64, 2048)
    qd, kc, _, btd, posd, kd, _ = decode_inputs(Bd, ctx, H, 1, D, dev)
    t.row("attn decode MLA", f"B={Bd} ctx={ctx} H={H} latent D={D}", torch.bfloat16,
          lambda: kt.paged_attention(qd, kc, kc, btd, posd, 192 ** -0.5),
          {"torch SDPA (dense KV)": lambda: F.scaled_dot_product_attention(qd.transpose(1, 2), kd, kd, scale=192 ** -0.5,
                                                                            enable_gqa=True)})


def bench_row_ops(t: Timings, quick: bool, dev: str) -> None:
    """RMSNorm, the chosen-token log-prob (and entropy), and the sampler's draw at a decode step's rows."""
    import torch
    import torch.nn.functional as F
    import kernels
    from kernels_triton import ops as kt
    from kernels_triton import vocab as ktv
    bf16 = torch.bfloat16
    Mr, Nr = (16, 64) if t.tiny else (8192, 4096)
    xr, wr = torch.randn(Mr, Nr, device=dev, dtype=bf16), torch.ones(Nr, device=dev, dtype=bf16)
    t.row("rms_norm", f"{Mr} x {Nr}", bf16, lambda: kt.rms_norm(xr, wr, 1e-6),
          {"torch F.rms_norm": lambda: F.rms_norm(xr, (Nr,), wr, 1e-6)})
    R, V = (4, 3000) if t.tiny else (1024, 151936) if quick else (4096, 151936)
    z, tg = torch.randn(R, V, device=dev, dtype=bf16), torch.randint(0, V, (R,), device=dev)
    t.row("token_logprobs", f"{R} x {V}, T=0.7", bf16, lambda: ktv.token_logprobs(z, tg, 0.7),
          {"torch log_softmax+gather": lambda: torch.log_softmax(z.float() / 0.7, -1).gather(-1, tg[:, None])})
    t.row("token_logprobs+entropy", f"{R} x {V}, T=0.7", bf16, lambda: ktv.token_logprobs(z, tg, 0.7, with_entropy=True),
          {"triton token_logprobs alone": lambda: ktv.token_logprobs(z, tg, 0.7)})
    zs = z[:4 if t.tiny else 256]
    u = torch.rand(zs.shape[0], device=dev, dtype=torch.float64)

    def torch_draw():
        with kernels.set_backend("torch"):
            return kernels.sample_tokens(zs, 1.0, 1.0, 0, u)
    t.row("sample_tokens", f"{zs.shape[0]} x {V}, T=1", bf16, lambda: ktv.sample_tokens(zs, 1.0, u),
          {"torch softmax + fp64 cumsum": torch_draw})


def flash_decode_check(att, dev: str) -> None:
    """May flash-attn serve the invariant path? Only if its decode equals its prefill bitwise."""
    import torch
    flash_attn_func, flash_attn_with_kvcache, fa = flash_attn_fns()
    if not fa:
        return
    bf16 = torch.bfloat16
    q, kk, vv = att[:3]
    KVH, Dh = kk.shape[2], kk.shape[3]
    qs, ks, vs = (x[:1, :300].contiguous() for x in (q.to(bf16), kk.to(bf16), vv.to(bf16)))
    pre = flash_attn_func(qs, ks, vs, causal=True)
    kcache = torch.zeros(1, 512, KVH, Dh, device=dev, dtype=bf16)
    vcache = torch.zeros_like(kcache)
    kcache[:, :300], vcache[:, :300] = ks, vs
    same = all(torch.equal(flash_attn_with_kvcache(qs[:, p:p + 1], kcache, vcache,
                                                   cache_seqlens=torch.tensor([p + 1], device=dev, dtype=torch.int32),
                                                   causal=True), pre[:, p:p + 1]) for p in (0, 17, 150, 299))
    print(f"\n{fa}: decode equals prefill bitwise: {same} (the invariant path does not use it either way)")


# ---------------------------------------------------------------------------------------------------
# sweep: candidate tile configs, timed, with their bits checked against the table's
# ---------------------------------------------------------------------------------------------------
# matmul candidates (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) per M; a candidate with another BLOCK_K
# may enter kernels_triton.MM_TABLE only if its bits are equal here AND in the CUDA test
MM_CANDIDATES = {
    # small M streams the weight once: more programs (BLOCK_N 16-32) and more bytes in flight per
    # program (BLOCK_K up to 256, stages) are the levers; BLOCK_K never changes the order of K on the
    # H200 probe (the MMA's k-steps run in order), and every config's bits are checked here anyway
    "bf16 small": [(16, 32, 64, 2, 5), (16, 64, 64, 4, 4), (16, 32, 128, 4, 4), (16, 64, 128, 4, 4),
                   (16, 16, 128, 2, 6), (16, 16, 256, 2, 4), (16, 16, 256, 1, 4), (16, 32, 256, 2, 4),
                   (16, 64, 256, 4, 3), (16, 128, 64, 4, 4), (32, 64, 64, 4, 4)],
    "bf16 mid": [(32, 64, 64, 4, 4), (64, 32, 64, 2, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3),
                 (64, 32, 128, 4, 4), (64, 64, 128, 4, 3), (128, 32, 128, 4, 3)],
    "bf16 large": [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3),
                   (128, 128, 128, 8, 3)],
    "fp32 small": [(16, 32, 32, 2, 4), (16, 64, 32, 4, 3), (16, 128, 32, 4, 3), (32, 64, 32, 4, 3)],
    "fp32 mid": [(32, 64, 32, 4, 3), (64, 64, 32, 4, 3), (64, 128, 32, 8, 3)],
    "fp32 large": [(64, 64, 32, 4, 3), (128, 64, 32, 8, 3), (128, 128, 32, 8, 3), (64, 128, 32, 4, 3), (128, 128, 16, 8, 3)],
}
# attention: forward (query rows, warps, stages) x key tile; backward (rows, warps, stages) per kernel
ATTN_FWD_CANDIDATES = [(64, 4, 2), (64, 4, 3), (128, 8, 2), (64, 8, 2)]
ATTN_KEY_CANDIDATES = (64, 128)
ATTN_BWD_CANDIDATES = [(64, 4, 2), (64, 8, 2), (128, 8, 2)]


class Clock:
    """Times a callable (median ms; dev="cpu": one call, 0 ms) and keeps the sweep's time budget:
    once it is spent, each section stops timing candidates and keeps what it has (or the table's)."""

    def __init__(self, dev: str, budget_s: float | None, timer=None):
        self.tiny, self.said, self.timer = dev == "cpu", False, timer
        self.deadline = time.time() + (float("inf") if budget_s is None else budget_s)

    def __call__(self, fn) -> float:
        if self.timer is not None:                   # tests: a stub
            return self.timer(fn)
        if self.tiny:
            fn()
            return 0.0
        from triton.testing import do_bench
        return do_bench(fn, warmup=5, rep=25, return_mode="median")

    def spent(self) -> bool:
        if time.time() > self.deadline and not self.said:
            print("  sweep: time budget spent; what is left keeps the configs timed so far, else the table's", flush=True)
            self.said = True
        return self.said


SWEEP_SECTIONS = ("moe", "matmul", "attention")


def sweep(dev: str = "cuda", budget_s: float | None = None, sections=SWEEP_SECTIONS, timer=None) -> dict:
    """Times candidate configs per real shape and returns the tuning (kernels_triton/tuning.py's format):
    per table the fastest candidate that keeps the contract. budget_s: seconds the sweep may take (the
    table after it must still run). dev="cpu": one call per candidate at tiny shapes (a smoke run).
    sections: which tables; timer: instead of do_bench (the warm-up runs each candidate once)."""
    ms, tuning = Clock(dev, budget_s, timer), {}
    if "moe" in sections:
        tuning["moe"] = {"bfloat16": sweep_moe(dev, ms)}
    if "matmul" in sections:
        tuning["mm"] = sweep_matmul(dev, ms)
    if "attention" in sections:
        tuning |= sweep_attention(dev, ms)
    return tuning


CHILDREN: list[subprocess.Popen] = []


def child(cmd: list[str], env: dict, quiet: bool = False) -> subprocess.Popen:
    """A process group of its own (pytest's workers, ptxas), stopped whole: by stop(), or with this
    process (guard_children), so nothing of it runs while the sweep times."""
    out = subprocess.DEVNULL if quiet else None
    CHILDREN.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=out, start_new_session=True))
    return CHILDREN[-1]


def stop(proc: subprocess.Popen, grace: float = 0.0) -> None:
    """Stop proc's process group: with grace, SIGINT first (pytest then reports the tests done so far) and
    SIGKILL only to what is left after grace seconds; else SIGKILL at once."""
    if proc.poll() is not None:
        return
    if grace:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    kill_group(proc)                             # also what outlived its leader (pytest's workers)
    proc.wait()


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:                   # nothing left of the group
        pass


def stop_children() -> None:
    """SIGKILL every child's process group not yet reaped. No wait: this may run in a signal handler
    that interrupted a Popen.wait() holding that Popen's lock."""
    for proc in CHILDREN:
        if proc.returncode is None:
            kill_group(proc)


def stop_children_and_exit(signum, frame):
    stop_children()
    sys.exit(128 + signum)


def guard_children() -> None:
    """The children run in sessions of their own, so neither Ctrl-C nor gpu_check.sh's time limit reaches
    them: stop them when this process is told to stop (SIGTERM, SIGINT, SIGHUP) or exits any other way
    (an exception, e.g. a closed stdout)."""
    atexit.register(stop_children)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop_children_and_exit)


def start_warmup(env: dict) -> list[subprocess.Popen]:
    """Compiling the sweep's candidates (about a second per binary, a hundred binaries) would take most of
    its time budget. One process per section runs every candidate once, while the tests run, so that
    the sweep finds them in Triton's cache and spends its budget timing."""
    return [child([sys.executable, os.path.abspath(__file__), "--warm", section], env, quiet=True)
            for section in SWEEP_SECTIONS]


def finish_warmup(procs: list[subprocess.Popen], deadline: float) -> None:
    """Wait for the warm-up processes until the deadline, then stop those still compiling (their
    candidates the sweep compiles itself); they must not run while the sweep times."""
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            stop(p)
    done = sum(p.returncode == 0 for p in procs)
    print(f"gpu_check: compile warm-up: {done} of {len(procs)} sweep sections compiled", flush=True)


def mm_class(largest) -> str:
    """The candidate list (MM_CANDIDATES' "small", "mid", "large") for the MM_TABLE row serving M <= largest."""
    return "large" if largest is None else "small" if largest <= 16 else "mid"


def sweep_matmul(dev, ms) -> dict:
    """Candidates per MM_TABLE row at the real shapes, at MM_ROWS and each row's largest M (so every row
    is timed at an M it serves); returns per dtype the table's rows (same M bounds), each with the
    config of the smallest geometric mean of ms / cuBLAS ms over its shapes and row counts among those
    that gave the table config's bits at every one of them; a row not timed keeps its config."""
    import math
    import torch
    from kernels_triton import ops as kt
    tiny = dev == "cpu"
    print("\nsweep: matmul (ms; bits = equal to the table config's result)", flush=True)
    ratios: dict[tuple, dict[tuple, list[float]]] = {}      # (dtype, table row) -> config -> [ms / cuBLAS ms]
    cases: dict[tuple, int] = {}                             # (dtype, table row) -> shapes x row counts timed
    for dtype, shapes in ((torch.bfloat16, MM_SHAPES), (torch.float32, MM_SHAPES[:1])):
        tag = "bf16" if dtype == torch.bfloat16 else "fp32"
        bounds = [largest for largest, *_ in kt.MM_TABLE[dtype]]
        for name, K, N in shapes:
            K, N = (min(K, 64), min(N, 96)) if tiny else (K, N)
            w = torch.randn(N, K, device=dev, dtype=dtype)
            for M in ((1,) if tiny else sorted(set(MM_ROWS) | set(bounds) - {None})):
                if ms.spent():                           # a row keeps the shapes timed whole so far
                    break
                x = torch.randn(M, K, device=dev, dtype=dtype)
                ref = kt._mm(x, w, dtype)
                i = next(i for i, largest in enumerate(bounds) if largest is None or M <= largest)  # its row
                size = mm_class(bounds[i])
                table_cfg = tuple(kt.mm_config(M, dtype))
                times = {table_cfg: ms(lambda: kt._mm(x, w, dtype))}
                line = []
                for cfg in MM_CANDIDATES[f"{tag} {size}"]:
                    try:
                        same = torch.equal(kt._mm(x, w, dtype, config=cfg), ref)
                        t = ms(lambda: kt._mm(x, w, dtype, config=cfg))
                    except Exception as e:                                   # report, keep going
                        print(f"  {tag} {name} M={M} {cfg}: error {type(e).__name__}: {str(e)[:80]}")
                        continue
                    line.append((t, cfg, same))
                    if same:                             # a config that changes bits may not enter the table
                        times.setdefault(cfg, t)
                cublas = ms(lambda: x @ w.T)
                print(f"  {tag} {name:8s} M={M:<5d} cuBLAS {cublas:.4f} table {table_cfg}:{times[table_cfg]:.4f} | "
                      + "  ".join(f"{c}:{t:.4f}{'' if same else '(BITS DIFFER)'}" for t, c, same in sorted(line)), flush=True)
                key = (dtype, i)
                cases[key] = cases.get(key, 0) + 1
                for cfg, t in times.items():
                    ratios.setdefault(key, {}).setdefault(cfg, []).append(t / cublas if cublas > 0 else 1.0)

    print("\nsweep: best matmul config per table row (geometric mean of triton/cuBLAS over its shapes and M; worst)")
    tables = {}
    for dtype, tag in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        rows = []
        for i, (largest, *committed) in enumerate(kt.MM_TABLE[dtype]):
            full = {cfg: r for cfg, r in ratios.get((dtype, i), {}).items() if len(r) == cases[(dtype, i)]}
            if not full:                                 # not timed (CPU smoke run, time budget): the table's
                rows.append([largest, *committed])
                continue
            cfg, r = min(full.items(), key=lambda kv: sum(map(math.log, kv[1])))
            print(f"  {tag} M <= {largest}: {cfg}: {math.exp(sum(map(math.log, r)) / len(r)):.2f}x  "
                  f"worst {max(r):.2f}x", flush=True)
            rows.append([largest, *cfg])
        tables[tag] = rows
    return tables


MOE_CANDIDATES = [(64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 64, 64, 4, 3), (32, 64, 64, 4, 3)]


def sweep_moe(dev, ms) -> list[int]:
    """MoE tile configs (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the forward at a decode step's rows
    (256 tokens) and forward+backward at a training step's (4096); returns the config with the smallest
    product of the two among those whose rows keep their bits between the two batches (the contract:
    one config serves the sampler and the trainer, so it need not give MOE_TILES' bits, which are
    printed, but a token's row may not depend on its batch)."""
    import torch
    import kernels
    from kernels_triton import moe as ktm
    tiny = dev == "cpu"
    M, E, k, D, I = (16, 4, 2, 32, 32) if tiny else (4096, 128, 8, 2048, 768)
    Md = 4 if tiny else 256
    x = torch.randn(M, D, device=dev, dtype=torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, D, device=dev) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E, D, I, device=dev) * 0.02).to(torch.bfloat16)
    ids, wts, _ = kernels.route(torch.randn(M, E, device=dev), k, True)
    params = [t.clone().requires_grad_() for t in (x, w13, w2, wts)]
    gy = torch.randn(M, D, device=dev, dtype=torch.bfloat16)
    ref = ktm.moe_experts(x, w13, w2, ids, wts)
    saved = ktm.MOE_TILES[torch.bfloat16]
    print(f"\nsweep: fused MoE E={E} k={k} D={D} I={I} bf16, forward at M={Md}, forward+backward at M={M} "
          f"(table {saved})", flush=True)
    timed = {}
    try:
        for cfg in MOE_CANDIDATES:
            if ms.spent():
                break
            ktm.MOE_TILES[torch.bfloat16] = cfg
            try:
                out = ktm.moe_experts(x, w13, w2, ids, wts)
                same = torch.equal(out, ref)
                invariant = torch.equal(ktm.moe_experts(x[:Md], w13, w2, ids[:Md], wts[:Md]), out[:Md])
                fwd = ms(lambda: ktm.moe_experts(x[:Md], w13, w2, ids[:Md], wts[:Md]))
                fb = ms(lambda: torch.autograd.grad(ktm.moe_experts(*params[:3], ids, params[3]), params, gy))
                print(f"  {cfg}: fwd M={Md} {fwd:.3f}  fwd+bwd M={M} {fb:.3f}  bits equal {same}, "
                      f"rows of M={Md} equal those of M={M} {invariant}", flush=True)
                if invariant:
                    timed[cfg] = fwd * fb
            except Exception as e:
                print(f"  {cfg}: error {type(e).__name__}: {str(e)[:80]}", flush=True)
    finally:
        ktm.MOE_TILES[torch.bfloat16] = saved
    return list(min(timed, key=timed.get) if timed else saved)


def decode_equals_prefill(q, kc, vc, bt, pos, D, parallel=False) -> bool:
    """One sequence's prefill (one program per query block) against decode at four positions, bitwise;
    parallel: the decode steps run their key splits as separate programs plus the merge kernel."""
    import torch
    from kernels_triton import ops as kt
    below = kt.ATTN_SPLIT_BELOW
    try:
        kt.ATTN_SPLIT_BELOW = 0
        pre = kt.paged_attention(q, kc, vc, bt, pos, D ** -0.5)
        kt.ATTN_SPLIT_BELOW = 10**9 if parallel else 0
        P = q.shape[1]
        return all(torch.equal(kt.paged_attention(q[:, p:p + 1], kc, vc, bt, pos[:, p:p + 1], D ** -0.5), pre[:, p:p + 1])
                   for p in (0, 17, P // 2, P - 1))
    finally:
        kt.ATTN_SPLIT_BELOW = below


def sweep_attention(dev, ms) -> dict:
    """Forward configs: prefill and decode times, and whether decode equals prefill bitwise (the
    contract: a forward config must keep it); the key splits in parallel or in one program; backward
    configs: forward+backward time. Returns the fastest forward config that keeps the contract
    (smallest product of prefill and decode time), ATTN_SPLIT_BELOW, and the fastest backward configs."""
    import torch
    from kernels_triton import ops as kt
    tiny = dev == "cpu"
    B, T, H, KVH, D = (1, 80, 4, 2, 16) if tiny else (4, 2048, 32, 4, 128)
    att = attention_inputs(B, T, H, KVH, D, torch.bfloat16, dev)
    q, k, v, kp, vp, bt, pos = att
    dec = decode_inputs(2 if tiny else 64, 256 if tiny else 2048, H, KVH, D, dev)
    qd, kc, vc, btd, posd = dec[:5]
    probe = [t[:1, :304] for t in (q, k, v)]                      # decode vs prefill check, one sequence
    P = probe[0].shape[1]
    pk, pv = (t.reshape(-1, 16, KVH, D) for t in probe[1:])
    pbt, ppos = torch.arange(pk.shape[0], device=dev)[None], torch.arange(P, device=dev)[None]
    saved = kt.ATTN_KEYS, dict(kt.ATTN_TABLE), kt.ATTN_SPLIT_BELOW, kt.ATTN_SPLIT
    tuning = {"attn_keys": kt.ATTN_KEYS, "attn": dict(kt.ATTN_TABLE), "attn_split_below": kt.ATTN_SPLIT_BELOW}
    print(f"\nsweep: attention forward, B={B} T={T} H={H} KVH={KVH} D={D} prefill / decode B={qd.shape[0]}", flush=True)
    try:
        fwd = {}                                                  # (keys, config) -> prefill ms x decode ms
        for keys, cfg in itertools.product(ATTN_KEY_CANDIDATES, ATTN_FWD_CANDIDATES):
            if ms.spent():
                break
            kt.ATTN_KEYS, kt.ATTN_TABLE["fwd"] = keys, cfg
            try:
                same = decode_equals_prefill(probe[0], pk, pv, pbt, ppos, D)
                kt.ATTN_SPLIT = 1                      # also through one-tile splits run in parallel
                same_split = decode_equals_prefill(probe[0], pk, pv, pbt, ppos, D, parallel=True)
                kt.ATTN_SPLIT = saved[3]
                t_pre = ms(lambda: kt.paged_attention(q, kp, vp, bt, pos, D ** -0.5))
                t_dec = ms(lambda: kt.paged_attention(qd, kc, vc, btd, posd, D ** -0.5))
                print(f"  keys={keys} (rows, warps, stages)={cfg}: prefill {t_pre:.3f}  decode {t_dec:.4f}  "
                      f"decode==prefill {same}, by parallel splits {same_split}", flush=True)
                if same and same_split:
                    fwd[keys, cfg] = t_pre * t_dec
            except Exception as e:
                print(f"  keys={keys} {cfg}: error {type(e).__name__}: {str(e)[:80]}", flush=True)
            finally:
                kt.ATTN_SPLIT = saved[3]
        if fwd:
            tuning["attn_keys"], tuning["attn"]["fwd"] = min(fwd, key=fwd.get)
        # the splits and the backward are timed with the chosen forward: the tuning applies them together,
        # and ATTN_KEYS is the backward's key tile and sets the forward's split count too
        kt.ATTN_KEYS, kt.ATTN_TABLE = tuning["attn_keys"], dict(saved[1], fwd=tuning["attn"]["fwd"])
        tuning["attn_split_below"] = sweep_splits(dev, ms, H, KVH, D)
        print(f"\nsweep: attention backward (forward + backward ms), keys={kt.ATTN_KEYS}", flush=True)
        for kernel in ("bwd_dq", "bwd_dkv"):
            bwd = {}
            for cfg in ATTN_BWD_CANDIDATES:
                if ms.spent():
                    break
                kt.ATTN_TABLE[kernel] = cfg
                try:
                    bwd[cfg] = ms(attention_fwd_bwd(att, "triton"))
                    print(f"  {kernel} {cfg}: {bwd[cfg]:.3f}", flush=True)
                except Exception as e:
                    print(f"  {kernel} {cfg}: error {type(e).__name__}: {str(e)[:80]}", flush=True)
            kt.ATTN_TABLE[kernel] = saved[1][kernel]          # the other kernel's sweep keeps the table's
            if bwd:
                tuning["attn"][kernel] = min(bwd, key=bwd.get)
    finally:
        kt.ATTN_KEYS, kt.ATTN_TABLE, kt.ATTN_SPLIT_BELOW, kt.ATTN_SPLIT = saved
    tuning["attn"] = {name: list(cfg) for name, cfg in tuning["attn"].items()}
    return tuning


def sweep_splits(dev, ms, H, KVH, D) -> int:
    """Decode of B sequences of ctx keys with the key splits run in parallel (two kernels) or in one
    program; returns ATTN_SPLIT_BELOW: the fewest programs at which one program was as fast (the
    splits run in parallel below it), or the table's value if the splits won everywhere."""
    from kernels_triton import ops as kt
    below = kt.ATTN_SPLIT_BELOW
    print("\nsweep: decode with the key splits in parallel (two kernels) or in one program "
          f"(kernels_triton.ATTN_SPLIT_BELOW = {below} programs picks)", flush=True)
    one_wins = []
    try:
        for Bd, ctx in ((2, 512), (1, 1024)) if dev == "cpu" else ((4, 16384), (16, 8192), (64, 2048), (256, 2048)):
            if ms.spent():
                break
            qd, kc, vc, btd, posd = decode_inputs(Bd, ctx, H, KVH, D, dev)[:5]
            times = {}
            try:
                for name, value in (("parallel", 10**9), ("one program", 0)):
                    kt.ATTN_SPLIT_BELOW = value
                    times[name] = ms(lambda: kt.paged_attention(qd, kc, vc, btd, posd, D ** -0.5))
            except Exception as e:                           # report, keep the other shapes
                print(f"  B={Bd} ctx={ctx}: error {type(e).__name__}: {str(e)[:80]}", flush=True)
                continue
            print(f"  B={Bd} ctx={ctx} ({Bd * KVH} programs): parallel {times['parallel']:.4f}  "
                  f"one program {times['one program']:.4f}", flush=True)
            if times["one program"] <= times["parallel"]:
                one_wins.append(Bd * KVH)
    finally:
        kt.ATTN_SPLIT_BELOW = below
    return min(one_wins, default=below)


if __name__ == "__main__":
    sys.exit(main())
