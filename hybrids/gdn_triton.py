"""The Gated DeltaNet's grid chunk (hybrids/gdn.chunk) as one Triton kernel: the triton backend's (CUDA).

One program computes one (sequence, value head)'s chunk of C = 64 rows from the state at its start, the
same ops as gdn.chunk's torch form in the same order of steps: the decay table from the cumulative log
decay, the strictly lower system N = tril(beta k k^T * decay, -1), its unit-lower inverse by forward
substitution (row i from the rows before it), the delta rule's targets u and w, the output and the end
state. Each dot is a fixed (64 x d) tile product whatever the batch, and a program reads its own
(sequence, head) alone, so a row's bits depend on neither the batch nor the rows after it (a partial
chunk's zero rows add exact zeros): the sampler's open chunk and the trainer's complete one agree.

The backward recomputes gdn.chunk's torch form under autograd (a chunk's inputs are all it keeps, as the
torch path's checkpoint does): gradients of the same arithmetic, not of these bits, which the trainer's
loss needs no more than it needs the torch backward's. Imported on the triton backend's first GDN call.
"""
from __future__ import annotations

import torch

from kernels_triton.base import LAUNCH, aligned    # first: the interpreter switch precedes triton's jit
import triton                                      # noqa: E402
import triton.language as tl                       # noqa: E402


@triton.jit
def _gdn_chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr, e_ptr, DK, DV,
                      C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    # program = one (sequence, value head) and BV of its value dims (the k side, recomputed per block, is
    # the same bits in each); every tensor contiguous: q, k (C, DK), v (C, DV), g, beta (C,), the state
    # (DK, DV); dims padded to BK / BV with zeros (a zero column adds nothing to any product)
    pid = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, C)
    ck, cv = tl.arange(0, BK), tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = ck < DK, cv < DV
    q = tl.load(q_ptr + pid * C * DK + r[:, None] * DK + ck[None, :], mask=mk[None, :], other=0.0)
    k = tl.load(k_ptr + pid * C * DK + r[:, None] * DK + ck[None, :], mask=mk[None, :], other=0.0)
    v = tl.load(v_ptr + pid * C * DV + r[:, None] * DV + cv[None, :], mask=mv[None, :], other=0.0)
    g = tl.load(g_ptr + pid * C + r)
    beta = tl.load(b_ptr + pid * C + r)
    s = tl.load(s_ptr + pid * DK * DV + ck[:, None] * DV + cv[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
    below = r[:, None] > r[None, :]
    causal = r[:, None] >= r[None, :]
    cum = tl.sum(tl.where(causal, g[None, :], 0.0), 1)                   # (C,) log decay since the start
    decay = tl.where(causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)   # (C, C)
    kb = k * beta[:, None]
    n = tl.where(below, tl.dot(kb, tl.trans(k), input_precision="ieee") * decay, 0.0)   # strictly lower
    # (I + N)^-1 by forward substitution: row i = -N[i] - N[i] @ T, T's rows before i already final
    t = tl.zeros((C, C), dtype=tl.float32)
    for i in range(1, C):
        row = tl.sum(tl.where(r[:, None] == i, n, 0.0), 0)                # (C,) N's row i
        new = -row - tl.sum(row[:, None] * t, 0)                          # (C,)
        t = tl.where(r[:, None] == i, new[None, :], t)
    t = t + tl.where(causal & (r[:, None] == r[None, :]), 1.0, 0.0)
    ecum = tl.exp(cum)
    u = tl.dot(t, v * beta[:, None], input_precision="ieee")             # (C, BV) the delta rule's targets
    w = tl.dot(t, kb * ecum[:, None], input_precision="ieee")            # (C, BK) what the start state predicts
    v_new = u - tl.dot(w, s, input_precision="ieee")
    attn = tl.dot(q, tl.trans(k), input_precision="ieee") * decay        # causal, the diagonal included
    out = tl.dot(q * ecum[:, None], s, input_precision="ieee") + tl.dot(attn, v_new, input_precision="ieee")
    tl.store(o_ptr + pid * C * DV + r[:, None] * DV + cv[None, :], out, mask=mv[None, :])
    last = tl.sum(tl.where(r == C - 1, cum, 0.0), 0)                       # cum at the chunk's last row
    kd = k * tl.exp(last - cum)[:, None]
    end = s * tl.exp(last) + tl.dot(tl.trans(kd), v_new, input_precision="ieee")   # (BK, BV)
    tl.store(e_ptr + pid * DK * DV + ck[:, None] * DV + cv[None, :], end, mask=mk[:, None] & mv[None, :])


BV, WARPS = 32, 8       # value dims a program, its warps (tools/compile_check.py --gdn: sm_90 spills least so)


def _block(d: int) -> int:
    return max(16, triton.next_power_of_2(d))                              # tl.dot's smallest side is 16


def chunk_forward(q, k, v, g, beta, state):
    """gdn.chunk's shapes: q, k (B, H, C, dk), v (B, H, C, dv), g, beta (B, H, C), state (B, H, dk, dv),
    fp32 -> (out (B, H, C, dv), the end state (B, H, dk, dv))."""
    B, H, C, dk = k.shape
    dv = v.shape[-1]
    ins = [aligned(x.float().contiguous()) for x in (q, k, v, g, beta, state)]
    out = torch.empty(B, H, C, dv, device=q.device, dtype=torch.float32)
    end = torch.empty(B, H, dk, dv, device=q.device, dtype=torch.float32)
    bv = min(BV, _block(dv))
    _gdn_chunk_kernel[(B * H, triton.cdiv(dv, bv))](*ins, out, end, dk, dv, C=C, BK=_block(dk), BV=bv,
                                                    num_warps=WARPS, **LAUNCH)
    return out, end


class Chunk(torch.autograd.Function):
    """Chunk.apply(torch_form, q, k, v, g, beta, state): the kernel's forward; the backward is autograd's
    through torch_form (gdn.chunk_torch, handed in: this file imports nothing of hybrids/), recomputed."""

    @staticmethod
    def forward(ctx, torch_form, q, k, v, g, beta, state):
        ctx.torch_form = torch_form
        ctx.save_for_backward(q, k, v, g, beta, state)
        return chunk_forward(q, k, v, g, beta, state)

    @staticmethod
    def backward(ctx, d_out, d_end):
        ins = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with torch.enable_grad():
            outs = ctx.torch_form(*ins)
        wanted = [x for x in ins if x.requires_grad]
        grads = iter(torch.autograd.grad(outs, wanted, (d_out, d_end), allow_unused=True))
        return (None, *(next(grads) if x.requires_grad else None for x in ins))
