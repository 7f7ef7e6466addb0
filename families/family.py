"""The other model families' checkpoints: their entries in support/hf.FAMILIES (config.json names, fixed knobs,
required options, weight-key spellings), registered when a config of one of families/options.MODEL_TYPES is
read or a model of one is built (hf.load_plugin). The model's knobs for them are ModelConfig fields, off by
default (model.py); the translation itself is support/hf.py's, the same for every family."""
from __future__ import annotations

from config import ModelConfig
from support.hf import BIAS_QKVO, FAMILIES, HF, QWEN_LAYOUT, Family

_ALL_MOE = {"mlp_only_layers": []}


def _alternating_layers(hf: dict) -> list[str]:
    """gpt-oss's layer_types when config.json has none: sliding and full attention alternating, sliding first."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(hf["num_hidden_layers"])]


# Mixtral's spelling of the MoE block and its experts (also MiniMax-M2's)
_MIXTRAL_LOAD = ((r"\.block_sparse_moe\.", ".mlp."), (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
                 (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
                 (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."))
_MIXTRAL_SAVE = ((r"\.mlp\.", ".block_sparse_moe."), (r"\.experts\.(\d+)\.gate_proj\.", r".experts.\1.w1."),
                 (r"\.experts\.(\d+)\.up_proj\.", r".experts.\1.w3."),
                 (r"\.experts\.(\d+)\.down_proj\.", r".experts.\1.w2."))


def _windows_default(hf: dict) -> list[str]:
    """dots.llm1's layer_types when config.json has none: sliding from layer max_window_layers on."""
    window, L = hf.get("sliding_window"), hf["num_hidden_layers"]
    return ["sliding_attention" if window is not None and i >= hf.get("max_window_layers", L) else "full_attention"
            for i in range(L)]


def _windows_read(hf: dict, kw: dict) -> None:
    """A config whose layers all attend fully has no window (its sliding_window is unused)."""
    if "sliding_attention" not in kw["layer_types"]:
        kw.update(sliding_window=0, layer_types=[])


def _windows_write(cfg: ModelConfig, d: dict) -> None:
    d["layer_types"] = cfg.layer_types or ["full_attention"] * cfg.num_hidden_layers
    d["sliding_window"] = cfg.sliding_window or None


def _rotary_fraction(hf: dict) -> float:
    """MiniMax-M2 gives partial RoPE as rotary_dim (dims of each head) in older configs."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return (hf.get("rotary_dim") or head_dim) / head_dim


# multi-head latent attention (DeepSeek-V2 / V3, GLM-4.7-Flash): head_dim is the RoPE key's width, and
# attention_bias the bias of q_a_proj, kv_a_proj_with_mqa and o_proj
_MLA = {"kv_lora_rank": HF(("kv_lora_rank",)),
        "q_lora_rank": HF(("q_lora_rank",), 0, lambda v: v or 0, lambda v: v or None),
        "qk_nope_head_dim": HF(("qk_nope_head_dim",)), "v_head_dim": HF(("v_head_dim",)),
        "head_dim": HF(("qk_rope_head_dim",)), "rope_interleave": HF(("rope_interleave",), True),
        **{k: HF(("attention_bias",), False) for k in ("attention_bias", "attention_out_bias")}}
# DeepSeek's MoE block: routed experts in groups, shared ungated experts, the first k layers dense
_DEEPSEEK_MOE = {"num_experts": HF(("n_routed_experts",), 0), "moe_intermediate_size": HF(("moe_intermediate_size",)),
                 "n_shared_experts": HF(("n_shared_experts",), 1),
                 "routed_scaling_factor": HF(("routed_scaling_factor",), 1.0, float),
                 "n_group": HF(("n_group",), 1, lambda v: v or 1),
                 "topk_group": HF(("topk_group",), 1, lambda v: v or 1),
                 "first_k_dense_replace": HF(("first_k_dense_replace",), 0, lambda v: v or 0)}


def _v2_groups_read(hf: dict, kw: dict) -> None:
    """DeepSeek-V2 routes in groups only under topk_method group_limited_greedy ("greedy": one group)."""
    if hf.get("topk_method", "greedy") != "group_limited_greedy":
        kw.update(n_group=1, topk_group=1)


def _v2_groups_write(cfg: ModelConfig, d: dict) -> None:
    d["topk_method"] = "group_limited_greedy" if cfg.n_group > 1 else "greedy"


def _mlp_layer_types_read(hf: dict, kw: dict) -> None:
    """GLM-4.7-Flash names each layer's MLP dense or sparse (default: the first dense, the rest sparse)."""
    types = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (hf["num_hidden_layers"] - 1)
    kw["mlp_only_layers"] = [i for i, t in enumerate(types) if t == "dense"]


def _mlp_layer_types_write(cfg: ModelConfig, d: dict) -> None:
    d["mlp_layer_types"] = ["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.num_hidden_layers)]


FAMILIES.update({
    "qwen3": Family(   # dense Qwen3: the same layers, no experts
        "Qwen3ForCausalLM", config=dict(BIAS_QKVO), fixed={"num_experts": 0, "mlp_only_layers": []},
        requires={"use_sliding_window": False}, extra={"sliding_window": None}),
    "qwen2_moe": Family(   # a sigmoid-gated shared expert, q/k/v biases, no q/k norm
        "Qwen2MoeForCausalLM",
        config={"num_experts": HF(("num_experts",), 0),
                "moe_intermediate_size": HF(("moe_intermediate_size",), 0),
                "norm_topk_prob": HF(("norm_topk_prob",), False), **QWEN_LAYOUT,
                "shared_expert_intermediate_size": HF(("shared_expert_intermediate_size",), 0),
                "attention_bias": HF(("qkv_bias",), True)},   # older configs have no key: always biased
        fixed={"qk_norm": "none"}, requires={"use_sliding_window": False}, router_dtype="compute"),
    "olmoe": Family(   # q/k RMSNorm over the whole projection; the experts' width is intermediate_size
        "OlmoeForCausalLM",
        config={"num_experts": HF(("num_experts",), 0), "moe_intermediate_size": HF(("intermediate_size",)),
                "norm_topk_prob": HF(("norm_topk_prob",), False), **BIAS_QKVO},
        fixed={"qk_norm": "full", **_ALL_MOE}, requires={"clip_qkv": None}, router_dtype="compute"),
    "mixtral": Family(   # softmax over the top-k (= renormalised), no q/k norm
        "MixtralForCausalLM",
        config={"num_experts": HF(("num_local_experts",), 0), "moe_intermediate_size": HF(("intermediate_size",))},
        fixed={"norm_topk_prob": True, "qk_norm": "none", **_ALL_MOE}, requires={"sliding_window": None},
        router_dtype="compute", load_renames=_MIXTRAL_LOAD, save_renames=_MIXTRAL_SAVE),
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
    "gpt_oss": Family(   # sinks, sliding windows, YaRN, biased router (softmax over its top-k) and experts
        "GptOssForCausalLM",
        config={"num_experts": HF(("num_local_experts",), 0), "moe_intermediate_size": HF(("intermediate_size",)),
                "sliding_window": HF(("sliding_window",), 0),
                "layer_types": HF(("layer_types",), _alternating_layers, list),
                "swiglu_alpha": HF(("swiglu_alpha",), 1.702, float), "swiglu_limit": HF(("swiglu_limit",), 7.0, float),
                "attention_bias": HF(("attention_bias",), True), "attention_out_bias": HF(("attention_bias",), True)},
        fixed={"attention_sinks": True, "router_bias": True, "router_scoring": "topk_softmax", "norm_topk_prob": True,
               "expert_bias": True, "moe_act": "clamped_swiglu", "qk_norm": "none", **_ALL_MOE},
        yarn=True, mxfp4=True, experts="gpt_oss", router_dtype="compute",
        load_renames=((r"\.mlp\.router\.", ".mlp.gate."),), save_renames=((r"\.mlp\.gate\.", ".mlp.router."),)),
    "dots1": Family(   # dots.llm1: GLM-4.5's router and shared experts, per-head q/k norm, q/k/v/o biases, windows
        "Dots1ForCausalLM",
        config={**_DEEPSEEK_MOE, "norm_topk_prob": HF(("norm_topk_prob",), False), **BIAS_QKVO,
                "sliding_window": HF(("sliding_window",), 0),
                "layer_types": HF(("layer_types",), _windows_default, list)},
        fixed={"router_scoring": "sigmoid", "score_correction_bias": True, "qk_norm": "head", **_ALL_MOE},
        read_hook=_windows_read, write_hook=_windows_write, router_dtype="float32"),
    "minimax_m2": Family(   # sigmoid scores + correction bias (top-k renormalised), q/k norm over the whole projection
        "MiniMaxM2ForCausalLM",
        config={"num_experts": HF(("num_local_experts",), 0), "moe_intermediate_size": HF(("intermediate_size",)),
                "partial_rotary_factor": HF(("partial_rotary_factor",), _rotary_fraction, float)},
        fixed={"router_scoring": "sigmoid", "score_correction_bias": True, "norm_topk_prob": True, "qk_norm": "full",
               **_ALL_MOE},
        router_dtype="compute",   # the gate in the model dtype, the sigmoid in fp32
        load_renames=((r"\.(block_sparse_moe|mlp)\.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
                      *_MIXTRAL_LOAD),   # the bias sits beside the gate (mlp. in transformers' memory)
        save_renames=((r"\.mlp\.gate\.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias"),
                      *_MIXTRAL_SAVE)),
    "deepseek_v3": Family(   # MLA + GLM-4.5's router (sigmoid, bias, groups); Moonlight, Kimi K2
        "DeepseekV3ForCausalLM",
        config={**_MLA, **_DEEPSEEK_MOE, "norm_topk_prob": HF(("norm_topk_prob",), True)},
        fixed={"router_scoring": "sigmoid", "score_correction_bias": True, "qk_norm": "none", **_ALL_MOE},
        requires={"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1},
        extra={"num_nextn_predict_layers": 0}, extra_layers=True, yarn=True, router_dtype="float32"),
    "deepseek_v2": Family(   # MLA (RoPE pairs interleaved) + a softmax router, greedy or best-group-limited
        "DeepseekV2ForCausalLM",
        config={**_MLA, **_DEEPSEEK_MOE},
        fixed={"rope_interleave": True, "router_scoring": "softmax", "norm_topk_prob": False, "group_score": "max",
               "qk_norm": "none", **_ALL_MOE},
        requires={"scoring_func": "softmax", "mlp_bias": False, "moe_layer_freq": 1},
        read_hook=_v2_groups_read, write_hook=_v2_groups_write, extra_layers=True, yarn=True, router_dtype="float32"),
    "glm4_moe_lite": Family(   # GLM-4.7-Flash: MLA + GLM-4.5's router, each layer's MLP named in mlp_layer_types
        "Glm4MoeLiteForCausalLM",
        config={**_MLA, **{k: v for k, v in _DEEPSEEK_MOE.items() if k != "first_k_dense_replace"},
                "norm_topk_prob": HF(("norm_topk_prob",), True)},
        fixed={"router_scoring": "sigmoid", "score_correction_bias": True, "qk_norm": "none"},
        read_hook=_mlp_layer_types_read, write_hook=_mlp_layer_types_write,
        extra={"num_nextn_predict_layers": 0}, extra_layers=True, yarn=True, router_dtype="float32"),
})
