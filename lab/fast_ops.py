"""The mismatch lab's fast op set: what a typical fast inference engine runs (cuBLAS / F.linear, SDPA,
F.silu, rsqrt, a per-expert MoE loop accumulating with index_add_, torch.topk), whose bits depend on the
batch, and the router's logits rounded to bf16. Swapped into the rollout's steps from outside
(kernels.op_set, rollout.Sampler.ops; RolloutConfig.rollout_ops under --rollout_mode=fast and --router_bf16),
so the trainer, outside the block, sees the mismatch; kernels.py keeps the invariant ops alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels


def op_set(batch_variant: bool, router_bf16: bool) -> dict:
    """{name: op} for kernels.op_set: the batch-variant ops, the bf16 router rounding, both or neither."""
    ops = dict(FAST) if batch_variant else {}
    if router_bf16:
        ops["round_router_logits"] = round_router_logits
    return ops


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def linear_heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("...hk,hnk->...hn", x, w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' formula: rsqrt (its vector tail is not row-invariant)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x.float())


def ranked(choice: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk: no tie-break guarantee (the values equal the stable sort's)."""
    top = torch.topk(choice, k, dim=-1)
    return top.values, top.indices


def round_router_logits(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.bfloat16)                                 # an injected rounding


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Each sequence's pages in table order as one contiguous run: cache (P, page, KVH, D), block_table
    (B, n) -> (B, n * page, KVH, D). index_select copies whole pages (7x faster than cache[table] on a CPU)."""
    B, n = block_table.shape
    return cache.index_select(0, block_table.reshape(-1).long()).view(B, n * cache.shape[1], *cache.shape[2:])


def paged_attention(q, k_cache, v_cache, block_table, positions, scale, sinks=None, window=0):
    """Gather the sequences' pages, then one SDPA call (its kernel and split choices depend on the
    shapes). Every page of the block table is gathered (its width, not positions.max(): no host sync,
    so a decode step can be a CUDA graph); the mask hides what lies past each query. The G query heads
    of a KV head are folded into its query rows, so SDPA sees no GQA: with a mask only its
    memory-efficient CUDA kernel applies, and whether that one takes enable_gqa depends on the torch
    version (else the math fallback would be the baseline). flash-attn's paged decode is not used: it
    needs pages of >= 256 positions, ours are block_size (16 by default)."""
    B, T, H, D = q.shape
    KVH = k_cache.shape[2]
    G = H // KVH
    keys = gather_pages(k_cache, block_table).transpose(1, 2)        # (B, KVH, L, D)
    vals = gather_pages(v_cache, block_table).transpose(1, 2)
    key = torch.arange(keys.shape[2], device=q.device)[None, None, :]
    visible = key <= positions[:, :, None]                            # (B, T, L)
    if window:
        visible = visible & (key > positions[:, :, None] - window)
    rows = q.reshape(B, T, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(B, KVH, G * T, D)  # head kvh*G+g, query t
    mask = visible[:, None, None].expand(B, 1, G, T, keys.shape[2]).reshape(B, 1, G * T, -1)   # (B, 1, G*T, L)
    if sinks is None:
        out = F.scaled_dot_product_attention(rows, keys, vals, attn_mask=mask, scale=scale)     # (B, KVH, G*T, D)
    else:   # SDPA has no sinks: transformers' eager gpt-oss attention (the sink a last logit, then dropped)
        s = (rows @ keys.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))         # (B, KVH, G*T, L)
        sink = sinks.to(s.dtype).view(1, KVH, G, 1, 1).expand(B, KVH, G, T, 1).reshape(B, KVH, G * T, 1)
        out = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1] @ vals
    return out.view(B, KVH, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H, D)


def moe_experts(x, w13, w2, ids, weights, b13=None, b2=None, swiglu=None):
    """What a fast engine runs: torch._grouped_mm over expert-sorted rows (bf16 on a GPU; no host
    sync), else a per-expert loop accumulating with index_add_ in the model dtype (as transformers;
    gpt-oss's biased, clamped experts always take the loop)."""
    plain = b13 is None and b2 is None and swiglu is None
    if plain and kernels.grouped_mm_usable(x.device, x.dtype, x.shape[1], w2.shape[2]):
        return grouped_mm_moe(x, w13, w2, ids, weights)
    I = w2.shape[2]
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        token, slot = torch.where(ids == e)
        h = F.linear(x[token], w13[e], None if b13 is None else b13[e])
        if swiglu is None:
            a = F.silu(h[:, :I]) * h[:, I:]
        else:
            alpha, limit = swiglu
            g, u = h[:, :I].clamp(max=limit), h[:, I:].clamp(-limit, limit)
            a = (u + 1) * g * torch.sigmoid(g * alpha)
        y = F.linear(a, w2[e], None if b2 is None else b2[e])
        out.index_add_(0, token, y * weights[token, slot, None].to(x.dtype))
    return out




def grouped_mm_moe(x, w13, w2, ids, weights):
    M, k = ids.shape
    E, I = w13.shape[0], w2.shape[2]
    flat = ids.reshape(-1)                                           # (M*k,) slot s = token s // k
    order = torch.argsort(flat, stable=True)
    ends = torch.searchsorted(flat[order], torch.arange(1, E + 1, device=x.device)).to(torch.int32)  # (E,)
    h = torch._grouped_mm(x[order // k], w13.transpose(1, 2), offs=ends)             # (M*k, 2I)
    y = torch._grouped_mm(F.silu(h[:, :I]) * h[:, I:], w2.transpose(1, 2), offs=ends)   # (M*k, D)
    per_slot = torch.empty_like(y).index_copy_(0, order, y)          # back to slot order
    return (per_slot.view(M, k, -1) * weights[..., None].to(x.dtype)).sum(1)


FAST = {"linear": linear, "linear_heads": linear_heads, "rms_norm": rms_norm, "silu_mul": silu_mul,
        "paged_attention": paged_attention, "sigmoid": sigmoid, "moe_experts": moe_experts, "ranked": ranked}
