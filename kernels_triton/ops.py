"""Triton backend of kernels.py: the same ops, the same invariance rules, on the GPU.

kernels.py dispatches here for CUDA tensors (KERNELS_BACKEND=auto, the default) or always
(KERNELS_BACKEND=triton / kernels.set_backend("triton")). Without a GPU the very same kernels run on
CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set below when CUDA is absent); that is
how tests/test_triton.py checks them at tiny sizes.

    import kernels
    with kernels.set_backend("triton"):
        y = kernels.linear(x, w)

Ops (one section each: kernel(s), then the autograd Function):
* linear            tile config by M bucket (MM_TABLE), whole K loop in order, fp32 accumulator
* rms_norm          one program per row, fp32
* paged_attention   one kernel for trainer prefill, rollout prefill and decode (key splits merged in
                    order, run in parallel when there are few programs); recompute backward; attention
                    sinks and sliding windows (gpt-oss) as constexpr variants; a head that is not
                    a power of two as two parts (head_split), wide heads in a layout of their own
                    (ATTN_WIDE: MLA's 576-dim latent head)
Two more files hold the rest, each importing only kernels_triton/base.py (interpreter switch, launch
options), never kernels.py: kernels_triton/moe.py (the fused MoE) and kernels_triton/vocab.py (the
ops over the vocabulary: token log-probs and the sampler's draw).
The router softmax/top-k, RoPE and the dense SiLU*up stay torch ops (elementwise or tiny, and
row-local); tests/test_triton.py checks their invariance on CUDA.

Under the interpreter `tl.dot` on bf16 operands is wrong, so every dot upcasts to fp32 there (UPCAST),
and fp32 -> bf16 casts round toward zero (the GPU rounds to nearest even): test bf16 on a GPU only.
Cross-backend results agree within tolerance, not bitwise (different summation orders); within one
backend the invariance contract is bitwise.

The interpreter cannot show that the kernels compile: tools/compile_check.py compiles every launch
the model makes to a cubin (Triton's bundled ptxas, no GPU needed) and checks that each call site
gets one binary for every batch geometry (see ATTN_GEOMETRY below).
"""
from __future__ import annotations

import torch

from kernels_triton.base import INTERPRET, LAUNCH, UPCAST, aligned as _aligned, operand_dtype  # sets up the interpreter

import triton                      # noqa: E402
import triton.language as tl       # noqa: E402

# The matmul's tile config follows the row count M (decode tiles for small M, large tiles for prefill).
# That keeps the contract because a row's sum runs over K in order, whole, into one fp32 accumulator
# in every config: never a split of K. On a tensor-core GPU (H200 measured, and tests/test_triton.py
# checks every config below on the GPU it runs on) the bits of a row are then the same in every
# config; under the interpreter numpy's BLAS may round a row by its place in the tile, so the CPU
# tests assert bitwise only at a fixed place. One row per M bucket, the last bucket takes every M:
#                  (largest M, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
MM_TABLE = {
    torch.bfloat16: ((16, 16, 32, 64, 2, 5), (64, 32, 64, 64, 4, 4), (256, 64, 64, 64, 4, 4),
                     (None, 128, 128, 64, 8, 3)),
    torch.float32: ((16, 16, 32, 32, 2, 4), (128, 32, 64, 32, 4, 3), (None, 64, 64, 32, 4, 3)),
}
MM_TABLE[torch.float16] = MM_TABLE[torch.bfloat16]
# the launch arguments a tile config sets: the only ones in which binaries of one call site may differ
MM_TILE_ARGS = ("BM", "BN", "BK", "num_warps", "num_stages")
# Attention. The keys are visited in tiles of ATTN_KEYS keys at absolute positions 0, ATTN_KEYS, ...,
# each key gathered through the block table, so any page size works (a tile may span several pages,
# or part of one; the sampler's pages are multiples of kernels.KV_BLOCK = 16). The forward's layout (query rows per program, warps,
# stages) is ONE config for prefill and decode: a row's softmax sums are reduced across threads in an
# order the layout decides, so decode may not take another layout than prefill. The backward is not
# batch-invariant (only deterministic): its configs are free.
#            (query rows = queries x GQA heads per program, num_warps, num_stages)
ATTN_KEYS = 64
ATTN_TABLE = {"fwd": (64, 4, 2), "bwd_dq": (64, 4, 2), "bwd_dkv": (64, 4, 2)}
# The forward's keys are also grouped in splits of ATTN_SPLIT tiles (1024 keys) at absolute positions:
# each split runs its own online softmax, and the splits are merged in order. A forward of few
# programs (a decode step of a few long sequences: the tail of a rollout) runs the splits as programs
# of their own and merges them in a second kernel; the same arithmetic in the same order, so the same
# bits as one program walking them (tests/test_triton.py), and the GPU is filled.
ATTN_SPLIT = 16
ATTN_SPLIT_BELOW = 264             # programs (2 per SM of an H200) under which the splits run in parallel
ATTN_SPLIT_SCRATCH = 256 << 20     # bytes of partial results the parallel splits may hold (else one program)
# Wide heads (MLA's absorbed form: 576 dims, split 512 + 64 by head_split) take a layout of their own from
# ATTN_WIDE_DIMS dims on: 64 query rows of 576 dims do not fit one program's registers, and ptxas does not
# finish compiling them (tools/compile_check.py); 16 rows, 8 warps and 16-key tiles compile in seconds
# with nothing spilled. Like the table's, one layout for prefill and decode of a model. Its query rows
# divide the table's, so the packed layout's blocks (kernels.packed_block: the table's rows) still put
# every query at its padded place.
ATTN_WIDE_DIMS = 512
ATTN_WIDE = {"keys": 16, "fwd": (16, 8, 2), "bwd_dq": (16, 8, 2), "bwd_dkv": (16, 8, 2)}
LOG2E = 1.4426950408889634         # softmax in base 2: exp2(x * log2 e) = exp(x), the scale folded in

# One compiled binary per call site, whatever the batch. A CUDA launch specializes integer arguments
# (== 1 becomes a constant, % 16 == 0 an alignment hint) into separate binaries; the row count and the
# strides that follow the batch geometry are therefore do_not_specialize, so decode (T = 1) and
# prefill, one sequence or many, run the same machine code (tools/compile_check.py checks it).
ATTN_GEOMETRY = ["T", "s_qb", "s_pb", "s_pt", "s_bb", "NB"]


# ===================================================================================================
# linear: y = x @ w.T
# ===================================================================================================
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, s_am, s_ak, s_bn, s_bk, s_cm, s_cn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr):
    # Invariance: one program owns one output tile and runs the whole K loop in order (no split-K)
    # into an fp32 accumulator, so a row's sum has one order whatever M, its neighbours, its place
    # in the tile or the tile config (see MM_TABLE) are.
    # Programs run in groups of GROUP_M row tiles per column tile (the L2 reuse of a grouped order);
    # which program computes a tile does not change what it computes.
    GROUP_M: tl.constexpr = 8
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)          # int64: M * N may pass 2**31 (LM head)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + rm[:, None] * s_am + rk[None, :] * s_ak                                # (BM, BK)
    b_ptrs = b_ptr + rn[None, :] * s_bn + rk[:, None] * s_bk                                # (BK, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (k0 + rk[None, :] < K), other=0.0)
        b = tl.load(b_ptrs, mask=(rn[None, :] < N) & (k0 + rk[:, None] < K), other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee")
        a_ptrs += BK * s_ak              # 64-bit pointers: k * s_ak passes 2**31 in the LM head's dW (s = V)
        b_ptrs += BK * s_bk
    tl.store(c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def mm_config(M: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of MM_TABLE for M rows of dtype."""
    table = MM_TABLE.get(dtype, MM_TABLE[torch.float32])
    return next(cfg for largest, *cfg in table if largest is None or M <= largest)


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, config=None) -> torch.Tensor:
    """a (M, K) @ b(N, K).T -> (M, N) in out_dtype; any strides (backward passes transposed views).
    config: a (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) to use instead of MM_TABLE's (tests, sweeps)."""
    M, K = a.shape
    N = b.shape[0]
    c = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    BM, BN, BK, warps, stages = config or mm_config(M, operand_dtype(a, b))
    upcast = UPCAST or a.dtype != b.dtype
    _matmul_kernel[(triton.cdiv(M, BM) * triton.cdiv(N, BN),)](
        a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        BM=BM, BN=BN, BK=BK, UPCAST=upcast, num_warps=warps, num_stages=stages, **LAUNCH)
    return c


class _Linear(torch.autograd.Function):
    # Backward reuses the same kernel on transposed views (other effective tilings; deterministic:
    # no split-K, no atomics). It is correct and run-to-run stable, not batch-invariant.
    @staticmethod
    def forward(ctx, x2, w):
        ctx.save_for_backward(x2, w)
        return _mm(x2, w, x2.dtype)

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        dx = _mm(dy, w.t(), x2.dtype) if ctx.needs_input_grad[0] else None        # (M, N) @ (N, K)
        dw = _mm(dy.t(), x2.t(), w.dtype) if ctx.needs_input_grad[1] else None    # (N, M) @ (M, K)
        return dx, dw


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    lead, K = x.shape[:-1], x.shape[-1]
    y = _Linear.apply(_aligned(x.reshape(-1, K)), _aligned(w))   # (M, N)
    return y.view(*lead, w.shape[0])


# ===================================================================================================
# RMSNorm
# ===================================================================================================
@triton.jit
def _rms_fwd_kernel(x_ptr, w_ptr, y_ptr, r_ptr, N, s_x, s_y, eps, BLOCK: tl.constexpr):
    # Invariance: one program per row, the whole row in one fixed-size block (a function of N only),
    # fp32 math; rows never interact.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * s_x + cols, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    r = tl.sqrt_rn(tl.sum(xf * xf, 0) / N + eps)
    normed = tl.div_rn(xf, r).to(x.dtype).to(tl.float32)         # round to x.dtype, as transformers
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * s_y + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(r_ptr + row, r)


@triton.jit
def _rms_bwd_kernel(dy_ptr, x_ptr, w_ptr, r_ptr, dx_ptr, dwp_ptr, N, s_dy, s_x, s_dx,
                    BLOCK: tl.constexpr):
    # Deterministic: one program per row; the weight gradient is written per row and summed by the
    # caller in a fixed order (no atomics).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * s_x + cols, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    r = tl.load(r_ptr + row)
    n = xf / r
    dy = tl.load(dy_ptr + row * s_dy + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(dwp_ptr + row * N + cols, dy * n.to(x.dtype).to(tl.float32), mask=ok)
    dn = dy * w                                                   # rounding to x.dtype: identity grad
    dx = (dn - n * (tl.sum(dn * n, 0) / N)) / r
    tl.store(dx_ptr + row * s_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=ok)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, eps):
        M, N = x2.shape
        y = torch.empty(M, N, dtype=torch.promote_types(x2.dtype, w.dtype), device=x2.device)
        r = torch.empty(M, dtype=torch.float32, device=x2.device)
        if M:
            _rms_fwd_kernel[(M,)](x2, w, y, r, N, x2.stride(0), y.stride(0), eps,
                                  BLOCK=triton.next_power_of_2(N), **LAUNCH)
        ctx.save_for_backward(x2, w, r)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, w, r = ctx.saved_tensors
        M, N = x2.shape
        dy = dy.contiguous()
        dx = torch.empty_like(x2)
        dwp = torch.empty(M, N, dtype=torch.float32, device=x2.device)      # per-row dw
        if M:
            _rms_bwd_kernel[(M,)](dy, x2, w, r, dx, dwp, N, dy.stride(0), x2.stride(0), dx.stride(0),
                                  BLOCK=triton.next_power_of_2(N), **LAUNCH)
        return dx, dwp.sum(0).to(w.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    N = x.shape[-1]
    x2 = x.reshape(-1, N)                                          # (M, N)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    return _RMSNorm.apply(_aligned(x2), _aligned(weight.contiguous()), eps).view(*x.shape[:-1], N)


# ===================================================================================================
# attention over a paged KV cache
# ===================================================================================================
# Program layout, shared by the three kernels: axis 0 is (sequence b, KV head kvh) (axis 0 has no
# 65535 limit), axis 1 the query block (or, in dK/dV, the KV tile); a program holds BT queries x GP
# query heads of that KV head packed into BT * GP rows (row r: query t = first + r // GP, head
# kvh * G + r % GP; GP = G rounded up to a power of two, extra rows masked). Decode packs the G heads
# of a KV head into one program the same way (T = 1).
# A head whose dims are not a power of two is two parts, each a power of two: BD dims and a tail of BR
# (head_split; MLA's absorbed 576 = 512 + 64), each dot product the sum of the two parts' dots,
# instead of one part padded to the next power of two (1024).
@triton.jit
def _attn_rows(blk, b, kvh, T, G, q_ptr, s_qb, s_qt, s_qh, s_qd, pos_ptr, s_pb, s_pt,
               BT: tl.constexpr, GP: tl.constexpr, BD: tl.constexpr, D):
    r = tl.arange(0, BT * GP)
    t = blk * BT + r // GP
    g = r % GP
    ok = (t < T) & (g < G)
    d = tl.arange(0, BD)
    h = kvh * G + g
    q_off = b * s_qb + t[:, None] * s_qt + h[:, None] * s_qh + d[None, :] * s_qd
    mask = ok[:, None] & (d[None, :] < D)
    pos = tl.load(pos_ptr + b * s_pb + t * s_pt, mask=ok, other=0)
    return t, h, ok, d, q_off, mask, pos


@triton.jit
def _attn_tail(b, t, h, ok, s_qb, s_qt, s_qh, s_qd, D, BD: tl.constexpr, BR: tl.constexpr):
    # the tail of the rows' heads, dims [BD, BD + BR): its dims, offsets in q's layout and mask
    d2 = BD + tl.arange(0, BR)
    off = b * s_qb + t[:, None] * s_qt + h[:, None] * s_qh + d2[None, :] * s_qd
    return d2, off, ok[:, None] & (d2[None, :] < D)


@triton.jit
def _kv_tile(j, b, kvh, bt_ptr, s_bb, s_bn, NB, k_ptr, v_ptr, s_kp, s_ks, s_kh, s_kd, PAGE, d, D,
             KB: tl.constexpr, UPCAST: tl.constexpr, SAME: tl.constexpr):
    # keys [j*KB, (j+1)*KB) of sequence b, each found through the block table: a tile may span
    # several pages or part of one (the tile boundaries are absolute positions either way)
    # (keys past the block table's NB pages read page 0: masked for every row, like any key past
    # the sequence's end)
    key = j * KB + tl.arange(0, KB)
    page = tl.load(bt_ptr + b * s_bb + (key // PAGE) * s_bn, mask=key // PAGE < NB, other=0).to(tl.int64)
    off = page[:, None] * s_kp + (key % PAGE)[:, None] * s_ks + kvh * s_kh + d[None, :] * s_kd
    k = tl.load(k_ptr + off, mask=d[None, :] < D, other=0.0)                         # (KB, BD)
    v = k                                           # SAME: the values are the keys (MLA's latent)
    if not SAME:
        v = tl.load(v_ptr + off, mask=d[None, :] < D, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v


@triton.jit
def _kv_tiles(j, b, kvh, bt_ptr, s_bb, s_bn, NB, k_ptr, v_ptr, s_kp, s_ks, s_kh, s_kd, PAGE, d, D,
              KB: tl.constexpr, UPCAST: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, SAME: tl.constexpr):
    # key tile j's keys and values (KB, BD) and their tails (KB, BR): with BR = 0 the tails are k, v
    k, v = _kv_tile(j, b, kvh, bt_ptr, s_bb, s_bn, NB, k_ptr, v_ptr, s_kp, s_ks, s_kh, s_kd, PAGE, d, D, KB, UPCAST,
                    SAME)
    k2, v2 = k, v
    if BR:
        k2, v2 = _kv_tile(j, b, kvh, bt_ptr, s_bb, s_bn, NB, k_ptr, v_ptr, s_kp, s_ks, s_kh, s_kd, PAGE,
                          BD + tl.arange(0, BR), D, KB, UPCAST, SAME)
    return k, v, k2, v2


@triton.jit
def _visible(kpos, pos, WIN, WINDOW: tl.constexpr):
    # (R, KB): key at kpos visible to the query at pos: causal, and inside a sliding window of WIN keys
    seen = kpos[None, :] <= pos[:, None]
    if WINDOW:
        seen = seen & (kpos[None, :] > pos[:, None] - WIN)
    return seen


@triton.jit
def _attn_span(pos, ok, WIN, KB: tl.constexpr, WINDOW: tl.constexpr):
    # a program's key tiles: it walks [j_lo, n_tiles), and tiles below n_full need no mask (every row
    # sees them whole). A window masks every tile, and tiles below j_lo are masked for every row (the
    # window of its smallest position starts past them): skipped, which is exact (see _attn_fwd_step).
    lo = tl.min(tl.where(ok, pos, 2**30), 0)
    n_tiles = tl.max(pos, 0) // KB + 1
    n_full = (lo + 1) // KB
    j_lo = lo * 0
    if WINDOW:
        n_full = lo * 0
        j_lo = tl.maximum(lo - WIN + 1, 0) // KB
    return n_full, n_tiles, j_lo


@triton.jit
def _attn_start(sink_ptr, h, ok, R: tl.constexpr, SINKS: tl.constexpr):
    # the online softmax before the first key: empty (m = -inf, l = 0), or the head's sink logit as its
    # first term (m = sink in base 2, l = exp2(0) = 1; the sink adds nothing to acc)
    if SINKS:
        m = tl.load(sink_ptr + h, mask=ok, other=0.0)
        l = tl.full((R,), 1.0, tl.float32)
    else:
        m = tl.full((R,), float("-inf"), tl.float32)
        l = tl.zeros((R,), tl.float32)
    return m, l


@triton.jit
def _attn_fwd_step(acc, acc2, m, l, q, q2, k, k2, v, v2, j, pos, qk_scale, WIN, MASK: tl.constexpr,
                   KB: tl.constexpr, WINDOW: tl.constexpr, BR: tl.constexpr):
    # one key tile of the online softmax, base 2: s2 = q.k * scale * log2(e); MASK on the tiles that
    # hold a row's causal edge (or its window's). A masked key gets -inf, and a whole tile of them is an
    # exact no-op for the row (m unchanged, alpha = exp2(0) = 1, p = 0; from the empty state m_ref = 0,
    # so l and acc stay exactly 0); unmasked and masked tiles give a visible key the same value, so
    # where the split falls, or where a program starts, cannot change a row's bits. With a tail (BR),
    # q2, k2, v2 and acc2 are the heads' dims past BD (else stand-ins, unused).
    s = tl.dot(q, tl.trans(k), input_precision="ieee")                                # (R, KB)
    if BR:
        s += tl.dot(q2, tl.trans(k2), input_precision="ieee")
    s = s * qk_scale
    if MASK:
        s = tl.where(_visible(j * KB + tl.arange(0, KB), pos, WIN, WINDOW), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)       # a row with no key yet in its split: p = 0
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    if BR:
        acc2 = acc2 * alpha[:, None] + tl.dot(p.to(v2.dtype), v2, input_precision="ieee")
    return acc, acc2, m_new, l


@triton.jit
def _attn_split(q, q2, pos, sp, n_full, n_tiles, j_lo, b, kvh, bt_ptr, s_bb, s_bn, NB, k_ptr, v_ptr, s_kp, s_ks,
                s_kh, s_kd, PAGE, d, D, qk_scale, WIN, R: tl.constexpr, BD: tl.constexpr, KB: tl.constexpr,
                SPLIT: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr, BR: tl.constexpr,
                SAME: tl.constexpr):
    # split sp: a fresh online softmax over key tiles [sp * SPLIT, (sp + 1) * SPLIT) in [j_lo, n_tiles),
    # without masks below n_full -> its (acc, acc2, m, l)
    m = tl.full((R,), float("-inf"), tl.float32)
    l = tl.zeros((R,), tl.float32)
    acc = tl.zeros((R, BD), tl.float32)
    acc2 = acc
    if BR:
        acc2 = tl.zeros((R, BR), tl.float32)
    j0 = tl.maximum(sp * SPLIT, j_lo)
    j1 = tl.minimum(sp * SPLIT + SPLIT, n_tiles)
    for j in range(j0, tl.minimum(j1, n_full)):
        k, v, k2, v2 = _kv_tiles(j, b, kvh, bt_ptr, s_bb, s_bn, NB, k_ptr, v_ptr, s_kp, s_ks, s_kh, s_kd, PAGE, d, D,
                                 KB, UPCAST, BD, BR, SAME)
        acc, acc2, m, l = _attn_fwd_step(acc, acc2, m, l, q, q2, k, k2, v, v2, j, pos, qk_scale, WIN, False, KB,
                                         WINDOW, BR)
    for j in range(tl.maximum(j0, n_full), j1):
        k, v, k2, v2 = _kv_tiles(j, b, kvh, bt_ptr, s_bb, s_bn, NB, k_ptr, v_ptr, s_kp, s_ks, s_kh, s_kd, PAGE, d, D,
                                 KB, UPCAST, BD, BR, SAME)
        acc, acc2, m, l = _attn_fwd_step(acc, acc2, m, l, q, q2, k, k2, v, v2, j, pos, qk_scale, WIN, True, KB,
                                         WINDOW, BR)
    return acc, acc2, m, l


@triton.jit
def _attn_merge(acc, acc2, m, l, acc_s, acc2_s, m_s, l_s, BR: tl.constexpr):
    # the running softmax state and a split's, at the larger max; from the empty state (m = -inf) this
    # returns the split's exactly, and an empty split (m_s = -inf) leaves the state exactly as it was
    m_new = tl.maximum(m, m_s)
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    a, c = tl.exp2(m - m_ref), tl.exp2(m_s - m_ref)
    if BR:
        acc2 = acc2 * a[:, None] + acc2_s * c[:, None]
    return acc * a[:, None] + acc_s * c[:, None], acc2, m_new, l * a + l_s * c


@triton.jit(do_not_specialize=ATTN_GEOMETRY + ["s_ob", "WIN"])
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, o_ptr, lse_ptr, sink_ptr,
                     s_qb, s_qt, s_qh, s_qd, s_kp, s_ks, s_kh, s_kd, s_bb, s_bn, s_pb, s_pt,
                     s_ob, s_ot, s_oh, s_od, T, H, KVH, G, D, PAGE, NB, qk_scale, WIN,
                     BT: tl.constexpr, GP: tl.constexpr, BD: tl.constexpr, KB: tl.constexpr,
                     SPLIT: tl.constexpr, UPCAST: tl.constexpr, SINKS: tl.constexpr, WINDOW: tl.constexpr,
                     BR: tl.constexpr, SAME: tl.constexpr):
    # Invariance: key tiles at absolute positions 0, KB, 2KB, ... visited upward with an fp32 online
    # softmax per split of SPLIT tiles, the splits merged in order into the running state (which starts
    # at the sink, SINKS), in one fixed layout (attn_layout("fwd", D)). The loop bounds (this program's
    # largest position; under a WINDOW, the first tile its smallest position's window reaches) and the
    # masked/unmasked boundary cannot change a row's bits (see _attn_fwd_step and _attn_merge): decode
    # (T = 1) equals prefill, and the batch and page layout do not matter.
    pid_bh = tl.program_id(0)
    blk = tl.num_programs(1) - 1 - tl.program_id(1)             # the longest causal rows start first
    b, kvh = (pid_bh // KVH).to(tl.int64), pid_bh % KVH          # int64: B * T * H * D may pass 2**31
    t, h, ok, d, q_off, mask, pos = _attn_rows(blk, b, kvh, T, G, q_ptr, s_qb, s_qt, s_qh, s_qd,
                                               pos_ptr, s_pb, s_pt, BT, GP, BD, D)
    q = tl.load(q_ptr + q_off, mask=mask, other=0.0)                                  # (R, BD)
    q2 = _attn_q_tail(q, q_ptr, b, t, h, ok, s_qb, s_qt, s_qh, s_qd, D, BD, BR, UPCAST)  # (R, BR)
    if UPCAST:
        q = q.to(tl.float32)
    m, l = _attn_start(sink_ptr, h, ok, BT * GP, SINKS)
    acc = tl.zeros((BT * GP, BD), tl.float32)
    acc2 = acc
    if BR:
        acc2 = tl.zeros((BT * GP, BR), tl.float32)
    n_full, n_tiles, j_lo = _attn_span(pos, ok, WIN, KB, WINDOW)
    for sp in range(j_lo // SPLIT, tl.cdiv(n_tiles, SPLIT)):
        acc_s, acc2_s, m_s, l_s = _attn_split(q, q2, pos, sp, n_full, n_tiles, j_lo, b, kvh, bt_ptr, s_bb, s_bn, NB,
                                              k_ptr, v_ptr, s_kp, s_ks, s_kh, s_kd, PAGE, d, D, qk_scale, WIN,
                                              BT * GP, BD, KB, SPLIT, UPCAST, WINDOW, BR, SAME)
        acc, acc2, m, l = _attn_merge(acc, acc2, m, l, acc_s, acc2_s, m_s, l_s, BR)
    _attn_store(acc, acc2, m, l, o_ptr, lse_ptr, b, t, h, d, s_ob, s_ot, s_oh, s_od, T, H, D, ok, mask, BD, BR)


@triton.jit
def _attn_q_tail(q, q_ptr, b, t, h, ok, s_qb, s_qt, s_qh, s_qd, D, BD: tl.constexpr, BR: tl.constexpr,
                 UPCAST: tl.constexpr):
    # the tail of the rows' q (or dO: the same layout), (R, BR); without one, q stands in
    q2 = q
    if BR:
        _, off2, mask2 = _attn_tail(b, t, h, ok, s_qb, s_qt, s_qh, s_qd, D, BD, BR)
        q2 = tl.load(q_ptr + off2, mask=mask2, other=0.0)
        if UPCAST:
            q2 = q2.to(tl.float32)
    return q2


@triton.jit
def _attn_store(acc, acc2, m, l, o_ptr, lse_ptr, b, t, h, d, s_ob, s_ot, s_oh, s_od, T, H, D, ok, mask,
                BD: tl.constexpr, BR: tl.constexpr):
    out = acc / l[:, None]
    o_off = b * s_ob + t[:, None] * s_ot + h[:, None] * s_oh + d[None, :] * s_od
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=mask)
    if BR:
        _, off2, mask2 = _attn_tail(b, t, h, ok, s_ob, s_ot, s_oh, s_od, D, BD, BR)
        tl.store(o_ptr + off2, (acc2 / l[:, None]).to(o_ptr.dtype.element_ty), mask=mask2)
    tl.store(lse_ptr + (b * T + t) * H + h, m + tl.log2(l), mask=ok)          # base 2


@triton.jit(do_not_specialize=ATTN_GEOMETRY + ["RS", "WIN"])
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, acc_ptr, ml_ptr,
                       s_qb, s_qt, s_qh, s_qd, s_kp, s_ks, s_kh, s_kd, s_bb, s_bn, s_pb, s_pt,
                       T, H, KVH, G, D, PAGE, NB, qk_scale, WIN, RS,
                       BT: tl.constexpr, GP: tl.constexpr, BD: tl.constexpr, KB: tl.constexpr,
                       SPLIT: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr, BR: tl.constexpr,
                       SAME: tl.constexpr):
    # program (sequence x KV head, query block, split): _attn_fwd_kernel's split sp, on its own; its
    # (acc, m, l) go to scratch for _attn_merge_kernel, the first RS rows of the block (min(T, BT)
    # queries x GP heads: a decode step's block has one query). A split past the block's keys, or
    # wholly below its window, stores nothing (the merge skips it too).
    pid_bh, blk, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kvh = (pid_bh // KVH).to(tl.int64), pid_bh % KVH
    t, h, ok, d, q_off, mask, pos = _attn_rows(blk, b, kvh, T, G, q_ptr, s_qb, s_qt, s_qh, s_qd,
                                               pos_ptr, s_pb, s_pt, BT, GP, BD, D)
    n_full, n_tiles, j_lo = _attn_span(pos, ok, WIN, KB, WINDOW)
    if sp * SPLIT >= n_tiles or sp < j_lo // SPLIT:
        return
    q = tl.load(q_ptr + q_off, mask=mask, other=0.0)
    q2 = _attn_q_tail(q, q_ptr, b, t, h, ok, s_qb, s_qt, s_qh, s_qd, D, BD, BR, UPCAST)
    if UPCAST:
        q = q.to(tl.float32)
    acc, acc2, m, l = _attn_split(q, q2, pos, sp, n_full, n_tiles, j_lo, b, kvh, bt_ptr, s_bb, s_bn, NB, k_ptr,
                                  v_ptr, s_kp, s_ks, s_kh, s_kd, PAGE, d, D, qk_scale, WIN, BT * GP, BD, KB, SPLIT,
                                  UPCAST, WINDOW, BR, SAME)
    part = ((pid_bh * tl.num_programs(1) + blk) * tl.num_programs(2) + sp).to(tl.int64)
    r = tl.arange(0, BT * GP)
    row = (part * RS + r[:, None]) * (BD + BR)                  # scratch rows of BD + BR: the head, its tail
    tl.store(acc_ptr + row + d[None, :], acc, mask=r[:, None] < RS)
    if BR:
        tl.store(acc_ptr + row + BD + tl.arange(0, BR)[None, :], acc2, mask=r[:, None] < RS)
    tl.store(ml_ptr + (part * 2) * RS + r, m, mask=r < RS)
    tl.store(ml_ptr + (part * 2 + 1) * RS + r, l, mask=r < RS)


@triton.jit(do_not_specialize=["T", "s_pb", "s_pt", "s_ob", "NS", "RS", "WIN"])
def _attn_merge_kernel(acc_ptr, ml_ptr, pos_ptr, o_ptr, lse_ptr, sink_ptr, s_pb, s_pt, s_ob, s_ot, s_oh, s_od,
                       T, H, KVH, G, D, NS, RS, WIN, BT: tl.constexpr, GP: tl.constexpr, BD: tl.constexpr,
                       KB: tl.constexpr, SPLIT: tl.constexpr, SINKS: tl.constexpr, WINDOW: tl.constexpr,
                       BR: tl.constexpr):
    # program (sequence x KV head, query block): the splits _attn_split_kernel wrote, merged in order
    # from the start state exactly as _attn_fwd_kernel merges them (the same splits: those from the
    # block's first to its last key tile), then the same output and log-sum-exp
    pid_bh, blk = tl.program_id(0), tl.program_id(1)
    b, kvh = (pid_bh // KVH).to(tl.int64), pid_bh % KVH
    t, h, ok, d, _, mask, pos = _attn_rows(blk, b, kvh, T, G, o_ptr, s_ob, s_ot, s_oh, s_od,
                                           pos_ptr, s_pb, s_pt, BT, GP, BD, D)
    r = tl.arange(0, BT * GP)
    m, l = _attn_start(sink_ptr, h, ok, BT * GP, SINKS)
    acc = tl.zeros((BT * GP, BD), tl.float32)
    acc2 = acc
    if BR:
        acc2 = tl.zeros((BT * GP, BR), tl.float32)
    _, n_tiles, j_lo = _attn_span(pos, ok, WIN, KB, WINDOW)
    for sp in range(j_lo // SPLIT, tl.cdiv(n_tiles, SPLIT)):
        part = ((pid_bh * tl.num_programs(1) + blk) * NS + sp).to(tl.int64)
        row = (part * RS + r[:, None]) * (BD + BR)
        acc_s = tl.load(acc_ptr + row + d[None, :], mask=r[:, None] < RS, other=0.0)
        acc2_s = acc_s
        if BR:
            acc2_s = tl.load(acc_ptr + row + BD + tl.arange(0, BR)[None, :], mask=r[:, None] < RS, other=0.0)
        m_s = tl.load(ml_ptr + (part * 2) * RS + r, mask=r < RS, other=0.0)      # rows past RS (never
        l_s = tl.load(ml_ptr + (part * 2 + 1) * RS + r, mask=r < RS, other=1.0)  # stored) stay finite
        acc, acc2, m, l = _attn_merge(acc, acc2, m, l, acc_s, acc2_s, m_s, l_s, BR)
    _attn_store(acc, acc2, m, l, o_ptr, lse_ptr, b, t, h, d, s_ob, s_ot, s_oh, s_od, T, H, D, ok, mask, BD, BR)


@triton.jit
def _attn_bwd_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, q_off, mask, ok, b, t, h, T, H, UPCAST: tl.constexpr):
    # a query block's inputs to the backward: q, dO (R, BD), the base-2 log-sum-exp and delta (R,)
    q = tl.load(q_ptr + q_off, mask=mask, other=0.0)
    do = tl.load(do_ptr + q_off, mask=mask, other=0.0)
    if UPCAST:
        q, do = q.to(tl.float32), do.to(tl.float32)
    lse2 = tl.load(lse_ptr + (b * T + t) * H + h, mask=ok, other=0.0)
    delta = tl.load(delta_ptr + (b * T + t) * H + h, mask=ok, other=0.0)
    return q, do, lse2, delta


@triton.jit
def _attn_bwd_p_ds(q, q2, do, do2, k, k2, v, v2, lse2, delta, kpos, pos, ok, qk_scale, WIN, MASK: tl.constexpr,
                   WINDOW: tl.constexpr, BR: tl.constexpr):
    # the backward's recomputed probabilities p (R, KB) and ds = p * (dO.v - delta); the log-sum-exp
    # holds the sink's term, so p is the forward's. Each dot adds its tail's (BR).
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    dov = tl.dot(do, tl.trans(v), input_precision="ieee")
    if BR:
        s += tl.dot(q2, tl.trans(k2), input_precision="ieee")
        dov += tl.dot(do2, tl.trans(v2), input_precision="ieee")
    p = tl.exp2(s * qk_scale - lse2[:, None])
    if MASK:
        p = tl.where(_visible(kpos, pos, WIN, WINDOW) & ok[:, None], p, 0.0)
    ds = p * (dov - delta[:, None])
    return p, ds


@triton.jit
def _attn_bwd_dq_step(dq, dq2, q, q2, do, do2, lse2, delta, j, b, kvh, bt_ptr, s_bb, s_bn, NB, k_ptr, v_ptr, s_kp,
                      s_ks, s_kh, s_kd, PAGE, d, D, pos, ok, qk_scale, WIN, MASK: tl.constexpr, KB: tl.constexpr,
                      UPCAST: tl.constexpr, WINDOW: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                      SAME: tl.constexpr):
    # key tile j's share of dq (and of its tail)
    k, v, k2, v2 = _kv_tiles(j, b, kvh, bt_ptr, s_bb, s_bn, NB, k_ptr, v_ptr, s_kp, s_ks, s_kh, s_kd, PAGE, d, D, KB,
                             UPCAST, BD, BR, SAME)
    p, ds = _attn_bwd_p_ds(q, q2, do, do2, k, k2, v, v2, lse2, delta, j * KB + tl.arange(0, KB), pos, ok, qk_scale,
                           WIN, MASK, WINDOW, BR)
    dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
    if BR:
        dq2 += tl.dot(ds.to(k2.dtype), k2, input_precision="ieee")
    return dq, dq2


@triton.jit(do_not_specialize=ATTN_GEOMETRY + ["WIN"])
def _attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                        s_qb, s_qt, s_qh, s_qd, s_kp, s_ks, s_kh, s_kd, s_bb, s_bn, s_pb, s_pt,
                        T, H, KVH, G, D, PAGE, NB, qk_scale, scale, WIN,
                        BT: tl.constexpr, GP: tl.constexpr, BD: tl.constexpr, KB: tl.constexpr,
                        UPCAST: tl.constexpr, WINDOW: tl.constexpr, BR: tl.constexpr, SAME: tl.constexpr):
    # Deterministic: one program per query block recomputes p from the saved log-sum-exp and
    # accumulates dq over the key tiles in order. q, do, dq share q's (B, T, H, D) strides (the
    # caller makes them contiguous). Dots take operands in the input dtype (p, ds rounded to it, as
    # flash-attention does) and accumulate in fp32.
    pid_bh = tl.program_id(0)
    blk = tl.num_programs(1) - 1 - tl.program_id(1)
    b, kvh = (pid_bh // KVH).to(tl.int64), pid_bh % KVH
    t, h, ok, d, q_off, mask, pos = _attn_rows(blk, b, kvh, T, G, q_ptr, s_qb, s_qt, s_qh, s_qd,
                                               pos_ptr, s_pb, s_pt, BT, GP, BD, D)
    q, do, lse2, delta = _attn_bwd_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, q_off, mask, ok, b, t, h, T, H, UPCAST)
    q2 = _attn_q_tail(q, q_ptr, b, t, h, ok, s_qb, s_qt, s_qh, s_qd, D, BD, BR, UPCAST)
    do2 = _attn_q_tail(do, do_ptr, b, t, h, ok, s_qb, s_qt, s_qh, s_qd, D, BD, BR, UPCAST)
    dq = tl.zeros((BT * GP, BD), tl.float32)
    dq2 = dq
    if BR:
        dq2 = tl.zeros((BT * GP, BR), tl.float32)
    n_full, n_tiles, j_lo = _attn_span(pos, ok, WIN, KB, WINDOW)
    for j in range(j_lo, n_full):
        dq, dq2 = _attn_bwd_dq_step(dq, dq2, q, q2, do, do2, lse2, delta, j, b, kvh, bt_ptr, s_bb, s_bn, NB, k_ptr,
                                    v_ptr, s_kp, s_ks, s_kh, s_kd, PAGE, d, D, pos, ok, qk_scale, WIN, False, KB,
                                    UPCAST, WINDOW, BD, BR, SAME)
    for j in range(tl.maximum(j_lo, n_full), n_tiles):
        dq, dq2 = _attn_bwd_dq_step(dq, dq2, q, q2, do, do2, lse2, delta, j, b, kvh, bt_ptr, s_bb, s_bn, NB, k_ptr,
                                    v_ptr, s_kp, s_ks, s_kh, s_kd, PAGE, d, D, pos, ok, qk_scale, WIN, True, KB,
                                    UPCAST, WINDOW, BD, BR, SAME)
    tl.store(dq_ptr + q_off, (dq * scale).to(dq_ptr.dtype.element_ty), mask=mask)
    if BR:
        _, off2, mask2 = _attn_tail(b, t, h, ok, s_qb, s_qt, s_qh, s_qd, D, BD, BR)
        tl.store(dq_ptr + off2, (dq2 * scale).to(dq_ptr.dtype.element_ty), mask=mask2)


@triton.jit(do_not_specialize=ATTN_GEOMETRY + ["WIN"])
def _attn_bwd_dkv_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                         s_qb, s_qt, s_qh, s_qd, s_kp, s_ks, s_kh, s_kd, s_bb, s_bn, s_pb, s_pt,
                         T, H, KVH, G, D, PAGE, NB, NKEYS, qk_scale, scale, WIN,
                         BT: tl.constexpr, GP: tl.constexpr, BD: tl.constexpr, KB: tl.constexpr,
                         UPCAST: tl.constexpr, WINDOW: tl.constexpr, BR: tl.constexpr, SAME: tl.constexpr):
    # Deterministic, atomic-free: one program per (key tile, sequence, KV head) owns its dk/dv tile
    # and loops over the query blocks in index order, skipping the blocks that see none of its keys
    # (causal, and under a WINDOW the blocks whose smallest position's window starts past the tile).
    # Output: per-sequence (B, NKEYS, KVH, D) fp32.
    pid_bh, j = tl.program_id(0), tl.program_id(1)               # key tile 0 has the most work: first
    b, kvh = (pid_bh // KVH).to(tl.int64), pid_bh % KVH
    d = tl.arange(0, BD)
    k, v, k2, v2 = _kv_tiles(j, b, kvh, bt_ptr, s_bb, s_bn, NB, k_ptr, v_ptr, s_kp, s_ks, s_kh, s_kd, PAGE, d, D, KB,
                             UPCAST, BD, BR, SAME)
    kpos = j * KB + tl.arange(0, KB)
    dk = tl.zeros((KB, BD), tl.float32)
    dv = tl.zeros((KB, BD), tl.float32)
    dk2, dv2 = dk, dv
    if BR:
        dk2 = tl.zeros((KB, BR), tl.float32)
        dv2 = tl.zeros((KB, BR), tl.float32)
    for i in range(0, tl.cdiv(T, BT)):
        t, h, ok, d, q_off, mask, pos = _attn_rows(i, b, kvh, T, G, q_ptr, s_qb, s_qt, s_qh, s_qd,
                                                   pos_ptr, s_pb, s_pt, BT, GP, BD, D)
        sees = tl.max(tl.where(ok, pos, -1), 0) >= j * KB
        if WINDOW:
            sees = sees & (tl.min(tl.where(ok, pos, 2**30), 0) - WIN < (j + 1) * KB - 1)
        if sees:                                                 # else this block adds exact zeros
            q, do, lse2, delta = _attn_bwd_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, q_off, mask, ok, b, t, h, T, H,
                                                UPCAST)
            q2 = _attn_q_tail(q, q_ptr, b, t, h, ok, s_qb, s_qt, s_qh, s_qd, D, BD, BR, UPCAST)
            do2 = _attn_q_tail(do, do_ptr, b, t, h, ok, s_qb, s_qt, s_qh, s_qd, D, BD, BR, UPCAST)
            p, ds = _attn_bwd_p_ds(q, q2, do, do2, k, k2, v, v2, lse2, delta, kpos, pos, ok, qk_scale, WIN, True,
                                   WINDOW, BR)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision="ieee")             # (KB, BD)
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee")
            if BR:
                dv2 += tl.dot(tl.trans(p).to(do2.dtype), do2, input_precision="ieee")      # (KB, BR)
                dk2 += tl.dot(tl.trans(ds).to(q2.dtype), q2, input_precision="ieee")
    row = ((b * NKEYS + kpos[:, None]) * KVH + kvh) * D
    tl.store(dk_ptr + row + d[None, :], dk * scale, mask=d[None, :] < D)
    tl.store(dv_ptr + row + d[None, :], dv, mask=d[None, :] < D)
    if BR:
        d2 = BD + tl.arange(0, BR)
        tl.store(dk_ptr + row + d2[None, :], dk2 * scale, mask=d2[None, :] < D)
        tl.store(dv_ptr + row + d2[None, :], dv2, mask=d2[None, :] < D)


def head_split(D: int) -> tuple[int, int]:
    """Head dims D -> (BD, BR): the kernels' power-of-two part and tail (0: none). A D that is not a power
    of two is split when that pads less than rounding D up does and both parts are at least 16 wide (a
    dot's least): MLA's absorbed 576 -> (512, 64) instead of 1024."""
    BD = triton.next_power_of_2(D)
    lo = BD // 2
    BR = max(16, triton.next_power_of_2(D - lo))
    return (lo, BR) if D < BD and lo >= 16 and lo + BR < BD else (BD, 0)


def attn_layout(kernel: str, D: int) -> tuple[int, int, int, int]:
    """(query rows per program, warps, stages, keys per tile) of an attention kernel ("fwd", "bwd_dq",
    "bwd_dkv") for heads of D dims: ATTN_TABLE's and ATTN_KEYS, or from ATTN_WIDE_DIMS on ATTN_WIDE's. It
    depends on the model alone, never on the batch: prefill and decode of a model share one layout."""
    if D >= ATTN_WIDE_DIMS:
        return (*ATTN_WIDE[kernel], ATTN_WIDE["keys"])
    return (*ATTN_TABLE[kernel], ATTN_KEYS)


def _attn_meta(q, k_cache, rows):
    B, T, H, D = q.shape
    PAGE, KVH = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    GP = triton.next_power_of_2(G)
    BT = max(1, rows // GP)
    return B, T, H, D, PAGE, KVH, G, GP, BT, *head_split(D)


def _strides(*ts):
    return [s for t in ts for s in t.stride()]


class _PagedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_cache, v_cache, block_table, positions, scale, sinks, window):
        rows, warps, stages, keys = attn_layout("fwd", q.shape[-1])
        B, T, H, D, PAGE, KVH, G, GP, BT, BD, BR = _attn_meta(q, k_cache, rows)
        assert k_cache.stride() == v_cache.stride()
        same = k_cache.data_ptr() == v_cache.data_ptr()                    # MLA: the values are the keys
        out = torch.empty_like(q)
        lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)     # base 2, the sink's term included
        sink2 = lse if sinks is None else (sinks.float() * LOG2E).contiguous()   # the sink logits in base 2
        grid = (B * KVH, triton.cdiv(T, BT))
        NB = block_table.shape[1]
        NS = triton.cdiv(triton.cdiv(NB * PAGE, keys), ATTN_SPLIT)           # splits the table can hold
        geometry = (T, H, KVH, G, D, PAGE, NB, scale * LOG2E, window or 1 << 30)
        opts = dict(BT=BT, GP=GP, BD=BD, BR=BR, KB=keys, SPLIT=ATTN_SPLIT, WINDOW=bool(window), **LAUNCH)
        parts, RS = grid[0] * grid[1] * NS, min(T, BT) * GP     # RS: rows a block stores per split
        # few programs and scratch to spare: the splits in parallel
        if NS > 1 and grid[0] * grid[1] < ATTN_SPLIT_BELOW and parts * RS * (BD + BR + 2) * 4 <= ATTN_SPLIT_SCRATCH:
            acc = torch.empty(parts, RS, BD + BR, dtype=torch.float32, device=q.device)
            ml = torch.empty(parts, 2, RS, dtype=torch.float32, device=q.device)
            _attn_split_kernel[(*grid, NS)](
                q, k_cache, v_cache, block_table, positions, acc, ml, *_strides(q, k_cache, block_table, positions),
                *geometry, RS, UPCAST=UPCAST, SAME=same, num_warps=warps, num_stages=stages, **opts)
            _attn_merge_kernel[grid](acc, ml, positions, out, lse, sink2, *_strides(positions, out), T, H, KVH, G, D,
                                     NS, RS, geometry[-1], SINKS=sinks is not None, num_warps=warps, **opts)
        else:
            _attn_fwd_kernel[grid](
                q, k_cache, v_cache, block_table, positions, out, lse, sink2,
                *_strides(q, k_cache, block_table, positions, out), *geometry, UPCAST=UPCAST, SINKS=sinks is not None,
                SAME=same, num_warps=warps, num_stages=stages, **opts)
        ctx.save_for_backward(q, k_cache, v_cache, block_table, positions, out, lse, sink2)
        ctx.scale, ctx.window, ctx.sinks, ctx.same = scale, window, sinks is not None, same
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_cache, v_cache, block_table, positions, out, lse, sink2 = ctx.saved_tensors
        B, T, H, D, PAGE, KVH, G, GP, _, BD, BR = _attn_meta(q, k_cache, 1)
        q, dout = q.contiguous(), dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1).contiguous()        # (B, T, H)
        common = (*_strides(q, k_cache, block_table, positions), T, H, KVH, G, D, PAGE, block_table.shape[1])
        scales = (ctx.scale * LOG2E, ctx.scale, ctx.window or 1 << 30)
        opts = dict(WINDOW=bool(ctx.window), BD=BD, BR=BR, GP=GP, UPCAST=UPCAST, SAME=ctx.same)
        dq = torch.empty_like(q)
        rows, warps, stages, keys = attn_layout("bwd_dq", D)
        BT = max(1, rows // GP)
        _attn_bwd_dq_kernel[(B * KVH, triton.cdiv(T, BT))](
            q, k_cache, v_cache, block_table, positions, dout, lse, delta, dq, *common, *scales,
            BT=BT, KB=keys, num_warps=warps, num_stages=stages, **opts, **LAUNCH)
        # dK, dV per sequence over every key tile the block table spans (its width, not the largest
        # position: no host sync; a tile no query sees gets zeros), then summed into the pages
        NB = block_table.shape[1]
        rows, warps, stages, keys = attn_layout("bwd_dkv", D)
        nkeys = triton.cdiv(NB * PAGE, keys) * keys
        dk_seq = torch.empty(B, nkeys, KVH, D, dtype=torch.float32, device=q.device)
        dv_seq = torch.empty_like(dk_seq)
        BT = max(1, rows // GP)
        _attn_bwd_dkv_kernel[(B * KVH, nkeys // keys)](
            q, k_cache, v_cache, block_table, positions, dout, lse, delta, dk_seq, dv_seq, *common, nkeys,
            *scales, BT=BT, KB=keys, num_warps=warps, num_stages=stages, **opts, **LAUNCH)
        # a sink's gradient: d out / d sink = -p_sink * out, so -sum over queries of p_sink * (dO . out),
        # p_sink = exp2(sink2 - lse2) (deterministic torch ops)
        dsinks = -(torch.exp2(sink2 - lse) * delta).sum((0, 1)) if ctx.sinks else None
        return (dq, *_pages_grad(dk_seq, dv_seq, k_cache, block_table), None, None, None, dsinks, None)


@triton.jit
def _pages_grad_kernel(dk_seq_ptr, dv_seq_ptr, entry_ptr, first_ptr, dk_ptr, dv_ptr, NB, s_seq, PAGE_ELEMS,
                       BLOCK: tl.constexpr):
    # Deterministic, atomic-free: one program per (cache page, column block) adds up, in sequence
    # order, the key gradients of every block-table entry naming that page (a GRPO prompt prefix is
    # one page in several sequences); a page no entry names gets zeros.
    page = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < PAGE_ELEMS
    dk = tl.zeros((BLOCK,), tl.float32)
    dv = tl.zeros((BLOCK,), tl.float32)
    for i in range(tl.load(first_ptr + page), tl.load(first_ptr + page + 1)):
        entry = tl.load(entry_ptr + i)                                # block-table entry b * NB + n
        src = (entry // NB) * s_seq + (entry % NB) * PAGE_ELEMS + cols
        dk += tl.load(dk_seq_ptr + src, mask=ok, other=0.0)
        dv += tl.load(dv_seq_ptr + src, mask=ok, other=0.0)
    tl.store(dk_ptr + page * PAGE_ELEMS + cols, dk.to(dk_ptr.dtype.element_ty), mask=ok)
    tl.store(dv_ptr + page * PAGE_ELEMS + cols, dv.to(dv_ptr.dtype.element_ty), mask=ok)


def _pages_grad(dk_seq, dv_seq, k_cache, block_table):
    """(B, NKEYS, KVH, D) per-sequence key gradients -> gradients of the page caches, on the device
    (no host sync). Every block-table entry adds its page's share; entries past a sequence's end add
    the zeros no query wrote; a page several entries name sums them in sequence order."""
    B, NB = block_table.shape
    num_pages, PAGE = k_cache.shape[:2]
    page_elems = PAGE * k_cache.shape[2] * k_cache.shape[3]
    pages = block_table.reshape(-1)                                   # (B * NB,) entry b * NB + n
    entry = torch.sort(pages, stable=True).indices                   # entries grouped by page, in order
    first = torch.searchsorted(pages[entry], torch.arange(num_pages + 1, device=pages.device))  # (P + 1,)
    dk = torch.empty(k_cache.shape, dtype=k_cache.dtype, device=k_cache.device)   # contiguous, as written
    dv = torch.empty_like(dk)
    BLOCK = min(1024, triton.next_power_of_2(page_elems))
    _pages_grad_kernel[(num_pages, triton.cdiv(page_elems, BLOCK))](
        dk_seq, dv_seq, entry, first, dk, dv, NB, dk_seq.stride(0), page_elems, BLOCK=BLOCK, **LAUNCH)
    return dk, dv


def paged_attention(q, k_cache, v_cache, block_table, positions, scale, sinks=None, window=0):
    # one index dtype for every caller (the trainer's arange and the sampler's tables are int64)
    block_table, positions = (_aligned(t.to(device=q.device, dtype=torch.long)) for t in (block_table, positions))
    return _PagedAttention.apply(_aligned(q), _aligned(k_cache), _aligned(v_cache), block_table, positions, float(scale),
                                 sinks, int(window))
