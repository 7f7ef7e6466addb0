"""The memory plan: bytes per rank of a training run's state, before anything is loaded.

    python train.py --plan --init_from=qwen3-30b-a3b --world_size=8 --parallel=fsdp --expert_parallel=8 \
        --dtype=bfloat16 --gpu_memory_gb=80

The layout assumed (fp32-master mixed precision): fp32 masters (4 bytes a parameter), fp32 gradients (4),
AdamW's two fp32 moments (8); with --dtype=bfloat16 a bf16 compute copy (2) cast from the masters (with
float32 the masters are the compute weights). --master_dtype=bfloat16 stores all four in bf16 (2 + 2 + 4,
no compute copy: the masters compute). Dense parameters (attention, router, norms, embeddings,
shared experts) are whole on every rank under DDP and sharded over the world under FSDP2; expert
parameters are divided by --expert_parallel=N, and under FSDP2 also by world / N. The sampler reads whole
dense weights and this rank's E/N experts: under DDP the compute copy (no more bytes), under FSDP2 a
copy of its own in --dtype; the mismatch lab's rollout copy (--rollout_dtype other than --dtype, int8 and
fp8_e4m3 stored dequantized in --dtype; --rollout_router_fault) comes on top of either. The KV pool:
--kv_tokens positions, or RolloutConfig's num_blocks pages, or (neither given) kv_memory_fraction of what
is left, as the sampler sizes it on a GPU.
Activations and temporaries are not counted: the headroom is theirs. The start-up is flagged apart
when it exceeds the GPU: from a checkpoint folder every rank reads its dense weights and its E/N experts
in --master_dtype (the other experts never leave the disk), then FSDP2 shards them; a preset is drawn
whole on every rank (the same random bits at every EP degree), then cut to its shard.
"""
from __future__ import annotations

import dataclasses
import math
import os

import hf
from config import MODEL_PRESETS, QUANT_FORMATS, ConfigError, ModelConfig, RolloutConfig, TrainConfig, apply_overrides, parse_args

GB = 1e9
PLAN_KEYS = {"world_size": int, "gpu_memory_gb": float, "kv_tokens": int}   # --plan's own keys


@dataclasses.dataclass
class MemoryPlan:
    """Bytes on the most loaded rank (FSDP2's first shards are the largest)."""
    dense_params: int              # parameters of the model, whole
    expert_params: int
    params_per_rank: int           # this rank's share (masters, gradients, AdamW state)
    masters: int
    grads: int
    adamw: int
    compute_copy: int
    sampler_copy: int
    kv_pool: int
    kv_tokens: int
    load_peak: int = 0             # what train.setup holds on a rank before it shards (see the docstring)

    @property
    def total(self) -> int:
        return self.masters + self.grads + self.adamw + self.compute_copy + self.sampler_copy + self.kv_pool


def shard_rows(rows: int, ways: int) -> int:
    """Rows of dim 0 on the first (largest) of `ways` shards: torch.chunk's split, as FSDP2's Shard(0)."""
    return -(-rows // ways)


def memory_plan(shapes: list[tuple[tuple[int, ...], bool]], world: int, parallel: str, expert_parallel: int,
                dtype_bytes: int, sampler_bytes: int, kv_bytes_per_token: int, kv_tokens: int = 0,
                gpu_bytes: int = 0, kv_fraction: float = 0.5, kv_cap_tokens: int = 0, master_bytes: int = 4,
                sampler_apart: bool = False, from_checkpoint: bool = True) -> MemoryPlan:
    """The arithmetic. shapes: (shape, is_expert) of every parameter, experts stacked (E, ...).
    dtype_bytes: the compute dtype's size (== master_bytes: the masters compute); sampler_bytes: the
    rollout's; sampler_apart: the rollout has a copy of its own even in sampler_bytes == dtype_bytes.
    kv_tokens 0: kv_fraction of what gpu_bytes leaves, at most kv_cap_tokens. from_checkpoint: read by
    shard (else a preset, drawn whole)."""
    N, fsdp = expert_parallel, parallel == "fsdp" and world > 1
    dense = sum(math.prod(s) for s, e in shapes if not e)
    expert = sum(math.prod(s) for s, e in shapes if e)
    mine = whole_dense = local_experts = 0
    for shape, is_expert in shapes:
        rows, rest = shape[0], math.prod(shape[1:])
        if is_expert:
            rows //= N                                                   # this rank's E/N experts
            local_experts += rows * rest
        else:
            whole_dense += rows * rest
        ways = (world // N if is_expert else world) if fsdp else 1
        mine += shard_rows(rows, ways) * rest
    compute = mine * dtype_bytes if dtype_bytes != master_bytes else 0
    # FSDP2's whole-weights copy in --dtype; the lab's rollout copy (another dtype, quantized) on top of it
    whole = whole_dense + local_experts
    lab = sampler_apart or sampler_bytes != dtype_bytes
    sampler = (whole * dtype_bytes if fsdp else 0) + (whole * sampler_bytes if lab else 0)
    mb = master_bytes                                                    # AdamW's moments: the masters' dtype
    load = whole if from_checkpoint else dense + expert
    plan = MemoryPlan(dense, expert, mine, mb * mine, mb * mine, 2 * mb * mine, compute, sampler, 0, kv_tokens, load * mb)
    if not kv_tokens and gpu_bytes and kv_bytes_per_token:
        room = max(0, gpu_bytes - plan.total) * kv_fraction
        plan.kv_tokens = min(int(room // kv_bytes_per_token), kv_cap_tokens or math.inf)
    plan.kv_pool = plan.kv_tokens * kv_bytes_per_token
    return plan


def parameter_shapes(cfg: ModelConfig) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, is_expert) of every parameter of the model, from a meta-device build (no memory)."""
    import torch

    from model import Transformer
    with torch.device("meta"):
        model = Transformer(cfg)
    return [(tuple(p.shape), n.endswith((".mlp.w13", ".mlp.w2"))) for n, p in model.named_parameters()]


def model_config(init_from: str) -> ModelConfig:
    """The config --init_from names, no weights read: a checkpoint folder's config.json, or a preset's."""
    if os.path.isdir(init_from):
        return hf.config_from_hf(init_from)
    if init_from in MODEL_PRESETS:
        return ModelConfig.preset(init_from)
    if os.path.exists(init_from):
        raise ConfigError(f"--init_from={init_from!r} is a file; pass the checkpoint's folder (config.json and *.safetensors)")
    if os.sep in init_from or init_from.startswith((".", "~")):
        raise ConfigError(f"--init_from={init_from!r}: no such checkpoint folder")
    raise ConfigError(f"--init_from={init_from!r} is neither a model preset ({', '.join(MODEL_PRESETS)}) "
                      "nor a checkpoint folder")


def main(argv: list[str]) -> str:
    """`python train.py --plan ...`: the table for the command line's configs (plus --world_size,
    --gpu_memory_gb, --kv_tokens)."""
    from expert_parallel import check_degree, placement_of
    overrides = parse_args(argv)
    mine = {k: overrides.pop(k) for k in list(overrides) if k in PLAN_KEYS}
    try:
        world, gpu_gb, kv_tokens = (PLAN_KEYS[k](mine.get(k, d)) for k, d in
                                    (("world_size", os.environ.get("WORLD_SIZE", "1")), ("gpu_memory_gb", "80"),
                                     ("kv_tokens", "0")))
    except ValueError:
        raise ConfigError(f"--plan: --world_size and --kv_tokens take integers, --gpu_memory_gb a number "
                          f"(got {mine})") from None
    if world < 1 or gpu_gb <= 0 or kv_tokens < 0:
        raise ConfigError("--plan: need --world_size >= 1, --gpu_memory_gb > 0, --kv_tokens >= 0")
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    apply_overrides(overrides, tcfg, rcfg)
    cfg = model_config(tcfg.init_from)
    check_degree(tcfg.expert_parallel, cfg.num_experts, world)
    placement_of(tcfg.expert_placement, tcfg.expert_parallel, cfg.num_experts)   # the run's one-line errors
    nbytes = {"float32": 4, "bfloat16": 2, "float16": 2}
    dtype_bytes = nbytes[tcfg.dtype]
    quantized = rcfg.rollout_dtype in QUANT_FORMATS                     # stored in --dtype, dequantized
    sampler_dtype = tcfg.dtype if quantized else rcfg.rollout_dtype or tcfg.dtype
    sampler_bytes = nbytes[sampler_dtype]
    lab_copy = quantized or sampler_dtype != tcfg.dtype or rcfg.rollout_router_fault != "none"   # lab.rollout_copy
    kv_per_token = cfg.num_hidden_layers * cfg.kv_numbers_per_token * sampler_bytes
    plan = memory_plan(parameter_shapes(cfg), world, tcfg.parallel, tcfg.expert_parallel, dtype_bytes,
                       sampler_bytes, kv_per_token, kv_tokens or rcfg.num_blocks * rcfg.block_size,
                       int(gpu_gb * GB), rcfg.kv_memory_fraction,
                       rcfg.max_batch_size * cfg.max_position_embeddings, nbytes[tcfg.master_dtype], lab_copy,
                       os.path.isdir(tcfg.init_from))
    parts = [tcfg.dtype] if tcfg.parallel == "fsdp" and world > 1 else []        # FSDP2's whole copy
    if lab_copy:
        parts.append(f"{rcfg.rollout_dtype} as {tcfg.dtype}" if quantized else
                     sampler_dtype if sampler_dtype != tcfg.dtype else f"{tcfg.dtype}, its router faulted")
    return format_plan(plan, tcfg, world, gpu_gb, " + ".join(parts) or tcfg.dtype, kv_line(cfg, sampler_bytes))


def kv_line(cfg: ModelConfig, nbytes: int) -> str:
    """What the KV pool holds per token: the layers' numbers, and for MLA what per-head keys and values would."""
    per_token = cfg.num_hidden_layers * cfg.kv_numbers_per_token * nbytes
    line = (f"KV cache: {per_token:,} bytes per token ({cfg.num_hidden_layers} layers x "
            f"{cfg.kv_numbers_per_token:,} numbers")
    if not cfg.kv_lora_rank:
        return line + f": keys and values of {cfg.num_key_value_heads} heads x {cfg.head_dim})"
    expanded = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.head_dim + cfg.v_head_dim)
    return (line + f": MLA's latent {cfg.kv_lora_rank} + RoPE key {cfg.head_dim}; its {cfg.num_attention_heads} heads' "
            f"keys and values would be {expanded:,}, {expanded / cfg.kv_numbers_per_token:.1f}x as many)")


def format_plan(plan: MemoryPlan, tcfg: TrainConfig, world: int, gpu_gb: float, sampler_dtype: str,
                kv: str = "") -> str:
    layout = "FSDP2" if tcfg.parallel == "fsdp" and world > 1 else "DDP" if world > 1 else "one process"
    m = {"float32": "fp32", "bfloat16": "bf16"}[tcfg.master_dtype]
    rows = [(f"masters ({m})", plan.masters), (f"gradients ({m})", plan.grads), (f"AdamW state ({m} x 2)", plan.adamw),
            (f"compute copy ({tcfg.dtype})", plan.compute_copy), (f"sampler's copy ({sampler_dtype})", plan.sampler_copy),
            (f"KV pool ({plan.kv_tokens:,} tokens)", plan.kv_pool), ("total", plan.total)]
    fits = plan.total <= gpu_gb * GB
    lines = [f"plan: {tcfg.init_from}, {plan.dense_params / 1e9:.2f}B dense + {plan.expert_params / 1e9:.2f}B expert "
             f"parameters; {world} rank(s), {layout}, --expert_parallel={tcfg.expert_parallel}, --dtype={tcfg.dtype}",
             f"per rank: {plan.params_per_rank / 1e9:.2f}B parameters"]
    lines += [f"  {name:<44} {b / GB:9.2f} GB" for name, b in rows]
    lines += [kv] if kv else []
    lines.append(f"{'fits' if fits else 'does not fit'} in {gpu_gb:g} GB per GPU "
                 f"({(gpu_gb * GB - plan.total) / GB:+.2f} GB left for activations and temporaries)")
    if plan.load_peak > gpu_gb * GB and os.path.isdir(tcfg.init_from):
        lines.append(f"start-up: every rank loads its dense weights and experts whole, {plan.load_peak / GB:.2f} GB "
                     f"in --master_dtype (more than {gpu_gb:g} GB), before FSDP2 shards them")
    elif plan.load_peak > gpu_gb * GB:
        lines.append(f"start-up: a preset is drawn whole on every rank, {plan.load_peak / GB:.2f} GB in --master_dtype "
                     f"(more than {gpu_gb:g} GB); a checkpoint folder of it is read by shard")
    return "\n".join(lines)
