"""Everything Hugging Face: the family table, config.json <-> ModelConfig, weight keys, safetensors.

    from support import hf
    cfg = hf.config_from_hf("path/to/config.json")     # a model_type of FAMILIES (qwen3_moe, gpt_oss, deepseek_v3, ...)
    hf.config_to_hf(cfg)                               # the config.json dict transformers reads
    state = hf.hf_to_state(hf.read_safetensors_dir(path), model)   # HF tensors -> model.state_dict() keys
    hf.write_safetensors_dir(path, hf.state_to_hf(model), hf.config_to_hf(model.config))

Transformer.from_pretrained / save_pretrained (model.py) are these calls. Dependencies run one way:
of the project's files this one imports config alone; model.py imports it, config.py knows nothing of it.

FAMILIES is the one seam. An entry says which config.json names carry which ModelConfig field (and the
family's default when a key is absent), which knobs its architecture always has, which HF options must
be off (what this model does not implement), and how its weight keys are spelled. This file holds the
core's, Qwen3-MoE; a plug-in registers the others when a config names one (load_plugin: families/family.py,
hybrids/family.py). Adding a family is one entry in families/family.py and its model_type in
families/options.py, plus a ModelConfig field (off by default) and its forward for each knob the model does
not have yet, plus the family in tests/conftest.py's FAMILY_HF (every test of tests/test_hf.py runs on
it). The model_type itself is checked here, where a config is read from or written to config.json:
ModelConfig treats it as a plain name. Each entry also names the dtype of its router under bf16 compute
(`router_dtype`, the default of --router_dtype=auto), following transformers' modeling code: GLM-4.5,
like DeepSeek-V3, keeps the gate weight and the score-correction bias in fp32 and upcasts the hidden
states for the gate matmul; Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral run the gate in the model dtype and
only the softmax in fp32.

Weight keys. Ours are transformers' without the leading "model.", except that the experts of each MoE
layer are stacked: layers.N.mlp.w13 (E, 2I, D) = [gate_proj; up_proj] per expert, layers.N.mlp.w2
(E, D, I) = down_proj. Checkpoints hold them per expert (`model.layers.N.mlp.experts.E.gate_proj.weight`:
what transformers saves and vLLM reads; Mixtral spells it `block_sparse_moe.experts.E.w1/w3/w2`) or fused
(`...mlp.experts.gate_up_proj` / `...mlp.experts.down_proj`, transformers 5's in-memory layout, which
newer tools write). Both load; the family's per-expert spelling is saved. A family's `load_renames`
are regex substitutions from its spelling to ours, `save_renames` the way back.

gpt-oss saves its experts fused (`mlp.experts.gate_up_proj` (E, D, 2I) with gate and up in alternate
columns, `down_proj` (E, I, D), and their biases), and may ship them as MXFP4 blocks and scales, which
load dequantized exactly as transformers dequantizes them (dequantize_mxfp4).

Safetensors. A checkpoint directory holds config.json and model.safetensors, or shards named by
model.safetensors.index.json. Reading refuses, naming the file and key, an unreadable shard and any
non-finite tensor: a poisoned checkpoint never loads silently.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from config import ConfigError, ModelConfig, declared_by


class CheckpointError(ValueError):
    """A checkpoint that does not match the model config; the message names the tensor."""


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
    yarn: bool = False                                    # reads and writes YaRN RoPE (else only default RoPE)
    mxfp4: bool = False                                   # loads MXFP4-quantized experts (dequantized on load)
    experts: str = "per_expert"                           # the saved expert layout: per_expert | gpt_oss (fused)
    read_hook: Callable | None = None                     # (config.json, kwargs): what one key per field cannot say
    write_hook: Callable | None = None                    # (ModelConfig, config.json dict): its inverse
    router_dtype: str = "compute"                         # --router_dtype=auto: the gate and bias in "float32"
    #                                                       or in the "compute" dtype, as transformers' model runs
    load_tensors: Callable | None = None                  # (HF tensors, ModelConfig) -> the layout the keys name
    save_tensors: Callable | None = None                  # its inverse, on the HF keys written
    kept: str = ""                                        # regex of HF keys kept aside and saved back (MTP layers)
    dropped: str = ""                                     # regex of HF keys not read (a vision tower)


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

# Qwen's spellings (also used by other families, families/family.py)
QWEN_LAYOUT = {   # which layers are MoE
    "mlp_only_layers": HF(("mlp_only_layers",), [], lambda v: list(v or [])),
    "decoder_sparse_step": HF(("decoder_sparse_step",), 1, lambda v: v or 1),
}
BIAS_QKVO = {     # one flag for the biases of q, k, v and o (Qwen3, OLMoE)
    "attention_bias": HF(("attention_bias",), False),
    "attention_out_bias": HF(("attention_bias",), False),
}

# YaRN's fields: ModelConfig name -> key in rope_parameters (rope_scaling in older configs), its default
YARN_KEYS = {"yarn_factor": ("factor", None),
             "yarn_original_max_position_embeddings": ("original_max_position_embeddings", None),
             "yarn_beta_fast": ("beta_fast", 32.0), "yarn_beta_slow": ("beta_slow", 1.0),
             "yarn_truncate": ("truncate", True), "yarn_mscale": ("mscale", 0.0),
             "yarn_mscale_all_dim": ("mscale_all_dim", 0.0), "yarn_attention_factor": ("attention_factor", 0.0)}

# the core's family; the others register theirs when a config names them (load_plugin: families/, hybrids/)
FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM",
        config={"num_experts": HF(("num_experts", "num_local_experts"), 0),
                "moe_intermediate_size": HF(("moe_intermediate_size",), 0),
                "norm_topk_prob": HF(("norm_topk_prob",), False), **QWEN_LAYOUT, **BIAS_QKVO},
        requires={"use_sliding_window": False}, extra={"sliding_window": None},
        router_dtype="compute"),   # gate(x) in the model dtype, softmax in fp32
}

# Fields that mean nothing for a config without MoE layers, or without dense layers (ignored when
# checking that a config survives config_to_hf -> config_from_hf).
MOE_FIELDS = ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "router_scoring",
              "score_correction_bias", "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts",
              "shared_expert_intermediate_size", "mlp_only_layers", "decoder_sparse_step", "first_k_dense_replace",
              "router_bias", "expert_bias", "moe_act", "swiglu_alpha", "swiglu_limit", "group_score")


def load_plugin(model_type: str) -> None:
    """Import the plug-in whose options.py lists model_type (config.declared_by): its `family` module
    registers the family here (and its layers in model.MIXERS, the hybrids). Nothing for Qwen3-MoE."""
    if folder := declared_by("MODEL_TYPES").get(model_type):
        importlib.import_module(f"{folder}.family")


# A multimodal model_type -> its text model's: config.json's text_config is read, the text weights loaded.
TEXT_OF = {"qwen3_5_moe": "qwen3_5_moe_text"}


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        load_plugin(model_type)
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} is not supported; supported: "
                          f"{', '.join(sorted({*FAMILIES, *declared_by('MODEL_TYPES')}))} (a new family: hf.FAMILIES)")
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
def _read_fields(hf: dict) -> dict:
    """A family's config.json (a dict) -> ModelConfig keyword arguments; ConfigError names what is wrong."""
    mt = hf.get("model_type", "qwen3_moe")
    fam = family(mt)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (("default", "yarn") if fam.yarn else ("default",)):
        raise ConfigError(f"rope type {rope_type!r} is not supported for {mt}, only "
                          + ("'default' and 'yarn'" if fam.yarn else "'default'") + " RoPE")
    for key, want in {**COMMON_REQUIRES, **fam.requires}.items():
        if hf.get(key, want) != want:
            raise ConfigError(f"{key}={hf[key]!r} is not supported for {mt} (this model implements {key}={want!r})")
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    if quant is not None and not (quant == "mxfp4" and fam.mxfp4):
        raise ConfigError(f"quantization_config with quant_method={quant!r} is not supported for {mt}"
                          + (" (only mxfp4, dequantized on load)" if fam.mxfp4 else " (load a dequantized checkpoint)"))

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
    if fam.read_hook is not None:
        fam.read_hook(hf, kw)
    if rope_type == "yarn":
        kw.update(_read_yarn(rope, hf))
    if not kw.get("num_experts"):   # a dense model: the MoE sizes are unused
        kw.update(num_experts=0, num_experts_per_tok=1, moe_intermediate_size=0)
    return kw


def _read_yarn(rope: dict, hf: dict) -> dict:
    """YaRN's ModelConfig fields from rope_parameters; a missing factor is the context's extension
    max_position_embeddings / original_max_position_embeddings, as transformers derives it."""
    original = rope.get("original_max_position_embeddings")
    if original is None:
        raise ConfigError("rope type 'yarn' needs original_max_position_embeddings in rope_parameters")
    kw = {"rope_type": "yarn", "yarn_original_max_position_embeddings": int(original),
          "yarn_factor": float(rope.get("factor") or hf.get("max_position_embeddings", 32768) / original),
          "yarn_truncate": bool(rope.get("truncate", True))}
    for name in ("yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_attention_factor"):
        key, default = YARN_KEYS[name]
        kw[name] = float(rope.get(key) or default)   # None or 0: the default, as transformers reads them
    return kw


def _write_fields(cfg: ModelConfig) -> dict:
    """ModelConfig -> the family's config.json dict, unchecked (config_to_hf checks that it reads back)."""
    fam = family(cfg.model_type)
    d = {"architectures": [fam.architecture], "model_type": cfg.model_type,
         **COMMON_EXTRA, **COMMON_REQUIRES, **fam.requires, **fam.extra}
    for name, spec in {**COMMON, **fam.config}.items():
        value = getattr(cfg, name)
        value = spec.write(value) if spec.write is not None else value
        for key in spec.names:
            d[key] = list(value) if isinstance(value, list) else value
    d["rope_parameters"] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if "partial_rotary_factor" in fam.config:
        d["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.rope_type == "yarn":
        yarn = {key: getattr(cfg, name) for name, (key, _) in YARN_KEYS.items()}
        # the mscales and the attention factor only where set: transformers would take a 0 for a 0
        d["rope_parameters"].update({k: v for k, v in yarn.items() if v or k == "truncate"})
    if fam.write_hook is not None:
        fam.write_hook(cfg, d)
    return d


def config_from_hf(path_or_dict: str | dict) -> ModelConfig:
    """Read a config.json (a dict, a file, or the directory holding it) of a supported family; old and
    new transformers names."""
    if isinstance(path_or_dict, dict):
        hf = dict(path_or_dict)
    else:
        path = path_or_dict
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"no config.json at {path_or_dict!r}")
        with open(path) as f:
            try:
                hf = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(hf.get("text_config"), dict) and hf.get("model_type") in TEXT_OF:   # a multimodal checkpoint
        hf = {**hf["text_config"], "model_type": TEXT_OF[hf["model_type"]]}
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in hf]
    if missing:
        raise ConfigError(f"config.json{'' if isinstance(path_or_dict, dict) else ' at ' + repr(path_or_dict)} "
                          f"lacks the required field(s) {', '.join(missing)}")
    return ModelConfig(**_read_fields(hf))


def eos_token_ids(folder: str) -> tuple[tuple[int, ...], str]:
    """The checkpoint's own stop ids and the file they came from: `eos_token_id` (one id or a list) of
    generation_config.json (what transformers' generate stops on), else of config.json; ((), "") if neither
    names one. A file that is not JSON, or an id that is not an integer, is a ConfigError naming it."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if eos is None or eos == []:
            continue
        ids = eos if isinstance(eos, list) else [eos]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ConfigError(f"{path}: eos_token_id={eos!r}: expected a token id or a list of them")
        return tuple(ids), path
    return (), ""


def config_to_hf(cfg: ModelConfig) -> dict:
    """The config.json that transformers' class for `cfg.model_type` reads (old and new rope keys).

    Raises ConfigError if the family cannot express a field this config sets (e.g. sigmoid routing
    under model_type qwen3_moe): a checkpoint must load back as the model that wrote it.
    """
    d = _write_fields(cfg)
    back = ModelConfig(**_read_fields(json.loads(json.dumps(d))))
    ignored = unused_fields(cfg)
    lost = [f.name for f in dataclasses.fields(cfg)
            if f.name not in ignored and getattr(back, f.name) != getattr(cfg, f.name)]
    if lost:
        raise ConfigError(f"model_type {cfg.model_type!r} cannot express {lost[0]}={getattr(cfg, lost[0])!r} "
                          f"(it would load back as {getattr(back, lost[0])!r}); pick the model_type of a "
                          "family that has this knob (FAMILIES: support/hf.py, families/family.py)")
    return d


# ---------------------------------------------------------------------------------------------------
# weight keys, expert stacking
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


def hf_to_state(tensors: dict[str, torch.Tensor], model: torch.nn.Module,
                experts: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Map a checkpoint's HF keys (spelled as model.config.model_type's family) onto the state_dict keys
    of `model` (a model.Transformer), stacking per-expert weights. experts: the model holds only these
    (an expert-parallel shard, read through expert_rows), stacked in this order.

    Raises CheckpointError naming the first missing, unexpected or mis-shaped tensor.
    """
    cfg = model.config
    fam = family(cfg.model_type)
    want = {k: v.shape for k, v in model.state_dict().items()}
    if fam.mxfp4:
        tensors = dequantize_mxfp4(tensors)
    if fam.load_tensors is not None:
        tensors = fam.load_tensors(tensors, cfg)
    src, hf_name = {}, {}                        # our spelling -> tensor, and -> the checkpoint's key
    model.extra_tensors = {k: t for k, t in tensors.items() if fam.kept and re.match(fam.kept, k)}
    for key, t in tensors.items():
        if key in model.extra_tensors or (fam.dropped and re.match(fam.dropped, key)):
            continue
        ours = hf_key_to_ours(fam, key, cfg.num_hidden_layers)
        if ours is not None:
            src[ours], hf_name[ours] = t, key
    state: dict[str, torch.Tensor] = {}

    def take(name: str, shape=None):
        if name not in src:
            raise CheckpointError(f"checkpoint is missing {our_key_to_hf(fam, name)!r} "
                                  "(does config.json match the weights?)")
        t = src.pop(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {hf_name[name]!r} has shape {tuple(t.shape)}, the config needs {tuple(shape)}")
        return t

    for name in want:
        if name.endswith(_STACKED):
            continue
        state[name] = take(name, want[name])
    if cfg.tie_word_embeddings:
        src.pop("lm_head.weight", None)   # some tools write the tied copy too
    for i in cfg.moe_layers:
        pre = f"layers.{i}.mlp.experts"
        if fam.experts == "gpt_oss":
            state.update(_gpt_oss_experts(take, i, want))
        elif f"{pre}.gate_up_proj" in src:   # fused layout of newer transformers: (E, 2I, D), (E, D, I)
            state[f"layers.{i}.mlp.w13"] = take(f"{pre}.gate_up_proj", want[f"layers.{i}.mlp.w13"])
            state[f"layers.{i}.mlp.w2"] = take(f"{pre}.down_proj", want[f"layers.{i}.mlp.w2"])
        else:
            D, I = cfg.hidden_size, cfg.moe_intermediate_size
            ids = range(cfg.num_experts) if experts is None else experts
            gate = [take(f"{pre}.{e}.gate_proj.weight", (I, D)) for e in ids]
            up = [take(f"{pre}.{e}.up_proj.weight", (I, D)) for e in ids]
            down = [take(f"{pre}.{e}.down_proj.weight", (D, I)) for e in ids]
            state[f"layers.{i}.mlp.w13"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)   # (E, 2I, D)
            state[f"layers.{i}.mlp.w2"] = torch.stack(down)                                         # (E, D, I)
    if src:
        extra = sorted(hf_name[k] for k in src)
        raise CheckpointError(f"checkpoint has {len(extra)} tensors the config does not use, e.g. {extra[0]!r} "
                              f"(does config.json match the weights?)")
    return state


_STACKED = (".mlp.w13", ".mlp.w2", ".mlp.b13", ".mlp.b2")     # our stacked experts and their biases


def _gpt_oss_experts(take, i: int, want: dict) -> dict[str, torch.Tensor]:
    """gpt-oss's fused experts of layer i -> ours. Its gate_up_proj (E, D, 2I) holds gate and up in
    alternate columns (2j gate, 2j + 1 up) and multiplies as x @ W; down_proj is (E, I, D); each has a
    bias. Ours: w13 (E, 2I, D) gate rows first, b13 (E, 2I) the same order, w2 (E, D, I), b2 (E, D)."""
    pre = f"layers.{i}.mlp"
    E, I2, D = want[f"{pre}.w13"]
    gate_up = take(f"{pre}.experts.gate_up_proj", (E, D, I2))
    bias = take(f"{pre}.experts.gate_up_proj_bias", (E, I2))
    return {f"{pre}.w13": torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], -1).transpose(1, 2).contiguous(),
            f"{pre}.b13": torch.cat([bias[:, 0::2], bias[:, 1::2]], -1),
            f"{pre}.w2": take(f"{pre}.experts.down_proj", (E, I2 // 2, D)).transpose(1, 2).contiguous(),
            f"{pre}.b2": take(f"{pre}.experts.down_proj_bias", (E, D))}


def _gpt_oss_layout(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One of our stacked expert tensors -> (gpt-oss's key suffix, tensor): the inverse of _gpt_oss_experts."""
    kind = name.rsplit(".", 1)[1]
    if kind in ("w13", "b13"):                       # gate half and up half -> alternating
        half = t.shape[1] // 2
        both = torch.stack([t[:, :half], t[:, half:]], 2).reshape(t.shape)   # (E, 2I, ...) interleaved rows
        return ("gate_up_proj", both.transpose(1, 2)) if kind == "w13" else ("gate_up_proj_bias", both)
    return ("down_proj", t.transpose(1, 2)) if kind == "w2" else ("down_proj_bias", t)


def state_to_hf(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state of `model` (a model.Transformer: weights and the router bias buffers) under its family's
    HF keys, experts split per expert (what transformers and vLLM read; gpt-oss: its own fused layout)."""
    cfg = model.config
    fam = family(cfg.model_type)
    I = cfg.moe_intermediate_size
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().contiguous()
        if fam.experts == "gpt_oss" and name.endswith(_STACKED):
            key, t = _gpt_oss_layout(name, t)
            out[our_key_to_hf(fam, name.rsplit(".", 1)[0] + ".experts." + key)] = t.contiguous()
        elif name.endswith(".mlp.w13") or name.endswith(".mlp.w2"):
            pre = name.rsplit(".", 1)[0] + ".experts"
            for e in range(t.shape[0]):
                if name.endswith("w13"):
                    out[our_key_to_hf(fam, f"{pre}.{e}.gate_proj.weight")] = t[e, :I].clone()
                    out[our_key_to_hf(fam, f"{pre}.{e}.up_proj.weight")] = t[e, I:].clone()
                else:
                    out[our_key_to_hf(fam, f"{pre}.{e}.down_proj.weight")] = t[e].clone()
        else:
            out[our_key_to_hf(fam, name)] = t
    if fam.save_tensors is not None:
        out = fam.save_tensors(out, cfg)
    return {**out, **getattr(model, "extra_tensors", {})}


# ---------------------------------------------------------------------------------------------------
# MXFP4 (the OCP microscaling format gpt-oss ships its experts in), dequantized on load
# ---------------------------------------------------------------------------------------------------
# The 16 values of an E2M1 code (bit 3 the sign, then 2 exponent bits and 1 mantissa bit)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks (E, R, G, 16) uint8, two E2M1 codes a byte (the low nibble first), and scales (E, R, G) uint8,
    one E8M0 exponent (biased by 127) per group of 32 values -> (E, G * 32, R) in dtype: value * 2^(scale - 127),
    transposed as transformers lays the dequantized experts out (x @ W). Each product is made in fp32
    (exact: a power-of-two scaling) and rounded to dtype once: transformers' bits."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise CheckpointError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                              "((..., G, 16) and (..., G))")
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=dtype, device=blocks.device)   # (E, R, G*32)
    for e in range(blocks.shape[0]):                      # an expert at a time: the codes are 4 bytes each
        codes = torch.stack([blocks[e] & 0x0F, blocks[e] >> 4], -1).int()         # (R, G, 16, 2)
        values = table[codes].flatten(-2)                                          # (R, G, 32)
        out[e] = torch.ldexp(values, scales[e].to(torch.int32)[..., None] - 127).flatten(-2).to(dtype)
    return out.transpose(1, 2)                                                     # (E, G*32, R)


def dequantize_mxfp4(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every `X_blocks` / `X_scales` pair replaced by X dequantized (mxfp4_dequantize), in the dtype of the
    checkpoint's other weights (its embedding's, as transformers dequantizes to the model dtype). A value
    that overflows (a scale near 255) is refused by name, like any non-finite weight."""
    pairs = [k.removesuffix("_blocks") for k in tensors if k.endswith("_blocks")]
    if not pairs:
        return tensors
    dtype = next((t.dtype for k, t in tensors.items() if k.endswith("embed_tokens.weight")), torch.bfloat16)
    out = {k: t for k, t in tensors.items() if not k.endswith(("_blocks", "_scales"))}
    for key in pairs:
        if key + "_scales" not in tensors:
            raise CheckpointError(f"checkpoint has {key}_blocks but no {key}_scales (an MXFP4 tensor needs both)")
        out[key] = mxfp4_dequantize(tensors[key + "_blocks"], tensors[key + "_scales"], dtype)
        if not bool(torch.isfinite(out[key]).all()):
            raise CheckpointError(f"MXFP4 tensor {key!r} dequantizes to non-finite values (a scale too large)")
    return out


# ---------------------------------------------------------------------------------------------------
# safetensors directories
# ---------------------------------------------------------------------------------------------------
Rows = Callable[[str], "list[int] | None"]   # a tensor's key -> the leading-dim rows to read (None: all; []: none)


def read_safetensors_dir(path: str, rows: Rows | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory under its HF key; `rows` reads only part of some (the
    experts of one rank: see expert_rows), and the rest of those files is never read.

    Raises CheckpointError naming the file for an unreadable (e.g. truncated) shard, and naming the key
    of the first tensor holding a NaN or an infinity: a poisoned checkpoint never loads silently.
    """
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index}: not a safetensors index (expected JSON with a 'weight_map')") from None
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path!r} has neither model.safetensors nor model.safetensors.index.json")
    out = {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: missing (named by model.safetensors.index.json)")
        out.update(read_safetensors_file(file, rows))
    return out


def read_safetensors_file(file: str, rows: Rows | None = None) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file (memory-mapped: only what is read leaves the disk), each
    checked finite. rows: see read_safetensors_dir."""
    from safetensors import SafetensorError, safe_open
    out = {}
    try:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                want = rows(key) if rows else None
                if want is None:
                    out[key] = f.get_tensor(key)
                elif want:
                    part = f.get_slice(key)
                    out[key] = torch.stack([part[r] for r in want])          # (len(want), ...)
    except SafetensorError as e:
        raise CheckpointError(f"{file}: unreadable safetensors file ({e}); was it truncated by an interrupted "
                              "copy or download?") from None
    for key, t in out.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            n = int((~torch.isfinite(t)).sum())
            raise CheckpointError(f"{file}: tensor {key!r} holds {n} non-finite value(s) (NaN or inf); "
                                  "the checkpoint is poisoned, load an earlier one")
    return out


_PER_EXPERT = re.compile(r"layers\.\d+\.mlp\.experts\.(\d+)\.")              # ours: one expert's tensor
# (E, ...) stacked: fused experts (gpt-oss's with their biases, MXFP4 blocks and scales), ours with biases
# and LoRA's adapters stacked by expert (lora/adapters.py, in a masters file)
_FUSED = re.compile(r"layers\.\d+\.mlp\.(experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?"
                    r"|w13|w2|b13|b2|lora_A13|lora_B13|lora_A2|lora_B2)$")


def expert_rows(cfg: ModelConfig, experts: list[int] | None, hf_keys: bool = True) -> Rows | None:
    """What to read of a checkpoint for a rank holding `experts` (logical ids, in its local order) of
    every MoE layer: the other experts' per-expert tensors are skipped, stacked ones read at those rows.
    hf_keys=False: the keys are ours (masters.safetensors). None: read everything."""
    if experts is None:
        return None
    fam, keep = family(cfg.model_type), set(experts)

    def rows(key: str):
        ours = hf_key_to_ours(fam, key, cfg.num_hidden_layers) if hf_keys else key
        if ours is None:
            return None
        if m := _PER_EXPERT.match(ours):
            e = int(m.group(1))                   # an id out of range is read, and refused by hf_to_state
            return None if e in keep or e >= cfg.num_experts else []
        return list(experts) if _FUSED.match(ours) else None
    return rows


def write_safetensors_dir(path: str, tensors: dict[str, torch.Tensor], config: dict,
                          max_shard_bytes: int = 2 << 30) -> None:
    """Write config.json (with the tensors' dtype added) and the tensors, in order, as model.safetensors
    or, past max_shard_bytes, as shards named by model.safetensors.index.json."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    dtype = next(iter(tensors.values())).dtype
    config = dict(config)
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    shards, cur, size = [], {}, 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + nbytes
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        _write_shards(path, shards)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _write_shards(path: str, shards: list[dict[str, torch.Tensor]]) -> None:
    """Several safetensors files, model-0000i-of-0000n, and the index naming each tensor's file."""
    from safetensors.torch import save_file
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        total += sum(v.numel() * v.element_size() for v in shard.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# ---------------------------------------------------------------------------------------------------
# a checkpoint's identity: its token ids and tokenizer files, carried into every export
# ---------------------------------------------------------------------------------------------------
TOKEN_ID_KEYS = ("eos_token_id", "bos_token_id", "pad_token_id")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


@dataclass
class Identity:
    """What an export needs beyond its weights for transformers' generate to stop and its tokenizer to load.

    token_ids: eos_token_id (an int or a list), bos_token_id, pad_token_id; None where unknown.
    generation: generation_config.json's other keys (the source's sampling defaults), kept as they were.
    files: the name in the export -> the file copied there (the tokenizer's).
    """
    token_ids: dict[str, Any] = field(default_factory=dict)
    generation: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    return d if isinstance(d, dict) else {}


def read_identity(folder: str) -> Identity:
    """The identity of an HF checkpoint folder: token ids from config.json, where generation_config.json
    (what generate reads) does not set them, and its tokenizer files."""
    config, gen = _read_json(os.path.join(folder, "config.json")), _read_json(os.path.join(folder, "generation_config.json"))
    ids = {k: gen.get(k, config.get(k)) for k in TOKEN_ID_KEYS}
    generation = {k: v for k, v in gen.items() if k not in TOKEN_ID_KEYS and not k.startswith("_")
                  and k != "transformers_version"}
    files = {n: os.path.join(folder, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))}
    return Identity(ids, generation, files)


def write_identity(path: str, identity: Identity) -> None:
    """Add the token ids to path/config.json, write generation_config.json, copy the tokenizer files.

    pad_token_id falls back to the first eos id (what generate pads a finished sequence with)."""
    import shutil
    ids = dict(identity.token_ids)
    eos = ids.get("eos_token_id")
    if ids.get("pad_token_id") is None and eos is not None:
        ids["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    ids = {k: v for k, v in ids.items() if v is not None}
    cfg_path = os.path.join(path, "config.json")
    config = {**_read_json(cfg_path), **ids}
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({**identity.generation, **ids}, f, indent=2)
    for name, src in identity.files.items():
        shutil.copyfile(src, os.path.join(path, name))
