"""The Mixture-of-Experts transformer (Qwen3-MoE semantics), its checkpoints (via support/hf.py), and forced routes.

    from config import ModelConfig
    from model import Transformer
    model = Transformer(ModelConfig.preset("tiny"))          # or Transformer.from_pretrained(dir)
    logits = model(tokens)                                   # (B, T) -> (B, T, V)
    logp, routes = model.score(tokens, temperature=1.0)      # (B, T-1), (B, T, n_moe_layers, top_k)
    logp, _ = model.score(tokens, routes=routes)             # R3: replay recorded expert choices
    logp, routes, detail = model.score(tokens, route_detail=True)   # + combine weights, margins (RouteDetail)
    _, _, detail = model.score(tokens, route_detail=True, router_logits=True)   # + detail.logits, with grad

There is one forward. The trainer calls it with no cache (keys and values of the call itself are laid
out as pages); the sampler (rollout.py) calls it with a `PagedKV` batch whose pages persist across
decode steps. Both go through the same kernels.py functions, so both compute the same bits.
The trainer may pack several sequences into a row (`score(tokens, packing=...)`, see support/packing.py): each
sequence keeps its own positions and pages, so every token gets the padded forward's bits.

Layer: x += attn(rmsnorm(x)); x += mlp(rmsnorm(x)), where mlp is MoE on layers chosen by
ModelConfig.is_moe_layer and a dense SwiGLU elsewhere. Attention: GQA, per-head RMSNorm on q and k
before NeoX RoPE, scale head_dim^-0.5, no biases. Router: softmax(gate(x)) in fp32, top-k,
optional renormalisation. Experts are stacked: w13 (E, 2I, D) with gate rows first, w2 (E, D, I).
That is Qwen3-MoE; the other families (support/hf.py) switch on config knobs, each off by default:
q/k/v and o biases (added after the matmul, in the model dtype), q/k norm over the whole projection or
none, partial RoPE (the first rotary_dim dims of each head), YaRN RoPE tables, sigmoid routing with a
score-correction bias and grouped top-k (kernels.route), routed_scaling_factor, shared experts (see MoE);
gpt-oss's attention sinks and sliding windows (kernels.paged_attention), its biased router with a softmax
over the top-k and its biased clamped-SwiGLU experts; DeepSeek's multi-head latent attention (MLA, in
its absorbed form: the sampler caches one latent per token, kv_caches).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from config import ModelConfig
from support import hf
from support.packing import PackedPages, Packing, packed_attention


def lm_head(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Logits of hidden states h (..., D) with the LM-head weight w (V, D): the one logits op."""
    return kernels.linear(h, w)


class _ChunkedLogprobs(torch.autograd.Function):
    """token_logprobs(lm_head(h, w)) for rows h (N, D) in chunks of `chunk` rows: no (N, V) logits are
    kept, the backward recomputes each chunk's. Row-invariant ops make the log-probs the unchunked
    ones bit for bit; the weight gradient is the chunks' partials summed in fp32, in chunk order."""

    @staticmethod
    def forward(ctx, h, w, targets, temperature, with_entropy, chunk, entropy_grad=False):
        logp = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for lo in range(0, h.shape[0], chunk):
            rows = slice(lo, lo + chunk)
            out = kernels.token_logprobs(lm_head(h[rows], w), targets[rows], temperature, with_entropy)
            if with_entropy:
                logp[rows], entropy[rows] = out
            else:
                logp[rows] = out
        ctx.save_for_backward(h, w, targets)
        ctx.temperature, ctx.chunk, ctx.entropy_grad = temperature, chunk, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g, g_entropy):
        h, w, targets = ctx.saved_tensors
        dh = torch.empty_like(h)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        for lo in range(0, h.shape[0], ctx.chunk):
            rows = slice(lo, lo + ctx.chunk)
            with torch.enable_grad():
                hc, wc = h[rows].detach().requires_grad_(), w.detach().requires_grad_()
                logits = lm_head(hc, wc)
                outs, grads = [kernels.token_logprobs(logits, targets[rows], ctx.temperature)], [g[rows]]
                if ctx.entropy_grad and g_entropy is not None:        # the entropy bonus's gradient too
                    outs.append(kernels.softmax_entropy(logits, ctx.temperature))
                    grads.append(g_entropy[rows])
                dh[rows], dwc = torch.autograd.grad(outs, (hc, wc), grads)
            dw += dwc.float()
        return dh, dw.to(w.dtype), None, None, None, None, None


@dataclass
class PagedKV:
    """What the sampler hands the forward for one batch (vLLM calls this attention metadata).

    caches: per layer a (k_pages, v_pages) pair, each (num_pages, page_size, KVH, D).
    block_table (B, n_blocks): the pages of each sequence, in position order.
    slot_mapping (B, T): flat slot (page * page_size + offset) where each new token's K/V is written;
        padding tokens point at a scratch slot that no sequence reads (writes are unconditional, so a
        decode step has no data-dependent shape and can be captured in a CUDA graph).
    positions (B, T): absolute position of each new token.
    window_table, window_slots: the same for the sliding-window layers where their pages are a pool of
        their own (the sampler's window pool: freed once below every query's window), else None.
    states: for layers without pages (hybrids/), (their pools (Transformer.state_pool), each batch row's pool
        row (B,), the fed tokens (B, T) bool: each row's first ones, within: each row's tokens lie in its open
        chunk of the grid (a verify step)), else None.
    """
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    window_table: torch.Tensor | None = None
    window_slots: torch.Tensor | None = None
    states: tuple | None = None


class Linear(nn.Module):
    """A linear layer whose matmul is kernels.linear (nn.Linear's is not batch-invariant).

    The optional bias is added after the matmul, in the model dtype (an elementwise add: row-invariant);
    transformers' nn.Linear fuses it into the GEMM, which agrees within rounding.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x):
        y = kernels.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


class Router(Linear):
    """The MoE gate, run in its own weight's dtype: an fp32 router (--router_dtype) upcasts x, as
    transformers' GLM-4.5 / DeepSeek-V3 do. The cast is made here, inside the gate's forward, where
    FSDP2 has gathered the weight in its compute dtype (outside it, the weight is the fp32 shard)."""

    def forward(self, x):
        return super().forward(x.to(self.weight.dtype))


class RMSNorm(nn.Module):
    """centered: the weight is stored minus one and scales by (1 + w) (Qwen3-Next, Qwen3.5: zero_centered_norm)."""

    def __init__(self, dim: int, eps: float, centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if centered else torch.ones(dim))
        self.eps, self.centered = eps, centered

    def forward(self, x):
        if self.centered:
            return kernels.rms_norm_centered(x, self.weight, self.eps)
        return kernels.rms_norm(x, self.weight, self.eps)


def attend(q, k, v, positions, kv: PagedKV | PackedPages | None, layer_idx: int, scale: float, **attn):
    """Attention of this call's queries q (B, T, H, D) over its own keys and values k, v (B, T, KVH, D)
    and, in the sampler, those of earlier steps in the pages of kv. v None: the values are the keys (MLA's
    latent cache is one tensor). attn: kernels.paged_attention's sinks and window. -> (B, T, H, D)."""
    B, T, KVH, D = k.shape
    if isinstance(kv, PackedPages):
        # Trainer path, packed: each sequence's queries and keys in blocks of their own
        return packed_attention(q, k, k if v is None else v, kv, scale, **attn)
    if kv is None:
        # Trainer path: this call's own keys, laid out as pages of KV_BLOCK positions, sequence b
        # owning pages [b * n_blocks, (b + 1) * n_blocks).
        pad = (-T) % kernels.KV_BLOCK
        k_pages = F.pad(k, (0, 0, 0, 0, 0, pad)).reshape(-1, kernels.KV_BLOCK, KVH, D)
        v_pages = k_pages if v is None else F.pad(v, (0, 0, 0, 0, 0, pad)).reshape(-1, kernels.KV_BLOCK, KVH, D)
        block_table = torch.arange(k_pages.shape[0], device=q.device).view(B, -1)
    else:
        # Sampler path: write the new keys into the persistent pages, then attend over them.
        (k_pages, v_pages), block_table, slots = kv.caches[layer_idx], kv.block_table, kv.slot_mapping
        if attn.get("window") and kv.window_table is not None:                        # the window pool's pages
            block_table, slots = kv.window_table, kv.window_slots
        slots = slots.reshape(-1)                                                      # (B*T,)
        k_pages.view(-1, KVH, D)[slots] = k.reshape(-1, KVH, D)
        if v is not None:
            v_pages.view(-1, KVH, D)[slots] = v.reshape(-1, KVH, D)
    return kernels.paged_attention(q, k_pages, v_pages, block_table, positions, scale, **attn)


def kv_caches(cfg: ModelConfig, num_pages: int, page_size: int, dtype, device,
              window_pages: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The sampler's KV pages: per layer a (k_pages, v_pages) pair (PagedKV.caches), zeroed. GQA: keys and
    values, each (num_pages, page_size, KVH, head_dim); MLA: one latent tensor (num_pages, page_size, 1,
    kv_lora_rank + head_dim) as both halves of the pair (its keys are its values, MLA.forward). With
    window_pages, a sliding-window layer has that many pages (the window pool) instead."""
    heads, dim = cfg.kv_cache_heads_dims
    caches = []
    for layer in range(cfg.num_hidden_layers):
        pages = window_pages if window_pages and cfg.window(layer) else num_pages
        h = 0 if cfg.is_linear(layer) else heads           # a recurrent layer: pages of no heads, no bytes
        k = torch.zeros(pages, page_size, h, dim, dtype=dtype, device=device)
        caches.append((k, k) if cfg.kv_lora_rank else (k, torch.zeros_like(k)))
    return caches


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rotary_dim, self.qk_norm = cfg.rotary_dim, cfg.qk_norm
        self.window = cfg.window(layer_idx)                 # gpt-oss's sliding layers: keys [p - window + 1, p]
        # gpt-oss's sinks: one logit per head in the softmax's denominator (kernels.paged_attention)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if cfg.attention_sinks else None
        qd, kd = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = Linear(cfg.hidden_size, qd, cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, kd, cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, kd, cfg.attention_bias)
        self.o_proj = Linear(qd, cfg.hidden_size, cfg.attention_out_bias)
        if cfg.qk_norm != "none":   # per head (Qwen3, GLM) or over the whole projection (OLMoE)
            per_head, centered = cfg.qk_norm == "head", cfg.zero_centered_norm
            self.q_norm = RMSNorm(self.head_dim if per_head else qd, cfg.rms_norm_eps, centered)
            self.k_norm = RMSNorm(self.head_dim if per_head else kd, cfg.rms_norm_eps, centered)

    def forward(self, x, cos, sin, positions, kv: PagedKV | PackedPages | None, layer_idx: int):
        B, T, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)                                         # (B, T, H*D), (B, T, KVH*D)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.head_dim)                                 # (B, T, H, D)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)                              # (B, T, KVH, D)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        o = attend(q, k, v, positions, kv, layer_idx, self.head_dim ** -0.5, sinks=self.sinks, window=self.window)
        return self.o_proj(o.reshape(B, T, self.n_heads * self.head_dim))

    def rope(self, x, cos, sin):
        """NeoX RoPE on the first rotary_dim dims of each head (all of them unless partial); the rest pass."""
        if self.rotary_dim == self.head_dim:
            return kernels.apply_rope(x, cos, sin)
        r = self.rotary_dim
        return torch.cat([kernels.apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)


class MLA(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 / V3, Moonlight, GLM-4.7-Flash), in its absorbed form.

    Per token the keys and values of all H heads come from one latent c = norm(kv_a(x)) of kv_lora_rank
    dims and one RoPE key k_rot of head_dim dims shared by the heads; kv_b_proj holds per head W_UK (the
    non-RoPE key, qk_nope_head_dim x kv_lora_rank) and W_UV (the value, v_head_dim x kv_lora_rank):

        score_h(i, j) = q_nope_h(i) . W_UK_h c_j + q_rot_h(i) . k_rot_j = [q_nope_h W_UK_h, q_rot_h](i) . [c, k_rot]_j
        out_h(i) = W_UV_h sum_j p_h(i, j) c_j

    That is attention of H query heads over ONE key head [c, k_rot] whose first kv_lora_rank dims are
    also its value; each head's W_UV is applied after. The cache holds [c, k_rot] per token (576
    numbers for DeepSeek-V3, not 2 * 128 heads * 192) and decode reads nothing else. The trainer's
    forward runs the same absorbed form, so the sampler's bits are the trainer's (docs/design.md, "MLA").
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        H, D = cfg.num_attention_heads, cfg.hidden_size
        self.n_heads, self.rank, self.rope_dim = H, cfg.kv_lora_rank, cfg.head_dim
        self.nope_dim, self.v_dim, self.interleave = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.rope_interleave
        q_dim = H * (self.nope_dim + self.rope_dim)
        if cfg.q_lora_rank:     # q through a low-rank bottleneck, normed in the middle (DeepSeek-V3)
            self.q_a_proj = Linear(D, cfg.q_lora_rank, cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)   # transformers' default eps, not rms_norm_eps
            self.q_b_proj = Linear(cfg.q_lora_rank, q_dim)
        else:
            self.q_proj = Linear(D, q_dim)
        self.kv_a_proj_with_mqa = Linear(D, self.rank + self.rope_dim, cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = Linear(self.rank, H * (self.nope_dim + self.v_dim))
        self.o_proj = Linear(H * self.v_dim, D, cfg.attention_bias)
        self.scale = (self.nope_dim + self.rope_dim) ** -0.5
        yarn = cfg.yarn()
        if yarn and yarn["mscale_all_dim"]:           # YaRN's softmax scale (DeepSeek's yarn_apply_mscale)
            self.scale *= kernels.yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2

    def forward(self, x, cos, sin, positions, kv: PagedKV | PackedPages | None, layer_idx: int):
        B, T, _ = x.shape
        H, r = self.n_heads, self.rank
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, H, self.nope_dim + self.rope_dim)                          # (B, T, H, dn + dr)
        ckv = self.kv_a_proj_with_mqa(x)                                            # (B, T, r + dr)
        latent = self.kv_a_layernorm(ckv[..., :r]).view(B, T, 1, r)                 # (B, T, 1, r)
        k_rot = self.rope(ckv[..., r:].reshape(B, T, 1, self.rope_dim), cos, sin)   # (B, T, 1, dr)
        w_uk, w_uv = self.kv_b_proj.weight.view(H, self.nope_dim + self.v_dim, r).split([self.nope_dim, self.v_dim], 1)
        q_lat = kernels.linear_heads(q[..., :self.nope_dim], w_uk.transpose(1, 2))  # (B, T, H, r): q_nope W_UK
        q = torch.cat([q_lat, self.rope(q[..., self.nope_dim:], cos, sin)], -1)     # (B, T, H, r + dr)
        keys = torch.cat([latent, k_rot], -1)                                       # (B, T, 1, r + dr)
        o = attend(q, keys, None, positions, kv, layer_idx, self.scale)            # (B, T, H, r + dr)
        out = kernels.linear_heads(o[..., :r], w_uv)                                # (B, T, H, dv): W_UV p.c
        return self.o_proj(out.reshape(B, T, H * self.v_dim))

    def rope(self, x, cos, sin):
        """RoPE on x (B, T, heads, dr): DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; they are
        gathered into halves first (both q and k, so their dot products are the interleaved ones)."""
        if self.interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], -1)
        return kernels.apply_rope(x, cos, sin)


@dataclass
class RouteDetail:
    """What a routing decision looked like, per (position, MoE layer), beside the routes' ids.

    weights (B, T, n_moe, k) fp32: the combine weights of the experts used (after renormalisation and
    scaling); margin (B, T, n_moe) fp32: the k-th minus the (k+1)-th score the choice was made on
    (kernels.route_margin); entropy (B, T, n_moe) fp32: of the routing distribution (kernels.router_entropy).
    All detached. The sampler stores weights and margin (rollout.SequenceOutput); the trainer gets all
    three from score(route_detail=True); under the contract both sides' bits are equal.
    logits (B, T, n_moe, E), only with score(router_logits=True), else None: the gate's logits in the
    router's dtype, WITH their gradient (the router losses, router_training/router.router_objective). Not one of FIELDS:
    moving the detail to the host (packing.on_host) or gathering it drops them.
    """
    weights: torch.Tensor
    margin: torch.Tensor
    entropy: torch.Tensor
    logits: torch.Tensor | None = None
    FIELDS = ("weights", "margin", "entropy")

    def map(self, f) -> "RouteDetail":
        """f applied to each field (a row selection, a move to the host, an unpack)."""
        return RouteDetail(f(self.weights), f(self.margin), f(self.entropy), None if self.logits is None else f(self.logits))

    @classmethod
    def stack(cls, layers: list, B: int, T: int, k: int, device, kept: "KeptLogits | None" = None) -> "RouteDetail":
        """From MoE.forward's per-layer (weights (B, T, k), margin (B, T), entropy (B, T)) tuples, and the
        logits kept (KeptLogits; an empty (B, T, 0, E) without MoE layers)."""
        logits = None if kept is None else kept.stack(B, T, device)
        if not layers:
            return cls(torch.zeros(B, T, 0, k, device=device), torch.zeros(B, T, 0, device=device),
                       torch.zeros(B, T, 0, device=device), logits)
        w, m, e = zip(*layers)
        return cls(torch.stack(w, 2), torch.stack(m, 2), torch.stack(e, 2), logits)   # layers on dim 2


class KeptLogits:
    """score(router_logits=True)'s holder of each MoE layer's gate logits (B, T, E), with their gradient.
    Not a list: FSDP2 rebuilds a block's list arguments that hold tensors with a gradient (registering its
    backward hooks on them), so the block's appends would land in a copy; an object it does not look into
    keeps them, and the blocks' hooks see only what they saw without it."""

    def __init__(self, n_experts: int):
        self.n_experts, self.layers = n_experts, []

    def stack(self, B: int, T: int, device) -> torch.Tensor:
        if not self.layers:
            return torch.zeros(B, T, 0, self.n_experts, device=device)
        return torch.stack(self.layers, 2)                            # (B, T, n_moe, E)


class MLP(nn.Module):
    """Dense SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = Linear(dim, hidden), Linear(dim, hidden), Linear(hidden, dim)

    def forward(self, x):
        return self.down_proj(kernels.silu_mul(self.gate_proj(x), self.up_proj(x)))


class MoE(nn.Module):
    """Routed experts, plus the shared experts of some families.

    The router (`gate`) may hold `gate.e_score_correction_bias` (E,): a buffer, not a parameter, because
    the optimizer must not train it (it moves only by --expert_bias_update_rate's balancing rule); it is
    state all the same, saved in checkpoints and copied wherever weights are synced (distributed.Policy).

    Output = routed + shared, added in this order in the model dtype: routed is moe_experts' fp32
    combine over k rounded to the model dtype; shared is the ungated MLP (GLM / DeepSeek, width
    n_shared_experts * moe_intermediate_size) or, for Qwen2-MoE, sigmoid(shared_expert_gate x) (fp32,
    row-invariant) times the shared MLP, multiplied in fp32 and rounded. transformers adds them in this
    order too. The router (`route`) and the routed experts (`experts`) are methods of their own: the
    mismatch lab's router faults (lab/faults.py) override them on the rollout's copy, never here.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Router(D, E, cfg.router_bias)
        if cfg.score_correction_bias:
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, D))      # gate_proj rows then up_proj rows
        self.w2 = nn.Parameter(torch.empty(E, D, I))           # down_proj
        # gpt-oss's experts: biases after each matmul (b13 like w13, gate entries then up) and the clamped SwiGLU
        self.b13 = nn.Parameter(torch.zeros(E, 2 * I)) if cfg.expert_bias else None
        self.b2 = nn.Parameter(torch.zeros(E, D)) if cfg.expert_bias else None
        self.swiglu = (cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.moe_act == "clamped_swiglu" else None
        self.shared_experts = MLP(D, I * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(D, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(D, 1)
        # the router's knobs; at their defaults kernels.route runs exactly the softmax path
        self.route_kw = dict(scoring=cfg.router_scoring, n_group=cfg.n_group, topk_group=cfg.topk_group,
                             scaling=cfg.routed_scaling_factor)
        if cfg.group_score != "top2_sum":                      # DeepSeek-V2 ranks a group by its best score
            self.route_kw["group_score"] = cfg.group_score
        self.n_experts = E

    def expert_extras(self) -> dict:
        """kernels.moe_experts' gpt-oss arguments (expert biases, clamped SwiGLU); none for other families."""
        if self.b13 is None and self.swiglu is None:
            return {}
        return dict(b13=self.b13, b2=self.b2, swiglu=self.swiglu)

    def forward(self, x, forced_ids=None, detail: list | None = None, kept: KeptLogits | None = None):
        """x (B, T, D) -> (B, T, D) and the router's own top-k ids (B, T, k). detail: a list to append
        this layer's route detail to, (weights (B, T, k), margin (B, T), entropy (B, T)) (RouteDetail);
        kept: where to append the gate's logits (B, T, E), with their gradient (the router losses)."""
        B, T, D = x.shape
        x2 = x.reshape(B * T, D)                                # (M, D)
        forced = None if forced_ids is None else forced_ids.reshape(B * T, -1)
        logits = self.gate(x2)                                  # (M, E)
        ids, weights, chosen, *extra = self.route(logits, forced, detail is not None)
        if detail is not None:                                  # the combine weights used, the margin, entropy
            margin, entropy = extra
            detail.append((weights.detach().view(B, T, -1), margin.view(B, T), entropy.view(B, T)))
        if kept is not None:
            kept.layers.append(logits.view(B, T, -1))
        out = self.add_shared(self.experts(x2, ids, weights), x2)
        return out.view(B, T, D), chosen.view(B, T, self.top_k)

    def add_shared(self, out: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """The routed experts' output (M, D) plus the shared expert's: ungated (GLM, DeepSeek) or gated by
        sigmoid(shared_expert_gate x) in fp32 (Qwen2-MoE)."""
        if self.shared_experts is not None:
            out = out + self.shared_experts(x2)
        if self.shared_expert is not None:
            g = kernels.sigmoid(self.shared_expert_gate(x2))                 # (M, 1) fp32
            out = out + (g * self.shared_expert(x2).float()).to(out.dtype)
        return out

    def router_inputs(self, dtype: torch.dtype) -> tuple[torch.Tensor | None, bool]:
        """The score-correction bias (in the logits' dtype, as it is applied) and norm_topk_prob."""
        bias = getattr(self.gate, "e_score_correction_bias", None)
        return (None if bias is None else bias.to(dtype)), self.norm_topk_prob

    def route(self, logits: torch.Tensor, forced: torch.Tensor | None, detail: bool):
        """The router over the gate's logits (M, E) in the router's dtype (Router): kernels.route's ids
        used (M, k) (forced ones under replay), fp32 combine weights (M, k), the router's own choice
        (M, k), and with detail the margin and entropy (M,) each."""
        bias, norm = self.router_inputs(logits.dtype)
        return kernels.route(logits, self.top_k, norm, forced, bias=bias, detail=detail, **self.route_kw)

    def experts(self, x2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' fp32 combine over k of rows x2 (M, D), in x2's dtype, by experts_op."""
        return self.experts_op(x2, self.w13, self.w2, ids, weights, **self.expert_extras())

    @staticmethod
    def experts_op(*args, **kw) -> torch.Tensor:
        """kernels.moe_experts (looked up at each call: an op set may swap it). A sharded layer holds its own
        (parallel/expert_parallel.shard_experts): the same bits, computed on the experts' owner ranks."""
        return kernels.moe_experts(*args, **kw)

    @torch.no_grad()
    def keep_experts(self, experts: list[int]) -> None:
        """Keep only these experts' rows, in this order, of the expert tensors (an EP rank's shard; in place)."""
        ids = torch.tensor(experts, device=self.w13.device)
        for name in ("w13", "w2", "b13", "b2"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, nn.Parameter(t[ids].clone(), requires_grad=t.requires_grad))


# Token mixers a plug-in adds, by layer kind (ModelConfig.layer_types): kind -> (the Block's attribute, the
# class, called as cls(cfg, layer_idx); its forward takes attention's arguments). hybrids/ adds
# "linear_attention" (Gated DeltaNet) and "gated_attention", registered when its family loads (hf.load_plugin).
MIXERS: dict[str, tuple[str, type]] = {}


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.is_moe = cfg.is_moe_layer(layer_idx)
        centered = cfg.zero_centered_norm
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, centered)
        kind = cfg.layer_types[layer_idx] if cfg.layer_types else "full_attention"
        self.mixer, mixer = MIXERS.get(kind) or ("self_attn", MLA if cfg.kv_lora_rank else Attention)
        setattr(self, self.mixer, mixer(cfg, layer_idx))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, centered)
        self.mlp = MoE(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.layer_idx = layer_idx

    def forward(self, x, cos, sin, positions, kv: PagedKV | PackedPages | None, forced_ids=None,
                detail: list | None = None, kept: KeptLogits | None = None):
        """x (B, T, D) -> (B, T, D), and the router's own top-k ids (B, T, top_k) on MoE layers (else None)."""
        mix = getattr(self, self.mixer)
        x = x + mix(self.input_layernorm(x), cos, sin, positions, kv, self.layer_idx)
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            out, ids = self.mlp(h, forced_ids, detail, kept)
            return x + out, ids
        return x + self.mlp(h), None


def expert_group(model: nn.Module):
    """The expert-parallel group a model's MoE layers were sharded with (parallel/expert_parallel.shard_experts
    sets each layer's `ep`); None for whole experts, the core's case, which then calls nothing of parallel/."""
    return next((m.ep for m in model.modules() if isinstance(m, MoE) and getattr(m, "ep", None) is not None), None)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        if config.model_type not in hf.FAMILIES:
            hf.load_plugin(config.model_type)              # a plug-in's family registers its layers (MIXERS)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.zero_centered_norm)
        self.extra_tensors: dict[str, torch.Tensor] = {}   # checkpoint tensors kept for save, unused (MTP layers)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        self.n_moe_layers = len(config.moe_layers)
        self._rope: dict = {}    # device -> (cos, sin) fp32; not a buffer so .to(bf16) leaves it fp32
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    def reset_parameters(self, seed: int | None = None):
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range
        centered = {id(m.weight) for m in self.modules() if isinstance(m, RMSNorm) and m.centered}
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(0.0 if id(p) in centered else 1.0)
                elif name.endswith((".bias", ".b13", ".b2")):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def keep_experts(self, experts: list[int]) -> None:
        """Every MoE layer keeps only these experts, in this order (MoE.keep_experts)."""
        for layer in self.layers:
            if layer.is_moe:
                layer.mlp.keep_experts(experts)

    def state_pool(self, rows: int, device, snapshots: int = 0) -> dict | None:
        """The sampler's memory of layers that keep a state per sequence, not pages (hybrids/: Gated DeltaNet):
        {layer index: its pool, `rows` rows and the prefix cache's `snapshots`}; None for a model without any."""
        mixers = {i: getattr(b, b.mixer) for i, b in enumerate(self.layers)}
        return {i: m.new_pool(rows, self.embed_tokens.weight.dtype, device, snapshots) for i, m in mixers.items()
                if hasattr(m, "new_pool")} or None

    def lm_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def rope(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._rope:
            c = self.config
            self._rope[device] = kernels.rope_tables(c.rotary_dim, c.rope_theta, c.max_position_embeddings, device,
                                                     yarn=c.yarn())
        return self._rope[device]

    # ---- the one forward ----
    def hidden_states(self, tokens: torch.Tensor, routes: torch.Tensor | None = None,
                      kv: PagedKV | None = None, packing: Packing | None = None, route_detail: bool = False,
                      router_logits: bool = False):
        """tokens (B, T) -> final normed hidden states (B, T, D) and routes (B, T, n_moe_layers, top_k),
        and with route_detail a third output, the RouteDetail of those routes (with router_logits, its
        logits: the gate's, with their gradient).

        packing: the tokens hold packed sequences (trainer only, kv None): positions restart at each
        sequence's start and attention stays inside it; every other op is row-local."""
        B, T = tokens.shape
        if packing is not None:
            if tuple(packing.shape) != (B, T):
                raise ValueError(f"packing is for tokens of shape {tuple(packing.shape)}, got {(B, T)}")
            positions = packing.positions(tokens.device)
            kv = packing.pages(kernels.packed_block(tokens), tokens.device)
        elif kv is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        else:
            positions = kv.positions
        # Only checks of shapes here, never of values: reading a tensor back is a host sync on a GPU.
        # The sampler checks its lengths at admission; score() and forward() check their inputs.
        longest = max(packing.lengths) if packing is not None else T
        if not isinstance(kv, PagedKV) and longest > self.config.max_position_embeddings:
            raise ValueError(f"position {longest - 1} is past max_position_embeddings="
                             f"{self.config.max_position_embeddings}; shorten the sequence or raise the limit")
        if routes is not None:
            self._check_route_shape(routes, B, T)
        cos_t, sin_t = self.rope(tokens.device)
        cos, sin = cos_t[positions], sin_t[positions]                     # (B, T, rotary_dim/2)
        x = self.embed_tokens(tokens)                                     # (B, T, D)
        recorded, detail = [], [] if route_detail else None
        kept = KeptLogits(self.config.num_experts) if route_detail and router_logits else None
        for layer in self.layers:
            forced = None if routes is None or not layer.is_moe else routes[:, :, len(recorded)]
            x, ids = layer(x, cos, sin, positions, kv, forced, detail, kept)
            if ids is not None:
                recorded.append(ids)
        if recorded:
            routes_out = torch.stack(recorded, dim=2)                     # (B, T, n_moe, k)
        else:
            routes_out = torch.zeros(B, T, 0, self.config.num_experts_per_tok, dtype=torch.long, device=tokens.device)
        if route_detail:
            return self.norm(x), routes_out, RouteDetail.stack(detail, B, T, self.config.num_experts_per_tok, x.device, kept)
        return self.norm(x), routes_out

    def _check_route_shape(self, routes: torch.Tensor, B: int, T: int) -> None:
        """Shape and dtype only (no tensor read): replay of routes that do not fit the tokens is an error."""
        want = (B, T, self.n_moe_layers, self.config.num_experts_per_tok)
        if tuple(routes.shape) != want:
            raise ValueError(f"routes have shape {tuple(routes.shape)} but the tokens need {want} "
                             f"(batch, tokens, moe layers, top_k); pass the routes recorded for these exact tokens")
        if routes.dtype == torch.bool or routes.dtype.is_floating_point or routes.dtype.is_complex:
            raise ValueError(f"routes must be integer expert ids, got {routes.dtype}")

    def check_routes(self, routes: torch.Tensor, B: int, T: int) -> None:
        """Raise ValueError unless routes are replayable expert ids for (B, T) tokens. Reads the routes
        back to the host: call it where routes enter (score, forward), not inside the trainer's loop."""
        c = self.config
        self._check_route_shape(routes, B, T)
        if (routes < -1).any():
            raise ValueError(f"routes hold the negative id {int(routes.min())}; the only negative id allowed is -1 "
                             "(the mark of an unrecorded row)")
        if (routes < 0).all():
            raise ValueError("routes are all -1: nothing to replay (were they recorded?); pass routes=None to route freely")
        unset = routes < 0
        if (unset.any(-1) & ~unset.all(-1)).any():
            raise ValueError("routes have a (token, layer) row that is partly -1; -1 marks a whole unrecorded row")
        if (routes >= c.num_experts).any():
            raise ValueError(f"routes hold expert ids >= num_experts={c.num_experts}")
        ordered = torch.sort(routes, -1).values
        if ((ordered.diff(dim=-1) == 0) & (ordered[..., 1:] >= 0)).any():
            raise ValueError("routes repeat an expert inside one token's top-k")

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head: hidden states (..., D) -> logits (..., V). The one logits path: forward, score
        and the sampler all call it (score's chunks through lm_head), so the contract rests on one line."""
        return lm_head(h, self.lm_weight())

    def check_tokens(self, tokens) -> None:
        """Raise TypeError / ValueError unless tokens is a (B, T) integer tensor of ids in [0, vocab_size)."""
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(f"tokens must be a torch.Tensor of shape (B, T), got {type(tokens).__name__}")
        if tokens.dtype == torch.bool or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
            raise TypeError(f"tokens must be integer token ids (torch.long), got {tokens.dtype}")
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape (B, T), got {tuple(tokens.shape)}"
                             + ("; add the batch dimension: tokens[None]" if tokens.dim() == 1 else ""))
        if tokens.numel() == 0:
            raise ValueError(f"tokens of shape {tuple(tokens.shape)} hold no tokens; need B >= 1 and T >= 1")
        lo, hi = torch.aminmax(tokens)
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, vocab_size={self.config.vocab_size}), got "
                             f"{int(lo) if lo < 0 else int(hi)}")

    def check_inputs(self, tokens, routes: torch.Tensor | None = None) -> None:
        """The checks of score() and forward(): tokens (check_tokens), then routes if given (check_routes)."""
        self.check_tokens(tokens)
        if routes is not None:
            self.check_routes(routes, *tokens.shape)

    def forward(self, tokens: torch.Tensor, routes: torch.Tensor | None = None) -> torch.Tensor:
        self.check_inputs(tokens, routes)
        h, _ = self.hidden_states(tokens, routes)
        return self.compute_logits(h)                                     # (B, T, V)

    def score(self, tokens: torch.Tensor, temperature: float = 1.0, routes: torch.Tensor | None = None,
              with_entropy: bool = False, logits_chunk: int = 0, packing: Packing | None = None,
              check: bool = True, route_detail: bool = False, entropy_grad: bool = False, router_logits: bool = False):
        """Log-probs of tokens[:, 1:] under softmax(logits / temperature), and the routes used.

        tokens (B, T) int, right padding allowed (padded positions get values the caller masks out).
        Returns logp (B, T-1) fp32 and routes (B, T, n_moe_layers, top_k) int64: the experts the router
        chose. With routes=, the given experts are used instead (R3 replay; rows of -1 route freely)
        and the returned routes are still the router's own choice, so a caller can audit the flips.
        with_entropy: also return the entropy (B, T-1) of softmax(logits / temperature) at each
        position, from the same pass over the vocabulary (detached; logp's bits do not change).
        logits_chunk: if > 0, at most that many positions' logits exist at a time (forward and
        backward, which recomputes them): the (B, T-1, V) logits of long responses need not fit. The
        same bits (every op is row-invariant); one more LM-head matmul in the backward.
        packing: tokens hold several sequences a row (see support/packing.py); logp and routes keep
        the packed layout (packing.to_padded lays them out per sequence), and each sequence token gets
        the bits of the padded forward. A log-prob at a sequence's last token is not one of its own.
        check: check tokens and routes first (ValueError / TypeError naming the problem). The checks
        read the inputs back to the host, a sync on a GPU: the trainer passes check=False for batches
        it built and checked itself (train.make_batch, replay.pack_routes), keeping its forward pure.
        route_detail: also return the RouteDetail (B, T, ...) of the routes, last: (logp, routes,
        [entropy,] detail). The other outputs keep their bits.
        entropy_grad: with with_entropy, the entropy carries its gradient (kernels.softmax_entropy: the
        entropy bonus, --entropy_coef); logp's bits and gradient do not change.
        router_logits: with route_detail, the detail also holds each MoE layer's gate logits (B, T, n_moe, E)
        with their gradient (RouteDetail.logits: the router losses, router_training/router.py). Only kept
        references to the tensors the router computes anyway: every other output keeps its bits, and
        without it (the default) nothing is kept.
        """
        if router_logits and not route_detail:
            raise ValueError("router_logits=True returns the logits in the RouteDetail: pass route_detail=True too")
        if check:
            self.check_inputs(tokens, routes)
        h, used, *detail = self.hidden_states(tokens, routes, packing=packing, route_detail=route_detail,
                                              router_logits=router_logits)
        B, T1, D = h.shape[0], h.shape[1] - 1, h.shape[2]
        if logits_chunk and B * T1 > logits_chunk:      # at most logits_chunk rows of logits at a time
            logp, entropy = _ChunkedLogprobs.apply(h[:, :-1].reshape(-1, D), self.lm_weight(), tokens[:, 1:].reshape(-1),
                                                   temperature, with_entropy, logits_chunk, entropy_grad)
            logp, entropy = logp.view(B, T1), entropy.view(B, T1) if with_entropy else None
        else:
            logits = self.compute_logits(h[:, :-1])                       # (B, T-1, V)
            detached = with_entropy and not entropy_grad                  # from the log-probs' own pass
            out = kernels.token_logprobs(logits, tokens[:, 1:], temperature, detached)
            logp, entropy = out if detached else (out, None)
            if with_entropy and entropy_grad:
                entropy = kernels.softmax_entropy(logits, temperature)
        return (logp, used) + ((entropy,) if with_entropy else ()) + tuple(detail)

    # ---- Hugging Face checkpoints: the translation lives in support/hf.py ----
    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype | None = None, device="cpu",
                        experts: list[int] | None = None) -> "Transformer":
        """Load a safetensors directory of a supported family (hf.FAMILIES; single file or sharded;
        per-expert or fused experts).

        dtype: None keeps the checkpoint's (that of its embedding); any other is converted to.
        experts: keep only these logical experts of every MoE layer, in this order (an expert-parallel
        rank's shard, parallel/expert_parallel.shard_experts): the others are never read from disk.
        Raises ConfigError for a config.json it cannot read, hf.CheckpointError for weights that do not fit.
        """
        config = hf.config_from_hf(path)
        with torch.device("meta"):
            model = cls(config)
        if experts is not None:
            model.keep_experts(experts)                    # on the meta device: nothing allocated
        state = hf.hf_to_state(hf.read_safetensors_dir(path, hf.expert_rows(config, experts)), model, experts)
        dtype = dtype or state["embed_tokens.weight"].dtype   # the weights' dtype (norms are often fp32)
        model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, assign=True)
        return model

    def save_pretrained(self, path: str, max_shard_bytes: int = 2 << 30) -> None:
        """Write config.json + safetensors (sharded past max_shard_bytes) in the per-expert HF layout of
        the config's model_type, which transformers reads back as the same model."""
        hf.write_safetensors_dir(path, hf.state_to_hf(self), hf.config_to_hf(self.config), max_shard_bytes)
