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
import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import kernels
from model import Linear, RMSNorm

CHUNK = 64               # the grid: Qwen3-Next's and FLA's chunk size


def expand_heads(x: torch.Tensor, value_heads: int) -> torch.Tensor:
    """(B, L, Hk, d) -> (B, L, H, d): each key head serves H / Hk consecutive value heads."""
    return x.repeat_interleave(value_heads // x.shape[2], dim=2)


class _InverseUnitLower(torch.autograd.Function):
    """(I + N)^-1 for N (..., C, C) strictly lower, by forward substitution: row i from the rows before it
    (the same ops for row i whatever follows it, unlike a batched triangular solve). Row i's sum over the
    rows before it is one (1 x i) @ (i x C) product per matrix: its shape is i's alone, not the batch's.
    The backward is the inverse's own: with T = (I + N)^-1, dT = -T dN T, so dN = -(T^T G T^T), strictly
    lower (two matmuls, not the 63 steps' graph)."""

    @staticmethod
    def forward(ctx, n):
        C = n.shape[-1]
        inv = torch.zeros_like(n)
        for i in range(1, C):
            inv[..., i:i + 1, :] = -n[..., i:i + 1, :] - n[..., i:i + 1, :i] @ inv[..., :i, :]
        inv = inv + torch.eye(C, dtype=n.dtype, device=n.device)
        ctx.save_for_backward(inv)
        return inv

    @staticmethod
    def backward(ctx, g):
        t = ctx.saved_tensors[0].transpose(-1, -2)
        return -(t @ g @ t).tril(-1)


_inverse_unit_lower = _InverseUnitLower.apply


def chunk(q, k, v, g, beta, state):
    """One chunk of the grid: q, k (B, H, C, dk), v (B, H, C, dv), g, beta (B, H, C), state (B, H, dk, dv) at
    the chunk's start -> (out (B, H, C, dv), the state at its end). Rows past a partial chunk's last token
    are zero (then the end state is not a boundary's: the caller keeps the start's). The triton backend
    runs hybrids/gdn_triton.py's kernel, the torch backend chunk_torch: one per run, sampler and trainer."""
    if kernels.triton_for(q) is None:
        return chunk_torch(q, k, v, g, beta, state)
    from hybrids import gdn_triton
    return gdn_triton.Chunk.apply(chunk_torch, q, k, v, g, beta, state)


def chunk_torch(q, k, v, g, beta, state):
    """chunk in torch ops."""
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
    # With a gradient, each chunk is recomputed in the backward from its inputs and start state (the
    # forward substitution's rows would keep O(C) numbers per token and head); the recompute is the same bits.
    # (The Triton kernel's backward recomputes already.)
    recompute = torch.is_grad_enabled() and kernels.triton_for(q) is None
    step = functools.partial(checkpoint, chunk, use_reentrant=False) if recompute else chunk
    for c in range(n):
        o, s = step(qs[:, :, c], ks[:, :, c], vs[:, :, c], gs[:, :, c], bs[:, :, c], s)
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


def _rows(a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """a (B, T, ...) at rows idx (B, C) of dim 1 -> (B, C, ...)."""
    return a.gather(1, idx.view(*idx.shape, *[1] * (a.dim() - 2)).expand(-1, -1, *a.shape[2:]))


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


class _Conv(nn.Module):
    """The depthwise conv's weight, (channels, 1, K) as transformers' nn.Conv1d holds it (its key: conv1d.weight)."""

    def __init__(self, channels: int, K: int, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, K, dtype=dtype))


class GatedDeltaNet(nn.Module):
    """A linear-attention layer of Qwen3.5-MoE and Qwen3-Next: x -> in_proj_qkv (q, k for Hk heads, v for H
    heads) -> causal conv + silu -> l2-normalised q (scaled) and k; beta = sigmoid(in_proj_b x),
    g = -exp(A_log) softplus(in_proj_a x + dt_bias) -> the gated delta rule on the grid -> RMSNorm per head,
    gated by silu(in_proj_z x) -> out_proj. Projections by kernels.linear, the row-invariant matmul; the
    parameters' names are transformers' (Qwen3.5's: Qwen3-Next's fused projections are split on load)."""

    def __init__(self, hidden: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                 conv_kernel: int = 4, eps: float = 1e-6, dtype=torch.float32):
        super().__init__()
        self.hk, self.h, self.dk, self.dv, self.eps = key_heads, value_heads, key_dim, value_dim, eps
        self.conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
        lin = lambda i, o: Linear(i, o).to(dtype)                         # noqa: E731
        self.in_proj_qkv, self.in_proj_z = lin(hidden, self.conv_dim), lin(hidden, value_heads * value_dim)
        self.in_proj_b, self.in_proj_a = lin(hidden, value_heads), lin(hidden, value_heads)
        self.conv1d = _Conv(self.conv_dim, conv_kernel, dtype)
        self.dt_bias = nn.Parameter(torch.empty(value_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(value_heads, dtype=dtype))
        self.norm = RMSNorm(value_dim, eps).to(dtype)                    # not centred: transformers' RMSNormGated
        self.out_proj = lin(value_heads * value_dim, hidden)

    @property
    def conv_taps(self) -> torch.Tensor:
        return self.conv1d.weight[:, 0]                                   # (conv_dim, K)

    def projections(self, x: torch.Tensor):
        """x (B, L, D) -> what the open chunk keeps of each position: the conv's input (B, L, conv_dim),
        g and beta (B, L, H) fp32."""
        mixed = self.in_proj_qkv(x)
        beta = kernels.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * _softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        return mixed, g, beta

    def rule_qkv(self, mixed: torch.Tensor, before: torch.Tensor):
        """The conv's inputs (B, L, conv_dim) and the K-1 before them -> the rule's q, k, v (value heads, fp32)."""
        B, L, _ = mixed.shape
        q, k, v = causal_conv(mixed, self.conv_taps, before).split([self.hk * self.dk, self.hk * self.dk,
                                                                    self.h * self.dv], dim=-1)
        q = expand_heads(_l2norm(q.view(B, L, self.hk, self.dk)), self.h) * self.dk ** -0.5
        k = expand_heads(_l2norm(k.view(B, L, self.hk, self.dk)), self.h)
        return q, k, v.reshape(B, L, self.h, self.dv)

    def rule_inputs(self, x: torch.Tensor, before: torch.Tensor):
        """x (B, L, D) and the conv's K-1 earlier inputs (B, K-1, conv_dim) -> the rule's q, k, v, g, beta
        (fp32, value heads) and the conv's inputs (B, L, conv_dim)."""
        mixed, g, beta = self.projections(x)
        return (*self.rule_qkv(mixed, before), g, beta), mixed

    def output(self, core: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The rule's output (B, L, H, dv) -> (B, L, D): RMSNorm per head, times silu(in_proj_z x)."""
        B, L, _ = x.shape
        z = self.in_proj_z(x).view(B, L, self.h, self.dv)
        gated = (self.norm(core.to(x.dtype)).float() * _silu(z)).to(x.dtype)
        return self.out_proj(gated.flatten(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The trainer's forward: whole sequences from position 0, (B, L, D) -> (B, L, D)."""
        before = x.new_zeros(x.shape[0], self.conv_taps.shape[1] - 1, self.conv_dim)
        rule, _ = self.rule_inputs(x, before)
        core, _, _ = chunked(*rule)
        return self.output(core, x)

    # ---- the sampler: a pool of per-sequence state, one row a sequence ----
    def new_pool(self, rows: int, dtype, device, snapshots: int = 0, C: int = CHUNK) -> "GDNPool":
        K1 = self.conv_taps.shape[1] - 1
        return GDNPool(torch.zeros(rows, K1 + C, self.conv_dim, dtype=dtype, device=device),
                       torch.zeros(rows, C, self.h, device=device), torch.zeros(rows, C, self.h, device=device),
                       torch.zeros(rows, self.h, self.dk, self.dv, device=device),
                       torch.zeros(snapshots, K1, self.conv_dim, dtype=dtype, device=device),
                       torch.zeros(snapshots, self.h, self.dk, self.dv, device=device))

    def step(self, x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor,
             pool: "GDNPool", within: bool = False) -> torch.Tensor:
        """The sampler's forward of new tokens x (B, T, D) at `positions` (B, T) of the sequences in pool
        `rows` (B,); valid (B, T): fed tokens, each row's first, the rest padding. A decode step (T = 1) and
        a verify step (within: each row's tokens inside its open chunk, none completing it unless it is the
        only one) are a fixed set of tensor ops (no host sync: a CUDA graph); a prefill reads its positions and
        feeds its tokens a grid chunk at a time (the first piece up to the next boundary). -> (B, T, D)."""
        mixed, g, beta = self.projections(x)
        if x.shape[1] == 1 or within:
            core = self._feed(pool, rows, mixed, g, beta, positions[:, 0] % CHUNK, valid.sum(1), positions[:, 0] == 0)
            return self.output(core, x)
        core = torch.zeros(*x.shape[:2], self.h, self.dv, device=x.device)
        first, count = positions[:, 0].tolist(), valid.sum(1).tolist()
        done = [0] * len(first)                                           # tokens fed so far, per row
        while any(d < n for d, n in zip(done, count)):
            o = [(p + d) % CHUNK for p, d in zip(first, done)]
            take = [min(n - d, CHUNK - oo) for n, d, oo in zip(count, done, o)]
            t = torch.tensor(done, device=x.device)[:, None] + torch.arange(CHUNK, device=x.device)   # (B, C)
            t = t.clamp(max=x.shape[1] - 1)
            out = self._feed(pool, rows, _rows(mixed, t), _rows(g, t), _rows(beta, t), torch.tensor(o, device=x.device),
                             torch.tensor(take, device=x.device),
                             torch.tensor([p == 0 and d == 0 for p, d in zip(first, done)], device=x.device))
            for b in range(len(first)):
                core[b, done[b]:done[b] + take[b]] = out[b, :take[b]]
            done = [d + k for d, k in zip(done, take)]
        return self.output(core, x)

    def _feed(self, pool, rows, mixed, g, beta, o, n, fresh):
        """Feed n (B,) rows of mixed / g / beta (B, T', ...) into each sequence's open chunk at offset o (B,)
        (o + n <= CHUNK), from its boundary state; fresh (B,): a sequence's start (the state and the conv's
        earlier inputs zero). The chunk is one C-row block computed by `chunk` with its rows past the last
        fed one zeroed: each row's bits are the trainer's. -> the fed rows' outputs (B, T', H, dv)."""
        C, K1 = CHUNK, self.conv_taps.shape[1] - 1
        B, T = mixed.shape[:2]
        keep = ~fresh[:, None, None]
        buf, state = pool.conv[rows] * keep, pool.state[rows] * keep[..., None]   # (B, K-1+C, ..), (B, H, dk, dv)
        j = torch.arange(C, device=o.device)[None, :]                          # (1, C) the chunk's rows
        src = (j - o[:, None]).clamp(0, T - 1)                                  # (B, C) the fed row each takes
        new = (j >= o[:, None]) & (j < (o + n)[:, None])                        # (B, C)
        take = lambda a, old: torch.where(new.view(B, C, *[1] * (a.dim() - 2)), _rows(a, src), old)   # noqa: E731
        rows_in = take(mixed, buf[:, K1:])                                      # (B, C, conv_dim)
        gs, bs = take(g, pool.g[rows]), take(beta, pool.beta[rows])              # (B, C, H)
        live = (j < (o + n)[:, None])                                           # rows of the chunk so far
        q, k, v = self.rule_qkv(rows_in, buf[:, :K1])
        m = live[..., None, None].float()
        hm = live[..., None].float()
        out, end = chunk(*(a.transpose(1, 2) for a in (q * m, k * m, v * m)), (gs * hm).transpose(1, 2),
                         (bs * hm).transpose(1, 2), state)                       # (B, H, C, dv), (B, H, dk, dv)
        full = (o + n == C)[:, None]                                            # a boundary: the chunk is complete
        pool.state[rows] = torch.where(full[..., None, None], end, state)
        pool.conv[rows] = torch.cat([torch.where(full[..., None], rows_in[:, C - K1:], buf[:, :K1]), rows_in], 1)
        pool.g[rows], pool.beta[rows] = gs, bs
        at = (o[:, None] + torch.arange(T, device=o.device)[None, :]).clamp(max=C - 1)   # (B, T') the fed rows
        return out.transpose(1, 2).gather(1, at[..., None, None].expand(-1, -1, self.h, self.dv))


@dataclasses.dataclass
class GDNPool:
    """The sampler's Gated DeltaNet memory for one layer, a row per sequence slot: conv (R, K-1+C, conv_dim)
    the conv's K-1 inputs before the open chunk, then the open chunk's inputs; g, beta (R, C, H) fp32 of the
    open chunk; state (R, H, dk, dv) fp32 at the last grid boundary. A sequence's bytes: its row's. The prefix
    cache's snapshots (scheduler.BoundaryStates), S slots of what a row holds at a boundary: saved_conv
    (S, K-1, conv_dim), the conv's inputs before it, and saved_state (S, H, dk, dv)."""
    conv: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    state: torch.Tensor
    saved_conv: torch.Tensor
    saved_state: torch.Tensor

    @property
    def grid(self) -> int:
        """The chunk a sequence's open rows fill before its state moves on (0: a recurrent pool, which moves
        on at every token: the lab's EngineDecode)."""
        return self.g.shape[1]

    def save(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Snapshot rows at their boundary: the open chunk (its conv inputs, g, beta) is not part of it."""
        self.saved_conv[slots] = self.conv[rows, :self.saved_conv.shape[1]]
        self.saved_state[slots] = self.state[rows]

    def load(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows start at a snapshot's boundary: the next fed position opens a chunk (nothing before it read)."""
        self.conv[rows, :self.saved_conv.shape[1]] = self.saved_conv[slots]
        self.state[rows] = self.saved_state[slots]

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """A group member's row becomes its leader's (the prompt the leader prefilled for both)."""
        for t in (self.conv, self.g, self.beta, self.state):
            t[dst] = t[src]


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


def fuse_qwen3_next(parts: dict[str, torch.Tensor], key_heads: int, value_heads: int, key_dim: int,
                    value_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """split_qwen3_next's inverse: {"qkv", "z", "b", "a"} weights -> (in_proj_qkvz, in_proj_ba)."""
    r, D = value_heads // key_heads, parts["qkv"].shape[-1]
    q, k, v = parts["qkv"].split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim])
    per_head = lambda t, rows: t.reshape(key_heads, rows, D)               # noqa: E731
    qkvz = torch.cat([per_head(q, key_dim), per_head(k, key_dim), per_head(v, r * value_dim),
                      per_head(parts["z"], r * value_dim)], dim=1).reshape(-1, D)
    ba = torch.cat([per_head(parts["b"], r), per_head(parts["a"], r)], dim=1).reshape(-1, D)
    return qkvz, ba
