"""Model families: how each Hugging Face `model_type` maps onto ModelConfig and onto this model's weights.

    import families
    families.FAMILIES["glm4_moe"].architecture                  # 'Glm4MoeForCausalLM'
    cfg = ModelConfig(**families.config_from_hf(hf_config_dict))  # what ModelConfig.from_hf does

FAMILIES is the one seam. An entry says which config.json names carry which ModelConfig field (and the
family's default when a key is absent), which knobs its architecture always has, which HF options must
be off (what this model does not implement), how its weight keys are spelled, and the dtype of its
router under bf16 compute (`router_dtype`, the default of --router_dtype=auto; it follows transformers'
modeling code: GLM-4.5, like DeepSeek-V3, keeps the gate weight and the score-correction bias in fp32
and upcasts the hidden states for the gate matmul; Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral run the gate
in the model dtype and only the softmax in fp32). ModelConfig.from_hf /
to_hf (config.py) and hf_to_state / state_to_hf (model.py) read only this table: adding a family is one
entry here plus its tests (tests/test_families.py).

Weight keys. Ours are transformers' without the leading "model.", except that the experts of each MoE
layer are stacked: layers.N.mlp.w13 (E, 2I, D) = [gate_proj; up_proj] per expert, layers.N.mlp.w2
(E, D, I) = down_proj. Checkpoints hold them per expert (`model.layers.N.mlp.experts.E.gate_proj.weight`:
what transformers saves and vLLM reads; Mixtral spells it `block_sparse_moe.experts.E.w1/w3/w2`) or fused
(`...mlp.experts.gate_up_proj` / `...mlp.experts.down_proj`, transformers 5's in-memory layout, which
newer tools write). Both load; the family's per-expert spelling is saved. A family's `load_renames`
are regex substitutions from its spelling to ours, `save_renames` the way back.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from config import ConfigError, ModelConfig

REQUIRED = object()   # a default meaning "config.json must have this key"


class HF(NamedTuple):
    """Where a ModelConfig field lives in a family's config.json."""
    names: tuple[str, ...]          # keys tried in order on reading (None counts as absent); all written
    default: Any = REQUIRED         # when none is present; a callable gets the config dict
    read: Callable | None = None    # HF value -> ours
    write: Callable | None = None   # ours -> HF value


@dataclass(frozen=True)
class Family:
    architecture: str                                     # transformers' class, written to config.json
    config: dict[str, HF] = field(default_factory=dict)   # fields beyond COMMON (or spelled differently)
    fixed: dict[str, Any] = field(default_factory=dict)   # knobs the architecture always has
    requires: dict[str, Any] = field(default_factory=dict)  # HF keys that must be absent or this value
    extra: dict[str, Any] = field(default_factory=dict)   # written to config.json only
    load_renames: tuple[tuple[str, str], ...] = ()        # (regex on an HF key, replacement) -> our spelling
    save_renames: tuple[tuple[str, str], ...] = ()        # (regex on our spelling, replacement) -> HF key
    extra_layers: bool = False                            # layers >= num_hidden_layers (MTP) are dropped
    router_dtype: str = "compute"                         # --router_dtype=auto: the gate and bias in "float32"
    #                                                       or in the "compute" dtype, as transformers' model runs


# Fields every family spells the same way.
COMMON: dict[str, HF] = {
    "vocab_size": HF(("vocab_size",)),
    "hidden_size": HF(("hidden_size",)),
    "num_hidden_layers": HF(("num_hidden_layers",)),
    "num_attention_heads": HF(("num_attention_heads",)),
    "num_key_value_heads": HF(("num_key_value_heads",), lambda hf: hf["num_attention_heads"]),
    "head_dim": HF(("head_dim",), lambda hf: hf["hidden_size"] // hf["num_attention_heads"]),
    "intermediate_size": HF(("intermediate_size",), 0),
    "num_experts_per_tok": HF(("num_experts_per_tok",), 1),
    "rope_theta": HF(("rope_theta",), 10000.0, float),
    "rms_norm_eps": HF(("rms_norm_eps",), 1e-6),
    "tie_word_embeddings": HF(("tie_word_embeddings",), False),
    "max_position_embeddings": HF(("max_position_embeddings",), 32768),
    "initializer_range": HF(("initializer_range",), 0.02),
}
COMMON_REQUIRES = {"hidden_act": "silu"}
COMMON_EXTRA = {"attention_dropout": 0.0, "use_cache": True, "output_router_logits": False,
                "router_aux_loss_coef": 0.0, "rope_scaling": None}

# Spellings shared by several families.
_QWEN_LAYOUT = {   # which layers are MoE
    "mlp_only_layers": HF(("mlp_only_layers",), [], lambda v: list(v or [])),
    "decoder_sparse_step": HF(("decoder_sparse_step",), 1, lambda v: v or 1),
}
_BIAS_QKVO = {     # one flag for the biases of q, k, v and o (Qwen3, OLMoE)
    "attention_bias": HF(("attention_bias",), False),
    "attention_out_bias": HF(("attention_bias",), False),
}
_ALL_MOE = {"mlp_only_layers": []}

FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM",
        config={"num_experts": HF(("num_experts", "num_local_experts"), 0),
                "moe_intermediate_size": HF(("moe_intermediate_size",), 0),
                "norm_topk_prob": HF(("norm_topk_prob",), False), **_QWEN_LAYOUT, **_BIAS_QKVO},
        requires={"use_sliding_window": False}, extra={"sliding_window": None},
        router_dtype="compute"),   # gate(x) in the model dtype, softmax in fp32
    "qwen3": Family(   # dense Qwen3: the same layers, no experts
        "Qwen3ForCausalLM", config=dict(_BIAS_QKVO), fixed={"num_experts": 0, "mlp_only_layers": []},
        requires={"use_sliding_window": False}, extra={"sliding_window": None}),
    "qwen2_moe": Family(   # a sigmoid-gated shared expert, q/k/v biases, no q/k norm
        "Qwen2MoeForCausalLM",
        config={"num_experts": HF(("num_experts",), 0),
                "moe_intermediate_size": HF(("moe_intermediate_size",), 0),
                "norm_topk_prob": HF(("norm_topk_prob",), False), **_QWEN_LAYOUT,
                "shared_expert_intermediate_size": HF(("shared_expert_intermediate_size",), 0),
                "attention_bias": HF(("qkv_bias",), True)},   # older configs have no key: always biased
        fixed={"qk_norm": "none"}, requires={"use_sliding_window": False}, router_dtype="compute"),
    "olmoe": Family(   # q/k RMSNorm over the whole projection; the experts' width is intermediate_size
        "OlmoeForCausalLM",
        config={"num_experts": HF(("num_experts",), 0), "moe_intermediate_size": HF(("intermediate_size",)),
                "norm_topk_prob": HF(("norm_topk_prob",), False), **_BIAS_QKVO},
        fixed={"qk_norm": "full", **_ALL_MOE}, requires={"clip_qkv": None}, router_dtype="compute"),
    "mixtral": Family(   # softmax over the top-k (= renormalised), no q/k norm
        "MixtralForCausalLM",
        config={"num_experts": HF(("num_local_experts",), 0), "moe_intermediate_size": HF(("intermediate_size",))},
        fixed={"norm_topk_prob": True, "qk_norm": "none", **_ALL_MOE}, requires={"sliding_window": None},
        router_dtype="compute",
        load_renames=((r"\.block_sparse_moe\.", ".mlp."), (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
                      (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
                      (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj.")),
        save_renames=((r"\.mlp\.", ".block_sparse_moe."), (r"\.experts\.(\d+)\.gate_proj\.", r".experts.\1.w1."),
                      (r"\.experts\.(\d+)\.up_proj\.", r".experts.\1.w3."),
                      (r"\.experts\.(\d+)\.down_proj\.", r".experts.\1.w2."))),
    "glm4_moe": Family(   # DeepSeek-V3 routing (sigmoid + bias + groups), shared experts, partial RoPE
        "Glm4MoeForCausalLM",
        config={"num_experts": HF(("n_routed_experts",), 0),
                "moe_intermediate_size": HF(("moe_intermediate_size",), 1408),
                "norm_topk_prob": HF(("norm_topk_prob",), True),
                "n_shared_experts": HF(("n_shared_experts",), 1),
                "routed_scaling_factor": HF(("routed_scaling_factor",), 1.0, float),
                "n_group": HF(("n_group",), 1), "topk_group": HF(("topk_group",), 1),
                "first_k_dense_replace": HF(("first_k_dense_replace",), 1),
                "attention_bias": HF(("attention_bias",), False),     # q, k, v only; o_proj has none
                "qk_norm": HF(("use_qk_norm",), False, lambda v: "head" if v else "none", lambda v: v == "head"),
                "partial_rotary_factor": HF(("partial_rotary_factor",), 0.5, float)},
        fixed={"router_scoring": "sigmoid", "score_correction_bias": True, **_ALL_MOE},
        extra={"num_nextn_predict_layers": 0},   # we keep no multi-token-prediction layer
        extra_layers=True,                       # GLM-4.5 ships its MTP layer as layer num_hidden_layers
        router_dtype="float32"),   # as DeepSeek-V3: gate weight and bias kept in fp32, x upcast for the gate
}

# Fields that mean nothing for a config without MoE layers, or without dense layers (ignored when
# checking that a config survives to_hf -> from_hf).
MOE_FIELDS = ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_scoring",
              "score_correction_bias", "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts",
              "shared_expert_intermediate_size", "mlp_only_layers", "decoder_sparse_step", "first_k_dense_replace")


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(FAMILIES))} "
                          "(a new family is one entry in families.FAMILIES)")
    return FAMILIES[model_type]


def unused_fields(cfg: ModelConfig) -> set[str]:
    moe = cfg.moe_layers
    out = set() if moe else set(MOE_FIELDS)
    if len(moe) == cfg.num_hidden_layers:
        out.add("intermediate_size")
    return out


# ---------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig fields
# ---------------------------------------------------------------------------------------------------
def config_from_hf(hf: dict) -> dict:
    """A family's config.json (a dict) -> ModelConfig keyword arguments; ConfigError names what is wrong."""
    mt = hf.get("model_type", "qwen3_moe")
    fam = family(mt)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope type {rope_type!r} is not supported, only 'default' RoPE")
    for key, want in {**COMMON_REQUIRES, **fam.requires}.items():
        if hf.get(key, want) != want:
            raise ConfigError(f"{key}={hf[key]!r} is not supported for {mt} (this model implements {key}={want!r})")

    def lookup(names):   # top-level keys first, then those newer transformers keep in rope_parameters
        for src in (hf, rope):
            for name in names:
                if src.get(name) is not None:
                    return src[name]
        return REQUIRED
    kw = {"model_type": mt}
    for name, spec in {**COMMON, **fam.config}.items():
        value = lookup(spec.names)
        if value is REQUIRED:
            if spec.default is REQUIRED:
                raise ConfigError(f"{mt} config.json has no {spec.names[0]!r}")
            value = spec.default(hf) if callable(spec.default) else spec.default
        elif spec.read is not None:
            value = spec.read(value)
        kw[name] = value
    kw.update(fam.fixed)
    if not kw.get("num_experts"):   # a dense model: the MoE sizes are unused
        kw.update(num_experts=0, num_experts_per_tok=1, moe_intermediate_size=0)
    return kw


def config_to_hf(cfg: ModelConfig) -> dict:
    """ModelConfig -> the family's config.json dict (ModelConfig.to_hf checks that it reads back the same)."""
    fam = family(cfg.model_type)
    d = {"architectures": [fam.architecture], "model_type": cfg.model_type,
         **COMMON_EXTRA, **COMMON_REQUIRES, **fam.requires, **fam.extra}
    for name, spec in {**COMMON, **fam.config}.items():
        value = getattr(cfg, name)
        value = spec.write(value) if spec.write is not None else value
        for key in spec.names:
            d[key] = list(value) if isinstance(value, list) else value
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if "partial_rotary_factor" in fam.config:
        d["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    return d


# ---------------------------------------------------------------------------------------------------
# weight keys
# ---------------------------------------------------------------------------------------------------
def hf_key_to_ours(fam: Family, key: str, num_hidden_layers: int) -> str | None:
    """An HF tensor name -> our spelling (experts still per expert or fused); None: not ours to load."""
    if fam.extra_layers:
        m = re.match(r"model\.layers\.(\d+)\.", key)
        if m and int(m.group(1)) >= num_hidden_layers:
            return None
    for pattern, repl in fam.load_renames:
        key = re.sub(pattern, repl, key)
    return key.removeprefix("model.")


def our_key_to_hf(fam: Family, key: str) -> str:
    """Our spelling (experts per expert: layers.N.mlp.experts.E.gate_proj.weight) -> the family's HF key."""
    key = key if key.startswith("lm_head") else "model." + key
    for pattern, repl in fam.save_renames:
        key = re.sub(pattern, repl, key)
    return key
