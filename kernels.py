"""Every numeric op of the forward pass (and the sampler's draw), written to be batch-invariant.

Batch invariance: the result for one row (token) is bitwise the same whatever other rows share the
call, how many there are, and how the batch is padded. The sampler and the trainer both call these
functions, so the log-probs and expert routes recorded at rollout are exactly what training recomputes.

How each op keeps the contract on the CPU (torch backend; each rule is checked by tests/):
* linear:    the rows are cut into fixed ROW_CHUNK-row tiles (the last one zero-padded) and multiplied
             with one batched matmul of fixed tile shape, so a row never sees a different GEMM shape.
             A plain `x @ w.T` picks its blocking from the number of rows and is NOT invariant.
* norms, log-softmax, softmax: reductions over the last dim only, one code path for every row count.
* elementwise: only ops that round the same in the vector body and tail (exp, division, mul/add);
             SiLU is written as x / (1 + exp(-x)), RMSNorm divides by sqrt instead of using rsqrt.
* attention: keys are visited in KV_BLOCK-key tiles at absolute positions 0, 16, 32, ... with an
             online softmax; a fully masked tile is an exact no-op, so prefill (many queries), decode
             (one query) and any padding give the same bits. q.k and p.v are bmm's over fixed
             ATTN_ROWS-row tiles of query rows (never a GEMM whose shape depends on the number of queries).
             Sinks start the softmax; a sliding window lets a row skip the tiles below it (exact).
             MLA's per-head projections (linear_heads) take linear()'s fixed row tiles.
* MoE:       a stable sort of (token, k) slots by expert, each expert's rows through the chunked linear,
             the router weight applied in fp32, then a fixed-order fp32 sum over k. No index_add_, no atomics.
* router:    softmax, or sigmoid as 1 / (1 + exp(-x)), in fp32; top-k by a stable descending sort (ties go
             to the lowest expert id), also inside group-limited routing; a score-correction bias only
             shifts the choice. Row-local torch ops on every device (a CUDA test proves them there).
* sampling:  the sampler's draw, the inverse CDF along the row at the row's own uniform (float64
             cumsum); row-local ops, so a sequence's token never depends on its neighbours.

Backward passes of the torch backend come from autograd on these ops: correct and deterministic, not
batch-invariant (kernels_triton/ops.py writes its own, also deterministic).

Backends: KERNELS_BACKEND=torch|triton|auto (default auto: the Triton kernels of kernels_triton*.py
for CUDA tensors, this torch code otherwise); `set_backend(name)` overrides it, also as a context
manager. Triton is imported only when the triton backend is first used.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import os

import torch
import torch.nn.functional as F

ROW_CHUNK = 32   # rows per matmul tile; fixed, never chosen from the number of rows
KV_BLOCK = 16    # keys per attention tile; a KV page holds a whole number of tiles
ATTN_ROWS = 16   # query rows per attention bmm tile (small: decode has only heads-per-KV-head rows)

# --- backend selection ------------------------------------------------------------------------------
BACKENDS = ("torch", "triton", "auto")


def _check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"kernels backend {name!r}: choose one of {', '.join(BACKENDS)} (KERNELS_BACKEND)")
    return name


_backend = _check_backend(os.environ.get("KERNELS_BACKEND", "auto"))


def get_backend() -> str:
    return _backend


class set_backend:
    """set_backend("triton") switches every op's backend; `with set_backend(...):` restores it after."""

    def __init__(self, name: str):
        global _backend
        self.previous, _backend = _backend, _check_backend(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _backend
        _backend = self.previous


def triton_for(t: torch.Tensor):
    """The kernels_triton module if tensor t goes to the Triton backend, else None (lazy import); a
    plug-in's own kernels ask it too (hybrids/gdn_triton.py)."""
    if _backend == "torch" or (_backend == "auto" and not t.is_cuda):
        return None
    from kernels_triton import ops as kernels_triton
    return kernels_triton


# --- end backend selection --------------------------------------------------------------------------

# --- another op set: the rollout's, from outside (the lab's fast ops, lab/fast_ops.py) ------------------
SWAPPABLE = ("linear", "linear_heads", "rms_norm", "silu_mul", "paged_attention", "sigmoid", "moe_experts",
             "ranked", "round_router_logits")


@contextlib.contextmanager
def op_set(ops: dict):
    """`with kernels.op_set(ops):` runs the block with some of SWAPPABLE's ops replaced by others (ops:
    {name: function}; {} changes nothing). The model and this module call each op by its name at call
    time, so a replaced one serves every caller. The sampler runs its steps so (rollout.Sampler.ops); the
    trainer never runs inside such a block, and INVARIANT_OPS restores the invariant set within one."""
    unknown = sorted(set(ops) - set(SWAPPABLE))
    if unknown:
        raise ValueError(f"kernels.op_set: {unknown} are not replaceable ops (kernels.SWAPPABLE)")
    here = globals()
    saved = {name: here[name] for name in ops}
    here.update(ops)
    try:
        yield
    finally:
        here.update(saved)


# ---------------------------------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------------------------------
def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T with fp32 accumulation, bitwise independent of the number of rows.

    x (..., K), w (N, K) -> (..., N) in x.dtype.
    """
    if (kt := triton_for(x)) is not None:    # triton backend dispatch
        return kt.linear(x, w)
    lead, K = x.shape[:-1], x.shape[-1]
    N = w.shape[0]
    x2 = x.reshape(-1, K)                                           # (M, K)
    M = x2.shape[0]
    # 1..ROW_CHUNK zero rows (never 0: an empty pad would skip ops, and the op count would depend on M)
    x2 = torch.cat([x2, x2.new_zeros(ROW_CHUNK - M % ROW_CHUNK, K)])
    if N == 1:      # one output column: a lone tile took a matrix-vector kernel (other bits); two stay tiled
        w = torch.cat([w, w.new_zeros(1, K)])
    tiles = x2.float().view(-1, ROW_CHUNK, K)                       # (M/C, C, K)
    wt = w.float().t().unsqueeze(0).expand(tiles.shape[0], -1, -1)  # (M/C, K, N'), a view
    y = torch.bmm(tiles, wt).view(-1, w.shape[0])[:M, :N]           # (M, N) fp32
    return y.to(x.dtype).view(*lead, N)


def linear_heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per head h, y[..., h, :] = x[..., h, :] @ w[h].T with fp32 accumulation, bitwise independent of the
    number of rows. x (..., H, K), w (H, N, K) -> (..., H, N) in x.dtype (MLA's absorbed key and value
    projections). The torch path is linear()'s: fixed ROW_CHUNK-row tiles, one batched matmul for all heads."""
    if (kt := triton_for(x)) is not None:    # triton backend: the matmul kernel, one launch per head
        return torch.stack([kt.linear(x[..., h, :], w[h]) for h in range(w.shape[0])], -2)
    lead, (H, K), N = x.shape[:-2], x.shape[-2:], w.shape[1]
    x2 = x.reshape(-1, H, K).transpose(0, 1)                        # (H, M, K)
    M = x2.shape[1]
    x2 = torch.cat([x2, x2.new_zeros(H, ROW_CHUNK - M % ROW_CHUNK, K)], 1)     # 1..ROW_CHUNK zero rows, as linear
    n_tiles = x2.shape[1] // ROW_CHUNK
    tiles = x2.float().reshape(H * n_tiles, ROW_CHUNK, K)           # (H*M/C, C, K)
    wt = w.float().transpose(1, 2)[:, None].expand(H, n_tiles, K, N).reshape(H * n_tiles, K, N)
    y = torch.bmm(tiles, wt).view(H, -1, N)[:, :M]                  # (H, M, N) fp32
    return y.transpose(0, 1).to(x.dtype).reshape(*lead, H, N)


# ---------------------------------------------------------------------------------------------------
# elementwise and row reductions
# ---------------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: normalise in fp32, round to x.dtype, then scale (as transformers does)."""
    if (kt := triton_for(x)) is not None:    # triton backend dispatch
        return kt.rms_norm(x, weight, eps)
    xf = x.float()
    var = (xf * xf).mean(-1, keepdim=True)
    return weight * (xf / torch.sqrt(var + eps)).to(x.dtype)


def rms_norm_centered(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The zero-centred RMSNorm of Qwen3-Next / Qwen3.5 (weights stored minus one): normalise and scale by
    (1 + w), both in fp32, then round to x.dtype once (as transformers does)."""
    xf = x.float()
    var = (xf * xf).mean(-1, keepdim=True)
    return (xf / torch.sqrt(var + eps) * (1.0 + weight.float())).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in fp32 with the row-invariant x / (1 + exp(-x))."""
    g = gate.float()
    return (g / (1.0 + torch.exp(-g)) * up.float()).to(gate.dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's GLU: gate clamped to <= limit, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha *
    gate), in fp32 with the row-invariant sigmoid, rounded to gate.dtype."""
    g = gate.float().clamp(max=limit)
    u = up.float().clamp(min=-limit, max=limit)
    return ((u + 1) * (g * sigmoid(g * alpha))).to(gate.dtype)


def rope_tables(head_dim: int, theta: float, max_pos: int, device=None,
                yarn: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (max_pos, head_dim // 2) in fp32, computed once (same formulas as transformers).

    yarn: YaRN's parameters (ModelConfig.yarn()): each frequency is a blend of itself (extrapolation)
    and itself / factor (interpolation) along a linear ramp over the dims, and cos and sin are scaled
    by the attention factor."""
    base = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)   # (head_dim/2,)
    inv_freq, factor = 1.0 / base, 1.0
    if yarn is not None:
        inv_freq, factor = _yarn_inv_freq(base, head_dim, theta, **yarn)
    freqs = torch.arange(max_pos, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    if factor == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * factor, freqs.sin() * factor


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(base: torch.Tensor, dim: int, theta: float, *, factor: float, original_max_position_embeddings: int,
                   beta_fast: float, beta_slow: float, truncate: bool, mscale: float, mscale_all_dim: float,
                   attention_factor: float) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: base (dim/2,) = theta^(2i/dim) -> the blended
    inverse frequencies (dim/2,) fp32 and the cos/sin scale."""
    def dim_of(rotations):            # the dim whose wavelength makes `rotations` turns over the original context
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                 # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=base.device) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp            # 1: keep the frequency (high ones), 0: divide it by factor (low ones)
    inv_freq = 1.0 / (factor * base) * (1 - extrapolate) + 1.0 / base * extrapolate
    if not attention_factor:
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    return inv_freq, float(attention_factor)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX half-split rotary embedding in fp32. x (B, T, H, D); cos, sin (B, T, D/2)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)                                    # (B, T, H, D/2) each
    c, s = cos[:, :, None, :], sin[:, :, None, :]                   # (B, T, 1, D/2)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# attention over a paged KV cache
# ---------------------------------------------------------------------------------------------------

def packed_block(t: torch.Tensor) -> int:
    """Positions per query block and page of a packed forward's attention (packing.PackedPages): the
    torch kernel's key tile; on Triton the forward's query rows per program, so a query sits at the
    place of its program's tile it has in the padded forward."""
    if (kt := triton_for(t)) is not None:
        return max(KV_BLOCK, kt.ATTN_TABLE["fwd"][0])
    return KV_BLOCK


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, positions: torch.Tensor, scale: float,
                    sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Causal attention of queries against their sequence's keys in a paged cache.

    q (B, T, H, D): queries of B sequences, T per sequence (prefill) or 1 (decode).
    k_cache, v_cache (num_pages, page_size, KVH, D): page p holds positions [i*page_size, (i+1)*page_size)
        of the sequence whose block_table row has p at index i.
    block_table (B, n_blocks) int: page ids per sequence; entries past the sequence's end may be any
        valid page (they are masked).
    positions (B, T) int: absolute position of each query; query at p sees keys 0..p.
    sinks (H,) or None: a learned logit per head, one more term exp(sink) in each softmax's denominator
        and none in its numerator (gpt-oss): the online softmax starts from it (m = sink, l = 1).
    window: if > 0, a query at p sees only keys p - window + 1 .. p (sliding-window attention).
    Returns (B, T, H, D) in q.dtype.

    The keys are visited in KV_BLOCK tiles at absolute positions with an online softmax in fp32; a row
    (sequence) walks the tiles from the first one its queries' windows reach (0 without a window) up
    to its own largest position. A tile masked for a query is an exact no-op for it (max unchanged,
    alpha = exp(0) = 1, p = 0; from the empty state, l and acc stay exactly 0), so where a row starts
    and stops does not change its bits: a decode step skips the tiles below its window, and gives the
    bits of the prefill that walked them.
    """
    if (kt := triton_for(q)) is not None:    # triton backend dispatch
        return kt.paged_attention(q, k_cache, v_cache, block_table, positions, scale, sinks, window)
    assert k_cache.shape[1] % KV_BLOCK == 0, "page_size must be a multiple of KV_BLOCK"
    # Each row walks its own tiles only: rows sorted by tile count (descending, stable), so at step i
    # the rows still walking are a prefix; a row retires after its last tile (the tiles it skips were
    # exact no-ops for it). A packed batch's short sequences then cost their own length, not the
    # longest one's; rows of equal length (the padded trainer batch) keep their order.
    first = torch.zeros_like(positions[:, 0])                         # (B,) the row's first tile
    if window:
        first = (positions.amin(1) - window + 1).clamp(min=0) // KV_BLOCK
    counts = positions.amax(1) // KV_BLOCK + 1 - first                # (B,) tiles to walk
    order = torch.argsort(counts, descending=True, stable=True)
    tiles = counts[order].tolist()                                    # host: the loop bounds
    if tiles[0] == tiles[-1]:
        return _attend_tiles(q, k_cache, v_cache, block_table, positions, scale, tiles, first, sinks, window)
    out = _attend_tiles(q[order], k_cache, v_cache, block_table[order], positions[order], scale, tiles,
                        first[order], sinks, window)
    return torch.empty_like(out).index_copy(0, order, out)            # back to the callers' row order


def _attend_tiles(q, k_cache, v_cache, block_table, positions, scale: float, tiles: list[int],
                  first: torch.Tensor, sinks, window: int) -> torch.Tensor:
    """paged_attention's torch path for rows sorted by their tile counts `tiles` (descending), row b
    walking tiles first[b], first[b] + 1, ..."""
    B, T, H, D = q.shape
    page_size, KVH = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    # The T * G query rows of each (sequence, KV head) go through fixed ATTN_ROWS-row bmm tiles, as in
    # linear(): a row's q.k and p.v never see a GEMM shape that depends on how many rows there are.
    # Only the two bmm's see the padding rows; the softmax state and its elementwise ops (row-local,
    # exact or invariant: max, exp, mul, add, a 16-key sum) keep the R real rows, so a decode step
    # (R = G rows padded to ATTN_ROWS) does not pay for the padding.
    R = T * G
    n_chunks = -(-R // ATTN_ROWS)
    pad = n_chunks * ATTN_ROWS - R
    qr = (q.float() * scale).view(B, T, KVH, G, D).permute(0, 2, 1, 3, 4).reshape(B, KVH, R, D)
    qr = F.pad(qr, (0, 0, 0, pad)).reshape(B * KVH * n_chunks, ATTN_ROWS, D)   # (B*KVH*nC, C, D); MHA: a view
    row_pos = positions[:, None, :, None].expand(B, 1, T, G).reshape(B, 1, R)
    m, l = _softmax_start(sinks, B, KVH, T, G, q.device)              # (B, KVH, R) each
    acc = torch.zeros((B, KVH, R, D), dtype=torch.float32, device=q.device)
    offs = torch.arange(KV_BLOCK, device=q.device)
    k_slots, v_slots = k_cache.view(-1, KVH, D), v_cache.view(-1, KVH, D)     # (pages * page_size, KVH, D)
    done = []                                                        # (acc, l) of retired rows, last first

    def per_chunk(t):                                                # (n, KVH, ...) -> (n*KVH*nC, ...)
        return t[:, :, None].expand(t.shape[0], KVH, n_chunks, *t.shape[2:]).reshape(-1, *t.shape[2:])
    n = B
    for i in range(tiles[0]):
        while tiles[n - 1] <= i:                                      # rows whose last tile has passed
            n -= 1
        if n < acc.shape[0]:
            done.append((acc[n:], l[n:]))
            acc, l, m = acc[:n], l[:n], m[:n]
        lo = (first[:n] + i) * KV_BLOCK                               # (n,) each row's tile
        page = block_table[:n].gather(1, (lo // page_size)[:, None])[:, 0]
        slots = (page * page_size + lo % page_size)[:, None] + offs   # (n, KB)
        k = k_slots.index_select(0, slots.view(-1)).view(n, KV_BLOCK, KVH, D).float().permute(0, 2, 3, 1)  # (n, KVH, D, KB)
        v = v_slots.index_select(0, slots.view(-1)).view(n, KV_BLOCK, KVH, D).float().permute(0, 2, 1, 3)  # (n, KVH, KB, D)
        s = torch.bmm(qr[:n * KVH * n_chunks], per_chunk(k)).view(n, KVH, R + pad, KV_BLOCK)[:, :, :R].contiguous()
        key = (lo[:, None] + offs)[:, None, None, :]                  # (n, 1, 1, KB)
        visible = key <= row_pos[:n, ..., None]                       # (n, 1, R, KB)
        if window:
            visible = visible & (key > row_pos[:n, ..., None] - window)
        s = s.masked_fill(~visible, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        # a query whose window starts past this tile has seen no key yet (m = -inf without sinks): its
        # state stays exactly empty (p = 0, alpha = 0) rather than exp(-inf + inf) = nan
        m_ref = torch.where(m_new > float("-inf"), m_new, 0.0) if window else m_new
        alpha = torch.exp(m - m_ref)
        p = torch.exp(s - m_ref[..., None])                          # (n, KVH, R, KB)
        l = l * alpha + p.sum(-1)
        p = (F.pad(p, (0, 0, 0, pad)) if pad else p).view(-1, ATTN_ROWS, KV_BLOCK)   # (n*KVH*nC, C, KB)
        pv = torch.bmm(p, per_chunk(v)).view(n, KVH, R + pad, D)[:, :, :R]
        acc = acc * alpha[..., None] + pv
        m = m_new
    if done:
        acc = torch.cat([acc] + [a for a, _ in done[::-1]])
        l = torch.cat([l] + [x for _, x in done[::-1]])
    out = (acc / l[..., None]).reshape(B, KVH, T, G, D)             # (B, KVH, T, G, D)
    return out.permute(0, 2, 1, 3, 4).reshape(B, T, H, D).to(q.dtype)


def _softmax_start(sinks, B: int, KVH: int, T: int, G: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax's (m, l) before the first key, (B, KVH, T*G) fp32 each (row t*G + g is head
    kvh*G + g): empty (-inf, 0), or with sinks the sink's own term (m = sink, l = exp(0) = 1)."""
    if sinks is None:
        return (torch.full((B, KVH, T * G), float("-inf"), dtype=torch.float32, device=device),
                torch.zeros((B, KVH, T * G), dtype=torch.float32, device=device))
    m = sinks.float().view(1, KVH, 1, G).expand(B, KVH, T, G).reshape(B, KVH, T * G)
    return m, torch.ones_like(m)


# ---------------------------------------------------------------------------------------------------
# MoE: router and experts
# ---------------------------------------------------------------------------------------------------
def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
          forced_ids: torch.Tensor | None = None, *, scoring: str = "softmax", bias: torch.Tensor | None = None,
          n_group: int = 1, topk_group: int = 1, scaling: float = 1.0, detail: bool = False,
          group_score: str = "top2_sum") -> tuple[torch.Tensor, ...]:
    """Router: the scores of ROUTER_SCORES[scoring] in fp32 (softmax by default), top-k with lowest-index
    tie-break, optional renormalisation.

    logits (M, E) -> ids (M, k) int64 used, weights (M, k) fp32, chosen (M, k) int64: the router's own
    top-k (equal to ids unless forced). bias (E,): the score-correction bias, added to the scores for the
    choice only (DeepSeek-V3's aux-loss-free balancing); n_group, topk_group: group-limited top-k
    (_group_limit, group_score); scaling: routed_scaling_factor, applied last.
    forced_ids (M, k): replay (R3) these experts instead of choosing; the weights are still the
    model's own scores of those experts (then the same renormalisation and scaling), so the router
    keeps its gradient. A row of all -1 (a position nobody recorded, e.g. padding) is routed normally.
    detail: also return margin (M,) and entropy (M,), fp32 and detached (see route_margin and
    router_entropy); the first three outputs keep their bits.

    Every step is row-local torch (sorts are stable and descending: ties go to the lowest index), also
    on CUDA, where no Triton kernel replaces it; tests/test_hf.py's GPU test shows the row invariance there.
    """
    kind = ROUTER_SCORES[scoring]
    probs = kind.scores(round_router_logits(logits))                 # (M, E) fp32; another op set may round the logits
    choice = probs if bias is None else probs + bias.float()
    if n_group > 1:
        choice = _group_limit(choice, n_group, topk_group, group_score)
    ids = chosen = ranked(choice, top_k)[1]
    if detail:
        margin = route_margin(choice, top_k)
        entropy = router_entropy(kind.distribution(probs))
    if forced_ids is not None:
        forced_ids = forced_ids.long()
        free = (forced_ids < 0).all(-1, keepdim=True)               # (M, 1) unrecorded rows
        ids = torch.where(free, ids, forced_ids)
    weights = kind.weigh(probs.gather(-1, ids))
    if norm_topk_prob:
        total = weights[:, 0]
        for j in range(1, top_k):                                    # fixed order, k ascending
            total = total + weights[:, j]
        weights = weights / (total + kind.eps if kind.eps else total)[:, None]
    if scaling != 1.0:
        weights = weights * scaling
    return (ids, weights, chosen, margin, entropy) if detail else (ids, weights, chosen)


def route_margin(choice: torch.Tensor, top_k: int) -> torch.Tensor:
    """How close a routing decision was: the k-th best minus the (k+1)-th best of the scores the choice
    was made on (biased, group-limited), (M, E) fp32 -> (M,) fp32, detached. 0 is a tie; +inf where
    fewer than k+1 experts could be chosen (E == k, or groups that leave only k).

    Values of a sort, then one subtraction: elementwise, so row-invariant, the same bits in the sampler
    and the trainer (another op set's `ranked`, torch.topk, gives the same values as the stable sort)."""
    choice = choice.detach()
    if top_k >= choice.shape[-1]:
        return torch.full(choice.shape[:-1], float("inf"), device=choice.device)
    top = ranked(choice, top_k + 1)[0]
    return top[:, top_k - 1] - top[:, top_k]


def ranked(choice: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row, (values, indices) (M, k), best first, ties to the lower index (a stable
    sort: row-local, the same choice in the sampler and the trainer)."""
    top = torch.sort(choice, dim=-1, descending=True, stable=True)
    return top.values[:, :k], top.indices[:, :k]


def round_router_logits(logits: torch.Tensor) -> torch.Tensor:
    """The router's logits as they are; another op set may round them (the lab's --router_bf16)."""
    return logits


def router_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the routing distribution: the router's scores (M, E) fp32 (softmax, or sigmoids),
    normalised to sum 1, -> (M,) fp32, detached. 0 log 0 counts as 0. For logging only."""
    p = probs.detach()
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
    return -(p * torch.log(p.clamp(min=1e-30))).sum(-1)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in fp32, row-invariant (fp32 torch.sigmoid was not on an AVX-512 CPU).

    x is clamped at -80 (sigmoid < 2e-35 there) so exp(-x) never overflows, which would make the
    gradient inf / inf = nan. Used by the router's sigmoid scoring and Qwen2-MoE's shared-expert gate.
    """
    z = x.float().clamp(min=-80.0)
    return 1.0 / (1.0 + torch.exp(-z))


class RouterScores:
    """One kind of router scores (ModelConfig.router_scoring, a key of ROUTER_SCORES): route takes the top-k
    on scores(logits) (plus the bias, group-limited) and weighs the chosen experts by weigh(their scores),
    renormalised over k with eps added (norm_topk_prob); distribution(scores) is what the route entropy is
    of. Each is row-local (the same bits in the sampler and the trainer)."""

    def __init__(self, scores, weigh=None, eps: float = 0.0, distribution=None):
        self.scores = scores                                          # logits (M, E) -> fp32 (M, E)
        self.weigh = weigh or (lambda w: w)                           # the chosen ones' scores (M, k) -> weights
        self.eps = eps
        self.distribution = distribution or (lambda p: p)


def _softmax_of_chosen(w: torch.Tensor) -> torch.Tensor:
    """gpt-oss: a softmax over the k chosen logits, exp(z - max) (route's renormalisation divides, in k order)."""
    return torch.exp(w - w.amax(-1, keepdim=True))


# Qwen, Mixtral, OLMoE: softmax over E; DeepSeek-V3, GLM-4.5: sigmoids (1 / (1 + exp(-z)): torch.sigmoid was not
# row-invariant), which can all be 0; gpt-oss: the top-k of the logits themselves, weighted by a softmax over those k
ROUTER_SCORES: dict[str, RouterScores] = {
    "softmax": RouterScores(lambda z: torch.softmax(z.float(), dim=-1)),
    "sigmoid": RouterScores(lambda z: sigmoid(z), eps=1e-20),            # (looked up at each call: an op set's)
    "topk_softmax": RouterScores(lambda z: z.float(), weigh=_softmax_of_chosen,
                                 distribution=lambda p: torch.softmax(p, -1)),
}


def _group_limit(choice: torch.Tensor, n_group: int, topk_group: int, score: str = "top2_sum") -> torch.Tensor:
    """Set to -inf the scores outside each row's topk_group best groups (DeepSeek's group-limited
    routing). choice (M, E) fp32; a group's score is the sum of its two best (V3) or its best (V2, "max");
    ties: lowest group index."""
    M, E = choice.shape
    grouped = choice.view(M, n_group, E // n_group)                  # (M, G, E/G)
    top2 = torch.sort(grouped, dim=-1, descending=True).values       # values only: ties do not matter
    group_score = top2[..., 0] + top2[..., 1] if score == "top2_sum" else top2[..., 0]   # (M, G)
    best = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    keep = torch.zeros(M, n_group, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(M, E), float("-inf"))


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                ids: torch.Tensor, weights: torch.Tensor, b13: torch.Tensor | None = None,
                b2: torch.Tensor | None = None, swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """Sum over k of weight_k * down(silu(gate x) * up x) for each token's chosen experts.

    x (M, D); w13 (E, 2I, D) gate rows first; w2 (E, D, I); ids (M, k); weights (M, k) fp32.
    gpt-oss's experts: b13 (E, 2I) and b2 (E, D) biases after each matmul (in x.dtype, as Linear's), and
    swiglu = (alpha, limit), its clamped SwiGLU (clamped_swiglu) in place of silu(gate) * up.
    The torch path is the three steps below; parallel/expert_parallel.py runs the same three with an exchange
    between them (sort_slots and grouped_experts on the expert's owner, combine_slots on the token's rank).
    """
    extras = dict(b13=b13, b2=b2, swiglu=swiglu)
    if triton_for(x) is not None:            # triton backend dispatch (the fused MoE has its own file)
        from kernels_triton import moe as kernels_triton_moe
        return kernels_triton_moe.moe_experts(x, w13, w2, ids, weights, **extras)
    M, k = ids.shape
    order, counts = sort_slots(ids, w13.shape[0])                   # slot s = token s // k
    per_slot = grouped_experts(x, k, order, counts, w13, w2, weights.reshape(-1), **extras)   # (M*k, D) fp32
    return combine_slots(per_slot.view(M, k, x.shape[1]), x.dtype)


def expert_rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """Each row through one expert: weights[r] * down(silu(gate x[r]) * up x[r]) of expert ids[r], fp32.

    The per-slot terms that moe_experts sums over k, for the rows an expert-parallel owner received:
    x (R, D); ids (R,) into w13 (E, 2I, D) / w2 (E, D, I); weights (R,) fp32 -> (R, D) fp32; b13, b2,
    swiglu as in moe_experts. A row's bits are those of its slot in moe_experts on the same backend (the
    same row-invariant kernels).
    """
    extras = dict(b13=b13, b2=b2, swiglu=swiglu)
    if triton_for(x) is not None:            # the fused Triton MoE, a slot per row
        from kernels_triton import moe as kernels_triton_moe
        return kernels_triton_moe.expert_rows(x, w13, w2, ids, weights, **extras)
    order, counts = sort_slots(ids.reshape(-1, 1), w13.shape[0])
    return grouped_experts(x, 1, order, counts, w13, w2, weights.reshape(-1), **extras)


def sort_slots(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The (row, slot) pairs grouped by expert with a stable sort: ids (R, k) -> order (R*k,), rows per expert."""
    slot_expert = ids.reshape(-1)                                    # (R*k,)
    order = torch.sort(slot_expert, stable=True).indices
    counts = torch.bincount(slot_expert, minlength=n_experts).tolist()
    return order, counts


def grouped_experts(x: torch.Tensor, k: int, order: torch.Tensor, counts: list[int], w13: torch.Tensor,
                    w2: torch.Tensor, weights: torch.Tensor, b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None, swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """weight * down(silu(gate x) * up x) in fp32 for each slot s, which reads row s // k of x.

    x (R, D); order, counts from sort_slots; w13 (E, 2I, D); w2 (E, D, I); weights (R*k,) fp32
    -> (R*k, D) fp32 in slot order. Each expert's rows go through the row-chunked linear, so a slot's
    bits depend neither on the other slots of its expert nor on its position among them (the biases
    and the GLU are elementwise). b13, b2, swiglu: see moe_experts.
    """
    I = w2.shape[2]
    outs, start = [], 0
    for e, n in enumerate(counts):                                   # empty experts too: the same ops
        slots = order[start:start + n]                               # whichever experts the batch hits
        start += n
        h = linear(x[slots // k], w13[e])                           # (n, 2I)
        if b13 is not None:
            h = h + b13[e]
        if swiglu is None:
            a = silu_mul(h[:, :I], h[:, I:])                        # (n, I)
        else:
            a = clamped_swiglu(h[:, :I], h[:, I:], *swiglu)
        y = linear(a, w2[e])                                        # (n, D)
        if b2 is not None:
            y = y + b2[e]
        outs.append(y.float() * weights[slots, None])
    sorted_out = torch.cat(outs)                                    # (R*k, D) in expert order
    return sorted_out[torch.argsort(order)]                         # back to slot order


def combine_slots(per_slot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The top-k combine: per_slot (M, k, D) fp32 summed over k ascending in fp32, rounded to dtype."""
    out = per_slot[:, 0]
    for j in range(1, per_slot.shape[1]):                          # fixed-order fp32 combine
        out = out + per_slot[:, j]
    return out.to(dtype)


# ---------------------------------------------------------------------------------------------------
# log-prob of the chosen tokens
# ---------------------------------------------------------------------------------------------------
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False):
    """log softmax(logits / temperature)[target] in fp32. logits (..., V), targets (...) -> (...).

    The one definition of a token's log-prob, used by the sampler and the trainer alike.
    temperature 0 (greedy sampling) scores under the unscaled distribution.
    with_entropy: return (logp, entropy), entropy (...) fp32 the entropy of the same distribution
    softmax(logits / T), from the same pass over the vocabulary. The entropy is detached (no
    gradient: it is for logging); logp is bitwise the same with or without it.
    """
    if triton_for(logits) is not None:       # triton backend dispatch (the vocabulary ops have their own file)
        from kernels_triton import vocab as kernels_triton_vocab
        return kernels_triton_vocab.token_logprobs(logits, targets, temperature, with_entropy)
    logp_all = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp
    with torch.no_grad():
        entropy = _entropy(logp_all)
    return logp, entropy


def softmax_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The entropy of softmax(logits / temperature) in fp32, (..., V) -> (...), with its gradient (the
    entropy bonus, --entropy_coef). Torch ops on every backend (the backward need not be batch-invariant);
    on the torch backend the values are token_logprobs(with_entropy=True)'s detached ones, bit for bit."""
    return _entropy(torch.log_softmax(_scaled(logits, temperature), dim=-1))


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in fp32 (0, greedy, scores the unscaled distribution)."""
    z = logits.float()
    return z / temperature if temperature not in (0.0, 1.0) else z


def _entropy(logp_all: torch.Tensor) -> torch.Tensor:
    p = logp_all.exp()
    return -torch.where(p > 0, p * logp_all, 0.0).sum(-1)            # 0 log 0 = 0


# ---------------------------------------------------------------------------------------------------
# sampling: one token per row by the inverse CDF at a given uniform
# ---------------------------------------------------------------------------------------------------
def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                  u: torch.Tensor, **filters) -> torch.Tensor:
    """Draw one token per row from softmax(logits / temperature), restricted by top-k, top-p and any other of
    SAMPLING_FILTERS (filters: their values by name; each at its `off` value does nothing).

    logits (B, V); u (B,) float64 uniforms in (0, 1] (the sampler's rollout.draw_keys); returns (B,)
    int64 on the logits' device. Inverse CDF: the first token whose cumulative probability (in float64)
    reaches u * total. Every op works along the row (softmax, sort, cumsum, comparison), so a row's draw
    depends on its logits and its u alone, not on the other rows; a few batched ops, whatever the batch.
    Without a filter the Triton backend computes the same inverse CDF in two kernels that read the
    logits about once (kernels_triton_vocab.sample_tokens); its sums run in another order, so the two backends
    agree except where u * total falls within rounding of a token's boundary.
    """
    on = {name: v for name, v in {"top_k": top_k, "top_p": top_p, **filters}.items() if v != SAMPLING_FILTERS[name].off}
    if not on and triton_for(logits) is not None:
        from kernels_triton import vocab as kernels_triton_vocab
        return kernels_triton_vocab.sample_tokens(logits, temperature, u)
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    p = torch.softmax(z, dim=-1)                                            # (B, V)
    if on:
        p = _truncate(p, on)
    cum = _row_cumsum(p.double())                                           # (B, V)
    return (cum < (u * cum[:, -1])[:, None]).sum(-1)                        # first index reaching it


def _row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """cumsum along rows. CUDA's cumsum takes another algorithm (another summation order) for a single
    row: scan at least two rows so that a row's sums do not depend on how many rows there are."""
    B = x.shape[0]
    return torch.cumsum(x if B > 1 else x.repeat(2, 1), dim=-1)[:B]


def _truncate(p: torch.Tensor, on: dict) -> torch.Tensor:
    """Zero the tokens a filter of `on` ({name: value} of SAMPLING_FILTERS) drops (the top token is always
    kept); p (B, V) fp32 probabilities."""
    sorted_p, idx = torch.sort(p, dim=-1, descending=True, stable=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    for name, value in on.items():
        keep &= SAMPLING_FILTERS[name].keep(sorted_p, value)
    return torch.zeros_like(p).scatter(-1, idx, torch.where(keep, sorted_p, 0.0))


class SamplingFilter:
    """A rule that narrows the draw (SAMPLING_FILTERS): keep(sorted_p, value) -> (B, V) bool, the tokens kept
    of each row's probabilities sorted descending (fp32, ties by index; row-local, and keeping the first);
    off: the value that keeps every token; valid(value) and rule: its check and the words of a refusal."""

    def __init__(self, keep, off, valid, rule: str):
        self.keep, self.off, self.valid, self.rule = keep, off, valid, rule


def is_int(v) -> bool:
    """An integer, not a bool (the checks of a count: SAMPLING_FILTERS, the sampler's arguments)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v) -> bool:
    """A real number, not a bool (the checks of a setting: SAMPLING_FILTERS, config.check_sampling)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


# The draw's filters, by the name of the option (a RolloutConfig field) and of generate()'s argument that sets
# each: config's check, the run's sampler and the draw read this table; a new one is an entry and a field
SAMPLING_FILTERS: dict[str, SamplingFilter] = {
    "top_p": SamplingFilter(lambda p, q: (_row_cumsum(p) - p) < q, 1.0,    # the smallest prefix of mass >= q
                            lambda v: is_real(v) and 0 < v <= 1, "must be in (0, 1]"),
    "top_k": SamplingFilter(lambda p, k: torch.arange(p.shape[-1], device=p.device) < k, 0,
                            lambda v: is_int(v) and v >= 0, "must be an integer >= 0 (0 turns it off)"),
}


def grouped_mm_usable(device: torch.device, dtype: torch.dtype, D: int, I: int) -> bool:
    """Whether the fast MoE takes torch._grouped_mm, which runs without a host sync (so a decode step
    can be a CUDA graph) only on sm90 / sm100 in bf16 (elsewhere PyTorch loops over the experts on the
    host), with 16-byte strides: D and I multiples of 8."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device)[0] in (9, 10) and D % 8 == 0 and I % 8 == 0)


INVARIANT_OPS = {name: globals()[name] for name in SWAPPABLE}   # this module's own: what op_set restores
