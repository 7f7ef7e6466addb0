"""The Triton backend's ops over the vocabulary: the token log-probs (and entropy) and the sampler's draw.

kernels.token_logprobs and kernels.sample_tokens dispatch here for CUDA tensors. A row of logits is
cut into fixed segments of VOCAB_SEGMENT entries (a function of the vocabulary size only, never of
the batch); the segments are reduced in parallel, then combined per row in segment order, so a
decode step's few rows still fill the GPU and a row's result depends on its own logits alone.
* token_logprobs  online logsumexp per (row, segment), combined per row (no full log-softmax),
                  optionally the entropy from the same pass; backward: one program per row
* sample_tokens   the inverse-CDF draw without top-k / top-p: per-segment max and float64 mass,
                  then per row the segment and the token (the logits are read about once)
Like kernels_triton/ops.py, this file imports only kernels_triton/base.py.
"""
from __future__ import annotations

import torch

from kernels_triton.base import LAUNCH, aligned as _aligned  # sets up the interpreter

import triton                      # noqa: E402
import triton.language as tl       # noqa: E402

VOCAB_SEGMENT = 8192               # 19 segments for Qwen's 151936-token vocabulary
VOCAB_CHUNK = 2048                 # a segment is walked in steps of this many entries


# ===================================================================================================
# log-prob of the chosen tokens
# ===================================================================================================
@triton.jit
def _scaled_logits(base, idx, end, temp, SCALE: tl.constexpr):
    # z / T in fp32 for the entries idx < end of a row (-inf past it); SCALE: T is not 0 or 1
    z = tl.load(base + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
    if SCALE:
        z = tl.div_rn(z, temp)
    return z


def _vocab_block(V: int) -> int:
    """The chunk (a power of two) in which a segment of a V-entry row is walked."""
    return min(VOCAB_CHUNK, triton.next_power_of_2(min(V, VOCAB_SEGMENT)))


@triton.jit
def _logprob_segments_kernel(z_ptr, m_ptr, s_ptr, u_ptr, V, s_z, temp, SEG,
                             SCALE: tl.constexpr, ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    # program (row, segment): an fp32 online logsumexp over the segment's chunks, in order: its max m
    # and s = sum e^(z - m). ENTROPY: also u = sum e^(z - m) (z - m), rescaled with m as s is (for
    # H = lse - E[z]); m and s are computed exactly as without it.
    row, seg = tl.program_id(0).to(tl.int64), tl.program_id(1)  # R * V may pass 2**31
    base = z_ptr + row * s_z
    cols = tl.arange(0, BLOCK_V)
    lo = seg * SEG
    hi = tl.minimum(lo + SEG, V)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    u = tl.full([], 0.0, tl.float32)
    for v0 in range(lo, hi, BLOCK_V):
        z = _scaled_logits(base, v0 + cols, hi, temp, SCALE)
        m_new = tl.maximum(m, tl.max(z, 0))
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)     # no finite logit yet: e = 0, not NaN
        e = tl.exp(z - m_ref)
        if ENTROPY:                        # before s is updated: the old terms move from m to m_new
            shift = s * tl.where(s > 0, m - m_ref, 0.0)              # s = 0 before the first finite chunk
            u = (u + shift) * tl.exp(m - m_ref) + tl.sum(e * tl.where(e > 0, z - m_ref, 0.0), 0)
        s = s * tl.exp(m - m_ref) + tl.sum(e, 0)
        m = m_new
    out = row * tl.num_programs(1) + seg
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    if ENTROPY:
        tl.store(u_ptr + out, u)


@triton.jit
def _logprob_combine_kernel(z_ptr, t_ptr, m_ptr, s_ptr, u_ptr, out_ptr, lse_ptr, ent_ptr, s_z, temp, S,
                            SCALE: tl.constexpr, ENTROPY: tl.constexpr, BLOCK_S: tl.constexpr):
    # One program per row: the segments' (m, s) rescaled to the row's max M and summed in segment
    # order: lse = M + log(sum s_k e^(m_k - M)); log p(target) = z_target / T - lse.
    row = tl.program_id(0).to(tl.int64)
    segs = tl.arange(0, BLOCK_S)
    ms = tl.load(m_ptr + row * S + segs, mask=segs < S, other=float("-inf"))
    ss = tl.load(s_ptr + row * S + segs, mask=segs < S, other=0.0)
    M = tl.max(ms, 0)
    a = tl.where(ss > 0, tl.exp(ms - M), 0.0)                       # an all -inf segment weighs 0
    total = tl.sum(ss * a, 0)
    lse = M + tl.log(total)
    zt = tl.load(z_ptr + row * s_z + tl.load(t_ptr + row)).to(tl.float32)
    if SCALE:
        zt = tl.div_rn(zt, temp)
    tl.store(out_ptr + row, zt - lse)
    tl.store(lse_ptr + row, lse)
    if ENTROPY:                            # H = log(total) - E[z - M]: each segment's u moved from m_k to M
        us = tl.load(u_ptr + row * S + segs, mask=segs < S, other=0.0)
        shifted = a * (us + ss * tl.where(ss > 0, ms - M, 0.0))
        tl.store(ent_ptr + row, tl.log(total) - tl.sum(shifted, 0) / total)


@triton.jit
def _logprob_bwd_kernel(z_ptr, t_ptr, lse_ptr, g_ptr, dz_ptr, V, s_z, s_dz, temp,
                        SCALE: tl.constexpr, BLOCK_V: tl.constexpr):
    # d logp / d z = (onehot(target) - softmax(z / T)) / T, written chunk by chunk.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    tgt = tl.load(t_ptr + row)
    for v0 in range(0, V, BLOCK_V):
        ok = v0 + cols < V
        z = tl.load(z_ptr + row * s_z + v0 + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if SCALE:
            z = tl.div_rn(z, temp)
        p = tl.exp(z - lse)
        d = g * (tl.where(v0 + cols == tgt, 1.0, 0.0) - p)
        if SCALE:
            d = tl.div_rn(d, temp)
        tl.store(dz_ptr + row * s_dz + v0 + cols, d.to(dz_ptr.dtype.element_ty), mask=ok)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z2, t1, temperature, with_entropy):
        R, V = z2.shape
        out = torch.empty(R, dtype=torch.float32, device=z2.device)
        lse = torch.empty(R, dtype=torch.float32, device=z2.device)
        ent = torch.empty(R if with_entropy else 0, dtype=torch.float32, device=z2.device)
        scale = temperature not in (0.0, 1.0)
        if R:
            S = triton.cdiv(V, VOCAB_SEGMENT)
            m = torch.empty(R, S, dtype=torch.float32, device=z2.device)
            ssum, usum = torch.empty_like(m), torch.empty_like(m) if with_entropy else m
            opts = dict(SCALE=scale, ENTROPY=with_entropy, **LAUNCH)
            _logprob_segments_kernel[(R, S)](z2, m, ssum, usum, V, z2.stride(0), float(temperature), VOCAB_SEGMENT,
                                             BLOCK_V=_vocab_block(V), **opts)
            _logprob_combine_kernel[(R,)](z2, t1, m, ssum, usum, out, lse, ent if with_entropy else lse,
                                          z2.stride(0), float(temperature), S, BLOCK_S=triton.next_power_of_2(S), **opts)
        ctx.save_for_backward(z2, t1, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, g, _g_ent):
        z2, t1, lse = ctx.saved_tensors
        R, V = z2.shape
        dz = torch.empty_like(z2)
        t = ctx.temperature
        if R:
            _logprob_bwd_kernel[(R,)](z2, t1, lse, g.contiguous(), dz, V, z2.stride(0), dz.stride(0), float(t),
                                      SCALE=t not in (0.0, 1.0),
                                      BLOCK_V=min(VOCAB_CHUNK, triton.next_power_of_2(V)), **LAUNCH)
        return dz, None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False):
    """kernels.token_logprobs on the Triton backend: logp, or (logp, entropy) (entropy detached)."""
    V = logits.shape[-1]
    z2 = logits.reshape(-1, V)                                     # (R, V)
    if z2.stride(1) != 1:
        z2 = z2.contiguous()
    t1 = targets.reshape(-1).to(device=logits.device, dtype=torch.long).contiguous()   # (R,)
    logp, ent = _TokenLogprobs.apply(_aligned(z2), _aligned(t1), float(temperature), bool(with_entropy))
    if with_entropy:
        return logp.view(targets.shape), ent.view(targets.shape)
    return logp.view(targets.shape)


# ===================================================================================================
# sampling: the inverse CDF of softmax(logits / T) at the row's uniform u
# ===================================================================================================
# The torch twin (kernels.sample_tokens) writes softmax and a float64 cumsum of every row: about 25
# bytes per logit at a 151936-token vocabulary. Here, by VOCAB_SEGMENT segments: kernel 1 reduces each
# (row, segment) to its max and fp64 mass, in parallel; kernel 2, one program per row, finds the
# segment where the running mass reaches u * total, then the token inside it. The logits are read
# about once.


@triton.jit
def _sample_segments_kernel(z_ptr, m_ptr, t_ptr, V, s_z, temp, SEG, SCALE: tl.constexpr, BLOCK_V: tl.constexpr):
    # program (row, segment): m = max of z / T over the segment, t = sum of exp(z / T - m) in fp64
    row, seg = tl.program_id(0).to(tl.int64), tl.program_id(1)
    base = z_ptr + row * s_z
    cols = tl.arange(0, BLOCK_V)
    lo = seg * SEG
    hi = tl.minimum(lo + SEG, V)
    m = tl.full([], float("-inf"), tl.float32)
    for v0 in range(lo, hi, BLOCK_V):
        m = tl.maximum(m, tl.max(_scaled_logits(base, v0 + cols, hi, temp, SCALE), 0))
    m_safe = tl.where(m > float("-inf"), m, 0.0)                 # an all -inf segment has mass 0
    t = tl.full([], 0.0, tl.float64)
    for v0 in range(lo, hi, BLOCK_V):                            # the segment again, now from the cache
        t += tl.sum(tl.exp(_scaled_logits(base, v0 + cols, hi, temp, SCALE) - m_safe).to(tl.float64), 0)
    tl.store(m_ptr + row * tl.num_programs(1) + seg, m)
    tl.store(t_ptr + row * tl.num_programs(1) + seg, t)


@triton.jit
def _sample_pick_kernel(z_ptr, u_ptr, m_ptr, t_ptr, out_ptr, V, s_z, temp, SEG, S,
                        SCALE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr):
    # One program per row. Segment masses relative to the row's max: w_s = t_s exp(m_s - M) (fp64);
    # the first segment s whose running mass reaches u * total (total = the last running mass), then
    # in s the first token whose running mass reaches it. Only tokens of positive mass are chosen: if
    # rounding leaves a segment's inner sums short of its w_s, its last token of positive mass is.
    row = tl.program_id(0).to(tl.int64)
    segs = tl.arange(0, BLOCK_S)
    ms = tl.load(m_ptr + row * S + segs, mask=segs < S, other=float("-inf"))
    ts = tl.load(t_ptr + row * S + segs, mask=segs < S, other=0.0)
    M = tl.max(ms, 0)
    w = tl.where(ts > 0, ts * tl.exp((ms - M).to(tl.float64)), 0.0)                  # (BLOCK_S,)
    cum = tl.cumsum(w, 0)
    thr = tl.load(u_ptr + row) * tl.sum(tl.where(segs == S - 1, cum, 0.0), 0)
    seg = tl.min(tl.where((cum >= thr) & (w > 0), segs, BLOCK_S), 0)
    seg = tl.where(seg < BLOCK_S, seg, tl.max(tl.where(w > 0, segs, 0), 0))
    prefix = tl.sum(tl.where(segs == seg - 1, cum, 0.0), 0)     # the mass before segment seg (0 for seg 0)
    m_seg = tl.sum(tl.where(segs == seg, ms, 0.0), 0)
    scale = tl.exp((m_seg - M).to(tl.float64))
    base = z_ptr + row * s_z
    cols = tl.arange(0, BLOCK_V)
    lo = seg * SEG
    hi = tl.minimum(lo + SEG, V)
    token = hi                                                   # none yet
    last = lo                                                    # the last token of positive mass so far
    for v0 in range(lo, hi, BLOCK_V):
        e = tl.exp(_scaled_logits(base, v0 + cols, hi, temp, SCALE) - m_seg).to(tl.float64) * scale
        run = prefix + tl.cumsum(e, 0)
        first = tl.min(tl.where((run >= thr) & (e > 0), v0 + cols, hi), 0)
        token = tl.minimum(token, first)
        last = tl.maximum(last, tl.max(tl.where(e > 0, v0 + cols, lo), 0))
        prefix += tl.sum(e, 0)
    tl.store(out_ptr + row, tl.where(token < hi, token, last).to(tl.int64))


def sample_tokens(logits: torch.Tensor, temperature: float, u: torch.Tensor) -> torch.Tensor:
    """kernels.sample_tokens on the Triton backend, without top-k / top-p: logits (B, V), u (B,) float64
    -> (B,) int64."""
    B, V = logits.shape
    z = logits if logits.stride(1) == 1 else logits.contiguous()
    S = triton.cdiv(V, VOCAB_SEGMENT)
    m = torch.empty(B, S, dtype=torch.float32, device=z.device)
    t = torch.empty(B, S, dtype=torch.float64, device=z.device)
    out = torch.empty(B, dtype=torch.long, device=z.device)
    if B:
        scale = temperature != 1.0
        block = _vocab_block(V)
        _sample_segments_kernel[(B, S)](_aligned(z), m, t, V, z.stride(0), float(temperature), VOCAB_SEGMENT,
                                        SCALE=scale, BLOCK_V=block, **LAUNCH)
        _sample_pick_kernel[(B,)](_aligned(z), _aligned(u.to(device=z.device, dtype=torch.float64).contiguous()),
                                  m, t, out, V, z.stride(0), float(temperature), VOCAB_SEGMENT, S, SCALE=scale,
                                  BLOCK_V=block, BLOCK_S=triton.next_power_of_2(S), **LAUNCH)
    return out
