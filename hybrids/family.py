"""Qwen3.5-MoE and Qwen3-Next in the model: their families (support/hf.FAMILIES) and the Gated DeltaNet
layer as the token mixer of their linear_attention layers (model.MIXERS). Imported by hf.load_plugin when
a config of one of hybrids/options.MODEL_TYPES is read or a model of one is built.

Both families: layer_types says which layers are Gated DeltaNet (`linear_attn`) and which gated softmax
attention (`self_attn`: q_proj doubled into query and gate, per-head (1 + w) q/k norms, RoPE on the first
quarter of each head: GatedAttention, layer kind gated_attention here); every RMSNorm but the GDN's own is zero-centred; every MLP a softmax top-k MoE
(renormalised) with a sigmoid-gated shared expert (Qwen2-MoE's, model.MoE). Keys are transformers': Qwen3.5's
linear layers hold separate in_proj_qkv / z / b / a, Qwen3-Next's the fused in_proj_qkvz / in_proj_ba, split
on load and fused on save. The multi-token-prediction weights (`mtp.*`) are kept aside on load and written
back on save, unused by the forward; a multimodal Qwen3.5 checkpoint loads as its text model (model.visual.*
is not read; a save writes the text model)."""
from __future__ import annotations

import re

import torch

import kernels
import model
from config import ModelConfig
from support import hf
from support.hf import HF, Family
from hybrids import gdn
from support.packing import PackedPages


class LinearAttention(gdn.GatedDeltaNet):
    """A Block's token mixer on a linear_attention layer: attention's call, the Gated DeltaNet's work. The
    trainer (no cache) runs whole sequences on the grid; the sampler (model.PagedKV with `states`) steps each
    sequence's row of the layer's pool."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                         cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps)

    def forward(self, x, cos=None, sin=None, positions=None, kv=None, layer_idx: int = 0):
        if isinstance(kv, model.PagedKV):
            pools, rows, valid, within = kv.states
            return self.step(x, positions, valid, rows, pools[layer_idx], within)
        if isinstance(kv, PackedPages):        # packed: each sequence from the grid's origin, as if padded
            padded = kv.packing.to_padded(x)                               # (S, longest, D)
            return kv.packing.from_padded(super().forward(padded))         # (B, T, D), 0 on padding
        return super().forward(x)


class GatedAttention(model.Attention):
    """A Block's token mixer on a gated_attention layer (config.json's full_attention): q_proj doubled into each
    head's query and its gate (per head [query; gate]), q/k norms zero-centred, and the attention's output
    times sigmoid(gate), in fp32 with the row-invariant sigmoid (transformers: in the model dtype)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        self.q_proj = model.Linear(cfg.hidden_size, 2 * self.n_heads * self.head_dim, cfg.attention_bias)

    def forward(self, x, cos, sin, positions, kv, layer_idx: int):
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)   # (B, T, H, D) each
        q, k = self.q_norm(q), self.k_norm(self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        o = model.attend(q, k, v, positions, kv, layer_idx, self.head_dim ** -0.5)   # (B, T, H, D)
        o = (o.float() * kernels.sigmoid(gate)).to(o.dtype)
        return self.o_proj(o.reshape(B, T, self.n_heads * self.head_dim))


def _ours(types: list[str]) -> list[str]:
    """config.json's layer_types -> ours: its full_attention layers are gated (GatedAttention)."""
    return ["gated_attention" if t == "full_attention" else t for t in types]


def _theirs(types: list[str]) -> list[str]:
    return ["full_attention" if t == "gated_attention" else t for t in types]


_CONFIG = {"num_experts": HF(("num_experts",), 0), "moe_intermediate_size": HF(("moe_intermediate_size",), 0),
           "shared_expert_intermediate_size": HF(("shared_expert_intermediate_size",), 0),
           "attention_bias": HF(("attention_bias",), False),
           "attention_out_bias": HF(("attention_bias",), False),
           "partial_rotary_factor": HF(("partial_rotary_factor",), 0.25, float),
           "layer_types": HF(("layer_types",), lambda c: _ours(_interval_layers(c)), _ours, _theirs),
           **{k: HF((k,), d) for k, d in (("linear_num_key_heads", 16), ("linear_num_value_heads", 32),
                                          ("linear_key_head_dim", 128), ("linear_value_head_dim", 128),
                                          ("linear_conv_kernel_dim", 4))}}
_FIXED = {"zero_centered_norm": True, "qk_norm": "head"}


def _interval_layers(c: dict) -> list[str]:
    """layer_types when config.json has none: full attention every full_attention_interval-th layer (4)."""
    every = c.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(c["num_hidden_layers"])]


def _split(tensors: dict, cfg: ModelConfig) -> dict:
    """Qwen3-Next's fused in_proj_qkvz / in_proj_ba -> the separate projections (gdn.split_qwen3_next)."""
    out = {}
    for key, t in tensors.items():
        if key.endswith("linear_attn.in_proj_ba.weight"):
            continue
        if m := re.match(r"(.*linear_attn\.)in_proj_qkvz\.weight$", key):
            ba = tensors[m.group(1) + "in_proj_ba.weight"]
            parts = gdn.split_qwen3_next(t, ba, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                         cfg.linear_key_head_dim, cfg.linear_value_head_dim)
            out.update({f"{m.group(1)}{name}.weight": w for name, w in parts.items()})
        else:
            out[key] = t
    return out


def _fuse(tensors: dict, cfg: ModelConfig) -> dict:
    """The separate projections -> Qwen3-Next's fused, per-key-head interleaved in_proj_qkvz / in_proj_ba."""
    out = {}
    for key, t in tensors.items():
        m = re.match(r"(.*linear_attn\.)in_proj_(qkv|z|b|a)\.weight$", key)
        if not m:
            out[key] = t
        elif m.group(2) == "qkv":
            p = m.group(1)
            qkvz, ba = gdn.fuse_qwen3_next({n: tensors[f"{p}in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a")},
                                           cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                           cfg.linear_key_head_dim, cfg.linear_value_head_dim)
            out[f"{p}in_proj_qkvz.weight"], out[f"{p}in_proj_ba.weight"] = qkvz, ba
    return out


hf.FAMILIES["qwen3_5_moe_text"] = Family(
    "Qwen3_5MoeForCausalLM", config=_CONFIG, fixed={**_FIXED, "norm_topk_prob": True, "mlp_only_layers": []},
    load_renames=((r"^model\.language_model\.", "model."),), kept=r"^mtp\.", dropped=r"^model\.visual\.",
    router_dtype="compute")
hf.FAMILIES["qwen3_next"] = Family(
    "Qwen3NextForCausalLM",
    config={**_CONFIG, "norm_topk_prob": HF(("norm_topk_prob",), True),
            "mlp_only_layers": HF(("mlp_only_layers",), [], lambda v: list(v or [])),
            "decoder_sparse_step": HF(("decoder_sparse_step",), 1, lambda v: v or 1)},
    fixed=_FIXED, load_tensors=_split, save_tensors=_fuse, kept=r"^mtp\.", router_dtype="compute")
model.MIXERS["linear_attention"] = ("linear_attn", LinearAttention)
model.MIXERS["gated_attention"] = ("self_attn", GatedAttention)


class EngineDecode(LinearAttention):
    """The mismatch lab's fault (--rollout_linear_decode=recurrent, lab/faults.py): the rollout copy's Gated
    DeltaNet layers run the recurrent form, a token at a time from the state after the last one, as
    inference engines decode (the trainer keeps the grid). Its pool: the conv's last K-1 inputs and the state
    after each sequence's last token. A decode step is one batched recurrent step; a prefill loops over its
    sequences."""

    def new_pool(self, rows: int, dtype, device, snapshots: int = 0) -> gdn.GDNPool:
        """The grid's pool with no open chunk (grid 0: no boundary, so neither drafts nor the prefix cache)."""
        return super().new_pool(rows, dtype, device, 0, C=0)

    def step(self, x, positions, valid, rows, pool, within=False):
        if x.shape[1] == 1:                                               # decode: the batch in one recurrent step
            keep = ((positions[:, 0] != 0) & valid[:, 0]).float()
            fed = valid[:, 0, None, None]
            conv, state = pool.conv[rows] * keep[:, None, None].to(pool.conv.dtype), pool.state[rows]
            rule, mixed = self.rule_inputs(x, conv)
            core, new = gdn.recurrent(*rule, state=state * keep[:, None, None, None])
            pool.state[rows] = torch.where(fed[..., None], new, state)
            pool.conv[rows] = torch.where(fed, torch.cat([conv, mixed], dim=1)[:, 1:], pool.conv[rows])
            return self.output(core, x)
        core = torch.zeros(*x.shape[:2], self.h, self.dv, device=x.device)
        for b, (n, first, r) in enumerate(zip(valid.sum(1).tolist(), positions[:, 0].tolist(), rows.tolist())):
            if n == 0:
                continue
            keep = float(first != 0)                                      # a sequence's start: zeros
            rule, mixed = self.rule_inputs(x[b:b + 1, :n], pool.conv[r:r + 1] * keep)
            core[b, :n], state = gdn.recurrent(*rule, state=pool.state[r:r + 1] * keep)
            pool.state[r] = state[0]
            pool.conv[r] = torch.cat([pool.conv[r] * keep, mixed[0]])[-pool.conv.shape[1]:]
        return self.output(core, x)
