"""GPU check of the Triton backend: its tests on CUDA (bf16 and fp32), then a timing table.

    python tests/gpu_check.py               # tests, then timings; under 8 minutes on one GPU
    python tests/gpu_check.py --bench-only  # only the table;  --tests-only: only the tests
    python tests/gpu_check.py --quick       # smaller benchmark shapes
    bash tests/gpu_check.sh                 # the same, from anywhere

The tests are tests/test_triton.py run on CUDA (the interpreter tests on the GPU, plus the `gpu`
tests in bf16 and fp32 at larger shapes). The table times each Triton kernel against its batch-variant
baseline in the same run and prints the ratio (triton ms / baseline ms; > 1 means Triton is slower):
matmul vs torch/cuBLAS, fused MoE vs torch._grouped_mm and a per-expert loop, paged attention vs
torch SDPA and flash-attn (where installed), RMSNorm and token log-probs vs plain torch.
Exit status: the tests' (0 when they pass), 2 without a CUDA device.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description="Triton backend GPU check: tests on CUDA, then timings vs torch baselines.")
    ap.add_argument("--tests-only", action="store_true", help="run tests/test_triton.py on CUDA, no timings")
    ap.add_argument("--bench-only", action="store_true", help="print the timing table only")
    ap.add_argument("--quick", action="store_true", help="smaller benchmark shapes")
    ap.add_argument("--test-timeout", type=int, default=360, help="seconds allowed for the tests (default 360)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="developers: run the benchmark code once on CPU (Triton interpreter, tiny shapes, no timings)")
    args = ap.parse_args()

    import torch
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        bench(quick=True, dev="cpu")
        return 0
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False). This check needs one GPU; "
              "on a CPU run `python -m pytest -q tests/test_triton.py` (the Triton interpreter tests).", file=sys.stderr)
        return 2
    print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rc = 0
    if not args.bench_only:
        t0 = time.time()
        env = {k: v for k, v in os.environ.items() if k not in ("KERNELS_BACKEND", "TRITON_INTERPRET")}
        try:
            rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "tests/test_triton.py"],
                                cwd=ROOT, env=env, timeout=args.test_timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"gpu_check: tests timed out after {args.test_timeout}s", flush=True)
            rc = 1
        print(f"gpu_check: tests {'passed' if rc == 0 else 'FAILED'} in {time.time() - t0:.0f}s", flush=True)
    if not args.tests_only:
        bench(args.quick)
    return rc


# ---------------------------------------------------------------------------------------------------
# benchmarks
# ---------------------------------------------------------------------------------------------------
def bench(quick: bool, dev: str = "cuda") -> None:
    """The timing table. dev="cpu": a smoke run of this code at tiny shapes, one call each, no timing."""
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    tiny = dev == "cpu"

    sys.path.insert(0, ROOT)
    import kernels
    import kernels_triton as kt

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    bf16, fp32 = torch.bfloat16, torch.float32
    try:
        import flash_attn
        from flash_attn import flash_attn_func, flash_attn_with_kvcache
        fa = f"flash-attn {flash_attn.__version__}"
    except Exception:                                                     # not installed or broken
        flash_attn_func = flash_attn_with_kvcache = None
        fa = None
    rows: list[tuple] = []

    def ms(fn):
        if tiny:
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
        return do_bench(fn, warmup=10, rep=40, return_mode="median")

    def row(op, shape, dtype, tri, baselines):
        """tri: the Triton callable; baselines: {name: callable or None}. Each timed here, same run."""
        try:
            t = ms(tri)
        except Exception as e:                                            # report, keep going
            rows.append((op, shape, str(dtype).removeprefix("torch."), f"error: {type(e).__name__}", "", "", ""))
            return
        for name, fn in baselines.items():
            try:
                b = ms(fn) if fn is not None else None
            except Exception as e:
                b, name = None, f"{name} (error: {type(e).__name__}: {str(e)[:60]})"
            rows.append((op, shape, str(dtype).removeprefix("torch."), f"{t:.3f}", name,
                         "n/a" if b is None else f"{b:.3f}", "n/a" if b is None else f"{t / b:.2f}"))
        print(f"  timed {op} {shape} {dtype}", flush=True)

    # --- matmul ---------------------------------------------------------------------------------
    K = N = 64 if tiny else 2048 if quick else 4096
    for dtype in (bf16, fp32):
        w = torch.randn(N, K, device=dev, dtype=dtype)
        for M in ((1, 16) if tiny else (1, 128, 4096)):
            x = torch.randn(M, K, device=dev, dtype=dtype)
            row("matmul", f"M={M} K={K} N={N}", dtype, lambda: kt.linear(x, w), {"torch (cuBLAS)": lambda: x @ w.T})

    # --- fused MoE ------------------------------------------------------------------------------
    M, E, k, D, I = (16, 4, 2, 32, 32) if tiny else (1024, 32, 4, 1024, 512) if quick else (4096, 64, 8, 2048, 768)
    x = torch.randn(M, D, device=dev, dtype=bf16)
    w13 = (torch.randn(E, 2 * I, D, device=dev) * 0.02).to(bf16)
    w2 = (torch.randn(E, D, I, device=dev) * 0.02).to(bf16)
    ids, wts, _ = kernels.route(torch.randn(M, E, device=dev), k, True)
    w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)                 # (E, D, 2I), (E, I, D) views

    def moe_loop():
        order = torch.sort(ids.reshape(-1), stable=True).indices
        counts = torch.bincount(ids.reshape(-1), minlength=E).tolist()
        out, start = torch.empty(M * k, D, device=dev), 0
        for e, n in enumerate(counts):
            s = order[start:start + n]
            start += n
            h = x[s // k] @ w13[e].T
            out[s] = (F.silu(h[:, :I]) * h[:, I:]) @ w2[e].T * wts.reshape(-1)[s, None]
        return out.view(M, k, D).sum(1).to(bf16)

    grouped = None
    if hasattr(torch, "_grouped_mm"):
        def grouped():
            flat = ids.reshape(-1)
            order = torch.sort(flat, stable=True).indices
            offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
            h = torch._grouped_mm(x[order // k], w13t, offs=offs)           # (M*k, 2I)
            y = torch._grouped_mm(F.silu(h[:, :I]) * h[:, I:], w2t, offs=offs)
            out = torch.empty(M * k, D, device=dev)
            out[order] = y.float() * wts.reshape(-1)[order, None]
            return out.view(M, k, D).sum(1).to(bf16)
    row("moe fwd", f"M={M} E={E} k={k} D={D} I={I}", bf16, lambda: kt.moe_experts(x, w13, w2, ids, wts),
        {"torch._grouped_mm": grouped, "per-expert loop": moe_loop})
    params = [t.clone().requires_grad_() for t in (x, w13, w2, wts)]
    gy = torch.randn(M, D, device=dev, dtype=bf16)

    def fwd_bwd(f):
        return lambda: torch.autograd.grad(f(*params[:3], ids, params[3]), params, gy)

    def loop_autograd(x, w13, w2, ids, wts):              # the per-expert loop, differentiable
        flat, order = ids.reshape(-1), torch.sort(ids.reshape(-1), stable=True).indices
        counts, parts, start = torch.bincount(flat, minlength=E).tolist(), [], 0
        for e, n in enumerate(counts):
            s = order[start:start + n]
            start += n
            h = x[s // k] @ w13[e].T
            parts.append((F.silu(h[:, :I]) * h[:, I:]) @ w2[e].T * wts.reshape(-1)[s, None])
        out = torch.zeros(M * k, D, device=dev).index_copy(0, order, torch.cat(parts).float())
        return out.view(M, k, D).sum(1).to(x.dtype)
    row("moe fwd+bwd", f"M={M} E={E} k={k} D={D} I={I}", bf16, fwd_bwd(kt.moe_experts),
        {"per-expert loop (autograd)": fwd_bwd(loop_autograd)})

    # --- attention ------------------------------------------------------------------------------
    B, T, H, KVH, Dh = (1, 32, 4, 2, 16) if tiny else (2, 1024, 16, 4, 128) if quick else (4, 2048, 32, 8, 128)
    for dtype in (bf16, fp32):
        q = torch.randn(B, T, H, Dh, device=dev, dtype=dtype)
        kk, vv = torch.randn(B, T, KVH, Dh, device=dev, dtype=dtype), torch.randn(B, T, KVH, Dh, device=dev, dtype=dtype)
        kp, vp = kk.reshape(-1, 16, KVH, Dh), vv.reshape(-1, 16, KVH, Dh)    # trainer layout: KV_BLOCK pages
        bt = torch.arange(kp.shape[0], device=dev).view(B, -1)
        pos = torch.arange(T, device=dev).expand(B, T)
        qt, kt_, vt = q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2)
        base = {"torch SDPA": lambda: F.scaled_dot_product_attention(qt, kt_, vt, is_causal=True, enable_gqa=True)}
        if fa and dtype == bf16:
            base[fa] = lambda: flash_attn_func(q, kk, vv, causal=True)
        row("attn prefill", f"B={B} T={T} H={H} KVH={KVH} D={Dh}", dtype,
            lambda: kt.paged_attention(q, kp, vp, bt, pos, Dh ** -0.5), base)
        if dtype == bf16:
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, kk, vv))
            g = torch.randn_like(q)

            def tri_fb():
                kpg, vpg = kg.reshape(-1, 16, KVH, Dh), vg.reshape(-1, 16, KVH, Dh)
                torch.autograd.grad(kt.paged_attention(qg, kpg, vpg, bt, pos, Dh ** -0.5), (qg, kg, vg), g)

            def sdpa_fb():
                o = F.scaled_dot_product_attention(qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2),
                                                   is_causal=True, enable_gqa=True)
                torch.autograd.grad(o, (qg, kg, vg), g.transpose(1, 2))
            fb = {"torch SDPA": sdpa_fb}
            if fa:
                fb[fa] = lambda: torch.autograd.grad(flash_attn_func(qg, kg, vg, causal=True), (qg, kg, vg), g)
            row("attn fwd+bwd", f"B={B} T={T} H={H} KVH={KVH} D={Dh}", dtype, tri_fb, fb)

    # decode: one new query per sequence against a long paged context
    Bd, ctx = (2, 256) if tiny else (32, 1024) if quick else (64, 2048)
    qd = torch.randn(Bd, 1, H, Dh, device=dev, dtype=bf16)
    kc = torch.randn(Bd * ctx // 256, 256, KVH, Dh, device=dev, dtype=bf16)   # pages of 256 (flash-attn's minimum)
    vc = torch.randn_like(kc)
    btd = torch.randperm(kc.shape[0], device=dev).view(Bd, -1).int()
    posd = torch.full((Bd, 1), ctx - 1, device=dev)
    kd = kc[btd.long()].flatten(1, 2).transpose(1, 2).contiguous()             # dense (B, KVH, ctx, D)
    vd = vc[btd.long()].flatten(1, 2).transpose(1, 2).contiguous()
    base = {"torch SDPA (dense KV)": lambda: F.scaled_dot_product_attention(qd.transpose(1, 2), kd, vd, enable_gqa=True)}
    if fa:
        seqlens = torch.full((Bd,), ctx, device=dev, dtype=torch.int32)
        base[f"{fa} paged"] = lambda: flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=seqlens, block_table=btd)
    row("attn decode", f"B={Bd} ctx={ctx} H={H} KVH={KVH} D={Dh}", bf16,
        lambda: kt.paged_attention(qd, kc, vc, btd, posd, Dh ** -0.5), base)

    # --- row ops --------------------------------------------------------------------------------
    Mr, Nr = (16, 64) if tiny else (8192, 4096)
    xr, wr = torch.randn(Mr, Nr, device=dev, dtype=bf16), torch.ones(Nr, device=dev, dtype=bf16)
    row("rms_norm", f"{Mr} x {Nr}", bf16, lambda: kt.rms_norm(xr, wr, 1e-6),
        {"torch F.rms_norm": lambda: F.rms_norm(xr, (Nr,), wr, 1e-6)})
    R, V = (4, 3000) if tiny else (1024, 151936) if quick else (4096, 151936)
    z, tg = torch.randn(R, V, device=dev, dtype=bf16), torch.randint(0, V, (R,), device=dev)
    row("token_logprobs", f"{R} x {V}, T=0.7", bf16, lambda: kt.token_logprobs(z, tg, 0.7),
        {"torch log_softmax+gather": lambda: torch.log_softmax(z.float() / 0.7, -1).gather(-1, tg[:, None])})

    # --- print ------------------------------------------------------------------------------------
    head = ("op", "shape", "dtype", "triton ms", "baseline", "base ms", "triton/base")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    print()
    for r in [head, tuple("-" * w for w in widths)] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))

    if fa:   # may flash-attn serve the invariant path? Only if its decode equals its prefill bitwise.
        qs, ks, vs = (t[:1, :300].contiguous() for t in (q.to(bf16), kk.to(bf16), vv.to(bf16)))
        pre = flash_attn_func(qs, ks, vs, causal=True)
        kcache = torch.zeros(1, 512, KVH, Dh, device=dev, dtype=bf16)
        vcache = torch.zeros_like(kcache)
        kcache[:, :300], vcache[:, :300] = ks, vs
        same = all(torch.equal(flash_attn_with_kvcache(qs[:, p:p + 1], kcache, vcache,
                                                       cache_seqlens=torch.tensor([p + 1], device=dev, dtype=torch.int32),
                                                       causal=True), pre[:, p:p + 1]) for p in (0, 17, 150, 299))
        print(f"\n{fa}: decode equals prefill bitwise: {same} (the invariant path does not use it either way)")


if __name__ == "__main__":
    sys.exit(main())
