"""Gated DeltaNet (GDN), the linear attention of Qwen3-Next and Qwen3.5-MoE, on an absolute chunk grid.

The layer keeps a state S (per value head, k_head_dim x v_head_dim) that each token decays by exp(g) and
corrects by the delta rule, S <- exp(g) S + k^T beta (v - k S exp(g)), and reads as o = q S. Engines decode
it token by token (the recurrent form) and trainers run it a chunk at a time (the chunked form, FLA's and
transformers'): two algorithms, whose low bits part and compound through the state. Here there is one:

* the grid is absolute: chunk c covers a sequence's positions [c C, (c + 1) C), C = 64, whatever the
  batch, the prefill's split or the number of tokens decoded so far;
* one kernel, `chunk`, computes a chunk from the state at its start, on a C-row block always: a partial
  chunk (a prompt's tail, the tokens decoded since the last boundary) is the complete chunk's first rows
  with zeros after them (g = 0, beta = 0, k = v = q = 0), and each of its rows depends on the rows before
  it alone, by the same ops on the same shapes, so a row's bits do not depend on how many rows follow;
* the state is materialised only at grid boundaries, from complete chunks: the sampler keeps S at the last
  boundary and recomputes the open chunk each step (at most C rows), the trainer scans the chunks in order.

`chunked` is the trainer's form and `recurrent` the engines' (the control: close, not equal). Shapes:
q, k (B, L, H, dk), v (B, L, H, dv), g and beta (B, L, H), in fp32; H is the value heads (a layer with
fewer key heads repeats them first, `expand_heads`); q is already scaled and both q and k l2-normalised
(the layer's part).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

import kernels

CHUNK = 64               # the grid: Qwen3-Next's and FLA's chunk size


def expand_heads(x: torch.Tensor, value_heads: int) -> torch.Tensor:
    """(B, L, Hk, d) -> (B, L, H, d): each key head serves H / Hk consecutive value heads."""
    return x.repeat_interleave(value_heads // x.shape[2], dim=2)


def _inverse_unit_lower(n: torch.Tensor) -> torch.Tensor:
    """(I + N)^-1 for N (..., C, C) strictly lower, by forward substitution: row i from the rows before it
    (the same ops for row i whatever follows it, unlike a batched triangular solve)."""
    C = n.shape[-1]
    rows = [torch.zeros_like(n[..., 0, :])]                               # row 0 of the inverse, less I
    for i in range(1, C):
        before = torch.stack(rows, dim=-2)                                # (..., i, C)
        rows.append(-n[..., i, :] - (n[..., i, :i, None] * before).sum(-2))
    return torch.stack(rows, dim=-2) + torch.eye(C, dtype=n.dtype, device=n.device)


def chunk(q, k, v, g, beta, state):
    """One chunk of the grid: q, k (B, H, C, dk), v (B, H, C, dv), g, beta (B, H, C), state (B, H, dk, dv) at
    the chunk's start -> (out (B, H, C, dv), the state at its end). Rows past a partial chunk's last token
    are zero (then the end state is not a boundary's: the caller keeps the start's)."""
    C = g.shape[-1]
    causal = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    cum = g.cumsum(-1)                                                    # (B, H, C): log decay since the start
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()   # (B, H, C, C)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    lower = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)               # strictly lower: I + it is the system
    t = _inverse_unit_lower(lower)
    u = t @ v_beta                                                        # the delta rule's targets in the chunk
    w = t @ (k_beta * cum.exp()[..., None])                               # what the start state predicts of them
    v_new = u - w @ state
    attn = (q @ k.transpose(-1, -2)) * decay                              # causal, the diagonal included
    out = (q * cum.exp()[..., None]) @ state + attn @ v_new
    last = cum[..., -1:]                                                  # (B, H, 1)
    end = state * last.exp()[..., None] + (k * (last - cum).exp()[..., None]).transpose(-1, -2) @ v_new
    return out, end


def _to_chunks(x: torch.Tensor, n: int, C: int) -> torch.Tensor:
    """(B, L, H, ...) -> (B, H, n, C, ...), zero-padded to n C positions."""
    pad = n * C - x.shape[1]
    x = x.transpose(1, 2)
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[0], x.shape[1], pad, *x.shape[3:])], dim=2)
    return x.reshape(x.shape[0], x.shape[1], n, C, *x.shape[3:])


def chunked(q, k, v, g, beta, state=None, C: int = CHUNK):
    """The trainer's form: the sequences from position 0 (the grid's origin) with `state` there (None:
    zeros) -> (out (B, L, H, dv), the state at the last boundary, the number of positions it covers)."""
    B, L, H, dk = k.shape
    n = -(-L // C)
    qs, ks, vs, gs, bs = (_to_chunks(x, n, C) for x in (q, k, v, g, beta))
    s = q.new_zeros(B, H, dk, v.shape[-1]) if state is None else state
    outs, boundary = [], s
    for c in range(n):
        o, s = chunk(qs[:, :, c], ks[:, :, c], vs[:, :, c], gs[:, :, c], bs[:, :, c], s)
        outs.append(o)
        if (c + 1) * C <= L:
            boundary = s
    out = torch.stack(outs, dim=2).reshape(B, H, n * C, -1)[:, :, :L]
    return out.transpose(1, 2), boundary, L // C * C


def recurrent(q, k, v, g, beta, state=None):
    """The engines' form, a token at a time (what the sampler must not use): the same arithmetic's other
    order. -> (out (B, L, H, dv), the state after the last token)."""
    B, L, H, dk = k.shape
    s = q.new_zeros(B, H, dk, v.shape[-1]) if state is None else state
    outs = []
    for t in range(L):
        s = s * g[:, t].exp()[..., None, None]
        kt = k[:, t]                                                       # (B, H, dk)
        delta = (v[:, t] - (s * kt[..., None]).sum(-2)) * beta[:, t, :, None]
        s = s + kt[..., None] * delta[..., None, :]
        outs.append((s * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, dim=1), s


# ---------------------------------------------------------------------------------------------------
# the layer: projections, the causal conv, the rule, the gated norm (Qwen3.5's separate projections;
# Qwen3-Next's fused, interleaved ones are split at load: split_qwen3_next)
# ---------------------------------------------------------------------------------------------------
def _silu(x: torch.Tensor) -> torch.Tensor:
    """silu in fp32 as x / (1 + exp(-x)): F.silu's vector tail gives a row other bits by its position."""
    x = x.float()
    return x / (1.0 + torch.exp(-x))


def _softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)) in fp32, x itself past 20 (F.softplus's threshold); F.softplus is not row-invariant
    on a vector CPU, log1p and exp are. exp's input is clamped so that its gradient never meets inf."""
    x = x.float()
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp(max=20.0))))


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| along the last dim in fp32, as FLA's kernel (eps inside the root)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, w: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv, then silu: x (B, L, C) the new inputs, w (C, K), before (B, K-1, C) the K-1
    inputs preceding x (zeros at a sequence's start) -> (B, L, C) fp32. The taps add in one order (j = 0
    .. K-1), elementwise, so a position's bits do not depend on the rows around it."""
    K, L = w.shape[1], x.shape[1]
    seq = torch.cat([before, x], dim=1).float()                           # (B, K-1+L, C)
    wf = w.float()
    acc = seq[:, 0:L] * wf[:, 0]
    for j in range(1, K):
        acc = acc + seq[:, j:j + L] * wf[:, j]
    return _silu(acc)


class GatedDeltaNet(nn.Module):
    """A linear-attention layer of Qwen3.5-MoE and Qwen3-Next: x -> in_proj_qkv (q, k for Hk heads, v for H
    heads) -> causal conv + silu -> l2-normalised q (scaled) and k; beta = sigmoid(in_proj_b x),
    g = -exp(A_log) softplus(in_proj_a x + dt_bias) -> the gated delta rule on the grid -> RMSNorm per head,
    gated by silu(in_proj_z x) -> out_proj. Projections by kernels.linear, the row-invariant matmul."""

    def __init__(self, hidden: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                 conv_kernel: int = 4, eps: float = 1e-6, dtype=torch.float32):
        super().__init__()
        self.hk, self.h, self.dk, self.dv, self.eps = key_heads, value_heads, key_dim, value_dim, eps
        self.conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
        p = lambda *shape: nn.Parameter(torch.empty(*shape, dtype=dtype))   # noqa: E731
        self.in_proj_qkv, self.in_proj_z = p(self.conv_dim, hidden), p(value_heads * value_dim, hidden)
        self.in_proj_b, self.in_proj_a = p(value_heads, hidden), p(value_heads, hidden)
        self.conv1d, self.dt_bias, self.A_log = p(self.conv_dim, conv_kernel), p(value_heads), p(value_heads)
        self.norm, self.out_proj = p(value_dim), p(hidden, value_heads * value_dim)

    def rule_inputs(self, x: torch.Tensor, before: torch.Tensor):
        """x (B, L, D) and the conv's K-1 earlier inputs (B, K-1, conv_dim) -> the rule's q, k, v, g, beta
        (fp32, value heads), the gate z (B, L, H, dv) and the conv's inputs (B, L, conv_dim)."""
        B, L, _ = x.shape
        mixed = kernels.linear(x, self.in_proj_qkv)                        # (B, L, conv_dim)
        qkv = causal_conv(mixed, self.conv1d, before)
        q, k, v = qkv.split([self.hk * self.dk, self.hk * self.dk, self.h * self.dv], dim=-1)
        q = expand_heads(_l2norm(q.view(B, L, self.hk, self.dk)), self.h) * self.dk ** -0.5
        k = expand_heads(_l2norm(k.view(B, L, self.hk, self.dk)), self.h)
        beta = kernels.sigmoid(kernels.linear(x, self.in_proj_b))
        g = -self.A_log.float().exp() * _softplus(kernels.linear(x, self.in_proj_a).float() + self.dt_bias.float())
        z = kernels.linear(x, self.in_proj_z).view(B, L, self.h, self.dv)
        return (q, k, v.reshape(B, L, self.h, self.dv), g, beta), z, mixed

    def output(self, core: torch.Tensor, z: torch.Tensor, dtype) -> torch.Tensor:
        """The rule's output (B, L, H, dv) -> (B, L, D): RMSNorm per head (kernels.rms_norm), times silu(z)."""
        normed = kernels.rms_norm(core.to(dtype), self.norm, self.eps)
        gated = (normed.float() * _silu(z)).to(dtype)
        return kernels.linear(gated.flatten(2), self.out_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The trainer's forward: whole sequences from position 0, (B, L, D) -> (B, L, D)."""
        before = x.new_zeros(x.shape[0], self.conv1d.shape[1] - 1, self.conv_dim)
        rule, z, _ = self.rule_inputs(x, before)
        core, _, _ = chunked(*rule)
        return self.output(core, z, x.dtype)

    def extend(self, x: torch.Tensor, cache: "GDNCache") -> torch.Tensor:
        """The sampler's step for one sequence: its next tokens x (1, n, D) (a prefill piece or one decode
        token) on its cache -> (1, n, D). The rows since the last boundary are recomputed with the new ones,
        from the boundary's state, by `chunked` from that boundary: the trainer's chunks, the same bits."""
        rule, z, mixed = self.rule_inputs(x, cache.conv)
        cache.conv = torch.cat([cache.conv, mixed], dim=1)[:, -cache.conv.shape[1]:]
        n, rows = x.shape[1], [torch.cat([o, r], dim=1) for o, r in zip(cache.open, rule)]
        core, state, covered = chunked(*rows, state=cache.state)
        cache.state = state
        cache.open = [r[:, covered:] for r in rows]                       # what the next boundary still needs
        return self.output(core[:, -n:], z, x.dtype)

    def decode(self, x: torch.Tensor, caches: list["GDNCache"]) -> torch.Tensor:
        """One decode token for each of S sequences, x (S, 1, D), in one call -> (S, 1, D): every sequence's
        open chunk (its rows since its last boundary, then the new one) zero-padded to a 64-row block and all
        of them computed by one `chunk` call from their boundary states. The kernel is row- and
        batch-invariant, so each row has the bits `extend` (and the trainer) give it."""
        S, C = x.shape[0], CHUNK
        rule, z, mixed = self.rule_inputs(x, torch.cat([c.conv for c in caches]))
        rows = [[torch.cat([o, r[i:i + 1]], dim=1) for o, r in zip(c.open, rule)] for i, c in enumerate(caches)]
        n = [r[0].shape[1] for r in rows]                                 # each open chunk's rows, 1..C
        padded = [torch.cat([_to_chunks(r[j], 1, C)[:, :, 0] for r in rows]) for j in range(5)]   # (S, H, C, ...)
        core, end = chunk(*padded, torch.cat([c.state for c in caches]))
        for i, c in enumerate(caches):
            c.conv = torch.cat([c.conv, mixed[i:i + 1]], dim=1)[:, 1:]
            c.open = rows[i] if n[i] < C else [r[:, C:] for r in rows[i]]   # a complete chunk: a boundary
            c.state = end[i:i + 1] if n[i] == C else c.state
        out = torch.stack([core[i, :, n[i] - 1] for i in range(S)])[:, None]   # (S, 1, H, dv)
        return self.output(out, z, x.dtype)

    def new_cache(self, dtype=torch.float32, device=None) -> "GDNCache":
        conv = torch.zeros(1, self.conv1d.shape[1] - 1, self.conv_dim, dtype=dtype, device=device)
        state = torch.zeros(1, self.h, self.dk, self.dv, device=device)
        empty = [torch.zeros(1, 0, self.h, d, device=device) for d in (self.dk, self.dk, self.dv)]
        return GDNCache(conv, state, empty + [torch.zeros(1, 0, self.h, device=device)] * 2)


@dataclasses.dataclass
class GDNCache:
    """A sequence's linear-attention memory in the sampler: the conv's last K-1 inputs, the state at the
    last grid boundary, and the rule's inputs since then (at most CHUNK - 1 rows)."""
    conv: torch.Tensor
    state: torch.Tensor
    open: list


def split_qwen3_next(qkvz: torch.Tensor, ba: torch.Tensor, key_heads: int, value_heads: int, key_dim: int,
                     value_dim: int) -> dict[str, torch.Tensor]:
    """Qwen3-Next's fused, per-key-head interleaved in_proj_qkvz / in_proj_ba -> Qwen3.5's separate
    in_proj_qkv ([q of every key head, k, v]), in_proj_z, in_proj_b, in_proj_a (the layout here)."""
    r, D = value_heads // key_heads, qkvz.shape[-1]
    q, k, v, z = qkvz.view(key_heads, 2 * key_dim + 2 * r * value_dim, D).split(
        [key_dim, key_dim, r * value_dim, r * value_dim], dim=1)          # (Hk, rows, D) each
    b, a = ba.view(key_heads, 2 * r, D).split([r, r], dim=1)
    flat = lambda t: t.reshape(-1, D)                                     # noqa: E731
    return {"in_proj_qkv": torch.cat([flat(q), flat(k), flat(v)]), "in_proj_z": flat(z),
            "in_proj_b": flat(b), "in_proj_a": flat(a)}
