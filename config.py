"""Configuration: one dataclass per concern, presets, and `--key=value` overrides.

    from config import ModelConfig
    cfg = ModelConfig.preset("tiny")                  # the CPU default of `python train.py`

Field names follow Hugging Face's Qwen3-MoE config; the knobs of other families (sigmoid routing, a
score-correction bias, grouped top-k, shared experts, biases, partial RoPE; gpt-oss's sinks, windows,
YaRN and experts; DeepSeek's MLA) are extra fields that are off by default. support/hf.py translates each
family's config.json onto them (hf.config_from_hf) and checks model_type; this file imports nothing of it.
Every dataclass validates itself in `__post_init__`; `apply_overrides` turns command-line
`--key=value` strings into typed fields and rejects unknown keys and bad values by name (with the
nearest name, or the one another codebase means: --n_layer -> --num_hidden_layers); `apply_command_line`
also takes a preset's ModelConfig fields (--num_hidden_layers=2) into TrainConfig.model_overrides.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib
import inspect
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field

from support.tasks import TASKS     # the task table (support/tasks.py imports nothing of this module)


class ConfigError(ValueError):
    """A config value, key or file that cannot be used; the message says what to change."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _require_range(cfg, names, ok, what: str) -> None:
    """Each field in names passes ok(value), else `--name=value: must be <what>` (one option per message)."""
    for name in names.split():
        v = getattr(cfg, name)
        _require(ok(v), f"--{name}={v:g}: must be {what}" if isinstance(v, float) else f"--{name}={v}: must be {what}")


def _require_finite(cfg) -> None:
    """Every float field finite: an inf learning rate or a NaN temperature would poison the run silently."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        _require(not isinstance(v, float) or math.isfinite(v), f"--{f.name}={v}: must be a finite number")


class Options:
    """What an options group's checks call as methods, so that a plug-in's options module imports nothing
    of the project (its `check`, `check_with_model`, `check_with_training` run on the whole config)."""
    require = staticmethod(_require)
    require_range = _require_range


def _check_groups(cfg, hook: str, *args) -> None:
    """Each option group's own `hook` on the whole config, the core's groups first (a plug-in's check may
    read the core's fields; another plug-in's only with getattr and that plug-in's default)."""
    for cls in reversed(type(cfg).__mro__):
        fn = vars(cls).get(hook)
        if fn is not None:
            fn(cfg, *args)


@dataclass
class ModelConfig:
    vocab_size: int = 32                 # token ids the embedding and the LM head hold
    hidden_size: int = 128               # the residual stream's width
    num_hidden_layers: int = 4           # transformer blocks
    num_attention_heads: int = 4         # query heads
    num_key_value_heads: int = 2         # key/value heads (grouped-query attention)
    head_dim: int = 32                   # dims per attention head
    num_experts: int = 8                 # 0 makes every layer a dense SwiGLU MLP
    num_experts_per_tok: int = 2         # top-k
    moe_intermediate_size: int = 128     # per expert
    intermediate_size: int = 256         # dense MLP layers
    norm_topk_prob: bool = True          # renormalise the top-k router probabilities to sum to 1
    mlp_only_layers: list[int] = field(default_factory=lambda: [0])   # layers with a dense MLP, comma-separated
    decoder_sparse_step: int = 1         # every step-th layer is MoE
    rope_theta: float = 10000.0          # RoPE base
    rms_norm_eps: float = 1e-6           # RMSNorm's epsilon
    tie_word_embeddings: bool = False    # the LM head shares the embedding's weights
    max_position_embeddings: int = 256   # the longest sequence (prompt + response)
    initializer_range: float = 0.02      # std of the random initial weights
    # other families (support/hf.py); every default below is Qwen3-MoE, which uses none of them
    model_type: str = "qwen3_moe"        # the HF family (hf.FAMILIES): config names and weight keys on load and save
    router_scoring: str = "softmax"      # softmax | sigmoid (DeepSeek-V3, GLM-4.5), in fp32
    score_correction_bias: bool = False  # a per-expert bias added to the scores for the choice only
    n_group: int = 1                     # group-limited top-k: experts in n_group groups, ...
    topk_group: int = 1                  # ... the top-k taken inside the best topk_group groups
    routed_scaling_factor: float = 1.0   # multiplies the routed experts' weights
    n_shared_experts: int = 0            # ungated shared expert of n * moe_intermediate_size (GLM, DeepSeek)
    shared_expert_intermediate_size: int = 0  # one shared expert with a sigmoid gate (Qwen2-MoE)
    first_k_dense_replace: int = 0       # layers [0, k) are dense
    attention_bias: bool = False         # biases on q_proj, k_proj, v_proj
    attention_out_bias: bool = False     # a bias on o_proj (OLMoE, Qwen3 attention_bias)
    qk_norm: str = "head"                # RMSNorm on q and k: per head | full (the whole projection) | none
    partial_rotary_factor: float = 1.0   # RoPE on the first head_dim * factor dims of each head
    # gpt-oss: attention sinks, sliding windows, YaRN RoPE, a biased router, biased clamped-SwiGLU experts
    attention_sinks: bool = False        # a learned logit per head in each attention softmax's denominator
    sliding_window: int = 0              # keys a query of a sliding layer sees, itself included (0: none)
    layer_types: list[str] = field(default_factory=list)   # per layer full_attention | sliding_attention,
                                         # comma-separated; empty: every layer full
    rope_type: str = "default"           # default | yarn (the yarn_* fields below)
    yarn_factor: float = 1.0             # YaRN: the context extension factor
    yarn_original_max_position_embeddings: int = 0   # YaRN: the pretraining context
    yarn_beta_fast: float = 32.0         # YaRN: rotations where the ramp to interpolation starts ...
    yarn_beta_slow: float = 1.0          # ... and where it ends
    yarn_truncate: bool = True           # YaRN: round the ramp's ends to whole dims
    yarn_mscale: float = 0.0             # YaRN: cos/sin scale mscale(factor, this) / mscale(factor, all_dim);
    yarn_mscale_all_dim: float = 0.0     # both 0: mscale(factor, 1); MLA's softmax scale * mscale(factor, all_dim)^2
    yarn_attention_factor: float = 0.0   # YaRN: the cos/sin scale given outright (0: from the mscales)
    router_bias: bool = False            # a bias on the router gate (gpt-oss)
    expert_bias: bool = False            # biases on each expert's gate/up and down projections (gpt-oss)
    moe_act: str = "silu"                # the experts' GLU: silu (silu(gate) * up) | clamped_swiglu (gpt-oss:
                                         # gate, up clamped at swiglu_limit, (up + 1) * gate * sigmoid(alpha gate))
    swiglu_alpha: float = 1.702          # clamped_swiglu's alpha
    swiglu_limit: float = 7.0            # clamped_swiglu's clamp
    # multi-head latent attention (DeepSeek-V2 / V3, Moonlight, GLM-4.7-Flash); head_dim is its RoPE key's width
    kv_lora_rank: int = 0                # MLA: the kv latent's width, cached per token with the RoPE key (0: GQA)
    q_lora_rank: int = 0                 # MLA: q through q_a_proj (this rank), q_a_layernorm, q_b_proj (0: q_proj)
    qk_nope_head_dim: int = 0            # MLA: each query / key head's dims without RoPE
    v_head_dim: int = 0                  # MLA: each value head's dims
    rope_interleave: bool = False        # MLA: RoPE on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek)
    group_score: str = "top2_sum"        # grouped top-k ranks a group by top2_sum (DeepSeek-V3, GLM) | max (V2)
    # linear-attention hybrids (Qwen3.5-MoE, Qwen3-Next; the hybrids/ plug-in): layer_types linear_attention
    # (Gated DeltaNet) and gated_attention (q_proj doubled into query and gate, out * sigmoid(gate))
    zero_centered_norm: bool = False     # every RMSNorm scales by (1 + w), in fp32 before rounding (w stored - 1)
    linear_num_key_heads: int = 0        # Gated DeltaNet: key (and query) heads
    linear_num_value_heads: int = 0      # Gated DeltaNet: value heads (the state's), a multiple of the key heads
    linear_key_head_dim: int = 0         # Gated DeltaNet: dims of a key head
    linear_value_head_dim: int = 0       # Gated DeltaNet: dims of a value head
    linear_conv_kernel_dim: int = 4      # Gated DeltaNet: taps of the causal depthwise conv

    def __post_init__(self):
        _require_finite(self)
        _require_range(self, "vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads "
                       "head_dim decoder_sparse_step max_position_embeddings rope_theta rms_norm_eps",
                       lambda v: v > 0, "> 0")
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                 f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        _require(self.head_dim % 2 == 0, f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        _require_range(self, "num_experts", lambda v: v >= 0, ">= 0")
        if self.num_experts > 0:
            _require(1 <= self.num_experts_per_tok <= self.num_experts,
                     f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts="
                     f"{self.num_experts}]")
            _require_range(self, "moe_intermediate_size", lambda v: v > 0, "> 0 when num_experts > 0")
        self.mlp_only_layers = sorted(int(i) for i in self.mlp_only_layers)
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        _require(not bad, f"mlp_only_layers {bad} are outside [0, num_hidden_layers={self.num_hidden_layers})")
        if any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers)):
            _require_range(self, "intermediate_size", lambda v: v > 0, "> 0: the config has dense layers")
        if self.model_type != "qwen3_moe" or any(getattr(self, k) != v for k, v in FAMILY_KNOBS.items()):
            self._check_family_knobs()

    def _check_family_knobs(self):
        from kernels import ROUTER_SCORES                             # the table the router runs
        _require(self.router_scoring in ROUTER_SCORES,
                 f"router_scoring={self.router_scoring!r}: {', '.join(ROUTER_SCORES)}")
        _require(self.router_scoring != "topk_softmax" or (self.norm_topk_prob and not self.score_correction_bias
                                                           and self.n_group == 1),
                 "router_scoring=topk_softmax (a softmax over the chosen k logits) needs norm_topk_prob=true, "
                 "no score_correction_bias and n_group=1")
        self._check_gpt_oss_knobs()
        _require(self.qk_norm in ("head", "full", "none"), f"qk_norm={self.qk_norm!r}: head, full or none")
        _require_range(self, "first_k_dense_replace n_shared_experts shared_expert_intermediate_size",
                       lambda v: v >= 0, ">= 0")
        _require(not (self.n_shared_experts and self.shared_expert_intermediate_size),
                 "set n_shared_experts (ungated, GLM / DeepSeek) or shared_expert_intermediate_size "
                 "(gated, Qwen2-MoE), not both")
        _require_range(self, "routed_scaling_factor", lambda v: v > 0, "> 0")
        _require_range(self, "partial_rotary_factor", lambda v: 0 < v <= 1, "in (0, 1]")
        _require(self.rotary_dim >= 2 and self.rotary_dim % 2 == 0,
                 f"head_dim * partial_rotary_factor = {self.rotary_dim} rotary dims: must be even and >= 2")
        _require(self.n_group >= 1 and 1 <= self.topk_group <= self.n_group,
                 f"need n_group >= 1 and 1 <= topk_group <= n_group, got n_group={self.n_group}, "
                 f"topk_group={self.topk_group}")
        if self.n_group > 1 and self.num_experts > 0:
            per = self.num_experts // self.n_group
            _require(self.num_experts % self.n_group == 0 and per >= 2,
                     f"n_group={self.n_group} must divide num_experts={self.num_experts} into groups of >= 2 "
                     "(a group is ranked by its top-2 scores)")
            _require(self.num_experts_per_tok <= self.topk_group * per,
                     f"num_experts_per_tok={self.num_experts_per_tok} is more than the {self.topk_group * per} "
                     f"experts in topk_group={self.topk_group} groups")

    def _check_gpt_oss_knobs(self):
        _require(self.sliding_window >= 0, f"sliding_window={self.sliding_window}: must be >= 0 (0: none)")
        own = family_layer_types().get(self.model_type, ())   # a plug-in family's own layer kinds (model.MIXERS)
        kinds = ("full_attention", "sliding_attention") + own
        if not all(t in kinds for t in self.layer_types):
            raise ConfigError(f"layer_types={self.layer_types}: each entry one of {', '.join(kinds)}"
                              + ("" if own else _plugin_kinds_hint()))
        _require(("linear_attention" in self.layer_types) == bool(self.linear_num_value_heads),
                 "linear_attention layers (Gated DeltaNet) and linear_num_value_heads > 0 go together")
        _require(not own or (self.layer_types and set(self.layer_types) <= set(own)),
                 f"model_type {self.model_type} needs layer_types of {' and '.join(own)} layers, one per layer")
        _require(not self.layer_types or len(self.layer_types) == self.num_hidden_layers,
                 f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}")
        _require(("sliding_attention" in self.layer_types) == (self.sliding_window > 0),
                 f"sliding_window={self.sliding_window} with layer_types={self.layer_types or '[]'}: a window "
                 "needs sliding_attention layers, and sliding_attention layers need a window > 0")
        _require(self.rope_type in ("default", "yarn"), f"rope_type={self.rope_type!r}: default or yarn")
        if self.rope_type == "yarn":
            _require(self.yarn_factor >= 1 and self.yarn_original_max_position_embeddings > 0,
                     f"rope_type=yarn needs yarn_factor >= 1 and yarn_original_max_position_embeddings > 0, got "
                     f"{self.yarn_factor:g} and {self.yarn_original_max_position_embeddings}")
        _require_range(self, "yarn_beta_fast yarn_beta_slow", lambda v: v > 0, "> 0")
        _require_range(self, "yarn_mscale yarn_mscale_all_dim yarn_attention_factor", lambda v: v >= 0, ">= 0")
        _require(self.moe_act in ("silu", "clamped_swiglu"), f"moe_act={self.moe_act!r}: silu or clamped_swiglu")
        _require_range(self, "swiglu_alpha swiglu_limit", lambda v: v > 0, "> 0")
        _require(self.group_score in ("top2_sum", "max"), f"group_score={self.group_score!r}: top2_sum or max")
        _require_range(self, "kv_lora_rank q_lora_rank qk_nope_head_dim v_head_dim", lambda v: v >= 0, ">= 0")
        if self.linear_num_value_heads:
            self._check_linear_knobs()
        if self.kv_lora_rank:
            _require(self.qk_nope_head_dim > 0 and self.v_head_dim > 0,
                     "MLA (kv_lora_rank > 0) needs qk_nope_head_dim > 0 and v_head_dim > 0")
            _require(self.qk_norm == "none" and self.partial_rotary_factor == 1 and not self.attention_sinks
                     and not self.sliding_window, "MLA (kv_lora_rank > 0) has no q/k norm, partial RoPE, sinks or "
                     "sliding window: set qk_norm=none and leave the others off")

    def _check_linear_knobs(self):
        _require_range(self, "linear_num_key_heads linear_key_head_dim linear_value_head_dim linear_conv_kernel_dim",
                       lambda v: v > 0, "> 0 for Gated DeltaNet layers (linear_num_value_heads > 0)")
        _require(self.linear_num_value_heads % self.linear_num_key_heads == 0,
                 f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of linear_num_key_heads "
                 f"({self.linear_num_key_heads})")

    def is_linear(self, layer_idx: int) -> bool:
        """A Gated DeltaNet layer (hybrids/): a recurrent state per sequence, no KV cache."""
        return bool(self.layer_types) and self.layer_types[layer_idx] == "linear_attention"

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The Gated DeltaNet layers' indices (none outside the hybrids)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_linear(i))

    def yarn(self) -> dict | None:
        """YaRN's parameters as kernels.rope_tables takes them; None for default RoPE."""
        if self.rope_type != "yarn":
            return None
        return dict(factor=self.yarn_factor, original_max_position_embeddings=self.yarn_original_max_position_embeddings,
                    beta_fast=self.yarn_beta_fast, beta_slow=self.yarn_beta_slow, truncate=self.yarn_truncate,
                    mscale=self.yarn_mscale, mscale_all_dim=self.yarn_mscale_all_dim,
                    attention_factor=self.yarn_attention_factor)

    def window(self, layer_idx: int) -> int:
        """Keys a query of this layer sees, itself included; 0: every earlier key (full attention)."""
        sliding = self.layer_types and self.layer_types[layer_idx] == "sliding_attention"
        return self.sliding_window if sliding else 0

    @property
    def kv_cache_heads_dims(self) -> tuple[int, int]:
        """(heads, dims) of a layer's cached keys (and as many values) per token: GQA's (KVH, head_dim) for
        keys and values; MLA's (1, kv_lora_rank + head_dim), one latent tensor that is keys and values."""
        if self.kv_lora_rank:
            return 1, self.kv_lora_rank + self.head_dim
        return self.num_key_value_heads, self.head_dim

    @property
    def kv_numbers_per_token(self) -> int:
        """Numbers the KV cache holds per token and layer (times the dtype's bytes: its memory)."""
        heads, dims = self.kv_cache_heads_dims
        return heads * dims * (1 if self.kv_lora_rank else 2)

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (the first ones; NeoX half-split over them)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0 and layer_idx >= self.first_k_dense_replace)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @staticmethod
    def preset(name: str) -> "ModelConfig":
        if name not in MODEL_PRESETS:
            raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
        return ModelConfig(**MODEL_PRESETS[name])


# the other families' knobs and their defaults (Qwen3-MoE's): their checks run when a config sets one
_MODEL_FIELDS = dataclasses.fields(ModelConfig)
_FIRST_KNOB = [f.name for f in _MODEL_FIELDS].index("router_scoring")        # the fields from it on
FAMILY_KNOBS = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                for f in _MODEL_FIELDS[_FIRST_KNOB:]}


MODEL_PRESETS: dict[str, dict] = {
    # ~1.5M parameters: 4 layers (1 dense + 3 MoE with 8 experts, top-2); trains in minutes on 2 CPU cores.
    "tiny": dict(),
    # The tiny model with DeepSeek-V3 / GLM-4.5 routing, for the mismatch lab: sigmoid scores, a
    "tiny-sigmoid": dict(model_type="glm4_moe", router_scoring="sigmoid", score_correction_bias=True, n_group=2,
                         topk_group=1, n_shared_experts=1, mlp_only_layers=[], first_k_dense_replace=1),
    # The dense control of the lab: tiny's width and active parameters, every layer a dense SwiGLU MLP of
    "tiny-dense": dict(num_experts=0, num_experts_per_tok=1, moe_intermediate_size=0, intermediate_size=256,
                       mlp_only_layers=[]),                        # the expert knobs as config.json gives them back
    # The tiny model in the two 2026 lines' attention, for the lab's family rows. gpt-oss: sinks, a window of 8
    # (shorter than a prompt and its answer) on every other layer, q/k/v/o biases, a biased router taking the
    "tiny-gpt-oss": dict(model_type="gpt_oss", attention_bias=True, attention_out_bias=True, qk_norm="none",
                         attention_sinks=True, sliding_window=8, mlp_only_layers=[], intermediate_size=128,
                         layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(4)],
                         router_bias=True, router_scoring="topk_softmax", expert_bias=True, moe_act="clamped_swiglu"),
    # DeepSeek-V3's: MLA (a 32-wide kv latent and a 16-wide RoPE key cached per token, interleaved RoPE), the
    "tiny-mla": dict(model_type="deepseek_v3", qk_norm="none", kv_lora_rank=32, qk_nope_head_dim=32, v_head_dim=32,
                     head_dim=16, rope_interleave=True, router_scoring="sigmoid", score_correction_bias=True,
                     n_group=2, topk_group=1, n_shared_experts=1, mlp_only_layers=[], first_k_dense_replace=1),
    "gpt-oss-20b": dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=2880,
        intermediate_size=2880, norm_topk_prob=True, mlp_only_layers=[], rope_theta=150000.0, rms_norm_eps=1e-5,
        max_position_embeddings=131072, attention_bias=True, attention_out_bias=True, qk_norm="none",
        attention_sinks=True, sliding_window=128,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
        rope_type="yarn", yarn_factor=32.0, yarn_original_max_position_embeddings=4096, yarn_truncate=False,
        router_bias=True, router_scoring="topk_softmax", expert_bias=True, moe_act="clamped_swiglu"),
    # Moonlight-16B-A3B's shapes (DeepSeek-V3's architecture: 27 layers, the first dense, 64 experts top-6 + 2
    "moonlight-16b-a3b": dict(
        model_type="deepseek_v3", vocab_size=163840, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, head_dim=64, num_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
        intermediate_size=11264, norm_topk_prob=True, mlp_only_layers=[], first_k_dense_replace=1,
        router_scoring="sigmoid", score_correction_bias=True, n_shared_experts=2, routed_scaling_factor=2.446,
        rope_theta=50000.0, rms_norm_eps=1e-5, max_position_embeddings=8192, qk_norm="none", kv_lora_rank=512,
        qk_nope_head_dim=128, v_head_dim=128, rope_interleave=True),
    # The real Qwen3-30B-A3B shapes (48 layers, 128 experts, top-8, 3.3B active parameters).
    "qwen3-30b-a3b": dict(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, intermediate_size=6144, norm_topk_prob=True, mlp_only_layers=[],
        decoder_sparse_step=1, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=40960),
}
# Qwen3.5-MoE's line (hybrids/): three Gated DeltaNet layers, then one gated softmax-attention layer (partial
# RoPE, (1 + w) norms); every MLP a softmax top-k MoE with a sigmoid-gated shared expert.
_HYBRID = dict(model_type="qwen3_5_moe_text", zero_centered_norm=True, partial_rotary_factor=0.25, mlp_only_layers=[],
               norm_topk_prob=True, linear_conv_kernel_dim=4)
# The tiny model as a hybrid, for tests and the lab: 2 key / 4 value heads of 16 in the linear layers.
MODEL_PRESETS["tiny-hybrid"] = dict(
    _HYBRID, shared_expert_intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "gated_attention"])
# Qwen3.5-35B-A3B's text model (its config.json's text_config): 40 layers, 256 experts of 512 top-8 + a shared one.
MODEL_PRESETS["qwen3.5-35b-a3b"] = dict(
    _HYBRID, vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    intermediate_size=512, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, rope_theta=10_000_000.0, max_position_embeddings=262144,
    layer_types=["gated_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)])
# Qwen3-Next-80B-A3B: 48 layers, 512 experts of 512 top-10 + a shared one; its linear layers' projections fused.
MODEL_PRESETS["qwen3-next-80b-a3b"] = dict(
    MODEL_PRESETS["qwen3.5-35b-a3b"], model_type="qwen3_next", vocab_size=151936, num_hidden_layers=48,
    num_experts=512, num_experts_per_tok=10, intermediate_size=5120,
    layer_types=["gated_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)])
# Qwen3-235B-A22B's: Qwen3-30B-A3B's family at 94 layers, 128 experts of 1536, 22B active (for --plan at scale).
MODEL_PRESETS["qwen3-235b-a22b"] = dict(MODEL_PRESETS["qwen3-30b-a3b"], hidden_size=4096, num_hidden_layers=94,
                                        num_attention_heads=64, moe_intermediate_size=1536, intermediate_size=12288)


# The ModelConfig fields a preset takes from the command line (--num_hidden_layers=2): all but vocab_size
# (TrainConfig's --vocab_size, which can also follow the tokenizer) and model_type (a family's knobs come with
# it: pick the preset, or a checkpoint, of that family).
MODEL_OPTIONS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("vocab_size", "model_type"))
# Names from other codebases that mean a field here: the nearest-name hint for an unknown key.
ALIASES = {"n_layer": "num_hidden_layers", "n_layers": "num_hidden_layers", "n_head": "num_attention_heads",
           "n_heads": "num_attention_heads", "n_kv_head": "num_key_value_heads", "n_kv_heads": "num_key_value_heads",
           "n_embd": "hidden_size", "d_model": "hidden_size", "dim": "hidden_size", "n_experts": "num_experts",
           "num_local_experts": "num_experts", "n_expert": "num_experts", "top_k_experts": "num_experts_per_tok",
           "n_experts_per_tok": "num_experts_per_tok", "moe_topk": "num_experts_per_tok",
           "expert_intermediate_size": "moe_intermediate_size", "ffn_dim": "intermediate_size",
           "max_seq_len": "max_position_embeddings", "learning_rate": "lr"}


def preset_summary(name: str) -> str:
    """A preset in a few words, from its config (the one source): layers, width, experts, vocabulary."""
    c = ModelConfig.preset(name)
    moe = (f"{len(c.moe_layers)} MoE layers of {c.num_experts} experts top-{c.num_experts_per_tok}"
           if c.moe_layers else "dense")
    return (f"{c.model_type}, {c.num_hidden_layers} layers ({moe}), hidden {c.hidden_size}, "
            f"{c.num_attention_heads} heads, vocab {c.vocab_size}")





def check_sampling(temperature, **filters) -> None:
    """The sampling ranges, the one rule for RolloutConfig (the command line) and for each request
    (rollout.SamplingParams, generate()'s arguments): the same words for the same value; filters: by name,
    checked by their entries of kernels.SAMPLING_FILTERS."""
    from kernels import SAMPLING_FILTERS, is_real

    def shown(x):
        return f"{x:g}" if is_real(x) else repr(x)
    _require(is_real(temperature) and math.isfinite(temperature) and temperature >= 0,
             f"--temperature={shown(temperature)}: must be >= 0 and finite (0 samples greedily)")
    for name, value in filters.items():
        rule = SAMPLING_FILTERS.get(name)
        _require(rule is not None, f"{name}={value!r}: not a sampling filter ({', '.join(SAMPLING_FILTERS)})")
        said = repr(value) if isinstance(rule.off, int) else shown(value)     # a count: as given
        _require(rule.valid(value), f"--{name}={said}: {rule.rule}")





@dataclass
class RolloutOptions(Options):
    """The sampler's settings: the paged KV, sampling, lengths.

    rollout.Sampler reads the engine's, train.py passes the sampling ones; the plug-ins' rollout options
    join them in RolloutConfig (the end of this section)."""
    # a group's FREE_ON_RESUME: what a resume may change without changing the run's numbers (the engine's:
    # the contract keeps its bits at any of them); FIXED_ON_RESUME: what it may not change even when asked
    # (support/checkpoint.check_resume_changes reads both from every group)
    FREE_ON_RESUME = ("block_size", "num_blocks", "max_batch_size", "max_num_batched_tokens", "prefix_cache",
                      "state_snapshots", "kv_memory_fraction", "cuda_graphs", "record_route_detail")
    block_size: int = 16              # KV positions per page
    num_blocks: int = 0               # 0: sized from the device (see rollout.Sampler)
    max_batch_size: int = 256         # running sequences at most
    max_num_batched_tokens: int = 4096   # tokens per prefill forward (prompts right-padded to the longest);
                                         # a longer prompt or observation is prefilled in chunks of this many
    prefix_cache: bool = True         # reuse computed full KV blocks (and routes) of a seen token prefix, same weights
    state_snapshots: int = 32         # linear-attention layers (hybrids/): the prefix cache's copies of their state at a
                                      # grid boundary, where a hit must end (each: a sequence's state pool row); 0: no cache
    window_blocks: int = 0            # sliding-window layers' own pool, freed below the window: 0 sized from the batch
                                      # (rollout.Sampler), -1 none (those layers keep every block, as full ones do)
    kv_memory_fraction: float = 0.5   # CUDA: share of free memory (after grads + AdamW state) for the KV pool
    cuda_graphs: bool | None = None   # decode steps as CUDA graphs; None: where they run without host syncs
    temperature: float = 1.0          # sampling temperature (0: greedy); log-probs are of softmax(logits / T)
    top_p: float = 1.0                # nucleus sampling (1: off)
    top_k: int = 0                    # sample among the k most likely tokens (0: off)
    max_new_tokens: int = 0           # response length limit (per turn in an episode); 0: the task's (n_digits + 1;
                                      # --task=jsonl: 64)
    max_episode_tokens: int = 0       # episodes: the most ids an episode adds after its prompt, the policy's and the
                                      # environment's; 0: the task's (lookup, fix: their length; --env: 4 x max_new_tokens)
    stop_tokens: str = ""             # comma-separated ids that end a response, instead of the checkpoint's /
                                      # tokenizer's eos (the digit tasks: their EOS)
    record_route_detail: bool = False  # the sampler also keeps each route's combine weights and margin (fp32)

    def __post_init__(self):
        _require_finite(self)
        _require_range(self, "block_size max_batch_size max_num_batched_tokens", lambda v: v > 0, "> 0")
        _require_range(self, "num_blocks max_new_tokens max_episode_tokens state_snapshots", lambda v: v >= 0, ">= 0")
        _require_range(self, "window_blocks", lambda v: v >= -1, ">= -1 (0: sized from the batch, -1: none)")
        from kernels import KV_BLOCK      # a page holds whole attention tiles
        _require(self.block_size % KV_BLOCK == 0,
                 f"--block_size={self.block_size}: must be a multiple of kernels.KV_BLOCK={KV_BLOCK}")
        _require(0 < self.kv_memory_fraction <= 1, f"--kv_memory_fraction={self.kv_memory_fraction}: must be in (0, 1]")
        check_sampling(self.temperature, **self.sampling_filters())
        self.stop_token_ids                                          # parses --stop_tokens (errors name it)
        _check_groups(self, "check")

    def sampling_filters(self) -> dict:
        """The draw's filters this config sets, by name (kernels.SAMPLING_FILTERS: top_p, top_k, a fork's)."""
        from kernels import SAMPLING_FILTERS
        return {name: getattr(self, name) for name in SAMPLING_FILTERS if hasattr(self, name)}

    def check_training(self, tcfg: "TrainConfig") -> None:
        """The rollout settings against the training's (train.py, every rank): the groups' own."""
        _check_groups(self, "check_with_training", tcfg)

    def rollout_ops(self) -> dict:
        """The op set the sampler's steps run (kernels.op_set): the invariant one; a plug-in's options
        group may return another (the lab's fast ops)."""
        return {}

    def draft_policy(self):
        """What drafts tokens for the sampler's verify steps (rollout.ModelRunner): none, plain decoding; a
        plug-in's options group may return one (sampling's n-gram drafts): .k, .propose, .accept."""
        return None

    @property
    def stop_token_ids(self) -> tuple[int, ...] | None:
        """--stop_tokens as ids, or None when not given (the task's then: support/tasks.py, "Stop tokens")."""
        if not self.stop_tokens.strip():
            return None
        items = [t.strip() for t in self.stop_tokens.split(",")]
        _require(all(re.fullmatch(r"\d+", t) for t in items),
                 f"--stop_tokens={self.stop_tokens!r}: comma-separated token ids, e.g. --stop_tokens=151645,151643")
        return tuple(int(t) for t in items)


@dataclass
class TrainOptions(Options):
    """The core's options: the run, precision, the batch, the optimizer, the loss and its correction.

    The core's other groups (below) and each plug-in folder's options.py join them in TrainConfig."""
    FREE_ON_RESUME = ("steps", "lr_decay_steps",            # the run's length, its lr plan: resume_plan explains them
                      "out_dir", "save_every", "keep_checkpoints", "save_dtype", "log_every", "progress",
                      "skip_nonfinite_steps", "resume_changes")   # what it writes and how
    init_from: str = "tiny"           # a model preset name or an HF checkpoint directory
    out_dir: str = "out"               # the run folder: metrics.jsonl, ckpt-NNNNNN/, latest
    device: str = "auto"              # auto: cuda if available, else cpu
    dtype: str = "float32"            # the compute dtype: float32 | bfloat16 (one copy serves sampler and trainer)
    master_dtype: str = "float32"     # the optimizer's weights and AdamW state: float32 | bfloat16 (= --dtype only)
    router_dtype: str = "auto"        # the router gate and bias: auto (the family table's) | float32 | --dtype
    save_dtype: str = ""              # the HF export's dtype: "" (--dtype) | float32 | bfloat16
    seed: int = 0                     # initial weights, data order and sampling noise
    resume: bool = False              # continue the run in out_dir from its latest checkpoint
    overwrite: bool = False           # start over in an out_dir that holds a run (deletes its metrics and checkpoints)
    grad_reduce: str = "exact"        # exact: gradients summed as fixed-point integers, the same bits at any
                                      # world size (support/exact_sum.py) | fast: fp32 accumulation and all-reduce
    kernels_backend: str = ""         # "" (KERNELS_BACKEND, default auto: Triton on CUDA) | auto | torch | triton
    # batch
    steps: int = 200                  # RL steps (one rollout batch each)
    prompts_per_step: int = 32        # prompts sampled per step (each gets group_size responses)
    group_size: int = 8               # G responses per prompt
    epochs: int = 1                   # passes over each rollout batch
    minibatch_size: int = 128         # sequences per optimizer step
    micro_batch_tokens: int = 4096    # tokens per forward/backward: sequences packed into one row (packing.pack);
                                      # 0: padded micro-batches of micro_batch_size sequences
    micro_batch_size: int = 0         # at most this many sequences per forward/backward (0: no cap; padded,
                                      # the whole minibatch)
    logits_chunk: int = 4096          # token positions whose (positions, vocab) logits exist at once in the
                                      # trainer's forward and backward (recomputed there); 0: all at once
    # optimizer
    lr: float = 1e-3                  # AdamW's peak learning rate
    min_lr_ratio: float = 0.1         # the schedule's floor, as a fraction of lr
    warmup_steps: int = 5             # linear warmup from lr / warmup_steps
    lr_schedule: str = "cosine"       # cosine | constant | halving (after warmup, halve every lr_decay_period
                                      # steps, never below lr * min_lr_ratio: lr_halving/)
    lr_decay_steps: int = 0           # the cosine's horizon; 0: --steps (on resume: docs/design.md, "The learning-rate horizon")
    weight_decay: float = 0.0         # AdamW's decoupled weight decay
    beta1: float = 0.9                # AdamW's first-moment decay
    beta2: float = 0.99               # AdamW's second-moment decay
    grad_clip: float = 1.0            # clip the global gradient norm to this
    skip_nonfinite_steps: int = 0     # optimizer steps with a non-finite loss or grad norm to skip before stopping
    # loss
    loss: str = "grpo"                # grpo | gspo | gspo_token (losses.LOSSES) | sapo | cispo (policy_losses/)
    agg: str = "auto"                 # auto (the loss's own: per sequence for GSPO and SAPO) | token_mean |
    #                                   seq_mean_token_mean | seq_mean_token_sum | drgrpo
    adv_std_norm: bool = True         # False: Dr.GRPO advantages (no division by the group std)
    eps_low: float = 0.2              # PPO-clip: ratios below 1 - eps_low are clipped
    eps_high: float = 0.28            # ... above 1 + eps_high (DAPO clip-higher)
    kl_coef: float = 0.0              # KL to the frozen initial policy
    kl_estimator: str = "k3"          # k1 | k2 | k3 | k3_clamped (k3 at most 10, as verl's low_var_kl)
    # train-inference mismatch
    recompute_old_logp: bool = False  # recompute old log-probs with the trainer (default: use the rollout's)
    correction: str = "none"          # none | is (rho) | tis (min(rho, tis_cap)) | mis (rho up to mis_high, else 0) |
    #                                   reject (1 inside [mis_low, mis_high], else 0) | icepop (rho inside, else 0)
    #                                   | seq_<each>: on the sequence's rho (losses.TOKEN_CORRECTIONS)
    tis_cap: float = 2.0              # tis: the cap C of min(rho, C)
    replay: str = "none"              # none | r3 (the rollout's routes) | old (the recomputed old policy's routes,
                                      # "vanilla routing replay"; needs --recompute_old_logp)
    replay_steps: int = 0             # > 0: replay on the first N optimizer steps of each batch only (bounded
                                      # replay), then the router's own routes (0: on every one)
    # logging
    log_every: int = 1                # write a metrics.jsonl row every N steps
    save_every: int = 50              # checkpoint every N steps (and at the end)
    keep_checkpoints: int = 1         # the newest K checkpoints are kept, older ones deleted
    progress: str = "auto"            # auto: a progress bar when stdout and stderr are a terminal, else a line
                                      # every --log_every steps (a log file gets lines, not bar frames) | true | false
    resume_changes: str = "refuse"    # --resume with settings that change the run's numbers (lr, the loss, the
                                      # task, ...): refuse | allow; either way each changed setting is printed
                                      # (docs/design.md, "Reliability")
    model_overrides: dict = field(default_factory=dict, metadata={"cli": False})  # the preset's fields set by --name=value

    def __post_init__(self):
        _require_finite(self)
        self.progress = _progress_value(self.progress)
        _require_range(self, "steps prompts_per_step epochs minibatch_size n_digits", lambda v: v > 0, ">= 1")
        _require_range(self, "micro_batch_tokens micro_batch_size logits_chunk lr_decay_steps skip_nonfinite_steps "
                       "warmup_steps", lambda v: v >= 0, ">= 0")
        plugin_value(self, "task", TASKS)                              # or a plug-in's task (multi_turn/)
        _require(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
                 f"--device={self.device!r}: choose auto, cpu, cuda or cuda:N")
        _require(not (self.resume and self.overwrite), "--resume and --overwrite contradict each other: pick one")
        self._check_objective()
        _require(self.keep_checkpoints >= 1, f"--keep_checkpoints={self.keep_checkpoints}: must be >= 1")
        for name in ("data", "tokenizer", "reward_fn"):                 # else the digit task runs, ignoring them
            _require(self.task == "jsonl" or not getattr(self, name),
                     f"--{name}={getattr(self, name)!r} is for your own task: add --task=jsonl (--task={self.task} "
                     "is a built-in digit task and would ignore it)")
        _require_range(self, "entropy_warn", lambda v: v >= 0, ">= 0 (0: off)")
        _require_range(self, "entropy_warn_steps", lambda v: v >= 1, ">= 1")
        _require(self.resume_changes in ("refuse", "allow"), f"--resume_changes={self.resume_changes!r}: refuse or allow")
        bad = sorted(set(self.model_overrides) - set(MODEL_OPTIONS))
        _require(not bad, f"model_overrides {bad}: not ModelConfig fields the command line can set")
        _require(not self.env or self.task == "jsonl", f"--env={self.env!r}: needs --task=jsonl (its prompts and tokenizer)")
        _require_range(self, "save_every log_every", lambda v: v > 0, ">= 1")
        _require_range(self, "lr", lambda v: v >= 0, ">= 0 (0: a frozen policy)")
        _require_range(self, "grad_clip tis_cap", lambda v: v > 0, "> 0")
        _require_range(self, "kl_coef eps_high gspo_eps_high weight_decay", lambda v: v >= 0, ">= 0")
        _require_range(self, "eps_low gspo_eps_low", lambda v: 0 <= v < 1, "in [0, 1)")
        _require_range(self, "beta1 beta2", lambda v: 0 <= v < 1, "in [0, 1)")
        self._check_schedule()
        _require(self.dtype in ("float32", "bfloat16"), f"--dtype={self.dtype!r}: float32 or bfloat16")
        _require_range(self, "group_size", lambda v: v >= 2, ">= 2: advantages compare responses within a group")
        _require(self.grad_reduce in ("exact", "fast"), f"--grad_reduce={self.grad_reduce!r}: exact or fast")
        _require(self.kernels_backend in ("", "auto", "torch", "triton"),
                 f"--kernels_backend={self.kernels_backend!r}: auto, torch or triton (or '' for KERNELS_BACKEND)")
        _require(self.vocab_size in ("", "auto") or (self.vocab_size.isdigit() and int(self.vocab_size) > 0),
                 f"--vocab_size={self.vocab_size!r}: auto (the task's tokenizer) or a number of token ids > 0")
        _require(self.task == "jsonl" or not (self.chat_template or self.system_prompt),
                 "--chat_template and --system_prompt format JSONL prompts: add --task=jsonl")
        _require(self.chat_template or not self.system_prompt,
                 "--system_prompt goes into the checkpoint's chat template: add --chat_template=true")
        self._check_precision()
        _check_groups(self, "check")

    def _check_schedule(self):
        """The lr schedule (distributed.lr_at, or a plug-in's) and the length surge's (runlog.LengthSurge)."""
        plugin_value(self, "lr_schedule", ("cosine", "constant"))   # or a plug-in's (lr_halving/)
        _require_range(self, "surge_window", lambda v: v >= 0, ">= 0 (0: off)")
        _require_range(self, "surge_ratio", lambda v: v > 0, "> 0 (the growth that counts as a surge)")

    def _check_objective(self):
        """The objective against losses.py's tables: the loss, its aggregation over minibatches, the corrections, the
        KL; the replay options (replay.py's)."""
        from losses import AGGREGATIONS, CORRECTIONS, KL_ESTIMATORS, LOSSES, SEQ_RHOS   # the tables the loop runs
        plugin_value(self, "loss", LOSSES)                            # or a plug-in's loss (policy_losses/)
        _require(self.agg == "auto" or self.agg in AGGREGATIONS,
                 f"--agg={self.agg!r}: choose auto or one of {', '.join(AGGREGATIONS)}")
        _require(not LOSSES[self.loss].per_sequence or self.agg in ("auto", "seq_mean_token_mean"),
                 f"--loss={self.loss} is defined with per-sequence mean aggregation; drop --agg={self.agg}")
        dual = [name for name, loss in LOSSES.items() if loss.dual_clip]
        _require(self.dual_clip_c == 0 or (self.dual_clip_c > 1 and LOSSES[self.loss].dual_clip),
                 f"--dual_clip_c={self.dual_clip_c}: 0 (off) or > 1, with a loss that has it ({', '.join(dual)})")
        _require(self.rejected_tokens in ("zero_weight", "drop"), "--rejected_tokens: zero_weight or drop")
        self._check_replay()
        _require(0 <= self.mis_low <= 1 <= self.mis_high,
                 f"--mis_low={self.mis_low}, --mis_high={self.mis_high}: need 0 <= mis_low <= 1 <= mis_high "
                 "(rho = 1, no mismatch, must keep its weight)")
        _require(self.correction in CORRECTIONS, f"--correction={self.correction!r}: choose one of {', '.join(CORRECTIONS)}")
        _require(self.seq_rho in SEQ_RHOS, f"--seq_rho={self.seq_rho!r}: choose one of {', '.join(SEQ_RHOS)}")
        _require(0 < self.gspo_log_ratio_max <= 20,
                 f"--gspo_log_ratio_max={self.gspo_log_ratio_max}: must be in (0, 20] (exp(20) stays finite in fp32)")
        _require(self.correction == "none" or self.recompute_old_logp,   # else rho = pi_old / mu is 1 by definition
                 f"--correction={self.correction} weighs the trainer's old log-probs against the rollout's; "
                 "without --recompute_old_logp=true they are the rollout's own: add it")
        batch = self.prompts_per_step * self.group_size
        _require(self.minibatch_size >= batch or batch % self.minibatch_size == 0,
                 f"--minibatch_size={self.minibatch_size} must divide the batch of {batch} (prompts_per_step "
                 "x group_size): uneven minibatches would weigh their sequences unequally")
        _require(self.kl_estimator in KL_ESTIMATORS, f"--kl_estimator={self.kl_estimator!r}: {', '.join(KL_ESTIMATORS)}")

    def _check_replay(self):
        """--replay against replay.py's table (the life of a route has one home)."""
        from replay import REPLAY_MODES
        _require(self.replay in REPLAY_MODES, f"--replay={self.replay!r}: choose one of {', '.join(REPLAY_MODES)}")
        _require(self.replay != "old" or self.recompute_old_logp,
                 "--replay=old replays the routes of the recomputed old-policy forward: add --recompute_old_logp=true")
        _require(self.replay_steps >= 0, f"--replay_steps={self.replay_steps}: must be >= 0 (0: replay on every update)")
        _require(not self.replay_steps or self.replay != "none",
                 f"--replay_steps={self.replay_steps} bounds a replay: add --replay=r3 or --replay=old")

    def check_ranks(self, n_train: int, n_rollout: int = 0) -> None:
        """The batch must split evenly over the training ranks (and --rollout_ranks' ranks)."""
        _require(self.prompts_per_step % n_train == 0 and self.minibatch_size % n_train == 0,
                 f"prompts_per_step ({self.prompts_per_step}) and minibatch_size ({self.minibatch_size}) must be "
                 f"divisible by the number of {'training ' if n_rollout else ''}ranks ({n_train})")
        _require(not n_rollout or self.prompts_per_step % n_rollout == 0,
                 f"prompts_per_step ({self.prompts_per_step}) must be divisible by --rollout_ranks={n_rollout}: "
                 "each rollout rank samples an equal share")
        _check_groups(self, "check_with_ranks", n_train, n_rollout)

    def check_saved(self, saved: dict) -> None:
        """A resume against the checkpoint's train config (its dict): each group's check_with_saved."""
        _check_groups(self, "check_with_saved", saved)

    def check_model(self, model: ModelConfig, task_vocab: int) -> None:
        """The options that need the model: the route options refuse a model without a router (they
        would do nothing), and the task's ids must fit the vocabulary; then each group's check_with_model."""
        if not model.moe_layers:
            _require(self.replay == "none", f"--replay={self.replay}: the model has no MoE layer (no routes); drop it")
        _require(task_vocab <= model.vocab_size,
                 f"task {self.task!r} uses {task_vocab} token ids, the model has vocab_size={model.vocab_size}")
        _check_groups(self, "check_with_model", model)

    def _check_precision(self):
        """--dtype / --master_dtype / --router_dtype / --save_dtype (docs/design.md, "Mixed precision")."""
        _require(self.master_dtype in ("float32", "bfloat16"),
                 f"--master_dtype={self.master_dtype!r}: float32 or bfloat16")
        _require(self.master_dtype == "float32" or self.dtype == "bfloat16",
                 f"--master_dtype={self.master_dtype}: the master weights cannot be less precise than "
                 f"--dtype={self.dtype}; drop --master_dtype")
        _require(self.router_dtype in ("auto", "float32", self.dtype),
                 f"--router_dtype={self.router_dtype!r}: auto, float32 or --dtype ({self.dtype})")
        _require(self.save_dtype in ("", "float32", "bfloat16"),
                 f"--save_dtype={self.save_dtype!r}: '' (--dtype), float32 or bfloat16")

    @property
    def mixed_precision(self) -> bool:
        """Compute in --dtype on a copy cast from float32 masters (the optimizer's weights)."""
        return self.dtype != self.master_dtype

    def preset_config(self) -> ModelConfig | None:
        """--init_from's preset with the fields the command line set on it (model_overrides), validated
        whole; None for a checkpoint folder, which has its own config.json (setting a field is refused)."""
        if self.init_from in MODEL_PRESETS and not os.path.isdir(self.init_from):
            return dataclasses.replace(ModelConfig.preset(self.init_from), **self.model_overrides)
        if self.model_overrides:
            key, value = next(iter(self.model_overrides.items()))
            what = ("a checkpoint folder with its own config.json (edit that, or start from a preset)"
                    if os.path.isdir(self.init_from) else f"not a preset ({', '.join(MODEL_PRESETS)})")
            raise ConfigError(f"--{key}={_shown(value)} sets a preset's field; --init_from={self.init_from!r} is {what}")
        return None

    def model_preset(self, task_vocab: int, tokenizer: bool) -> ModelConfig | None:
        """The ModelConfig of --init_from when it names a preset (None for a checkpoint folder), with the
        command line's fields (preset_config) and its vocabulary set by --vocab_size: '' keeps the
        preset's, auto takes the task's, N is N.

        The task's ids must fit; with a tokenizer, a larger vocabulary is refused too: the ids past the
        tokenizer's decode to nothing, yet the policy would sample them. Each refusal says what to pass.
        """
        cfg = self.preset_config()
        if cfg is None:
            _require(not (self.vocab_size and os.path.isdir(self.init_from)),
                     f"--vocab_size={self.vocab_size}: only a preset's vocabulary can be changed; "
                     f"--init_from={self.init_from!r} is a checkpoint folder with its own")
            return None
        vocab = task_vocab if self.vocab_size == "auto" else int(self.vocab_size or cfg.vocab_size)
        source = "the tokenizer" if tokenizer else f"task {self.task!r}"
        _require(vocab >= task_vocab, f"{source} uses {task_vocab} token ids, the model has vocab_size={vocab} "
                 f"({'--vocab_size' if self.vocab_size else 'preset ' + repr(self.init_from)}); pass "
                 f"--vocab_size=auto (or N >= {task_vocab})")
        _require(not tokenizer or vocab == task_vocab or self.vocab_size.isdigit(),
                 f"the tokenizer has {task_vocab} tokens, preset {self.init_from!r} has vocab_size={vocab}: ids "
                 f"{task_vocab}..{vocab - 1} would decode to nothing; pass --vocab_size=auto (or --vocab_size={vocab} "
                 "to keep them)")
        return dataclasses.replace(cfg, vocab_size=vocab)

    @property
    def aggregation(self) -> str:
        """--agg with auto resolved to the loss's own (GSPO and SAPO per sequence, the others per token)."""
        from losses import LOSSES
        return LOSSES[self.loss].aggregation if self.agg == "auto" else self.agg


@dataclass
class TaskOptions(Options):
    """The task (support/tasks.py): built-in or your JSONL, its reward or environment."""
    task: str = "copy"                # a name in tasks.TASKS: copy | reverse | jsonl, or lookup | fix (multi-turn: multi_turn/)
    n_digits: int = 4                 # copy / reverse / lookup / fix: digits per prompt
    data: str = ""                    # --task=jsonl: the JSONL file
    tokenizer: str = ""               # --task=jsonl: an HF tokenizer.json
    reward_fn: str = ""               # --task=jsonl: module:function or file.py:function, reward(prompt, response, answer)
    env: str = ""                     # --task=jsonl: episodes, file.py:make_env or module:make_env; make_env(prompt, answer)
                                      # -> an environment, env.step(response) -> (observation, reward, done)
    chat_template: bool = False       # --task=jsonl: format each prompt with tokenizer_config.json's chat_template
    system_prompt: str = ""           # --chat_template=true: a system message before each prompt
    vocab_size: str = ""              # a preset's vocabulary: '' (the preset's) | auto (the task's tokenizer) | N


@dataclass
class ObjectiveOptions(Options):
    """The objectives' other knobs (losses.py's tables; the router's training is router_training/'s)."""
    dual_clip_c: float = 0.0          # > 1: GRPO tokens with A < 0 lose at most -A * c (0: off)
    gspo_eps_low: float = 3e-4        # GSPO's clip range on the sequence ratio: below 1 - this ...
    gspo_eps_high: float = 4e-4       # ... and above 1 + this
    gspo_log_ratio_max: float = 20.0  # GSPO's sequence log-ratio clamped to [-20, this] (verl: 10)
    mis_low: float = 0.5              # reject and icepop keep rho inside [mis_low, mis_high]
    mis_high: float = 5.0             # ... (mis keeps rho <= mis_high: masked IS's C)
    seq_rho: str = "geo_mean"         # seq_*: the sequence's rho as the geometric mean of its tokens' rho, or
                                      # their product (the papers' Seq-TIS / Seq-MIS, verl's rollout_is=sequence)
    rejected_tokens: str = "zero_weight"   # zero_weight (still counted in the token mean, still carry KL) | drop


@dataclass
class LogOptions(Options):
    """What a run shows and writes beyond metrics.jsonl (support/runlog.py)."""
    FREE_ON_RESUME = ("entropy_warn", "entropy_warn_steps")
    entropy_warn: float = 0.05        # one warning line when the mean entropy stays below this for
                                      # --entropy_warn_steps steps in a row (0: never)
    entropy_warn_steps: int = 10      # ... that many consecutive steps
    surge_window: int = 10            # W: a response-length surge is the mean response_len of the last W steps over
                                      # (1 + surge_ratio) times that of the W before; one warning line, length_surge
                                      # 1 on that step (once a run; 0: off)
    surge_ratio: float = 0.5          # ... r: the growth that counts as a surge

# ---------------------------------------------------------------------------------------------------
# the configs: the core's groups, then each plug-in folder's options.py
# ---------------------------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.abspath(__file__))


@functools.cache
def plugin_folders() -> dict[str, tuple[frozenset[str], bool]]:
    """{folder: (the options its options.py declares, whether a GPU run imports it)}, read from the source
    (ast), not imported: a plug-in's code, its options module included, loads only for a run that names
    one of its options (a default run imports no plug-in). `ON_GPU = True` in an options.py: every GPU run
    needs it (tooling's check of the run's plan against the GPU). Read once a process."""
    out = {}
    for n, (tree, top) in _options_sources().items():
        groups = {e.id for k in ("TRAIN", "ROLLOUT") if isinstance(top.get(k), ast.List) for e in top[k].elts}
        fields = frozenset(st.target.id for c in tree.body if isinstance(c, ast.ClassDef) and c.name in groups
                           for st in c.body if isinstance(st, ast.AnnAssign))
        out[n] = fields, isinstance(top.get("ON_GPU"), ast.Constant) and top["ON_GPU"].value is True
    return out


@functools.cache
def _options_sources() -> dict[str, tuple]:
    """{folder: (its options.py parsed, its top-level assignments by name)} for every plug-in folder."""
    paths = {n: os.path.join(ROOT, n, "options.py") for n in sorted(os.listdir(ROOT))}
    trees = {n: ast.parse(open(p, encoding="utf-8").read()) for n, p in paths.items() if os.path.isfile(p)}
    return {n: (t, {a.id: st.value for st in t.body if isinstance(st, ast.Assign) for a in st.targets
                    if isinstance(a, ast.Name)}) for n, t in trees.items()}


PLUGIN_VALUES = {"task": "TASKS", "loss": "LOSSES", "lr_schedule": "LR_SCHEDULES"}   # a core option's values a
# plug-in may add: the list in its options.py that names them (declared_by), and its module that adds them to the
# core's table (multi_turn/tasks.py, policy_losses/losses.py; lr_halving/lr_schedules.py's is a step hook); naming
# one brings the plug-in (configs_for) and imports that module (plugin_value)


def plugin_value(cfg, option: str, core) -> str | None:
    """The plug-in folder that adds cfg.<option>'s value (PLUGIN_VALUES), or None: `core`'s; else one line."""
    value, added = getattr(cfg, option), declared_by(PLUGIN_VALUES[option])
    names, fields = [*(v for v in core if v not in added), *added], {f.name for f in dataclasses.fields(cfg)}
    here = value not in added or plugin_folders()[added[value]][0] <= fields           # its options in cfg
    _require(value in names and here, f"--{option}={value!r}: choose one of {', '.join(names)}"
             + ("" if here else f" ({added[value]}/'s, whose options this config lacks: config.configs_for)"))
    if value in added:                                   # its module of that name adds it to the core's table
        importlib.import_module(f"{added[value]}.{PLUGIN_VALUES[option].lower()}")
    return added.get(value)


@functools.cache
def declared_by(key: str) -> dict[str, str]:
    """{name: the plug-in folder whose options.py lists it in `key`}: MODEL_TYPES, the families a plug-in adds (its
    `family` module registers them in support/hf.FAMILIES); TASKS, its tasks (its `tasks` module adds them to
    support/tasks.TASKS: multi_turn/'s lookup and fix)."""
    return {e.value: n for n, (_, top) in _options_sources().items()
            if isinstance(top.get(key), (ast.Tuple, ast.List)) for e in top[key].elts}


def import_task(name: str) -> None:
    """Import the plug-in whose options.py lists task `name` in TASKS (a task made without a config: tests): its
    `tasks` module adds the task to support/tasks.TASKS (multi_turn/'s lookup and fix). Nothing for the core's."""
    if folder := declared_by("TASKS").get(name):
        importlib.import_module(f"{folder}.tasks")


@functools.cache
def family_layer_types() -> dict[str, tuple[str, ...]]:
    """{model_type: its layer kinds} for the families of plug-ins whose options.py declares LAYER_TYPES."""
    tops = {t: _options_sources()[n][1] for t, n in declared_by("MODEL_TYPES").items()}
    return {t: tuple(e.value for e in top["LAYER_TYPES"].elts) for t, top in tops.items() if "LAYER_TYPES" in top}


def _plugin_kinds_hint() -> str:
    """' (gated_attention, linear_attention: model_type qwen3_5_moe_text or qwen3_next)': who has which kinds."""
    by_kinds: dict[tuple, list] = {}
    for t, kinds in family_layer_types().items():
        by_kinds.setdefault(kinds, []).append(t)
    hint = "; ".join(f"{', '.join(k)}: model_type {' or '.join(ts)}" for k, ts in by_kinds.items())
    return f" ({hint})" if hint else ""


def plugin_modules(folders=None) -> list:
    """The options modules of these plug-in folders (None: every one), by name: option groups (TRAIN,
    ROLLOUT) and, where it has any, step hooks (`hooks`, support/hooks.py). A deleted folder takes both."""
    return [importlib.import_module(f"{n}.options") for n in sorted(plugin_folders() if folders is None else folders)]


def configs(folders=None) -> tuple[type, type]:
    """(TrainConfig, RolloutConfig) with the core's groups and these plug-in folders' (None: every one's;
    `config.TrainConfig` is that). One class per set of folders, so a run's configs compare and copy."""
    return _configs(frozenset(plugin_folders() if folders is None else folders))


@functools.cache
def _configs(folders: frozenset[str]) -> tuple[type, type]:
    mods = plugin_modules(folders)
    tcls = compose("TrainConfig", TrainOptions, [TaskOptions, ObjectiveOptions, LogOptions,
                                                 *(g for m in mods for g in m.TRAIN)])
    rcls = compose("RolloutConfig", RolloutOptions, [g for m in mods for g in m.ROLLOUT])
    tcls.plugins = rcls.plugins = tuple(mods)                    # their step hooks (support/hooks.plugin_hooks)
    return tcls, rcls


def configs_for(keys, gpu: bool = False) -> tuple[type, type]:
    """The configs of a run whose options (a command line's, a saved run's) are `keys` (a dict: with their
    values): the plug-ins that declare any of them or add one of their values (PLUGIN_VALUES: --loss=sapo
    brings policy_losses/), and on a GPU those marked ON_GPU."""
    values = keys if isinstance(keys, dict) else {}                   # a value a plug-in adds brings it
    chosen = {declared_by(t).get(str(values[k])) for k, t in PLUGIN_VALUES.items() if k in values}
    return configs({n for n, (fields, on_gpu) in plugin_folders().items()
                    if fields & set(keys) or gpu and on_gpu or n in chosen})


def __getattr__(name: str):
    """config.TrainConfig / config.RolloutConfig: with every plug-in's options (--help, tests, tools)."""
    if name in ("TrainConfig", "RolloutConfig"):
        return configs()[name == "RolloutConfig"]
    raise AttributeError(f"module 'config' has no attribute {name!r}")


def compose(name: str, core: type, groups: list[type]) -> type:
    """One dataclass with the core's fields, then each group's: one flat --key=value namespace, one run.json,
    one resume check. Two groups may not declare the same option."""
    owner = {}
    for g in (core, *groups):
        for f in dataclasses.fields(g):
            if f.name in owner:
                raise TypeError(f"option {f.name!r} is declared by {owner[f.name].__name__} and {g.__name__}")
            owner[f.name] = g
    return dataclass(type(name, (*reversed(groups), core), {"__doc__": core.__doc__, "__module__": __name__,
                                                            "__qualname__": name}))


def option_groups(cls) -> list[type]:
    """A config's groups in --help's order: the core's, then each plug-in's ([cls] for a plain dataclass)."""
    return [c for c in reversed(cls.__mro__) if dataclasses.is_dataclass(c) and vars(c).get("__annotations__")]


# ---------------------------------------------------------------------------------------------------
# --key=value overrides, checked against the dataclass field types
# ---------------------------------------------------------------------------------------------------
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def parse_bool(key: str, raw: str) -> bool:
    """The one reading of a bool option: 1 / true / yes / on or 0 / false / no / off, any case."""
    if raw.lower() in _TRUE | _FALSE:
        return raw.lower() in _TRUE
    raise ConfigError(f"--{key} expects bool, got {raw!r}")


def _convert(key: str, raw: str, tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw.lower() in ("none", "null"):
            return None
        return _convert(key, raw, args[0])
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (str,)
        items = [s for s in raw.replace("[", "").replace("]", "").split(",") if s.strip()]
        return [_convert(key, s.strip(), inner) for s in items]
    if tp is bool:
        return parse_bool(key, raw)
    conv = {int: int, float: float, str: str}.get(tp)
    if conv is None:
        raise ConfigError(f"--{key}: unsupported field type {tp}")
    try:
        return conv(raw)
    except ValueError:
        raise ConfigError(f"--{key} expects {tp.__name__}, got {raw!r}") from None


def parse_args(argv: list[str]) -> dict[str, str]:
    """['--a=1', '--flag', '--b', '2'] -> {'a': '1', 'flag': 'true', 'b': '2'}; anything else is an error."""
    out, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}: options look like --key=value")
        key, eq, val = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                val, i = argv[i + 1], i + 1
            else:
                val = "true"   # a bare --flag sets a bool field
        out[key.replace("-", "_")] = val
        i += 1
    return out


def _cli_fields(cls) -> list[str]:
    """The fields of a config dataclass that are command-line options (all but metadata cli=False)."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def unknown_key(key: str, known) -> ConfigError:
    """`unknown config key --key`, with the nearest known name (or the one another codebase means by it)."""
    near = [ALIASES[key]] if ALIASES.get(key) in known else difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return ConfigError(f"unknown config key --{key}" + (f"; did you mean --{near[0]}?" if near else "")
                       + " (--help lists every option)")


def apply_overrides(overrides: dict[str, str], *configs, also_known=()) -> None:
    """Set each key on the one config dataclass that has it, converting by the field's type.

    Unknown keys and wrong types raise ConfigError naming the key (also_known: more names for its
    hint); each config is re-validated.
    """
    hints = [(c, {k: t for k, t in typing.get_type_hints(type(c)).items() if k in _cli_fields(type(c))})
             for c in configs]
    for key, raw in overrides.items():
        owners = [(c, h[key]) for c, h in hints if key in h]
        if not owners:
            raise unknown_key(key, [k for _, h in hints for k in h] + list(also_known))
        for c, tp in owners:
            setattr(c, key, _convert(key, raw, tp))
    for c in configs:
        c.__post_init__()


def apply_command_line(overrides: dict[str, str], tcfg: TrainConfig, rcfg: RolloutConfig) -> None:
    """train.py's and --plan's options onto the configs: a ModelConfig field (--num_hidden_layers=2) goes
    into tcfg.model_overrides, typed, for --init_from's preset (a checkpoint folder refuses it, one line);
    every other key is apply_overrides'."""
    types_ = typing.get_type_hints(ModelConfig)
    model = {k: _convert(k, raw, types_[k]) for k, raw in overrides.items() if k in MODEL_OPTIONS}
    plugins = [f for fields, _ in plugin_folders().values() for f in fields]     # a typo's nearest name among them too
    apply_overrides({k: v for k, v in overrides.items() if k not in model}, tcfg, rcfg,
                    also_known=[*MODEL_OPTIONS, *plugins])
    if model:
        tcfg.model_overrides = {**tcfg.model_overrides, **model}
        tcfg.__post_init__()
    tcfg.preset_config()                                              # the preset with them, checked whole


def _progress_value(v) -> str:
    """--progress as auto | true | false (any bool spelling; a bool from a checkpoint of an older run)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    low = str(v).lower()
    if low in _TRUE | _FALSE:
        return "true" if low in _TRUE else "false"
    _require(low == "auto", f"--progress={v!r}: auto (a bar on a terminal, lines otherwise), true or false")
    return low


def _shown(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)


def field_docs(cls) -> dict[str, str]:
    """{field: its description}: the trailing comment of the field's line in the class source, with the
    comment-only lines that continue it (indented past the field, or `#` then aligned text). The one place
    an option is described: --help prints these. A composed config's are its groups'."""
    if hasattr(cls, "plugins"):
        return {k: v for g in option_groups(cls) for k, v in field_docs(g).items()}
    docs, last = {}, None
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"    (\w+): [^#]*?(?:#\s?(.*))?$", line)
        if m and not line.lstrip().startswith("#"):
            last = m.group(1) if m.group(2) is not None else None
            docs[m.group(1)] = (m.group(2) or "").strip()
            continue
        c = re.match(r"( +)#(.*)$", line)
        if last and c and (len(c.group(1)) > 4 or c.group(2).startswith("  ")):
            docs[last] += " " + c.group(2).strip()
        else:
            last = None
    return docs


def help_text(*configs) -> str:
    """Every option: `--name=default  description`, under its group and the file that declares it."""
    lines = []
    for c in configs:
        for group in option_groups(type(c)):
            docs, names = field_docs(group), [f.name for f in dataclasses.fields(group) if f.metadata.get("cli", True)]
            where = os.path.relpath(inspect.getsourcefile(group), ROOT)
            lines.append(f"{group.__name__} ({where}): {group.__doc__.split(chr(10))[0]}")
            opts = [(f"--{name}={getattr(c, name)!r}", docs.get(name, "")) for name in names]
            width = max(len(o) for o, _ in opts)
            lines += [f"  {o:<{width}}  {d}".rstrip() for o, d in opts]
    return "\n".join(lines)


def model_help() -> str:
    """The presets, and the ModelConfig fields a preset takes from the command line (tiny's values shown)."""
    width = max(map(len, MODEL_PRESETS))
    lines = ["presets (--init_from=NAME; or a checkpoint folder):"]
    lines += [f"  {name:<{width}}  {preset_summary(name)}" for name in MODEL_PRESETS]
    lines.append("ModelConfig (a preset is a starting point: --num_hidden_layers=2 --num_experts=4 ... set its "
                 "fields; not with a checkpoint folder; --vocab_size is TrainConfig's):")
    docs, tiny = field_docs(ModelConfig), ModelConfig.preset("tiny")
    opts = [(f"--{name}={getattr(tiny, name)!r}", docs.get(name, "")) for name in MODEL_OPTIONS]
    width = max(len(o) for o, _ in opts)
    return "\n".join(lines + [f"  {o:<{width}}  {d}".rstrip() for o, d in opts])
