"""The fused MoE experts of the Triton backend (kernels.moe_experts dispatches here for CUDA tensors).

The (token, k) slots are sorted stably by expert with torch ops (no atomics, no host sync); each tile
of the grouped GEMMs holds rows of one expert, so a row's result depends neither on the other rows
nor on its place in the tile. The backward is Triton too, deterministic: every output element is
written by one program, and reductions run in index order.
"""
from __future__ import annotations

import torch

from kernels_triton.base import LAUNCH, UPCAST, aligned as _aligned, operand_dtype  # sets up the interpreter

import triton                      # noqa: E402
import triton.language as tl       # noqa: E402

# Fixed tile configurations, one per dtype (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); never a
# function of M (tools/gpu_check.py --sweep times candidates).
MOE_TILES = {torch.float32: (32, 32, 32, 4, 3), torch.bfloat16: (64, 64, 64, 4, 3), torch.float16: (64, 64, 64, 4, 3)}


# Rows: the (token, k) slots sorted stably by expert (slot = token * TOPK + j); a tile is up to BM
# sorted rows of ONE expert. Forward: up (gate/up GEMM, SiLU * up fused; gpt-oss: + bias, clamped
# SwiGLU) -> down (GEMM, gpt-oss: + bias, router weight in fp32, stored per slot) -> fixed-order fp32
# sum over k. Backward, all deterministic (every output element is written by one program, reductions
# run in index order, no atomics; the biases' gradients are sums over an expert's rows, _bias_grads):
#   gw  = dL/dout[token] @ W2[e]                 (S, I) per sorted row       _moe_gemm_kernel
#   act, dh = d(SiLU(g) * u), dwt partial sums    recomputes gate/up          _moe_up_kernel(BWD)
#   dx  = dh @ W13[e] per slot, then sum over k   (S, D)                      _moe_gemm_kernel
#   dW2[e] = (wt * dL/dout)^T act, dW13[e] = dh^T x, each over expert e's rows in order   _moe_wgrad_kernel
EPI_WEIGHTED = tl.constexpr(0)    # forward down projection: round, times the router weight, at the slot
EPI_SLOT = tl.constexpr(1)        # fp32 result at the slot (dx)
EPI_ROW = tl.constexpr(2)         # fp32 result at the sorted row (gw)


@triton.jit
def _moe_tile(tile_e_ptr, row_start_ptr, row_end_ptr, order_ptr, TOPK, BM: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(tile_e_ptr + tile)
    rows = tl.load(row_start_ptr + tile) + tl.arange(0, BM)
    rmask = rows < tl.load(row_end_ptr + tile)
    slot = tl.load(order_ptr + rows, mask=rmask, other=0)        # (BM,) slot = token * TOPK + j
    return e, rows, rmask, slot, slot // TOPK


@triton.jit
def _moe_tile_empty(row_start_ptr, row_end_ptr):
    # the plan has cdiv(S, BM) + E tiles, an upper bound; the ones past the real tiles hold no rows
    return tl.load(row_end_ptr + tl.program_id(0)) <= tl.load(row_start_ptr + tl.program_id(0))


@triton.jit
def _glu(g, u, alpha, limit, SWIGLU: tl.constexpr):
    # the experts' GLU in fp32 and the pieces its backward needs: SiLU(g) * u, or gpt-oss's clamped
    # SwiGLU (min(u, limit) clamped below at -limit, plus 1) * gc * sigmoid(alpha gc), gc = min(g, limit)
    if SWIGLU:
        gc = tl.minimum(g, limit)
        z = tl.maximum(gc * alpha, -80.0)                      # as kernels.sigmoid: exp(-z) never overflows
        sig = tl.div_rn(1.0, 1.0 + tl.exp(-z))
        glu = gc * sig
        act = (tl.minimum(tl.maximum(u, -limit), limit) + 1.0) * glu
    else:
        sig = tl.div_rn(1.0, 1.0 + tl.exp(-g))
        glu = tl.div_rn(g, 1.0 + tl.exp(-g))
        act = glu * u
    return act, glu, sig


@triton.jit
def _glu_grad(da, g, u, glu, sig, alpha, limit, SWIGLU: tl.constexpr):
    # (dL/dgate, dL/dup) of _glu from dL/dact; a clamp passes the gradient inside its range (as torch's)
    if SWIGLU:
        gc = tl.minimum(g, limit)
        dsig = tl.where(gc * alpha >= -80.0, sig * (1.0 - sig) * alpha, 0.0)
        uc1 = tl.minimum(tl.maximum(u, -limit), limit) + 1.0
        dg = tl.where(g <= limit, da * uc1 * (sig + gc * dsig), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), da * glu, 0.0)
    else:
        dg = da * u * sig * (1.0 + g * (1.0 - sig))
        du = da * glu
    return dg, du


@triton.jit
def _moe_up_kernel(x_ptr, w13_ptr, b13_ptr, a_ptr, gw_ptr, wt_ptr, dh_ptr, dwt_ptr,
                   tile_e_ptr, row_start_ptr, row_end_ptr, order_ptr,
                   D, I, TOPK, s_xm, s_xk, s_we, s_wn, s_wk, alpha, limit,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BWD: tl.constexpr, UPCAST: tl.constexpr,
                   BIAS: tl.constexpr, SWIGLU: tl.constexpr):
    # Invariance: each tile holds rows of ONE expert (the host sorted slots by expert, stably) and
    # runs the whole D loop in order in a fixed tile shape, so a row's gate/up values do not depend
    # on the other rows or on its place in the tile. The GLU is fused, rounded as the torch backend
    # rounds (h to x.dtype, plus the bias rounded again under BIAS, then the product): act, gw: (S, I);
    # dh: (S, 2I), contiguous. SWIGLU: gpt-oss's clamped SwiGLU (_glu) instead of SiLU(gate) * up.
    # BWD: also da = wt * gw, dh = d act / d (gate, up) * da and this column block's share
    # of dL/dwt = act . gw (= round(y) . dL/dout up to y's rounding), one partial per (slot, block).
    if _moe_tile_empty(row_start_ptr, row_end_ptr):
        return
    e, rows, rmask, slot, tok = _moe_tile(tile_e_ptr, row_start_ptr, row_end_ptr, order_ptr, TOPK, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + rk
        a = tl.load(x_ptr + tok[:, None] * s_xm + kk[None, :] * s_xk,
                    mask=rmask[:, None] & (kk[None, :] < D), other=0.0)                   # (BM, BK)
        wmask = (rn[None, :] < I) & (kk[:, None] < D)
        w_off = w13_ptr + e * s_we + kk[:, None] * s_wk
        wg = tl.load(w_off + rn[None, :] * s_wn, mask=wmask, other=0.0)                 # (BK, BN)
        wu = tl.load(w_off + (I + rn[None, :]) * s_wn, mask=wmask, other=0.0)
        if UPCAST:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
        acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
    g = acc_g.to(a_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(a_ptr.dtype.element_ty).to(tl.float32)
    if BIAS:                                                   # (E, 2I) contiguous: gate entries, then up
        bg = tl.load(b13_ptr + e * 2 * I + rn, mask=rn < I, other=0.0).to(tl.float32)
        bu = tl.load(b13_ptr + e * 2 * I + I + rn, mask=rn < I, other=0.0).to(tl.float32)
        g = (g + bg[None, :]).to(a_ptr.dtype.element_ty).to(tl.float32)
        u = (u + bu[None, :]).to(a_ptr.dtype.element_ty).to(tl.float32)
    act, glu, sig = _glu(g, u, alpha, limit, SWIGLU)
    act = act.to(a_ptr.dtype.element_ty)
    ok = rmask[:, None] & (rn[None, :] < I)
    tl.store(a_ptr + rows[:, None] * I + rn[None, :], act, mask=ok)
    if BWD:
        gw = tl.load(gw_ptr + rows[:, None] * I + rn[None, :], mask=ok, other=0.0)        # fp32
        tl.store(dwt_ptr + slot * tl.num_programs(1) + tl.program_id(1), tl.sum(act.to(tl.float32) * gw, 1),
                 mask=rmask)
        da = gw * tl.load(wt_ptr + slot, mask=rmask, other=0.0)[:, None]
        dg, du = _glu_grad(da, g, u, glu, sig, alpha, limit, SWIGLU)
        dh = dh_ptr + rows[:, None] * (2 * I) + rn[None, :]
        tl.store(dh, dg.to(dh_ptr.dtype.element_ty), mask=ok)
        tl.store(dh + I, du.to(dh_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, wt_ptr, out_ptr, b_ptr, tile_e_ptr, row_start_ptr, row_end_ptr, order_ptr,
                     K, N, TOPK, s_am, s_we, s_wn, s_wk, s_om,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, A_BY_TOKEN: tl.constexpr,
                     EPI: tl.constexpr, UPCAST: tl.constexpr, BIAS: tl.constexpr):
    # out[row] = A[row] @ W[e]^T over the tiles' sorted rows; W[e]'s element (n, k) sits at
    # e * s_we + n * s_wn + k * s_wk, so the same kernel runs act @ W2^T (forward), dL/dout @ W2 and
    # dh @ W13 (backward) by passing strides. A's row is the sorted row, or its token (A_BY_TOKEN).
    # Invariance: as _moe_up_kernel. The forward (EPI_WEIGHTED) rounds the result to A's dtype (adds
    # the expert's bias b (E, N) and rounds again under BIAS), scales it by the router weight in fp32 and
    # stores it at the row's slot; the sum over k comes later, in a fixed order.
    if _moe_tile_empty(row_start_ptr, row_end_ptr):
        return
    e, rows, rmask, slot, tok = _moe_tile(tile_e_ptr, row_start_ptr, row_end_ptr, order_ptr, TOPK, BM)
    arow = tok if A_BY_TOKEN else rows
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(a_ptr + arow[:, None] * s_am + kk[None, :], mask=rmask[:, None] & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + e * s_we + rn[None, :] * s_wn + kk[:, None] * s_wk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)                 # (BK, BN)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision="ieee")
    omask = rmask[:, None] & (rn[None, :] < N)
    if EPI == EPI_WEIGHTED:
        wt = tl.load(wt_ptr + slot, mask=rmask, other=0.0)                                 # fp32
        y = acc.to(a_ptr.dtype.element_ty).to(tl.float32)
        if BIAS:
            b = tl.load(b_ptr + e * N + rn, mask=rn < N, other=0.0).to(tl.float32)
            y = (y + b[None, :]).to(a_ptr.dtype.element_ty).to(tl.float32)
        y = y * wt[:, None]
        tl.store(out_ptr + slot[:, None] * s_om + rn[None, :], y, mask=omask)
    elif EPI == EPI_SLOT:
        tl.store(out_ptr + slot[:, None] * s_om + rn[None, :], acc, mask=omask)
    else:
        tl.store(out_ptr + rows[:, None] * s_om + rn[None, :], acc, mask=omask)


@triton.jit
def _moe_wgrad_kernel(a_ptr, b_ptr, wt_ptr, out_ptr, offsets_ptr, order_ptr, N1, N2, TOPK, s_am, s_bm,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, A_BY_TOKEN: tl.constexpr,
                      B_BY_TOKEN: tl.constexpr, SCALE_A: tl.constexpr, UPCAST: tl.constexpr):
    # out[e] (N1, N2) fp32 = sum over expert e's sorted rows r of A[r]^T B[r] (A[r] times the router
    # weight when SCALE_A). One program per (expert, N1 tile, N2 tile) walks the rows in order: the
    # weight gradient is a plain loop, no split over rows, no atomics.
    e = tl.program_id(0).to(tl.int64)                  # e * N1 * N2 may pass 2**31
    n1 = tl.program_id(1) * BM + tl.arange(0, BM)
    n2 = tl.program_id(2) * BN + tl.arange(0, BN)
    end = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BM, BN), tl.float32)
    for r0 in range(tl.load(offsets_ptr + e), end, BK):
        r = r0 + tl.arange(0, BK)
        rmask = r < end
        slot = tl.load(order_ptr + r, mask=rmask, other=0)
        ra = slot // TOPK if A_BY_TOKEN else r
        rb = slot // TOPK if B_BY_TOKEN else r
        at = tl.load(a_ptr + ra[None, :] * s_am + n1[:, None], mask=rmask[None, :] & (n1[:, None] < N1), other=0.0)
        if SCALE_A:                                                                        # (BM, BK)
            at = (at.to(tl.float32) * tl.load(wt_ptr + slot, mask=rmask, other=0.0)[None, :]).to(a_ptr.dtype.element_ty)
        b = tl.load(b_ptr + rb[:, None] * s_bm + n2[None, :], mask=rmask[:, None] & (n2[None, :] < N2), other=0.0)
        if UPCAST:                                                                         # (BK, BN)
            at, b = at.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(at, b, acc, input_precision="ieee")
    tl.store(out_ptr + e * N1 * N2 + n1[:, None] * N2 + n2[None, :], acc, mask=(n1[:, None] < N1) & (n2[None, :] < N2))


def _moe_plan(ids: torch.Tensor, E: int, BM: int):
    """Stable sort of the (token, k) slots by expert and the tile list; torch ops, no atomics, no sync.

    Returns order (S,) sorted row -> slot, offsets (E+1,) first sorted row of each expert, and per
    tile (expert, first row, end row); the tile count is the upper bound cdiv(S, BM) + E, tiles past
    the real ones get no rows.
    """
    slot_expert = ids.reshape(-1)                                          # (S,) slot s = token s // k
    order = torch.sort(slot_expert, stable=True).indices
    offsets = torch.searchsorted(slot_expert[order], torch.arange(E + 1, device=ids.device))
    tiles = (offsets[1:] - offsets[:-1] + BM - 1) // BM                    # (E,)
    tile_end = torch.cumsum(tiles, 0)
    i = torch.arange(triton.cdiv(slot_expert.numel(), BM) + E, device=ids.device)
    tile_e = torch.searchsorted(tile_end, i, right=True)
    valid = tile_e < E
    e = tile_e.clamp(max=E - 1)
    row_start = offsets[e] + (i - (tile_end[e] - tiles[e])) * BM
    row_end = torch.where(valid, offsets[e + 1], row_start)
    return order, offsets, (e.contiguous(), row_start.contiguous(), row_end.contiguous(), order)


def _sum_over_k(per_slot: torch.Tensor) -> torch.Tensor:
    """(M, k, D) fp32 -> (M, D): the k terms added left to right (a fixed order, whatever M is)."""
    out = per_slot[:, 0]
    for j in range(1, per_slot.shape[1]):
        out = out + per_slot[:, j]
    return out


class _MoE(torch.autograd.Function):
    """per_slot: return the weighted fp32 term of each (token, k) slot, (M*k, D), instead of their sum
    over k rounded to x.dtype; its gradient is rounded to x.dtype (exact when it is a rounded output's).
    b13 (E, 2I), b2 (E, D), swiglu (alpha, limit): gpt-oss's experts (kernels.moe_experts)."""
    @staticmethod
    def forward(ctx, x, w13, w2, ids, weights, per_slot=False, b13=None, b2=None, swiglu=None):
        M, D = x.shape
        E, k, I = w13.shape[0], ids.shape[1], w2.shape[2]
        BM, BN, BK, warps, stages = MOE_TILES.get(operand_dtype(x, w13, w2), MOE_TILES[torch.float32])
        order, offsets, plan = _moe_plan(ids, E, BM)
        # every slot must land in an expert (else its output row would stay unwritten): checked on the
        # device without a host sync; an id outside [0, E) fails here (CPU) or at a later CUDA call
        torch._assert_async((offsets[0] == 0) & (offsets[E] == M * k),
                            "moe_experts: expert ids outside [0, num_experts)")
        wt = _aligned(weights.float().contiguous())
        act = torch.empty(M * k, I, dtype=x.dtype, device=x.device)      # (S, I) in sorted order
        y = torch.empty(M * k, D, dtype=torch.float32, device=x.device)  # (S, D) in slot order
        opts = dict(BM=BM, BN=BN, BK=BK, UPCAST=UPCAST or len({x.dtype, w13.dtype, w2.dtype}) > 1,
                    num_warps=warps, num_stages=stages, **LAUNCH)
        bias = b13 is not None
        b13, b2 = (_aligned(b.contiguous()) if bias else wt for b in (b13, b2))   # (unread without BIAS)
        glu = dict(SWIGLU=swiglu is not None)
        alpha, limit = swiglu if swiglu is not None else (1.0, 1.0)
        if M:
            n_tiles = plan[0].numel()
            _moe_up_kernel[(n_tiles, triton.cdiv(I, BN))](
                x, w13, b13, act, act, wt, act, wt, *plan, D, I, k, x.stride(0), x.stride(1), *w13.stride(),
                alpha, limit, BWD=False, BIAS=bias, **glu, **opts)
            _moe_gemm_kernel[(n_tiles, triton.cdiv(D, BN))](
                act, w2, wt, y, b2, *plan, I, D, k, act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2),
                y.stride(0), A_BY_TOKEN=False, EPI=EPI_WEIGHTED, BIAS=bias, **opts)
        ctx.save_for_backward(x, w13, w2, wt, offsets, b13, b2, ids, *plan)
        ctx.opts, ctx.k, ctx.wt_dtype, ctx.bias, ctx.glu = opts, k, weights.dtype, bias, (alpha, limit, glu)
        return y if per_slot else _sum_over_k(y.view(M, k, D)).to(x.dtype)

    @staticmethod
    def backward(ctx, gout):
        x, w13, w2, wt, offsets, b13, b2, ids, *plan = ctx.saved_tensors
        order, opts = plan[3], ctx.opts
        M, D = x.shape
        E, I, S = w13.shape[0], w2.shape[2], order.numel()
        k = ctx.k
        BM, BN = opts["BM"], opts["BN"]
        gout = gout.to(x.dtype).contiguous()
        x = x.contiguous()
        no_bias = (None, None)
        if not M:
            biases = (torch.zeros_like(b13), torch.zeros_like(b2)) if ctx.bias else no_bias
            return (torch.zeros_like(x), torch.zeros_like(w13), torch.zeros_like(w2), None,
                    torch.zeros(0, k, dtype=ctx.wt_dtype, device=x.device), None, *biases, None)
        n_tiles, n_blocks = plan[0].numel(), triton.cdiv(I, BN)
        gw = torch.empty(S, I, dtype=torch.float32, device=x.device)       # dL/dout[token] @ W2[e], sorted rows
        _moe_gemm_kernel[(n_tiles, n_blocks)](
            gout, w2, wt, gw, wt, *plan, D, I, k, gout.stride(0), w2.stride(0), w2.stride(2), w2.stride(1),
            gw.stride(0), A_BY_TOKEN=True, EPI=EPI_ROW, BIAS=False, **opts)
        act = torch.empty(S, I, dtype=x.dtype, device=x.device)
        dh = torch.empty(S, 2 * I, dtype=x.dtype, device=x.device)
        dwt_part = torch.empty(S, n_blocks, dtype=torch.float32, device=x.device)
        alpha, limit, glu = ctx.glu
        _moe_up_kernel[(n_tiles, n_blocks)](
            x, w13, b13, act, gw, wt, dh, dwt_part, *plan, D, I, k, x.stride(0), x.stride(1), *w13.stride(),
            alpha, limit, BWD=True, BIAS=ctx.bias, **glu, **opts)
        dx_slot = torch.empty(S, D, dtype=torch.float32, device=x.device)
        _moe_gemm_kernel[(n_tiles, triton.cdiv(D, BN))](
            dh, w13, wt, dx_slot, wt, *plan, 2 * I, D, k, dh.stride(0), w13.stride(0), w13.stride(2), w13.stride(1),
            dx_slot.stride(0), A_BY_TOKEN=False, EPI=EPI_SLOT, BIAS=False, **opts)
        dw13 = dw2 = None                                                   # every element is written
        if ctx.needs_input_grad[2]:
            dw2 = torch.empty(w2.shape, dtype=torch.float32, device=x.device)
            _moe_wgrad_kernel[(E, triton.cdiv(D, BM), triton.cdiv(I, BN))](    # dW2[e] (D, I)
                gout, act, wt, dw2, offsets, order, D, I, k, gout.stride(0), act.stride(0),
                A_BY_TOKEN=True, B_BY_TOKEN=False, SCALE_A=True, **opts)
        if ctx.needs_input_grad[1]:
            dw13 = torch.empty(w13.shape, dtype=torch.float32, device=x.device)
            _moe_wgrad_kernel[(E, triton.cdiv(2 * I, BM), triton.cdiv(D, BN))](  # dW13[e] (2I, D)
                dh, x, wt, dw13, offsets, order, 2 * I, D, k, dh.stride(0), x.stride(0),
                A_BY_TOKEN=False, B_BY_TOKEN=True, SCALE_A=False, **opts)
        dx = _sum_over_k(dx_slot.view(M, k, D)).to(x.dtype)
        dwt = dwt_part.sum(1).view(M, k)
        if ctx.bias:     # the slot's output also holds its expert's down bias: d/dwt gains b2[e] . dL/dout
            dwt = dwt + (b2[ids].float() * gout.float()[:, None, :]).sum(-1)
        dwt = dwt.to(ctx.wt_dtype)
        biases = no_bias
        if ctx.bias:
            biases = [g.to(b13.dtype) for g in _bias_grads(gout, dh, wt, offsets, order, k, E, opts)]
        return (dx, None if dw13 is None else dw13.to(w13.dtype), None if dw2 is None else dw2.to(w2.dtype), None, dwt,
                None, *biases, None)


def _bias_grads(gout, dh, wt, offsets, order, k, E, opts):
    """dL/db13[e] = the sum of dh over expert e's rows, dL/db2[e] = the sum of wt * dL/dout[token] over
    them, each in row order: the weight-gradient kernel with a column of ones for A (deterministic)."""
    ones = torch.ones(order.numel(), 1, dtype=gout.dtype, device=gout.device)    # (S, 1)
    grads = []
    for b, by_token in ((dh, False), (gout, True)):
        N = b.shape[1]
        out = torch.empty(E, 1, N, dtype=torch.float32, device=gout.device)
        _moe_wgrad_kernel[(E, 1, triton.cdiv(N, opts["BN"]))](
            ones, b, wt, out, offsets, order, 1, N, k, ones.stride(0), b.stride(0),
            A_BY_TOKEN=False, B_BY_TOKEN=by_token, SCALE_A=by_token, **opts)
        grads.append(out[:, 0])                                                  # (E, N)
    return grads


def moe_experts(x, w13, w2, ids, weights, b13=None, b2=None, swiglu=None):
    return _MoE.apply(_aligned(x), _aligned(w13), _aligned(w2), _aligned(ids.long().contiguous()), weights, False,
                      b13, b2, swiglu)


def expert_rows(x, w13, w2, ids, weights, b13=None, b2=None, swiglu=None):
    """kernels.expert_rows: each row a slot of top-1 (the same tiles and kernels as moe_experts, so a
    row's fp32 term has the bits of that slot in moe_experts). x (R, D), ids (R,), weights (R,) -> (R, D) fp32."""
    return _MoE.apply(_aligned(x), _aligned(w13), _aligned(w2), _aligned(ids.long().reshape(-1, 1).contiguous()),
                      weights.reshape(-1, 1), True, b13, b2, swiglu)
