"""Configuration: one dataclass per concern, presets, and `--key=value` overrides.

    from config import ModelConfig
    cfg = ModelConfig.preset("tiny")                  # the CPU default of `python train.py`

Field names follow Hugging Face's Qwen3-MoE config; the knobs of other families (sigmoid routing, a
score-correction bias, grouped top-k, shared experts, biases, partial RoPE) are extra fields that are
off by default. hf.py translates each family's config.json onto them (hf.config_from_hf) and checks
model_type; this file imports nothing of it.
Every dataclass validates itself in `__post_init__`; `apply_overrides` turns command-line
`--key=value` strings into typed fields and rejects unknown keys and bad values by name.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field

from tasks import TASKS     # the task table (tasks.py imports nothing of this module)


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
    # other families (hf.py); every default below is Qwen3-MoE, which uses none of them
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
        self._check_family_knobs()

    def _check_family_knobs(self):
        _require(self.router_scoring in ("softmax", "sigmoid"),
                 f"router_scoring={self.router_scoring!r}: softmax or sigmoid")
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


MODEL_PRESETS: dict[str, dict] = {
    # ~1.5M parameters: 4 layers (1 dense + 3 MoE with 8 experts, top-2); trains in minutes on 2 CPU cores.
    "tiny": dict(),
    # The tiny model with DeepSeek-V3 / GLM-4.5 routing, for the mismatch lab: sigmoid scores, a
    # score-correction bias (zero until --expert_bias_update_rate moves it), 2 expert groups of 4 (top-2
    # inside the best one), one shared expert; layer 0 dense through first_k_dense_replace (GLM's spelling).
    "tiny-sigmoid": dict(model_type="glm4_moe", router_scoring="sigmoid", score_correction_bias=True, n_group=2,
                         topk_group=1, n_shared_experts=1, mlp_only_layers=[], first_k_dense_replace=1),
    # The dense control of the lab: tiny's width and active parameters, every layer a dense SwiGLU MLP of
    # intermediate_size = top_k * moe_intermediate_size (2 * 128), so a numeric gap meets no router.
    "tiny-dense": dict(num_experts=0, num_experts_per_tok=1, moe_intermediate_size=0, intermediate_size=256,
                       mlp_only_layers=[]),                        # the expert knobs as config.json gives them back
    # The real Qwen3-30B-A3B shapes (48 layers, 128 experts, top-8, 3.3B active parameters).
    "qwen3-30b-a3b": dict(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, intermediate_size=6144, norm_topk_prob=True, mlp_only_layers=[],
        decoder_sparse_step=1, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=40960),
}


QUANT_FORMATS = ("int8", "fp8_e4m3")   # --rollout_dtype's quantized formats


def check_sampling(temperature, top_p, top_k) -> None:
    """The sampling ranges, the one rule for RolloutConfig (the command line) and for each request
    (rollout.SamplingParams, generate()'s arguments): the same words for the same value."""
    import numbers

    def real(x):
        return isinstance(x, numbers.Real) and not isinstance(x, bool)

    def shown(x):
        return f"{x:g}" if real(x) else repr(x)
    _require(real(temperature) and math.isfinite(temperature) and temperature >= 0,
             f"--temperature={shown(temperature)}: must be >= 0 and finite (0 samples greedily)")
    _require(real(top_p) and 0 < top_p <= 1, f"--top_p={shown(top_p)}: must be in (0, 1]")
    _require(isinstance(top_k, numbers.Integral) and not isinstance(top_k, bool) and top_k >= 0,
             f"--top_k={top_k!r}: must be an integer >= 0 (0 turns it off)")


# The mismatch lab's router faults (RolloutConfig.rollout_router_fault), set on the rollout copy's MoE
# modules only (lab.set_router_fault, lab.FaultyRouting applies them): what a conversion bug or a
# second engine gets wrong.
ROUTER_FAULTS = ("none",
                 "no_bias",            # the score-correction bias lost: the choice on the raw scores
                 "bias_sign",          # the bias subtracted instead of added
                 "bias_in_weights",    # the combine weights taken from the biased scores
                 "no_renorm",          # the top-k weights not renormalised (norm_topk_prob ignored)
                 "expert_map")         # a wrong logical-to-physical expert table (expert_map_fault): the
                                       # router is right, its ids reach the wrong experts, routes are logged as chosen


@dataclass
class RolloutConfig:
    """The sampler's settings (rollout.Sampler reads the engine's, train.py passes the sampling ones)."""
    block_size: int = 16              # KV positions per page
    num_blocks: int = 0               # 0: sized from the device (see rollout.Sampler)
    max_batch_size: int = 256         # running sequences at most
    max_num_batched_tokens: int = 4096   # tokens per prefill forward (prompts right-padded to the longest);
                                         # a longer prompt or observation is prefilled in chunks of this many
    prefix_cache: bool = True         # reuse computed full KV blocks (and routes) of a seen token prefix, same weights
    kv_memory_fraction: float = 0.5   # CUDA: share of free memory (after grads + AdamW state) for the KV pool
    cuda_graphs: bool | None = None   # decode steps as CUDA graphs; None: where they run without host syncs
    temperature: float = 1.0          # sampling temperature (0: greedy); log-probs are of softmax(logits / T)
    top_p: float = 1.0                # nucleus sampling (1: off)
    top_k: int = 0                    # sample among the k most likely tokens (0: off)
    max_new_tokens: int = 0           # response length limit; 0: the task's (n_digits + 1; --task=jsonl: 64)
    stop_tokens: str = ""             # comma-separated ids that end a response, instead of the checkpoint's /
                                      # tokenizer's eos (the digit tasks: their EOS)
    # the mismatch lab: deviations on the rollout side only (the trainer always stays invariant)
    rollout_mode: str = "invariant"   # invariant | fast (batch-variant torch / cuBLAS / SDPA ops)
    router_bf16: bool = False         # round the rollout's router logits to bf16
    rollout_dtype: str = ""           # "" (the trainer's) | bfloat16 | float16: a lower-precision weight copy |
                                      # int8 | fp8_e4m3: matmul weights rounded to that format per output channel
                                      # (absmax scales) and dequantized (lab.quantized_copy)
    rollout_quant_router: bool = True   # int8 / fp8_e4m3: quantize the router gate too (false: full precision)
    rollout_router_fault: str = "none"  # none | no_bias | bias_sign | bias_in_weights | no_renorm | expert_map: the
                                        # rollout's routing wrong in that one way (ROUTER_FAULTS), the trainer's right
    record_route_detail: bool = False  # the sampler also keeps each route's combine weights and margin (fp32)

    def __post_init__(self):
        _require_finite(self)
        _require(self.rollout_mode in ("invariant", "fast"), f"--rollout_mode={self.rollout_mode!r}: invariant or fast")
        _require(self.rollout_dtype in ("", "float32", "bfloat16", "float16") + QUANT_FORMATS,
                 f"--rollout_dtype={self.rollout_dtype!r}: '', float32, bfloat16, float16, int8 or fp8_e4m3")
        _require(self.rollout_quant_router or self.rollout_dtype in QUANT_FORMATS,
                 f"--rollout_quant_router=false: only a quantized rollout (--rollout_dtype=int8 or fp8_e4m3) "
                 f"quantizes the router (this one's is {self.rollout_dtype or 'the trainer dtype'})")
        _require(self.rollout_router_fault in ROUTER_FAULTS,
                 f"--rollout_router_fault={self.rollout_router_fault!r}: choose one of {', '.join(ROUTER_FAULTS)}")
        _require_range(self, "block_size max_batch_size max_num_batched_tokens", lambda v: v > 0, "> 0")
        _require_range(self, "num_blocks max_new_tokens", lambda v: v >= 0, ">= 0")
        from kernels import KV_BLOCK      # a page holds whole attention tiles
        _require(self.block_size % KV_BLOCK == 0,
                 f"--block_size={self.block_size}: must be a multiple of kernels.KV_BLOCK={KV_BLOCK}")
        _require(0 < self.kv_memory_fraction <= 1, f"--kv_memory_fraction={self.kv_memory_fraction}: must be in (0, 1]")
        check_sampling(self.temperature, self.top_p, self.top_k)
        self.stop_token_ids                                          # parses --stop_tokens (errors name it)

    @property
    def stop_token_ids(self) -> tuple[int, ...] | None:
        """--stop_tokens as ids, or None when not given (the task's then: tasks.py, "Stop tokens")."""
        if not self.stop_tokens.strip():
            return None
        items = [t.strip() for t in self.stop_tokens.split(",")]
        _require(all(re.fullmatch(r"\d+", t) for t in items),
                 f"--stop_tokens={self.stop_tokens!r}: comma-separated token ids, e.g. --stop_tokens=151645,151643")
        return tuple(int(t) for t in items)


@dataclass
class TrainConfig:
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
    parallel: str = "ddp"             # under torchrun: ddp (full model per rank) | fsdp (FSDP2 sharding)
    grad_reduce: str = "exact"        # exact: gradients summed as fixed-point integers, the same bits at any
                                      # world size (exact_sum.py) | fast: fp32 accumulation and all-reduce
    expert_parallel: int = 1          # N ranks per EP group, each holding E/N experts (expert_parallel.py)
    expert_placement: list[int] = field(default_factory=list)   # "" contiguous | physical slot of each logical
                                      # expert, comma-separated (a permutation; slot p on rank p // (E/N))
    kernels_backend: str = ""         # "" (KERNELS_BACKEND, default auto: Triton on CUDA) | auto | torch | triton
    # data
    task: str = "copy"                # a name in tasks.TASKS: copy | reverse | jsonl
    n_digits: int = 4                 # copy / reverse: digits per prompt
    data: str = ""                    # --task=jsonl: the JSONL file
    tokenizer: str = ""               # --task=jsonl: an HF tokenizer.json
    reward_fn: str = ""               # --task=jsonl: module:function or file.py:function, reward(prompt, response, answer)
    chat_template: bool = False       # --task=jsonl: format each prompt with tokenizer_config.json's chat_template
    system_prompt: str = ""           # --chat_template=true: a system message before each prompt
    vocab_size: str = ""              # a preset's vocabulary: '' (the preset's) | auto (the task's tokenizer) | N
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
                                      # steps, never below lr * min_lr_ratio)
    lr_decay_steps: int = 0           # the cosine's horizon; 0: --steps (on resume: docs/design.md, "The learning-rate horizon")
    lr_decay_period: int = 0          # --lr_schedule=halving: steps per halving (required there, 0 elsewhere)
    router_lr_scale: float = 1.0      # the MoE router gate weights train at lr * S (0 freezes them; the
                                      # score-correction bias is --expert_bias_update_rate's)
    weight_decay: float = 0.0         # AdamW's decoupled weight decay
    beta1: float = 0.9                # AdamW's first-moment decay
    beta2: float = 0.99               # AdamW's second-moment decay
    grad_clip: float = 1.0            # clip the global gradient norm to this
    skip_nonfinite_steps: int = 0     # optimizer steps with a non-finite loss or grad norm to skip before stopping
    # loss
    loss: str = "grpo"                # grpo | gspo | gspo_token | sapo | cispo (losses.LOSSES)
    agg: str = "auto"                 # auto (the loss's own: per sequence for GSPO and SAPO) | token_mean |
    #                                   seq_mean_token_mean | seq_mean_token_sum | drgrpo
    adv_std_norm: bool = True         # False: Dr.GRPO advantages (no division by the group std)
    eps_low: float = 0.2              # PPO-clip: ratios below 1 - eps_low are clipped
    eps_high: float = 0.28            # ... above 1 + eps_high (DAPO clip-higher)
    dual_clip_c: float = 0.0          # > 1: GRPO tokens with A < 0 lose at most -A * c (0: off)
    gspo_eps_low: float = 3e-4        # GSPO's clip range on the sequence ratio: below 1 - this ...
    gspo_eps_high: float = 4e-4       # ... and above 1 + this
    gspo_log_ratio_max: float = 20.0  # GSPO's sequence log-ratio clamped to [-20, this] (verl: 10)
    sapo_tau_pos: float = 1.0         # SAPO's gate temperature for A > 0
    sapo_tau_neg: float = 1.05        # ... for A < 0
    kl_coef: float = 0.0              # KL to the frozen initial policy
    kl_estimator: str = "k3"          # k1 | k2 | k3 | k3_clamped (k3 at most 10, as verl's low_var_kl)
    # train-inference mismatch
    recompute_old_logp: bool = False  # recompute old log-probs with the trainer (default: use the rollout's)
    correction: str = "none"          # none | is (rho) | tis (min(rho, tis_cap)) | mis (rho up to mis_high, else 0) |
    #                                   reject (1 inside [mis_low, mis_high], else 0) | icepop (rho inside, else 0)
    #                                   | seq_<each>: on the sequence's rho (losses.TOKEN_CORRECTIONS)
    tis_cap: float = 2.0              # tis: the cap C of min(rho, C)
    mis_low: float = 0.5              # reject and icepop keep rho inside [mis_low, mis_high]
    mis_high: float = 5.0             # ... (mis keeps rho <= mis_high: masked IS's C)
    seq_rho: str = "geo_mean"         # seq_*: the sequence's rho as the geometric mean of its tokens' rho, or
                                      # their product (the papers' Seq-TIS / Seq-MIS, verl's rollout_is=sequence)
    rejected_tokens: str = "zero_weight"   # zero_weight (still counted in the token mean, still carry KL) | drop
    replay: str = "none"              # none | r3 (the rollout's routes) | old (the recomputed old policy's routes,
                                      # "vanilla routing replay"; needs --recompute_old_logp)
    route_filter: str = "none"        # none | mask | downweight: the loss of tokens whose rollout/trainer top-k
                                      # overlap is below --route_filter_threshold (masked, or times the overlap)
    route_filter_threshold: float = 0.9    # --route_filter: the overlap (mean over MoE layers) a token needs
    route_filter_level: str = "token"      # token | sequence: filter whole responses by their mean overlap
    train_capacity_factor: float = 0.0    # > 0: in the trainer's forwards each expert takes at most
                                          # ceil(C * tokens * k / E) (token, slot) rows (model.capacity_limit);
                                          # 0: dropless. The rollout is always dropless
    expert_bias_update_rate: float = 0.0  # > 0: after each optimizer step, router bias += rate * sign(mean load - load)
    # logging
    log_every: int = 1                # write a metrics.jsonl row every N steps
    save_every: int = 50              # checkpoint every N steps (and at the end)
    keep_checkpoints: int = 1         # the newest K checkpoints are kept, older ones deleted
    progress: bool = True             # a progress bar; false: one line every --log_every steps
    probe_every: int = 0              # > 0: every N steps, roll out a fixed probe set greedily and audit it
    probe_prompts: int = 8            # the probe set's size (drawn once from the task)
    diagnostics: int = 0              # > 0: each step, the N most mismatched sequences to diagnostics.jsonl
    log_samples: int = 0              # N sampled responses per step to out_dir/samples.jsonl (one shown)
    log_to: str = ""                  # "" (metrics.jsonl only) | tensorboard | wandb: a copy of each row
    # evaluation (eval.py): greedy and sampled reward and pass@k on a held-out JSONL
    eval_data: str = ""               # a JSONL file in --data's format, scored with --reward_fn
    eval_every: int = 0               # evaluate every N steps and at the last (0: at the last step only)
    eval_samples: int = 4             # k sampled responses per eval prompt (pass@k)

    def __post_init__(self):
        _require_finite(self)
        for name in ("steps", "prompts_per_step", "epochs", "minibatch_size", "n_digits"):
            _require(getattr(self, name) > 0, f"--{name}={getattr(self, name)}: must be >= 1")
        for name in ("micro_batch_tokens", "micro_batch_size", "logits_chunk", "lr_decay_steps", "skip_nonfinite_steps",
                     "warmup_steps"):
            _require(getattr(self, name) >= 0, f"--{name}={getattr(self, name)}: must be >= 0")
        _require(self.task in TASKS, f"--task={self.task!r}: choose one of {tuple(TASKS)}")
        _require(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
                 f"--device={self.device!r}: choose auto, cpu, cuda or cuda:N")
        _require(not (self.resume and self.overwrite), "--resume and --overwrite contradict each other: pick one")
        self._check_objective()
        for name in ("keep_checkpoints", "eval_samples"):
            _require(getattr(self, name) >= 1, f"--{name}={getattr(self, name)}: must be >= 1")
        for name in ("log_samples", "eval_every"):
            _require(getattr(self, name) >= 0, f"--{name}={getattr(self, name)}: must be >= 0")
        _require(self.log_to in ("", "tensorboard", "wandb"), f"--log_to={self.log_to!r}: '', tensorboard or wandb")
        _require(not self.eval_every or self.eval_data,
                 f"--eval_every={self.eval_every}: needs --eval_data=FILE (a held-out JSONL)")
        _require(not self.eval_data or self.task == "jsonl",
                 f"--eval_data={self.eval_data!r}: needs --task=jsonl (its --tokenizer and --reward_fn score it)")
        _require_range(self, "route_filter_threshold", lambda v: 0 <= v <= 1, "in [0, 1]")
        _require_range(self, "save_every log_every", lambda v: v > 0, ">= 1")
        _require_range(self, "lr", lambda v: v >= 0, ">= 0 (0: a frozen policy)")
        _require_range(self, "grad_clip tis_cap", lambda v: v > 0, "> 0")
        _require_range(self, "kl_coef eps_high gspo_eps_high weight_decay", lambda v: v >= 0, ">= 0")
        _require_range(self, "eps_low gspo_eps_low", lambda v: 0 <= v < 1, "in [0, 1)")
        _require_range(self, "beta1 beta2", lambda v: 0 <= v < 1, "in [0, 1)")
        _require(self.probe_every >= 0 and self.diagnostics >= 0,
                 f"--probe_every={self.probe_every}, --diagnostics={self.diagnostics}: must be >= 0 (0: off)")
        _require(self.probe_prompts > 0, f"--probe_prompts={self.probe_prompts}: must be >= 1")
        _require(self.train_capacity_factor >= 0,
                 f"--train_capacity_factor={self.train_capacity_factor}: 0 (dropless) or > 0")
        _require(self.lr_schedule in ("cosine", "constant", "halving"),
                 f"--lr_schedule={self.lr_schedule!r}: cosine, constant or halving")
        _require(self.lr_schedule != "halving" or self.lr_decay_period >= 1,
                 f"--lr_decay_period={self.lr_decay_period}: --lr_schedule=halving needs a period of >= 1 steps")
        _require(self.lr_schedule == "halving" or self.lr_decay_period == 0,
                 f"--lr_decay_period={self.lr_decay_period}: only --lr_schedule=halving uses it "
                 f"(this run's is {self.lr_schedule})")
        _require(self.lr_schedule != "halving" or 0 <= self.min_lr_ratio <= 1,
                 f"--min_lr_ratio={self.min_lr_ratio}: --lr_schedule=halving needs a floor in [0, 1]")
        _require(self.router_lr_scale >= 0,
                 f"--router_lr_scale={self.router_lr_scale}: must be >= 0 (0 freezes the router)")
        _require(self.dtype in ("float32", "bfloat16"), f"--dtype={self.dtype!r}: float32 or bfloat16")
        _require_range(self, "group_size", lambda v: v >= 2, ">= 2: advantages compare responses within a group")
        _require(self.parallel in ("ddp", "fsdp"), f"--parallel={self.parallel!r}: ddp or fsdp")
        _require(self.grad_reduce in ("exact", "fast"), f"--grad_reduce={self.grad_reduce!r}: exact or fast")
        _require(self.expert_parallel >= 1, f"--expert_parallel={self.expert_parallel}: must be >= 1")
        _require(self.kernels_backend in ("", "auto", "torch", "triton"),
                 f"--kernels_backend={self.kernels_backend!r}: auto, torch or triton (or '' for KERNELS_BACKEND)")
        _require_range(self, "expert_bias_update_rate", lambda v: v >= 0, ">= 0 (0: the bias is frozen)")
        _require(self.vocab_size in ("", "auto") or (self.vocab_size.isdigit() and int(self.vocab_size) > 0),
                 f"--vocab_size={self.vocab_size!r}: auto (the task's tokenizer) or a number of token ids > 0")
        _require(self.task == "jsonl" or not (self.chat_template or self.system_prompt),
                 "--chat_template and --system_prompt format JSONL prompts: add --task=jsonl")
        _require(self.chat_template or not self.system_prompt,
                 "--system_prompt goes into the checkpoint's chat template: add --chat_template=true")
        self._check_precision()

    def _check_objective(self):
        """The objective against losses.py's tables: the loss, its aggregation over minibatches, the corrections, the
        KL; the replay options (replay.py's)."""
        from losses import AGGREGATIONS, CORRECTIONS, KL_ESTIMATORS, LOSSES, SEQ_RHOS   # the tables the loop runs
        _require(self.loss in LOSSES, f"--loss={self.loss!r}: choose one of {', '.join(LOSSES)}")
        _require(self.agg == "auto" or self.agg in AGGREGATIONS,
                 f"--agg={self.agg!r}: choose auto or one of {', '.join(AGGREGATIONS)}")
        _require(not LOSSES[self.loss].per_sequence or self.agg in ("auto", "seq_mean_token_mean"),
                 f"--loss={self.loss} is defined with per-sequence mean aggregation; drop --agg={self.agg}")
        _require(self.dual_clip_c == 0 or (self.dual_clip_c > 1 and self.loss == "grpo"),
                 f"--dual_clip_c={self.dual_clip_c}: 0 (off) or > 1, with --loss=grpo")
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
        """--replay and --route_filter against replay.py's tables (the life of a route has one home)."""
        from replay import REPLAY_MODES, ROUTE_FILTER_LEVELS, ROUTE_FILTERS
        _require(self.replay in REPLAY_MODES, f"--replay={self.replay!r}: choose one of {', '.join(REPLAY_MODES)}")
        _require(self.replay != "old" or self.recompute_old_logp,
                 "--replay=old replays the routes of the recomputed old-policy forward: add --recompute_old_logp=true")
        _require(self.route_filter in ROUTE_FILTERS, f"--route_filter: {', '.join(ROUTE_FILTERS)}")
        _require(self.route_filter_level in ROUTE_FILTER_LEVELS,
                 f"--route_filter_level={self.route_filter_level!r}: {' or '.join(ROUTE_FILTER_LEVELS)}")

    def check_model(self, model: ModelConfig, task_vocab: int) -> None:
        """The options that need the model: the route options refuse a model without a router (they
        would do nothing), the bias update needs a bias, and the task's ids must fit the vocabulary."""
        if not model.moe_layers:
            for name, off in (("train_capacity_factor", 0.0), ("replay", "none"), ("route_filter", "none")):
                _require(getattr(self, name) == off,
                         f"--{name}={getattr(self, name)}: the model has no MoE layer (no routes); drop it")
        _require(self.expert_bias_update_rate == 0 or model.score_correction_bias,
                 "--expert_bias_update_rate needs a model with a score-correction bias "
                 "(score_correction_bias=True: e.g. --init_from=tiny-sigmoid or a glm4_moe checkpoint)")
        _require(task_vocab <= model.vocab_size,
                 f"task {self.task!r} uses {task_vocab} token ids, the model has vocab_size={model.vocab_size}")

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
        _require(self.expert_bias_update_rate == 0 or self.master_dtype == "float32" or self.router_dtype == "float32",
                 "--expert_bias_update_rate needs a float32 bias: keep --master_dtype=float32 (or pass "
                 "--router_dtype=float32); a bf16 bias would round away updates smaller than its precision")

    @property
    def mixed_precision(self) -> bool:
        """Compute in --dtype on a copy cast from float32 masters (the optimizer's weights)."""
        return self.dtype != self.master_dtype

    def model_preset(self, task_vocab: int, tokenizer: bool) -> ModelConfig | None:
        """The ModelConfig of --init_from when it names a preset (None for a checkpoint folder), its vocabulary
        set by --vocab_size: '' keeps the preset's, auto takes the task's, N is N.

        The task's ids must fit; with a tokenizer, a larger vocabulary is refused too: the ids past the
        tokenizer's decode to nothing, yet the policy would sample them. Each refusal says what to pass.
        """
        if self.init_from not in MODEL_PRESETS or os.path.isdir(self.init_from):
            _require(not (self.vocab_size and os.path.isdir(self.init_from)),
                     f"--vocab_size={self.vocab_size}: only a preset's vocabulary can be changed; "
                     f"--init_from={self.init_from!r} is a checkpoint folder with its own")
            return None
        cfg = ModelConfig.preset(self.init_from)
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


def apply_overrides(overrides: dict[str, str], *configs) -> None:
    """Set each key on the one config dataclass that has it, converting by the field's type.

    Unknown keys and wrong types raise ConfigError naming the key; each config is re-validated.
    """
    hints = [(c, typing.get_type_hints(type(c))) for c in configs]
    for key, raw in overrides.items():
        owners = [(c, h[key]) for c, h in hints if key in h]
        if not owners:
            near = difflib.get_close_matches(key, [k for _, h in hints for k in h], n=1, cutoff=0.6)
            raise ConfigError(f"unknown config key --{key}" + (f"; did you mean --{near[0]}?" if near else "")
                              + " (--help lists every option)")
        for c, tp in owners:
            setattr(c, key, _convert(key, raw, tp))
    for c in configs:
        c.__post_init__()


def field_docs(cls) -> dict[str, str]:
    """{field: its description}: the trailing comment of the field's line in the class source, with the
    comment-only lines that continue it (indented past the field, or `#` then aligned text). The one place
    an option is described: --help prints these."""
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
    """Every option: `--name=default  description`, grouped by dataclass."""
    lines = []
    for c in configs:
        lines.append(f"{type(c).__name__}:")
        docs = field_docs(type(c))
        opts = [(f"--{f.name}={getattr(c, f.name)!r}", docs.get(f.name, "")) for f in dataclasses.fields(c)]
        width = max(len(o) for o, _ in opts)
        lines += [f"  {o:<{width}}  {d}".rstrip() for o, d in opts]
    return "\n".join(lines)
