"""The memory plan: bytes per rank of a training run, before anything is loaded.

    python train.py --plan --init_from=qwen3-30b-a3b --world_size=8 --parallel=fsdp --expert_parallel=8 \
        --dtype=bfloat16 --gpu_memory_gb=80

It prints the table and a verdict; a run that does not fit ends in one `error:` line (exit status 1).

The weights' state (fp32-master mixed precision): fp32 masters (4 bytes a parameter), fp32 gradients (4),
AdamW's two fp32 moments (8); with --dtype=bfloat16 a bf16 compute copy (2) cast from the masters (with
float32 the masters are the compute weights). --master_dtype=bfloat16 stores all four in bf16 (2 + 2 + 4,
no compute copy: the masters compute). Dense parameters (attention, router, norms, embeddings,
shared experts) are whole on every rank under DDP and sharded over the world under FSDP2; expert
parameters are divided by --expert_parallel=N, and under FSDP2 also by world / N. The sampler reads whole
dense weights and this rank's E/N experts: under DDP the compute copy (no more bytes), under FSDP2 a
copy of its own in --dtype, the one kept: FSDP2's trainer has no compute copy but what its all-gathers
hold at once, cast from the shards as they go (the root group's embeddings and head, kept from the forward
to the end of the backward, and two blocks: the one computing and the next, prefetched); the mismatch
lab's rollout copy (--rollout_dtype other than --dtype, int8 and fp8_e4m3 stored dequantized in --dtype;
--rollout_router_fault) comes on top of either. --kl_coef > 0
adds the reference policy: whole dense weights and E/N experts in --dtype. --grad_reduce=exact (the
default) adds its int64 accumulators: 16 bytes an element of this rank's share, and of its E/N experts
whole under EP, also when FSDP2 shards them over their replicas (exact_sum.Reducer.reserve_bytes);
none when every sum has one term (one process, a minibatch in one micro-batch: plan.one_term).
--offload_optimizer (memory/offload.py) moves the masters, gradients, AdamW state and exact sums to the
host (their own rows, "on the host"), and keeps a compute copy on the GPU also where the masters' dtype
computes; the start-up then shards on the host.

The rollout: the KV pool holds --kv_tokens positions, else --num_blocks pages, else what this rank's
rollout needs: its S = prompts_per_step / world x group_size sequences at the run's longest, L = the
longest prompt + the response limit (each rounded up to whole pages), so no sequence is preempted. A
position costs 2 x layers x KV heads x head_dim in the rollout's dtype, plus its routes (n_moe x top_k
ids, 1 byte each, 2 past 256 experts; --record_route_detail: 4 (top_k + 1) more). Beside the pool the
sampler keeps (max_batch_size + 1) rows x (L + 1) positions of token ids and log-probs (12 bytes each).

Activations: the larger of the trainer's and the sampler's (the phases of a step run one after the
other), with D = hidden_size, Q = heads x head_dim, K = KV heads x head_dim, k = top_k, I the
intermediate size of the layer's experts (dense MLP: intermediate_size), V = vocab_size, E = experts:
* the trainer keeps, for the backward, A bytes per token of its largest micro-batch of M tokens (packed:
  min(--micro_batch_tokens, a minibatch's sequences x L), at least one whole sequence, at most
  --micro_batch_size sequences; padded: --micro_batch_size (else the rank's minibatch) rows x L), plus
  the logits of min(M, --logits_chunk) positions: on the torch backend 4 fp32 copies (logits, log-softmax,
  its exp and the entropy's product: 16 V bytes a position), on Triton 2 in --dtype (logits, their grad);
  A sums over the layers, in bytes per token (b: --dtype's bytes):
    torch (every op computes in fp32, so the counts are 4-byte values at either --dtype; each matmul
    keeps an fp32 copy of its input, each RMSNorm its input and output, SwiGLU its five fp32 temporaries):
      attention 8D + 6Q + 5K (norms, q/k/v/o inputs, q/k norms, RoPE, the block layout) + the key tiles
        (below); MoE layer k (2D + 6I) + 4E + D (router); dense layer 2D + 6I; then 3D + head_dim.
      key tiles (packed attention walks each 16-position query block over the 16-key tiles up to its
        own, keeping every tile's scores): per token ((H (48 head_dim + 592) + 64 H / K-heads) n (n + 1) / 2
        + 32 H head_dim n) / L, n = ceil(L / 16) blocks of a sequence.
    triton (the kernels keep their inputs and recompute inside the backward; RoPE, the router's fp32
    softmax and a dense SwiGLU are torch ops): b (4D + 4Q + 3K + p (2Q + 2K)) + 4 (Q + K) a layer, p the
    padding of a sequence to whole 64-position query blocks; MoE + 12E + 16 + 8k (the routing plan);
    dense + 3bI + 4I (3 in fp32, 5 in bf16: SwiGLU's fp32 temporaries); then 2bD;
  with --activation_checkpointing a recomputed block (full) or MoE layer (moe) keeps only its input, bD
  a token, and the backward holds the largest recomputed one's whole terms once more;
* the sampler, with no gradient, holds one layer's temporaries at a time: P tokens of a prefill (P =
  min(max_num_batched_tokens, S x the longest prompt)) or R = min(max_batch_size, S) decode rows, 4 bytes
  x (k (3I + 2D) + 6D + 2 (Q + 2K)) a token, plus 16 V bytes of logits for each of its rows.
The phases come one after the other, so the total counts the largest: the trainer's (its activations,
and the exact sums' conversion of a gradient in flight: 24 bytes an element of the largest tensor), the
sampler's, or the optimizer step's temporaries (AdamW's foreach: one tensor the size of a moment; the
norm's fp64 rows and the gradient scan's int32 buffer of the largest tensor: 12 bytes an element); with
--offload_optimizer the step's and the conversion's are the host's.
The real peak also holds allocator slack and the runtime's own (on the CPU, about 50 MB): tests/test_plan.py
holds the formula against the bytes autograd saves (both backends) and the whole plan against a training
run's peak memory at two sizes, and within 10% at three memory settings (docs/results.md, "Memory plan").

Where the run does not fit, the verdict names the fewest of --offload_optimizer, --activation_checkpointing
=full, --grad_reduce=fast and --master_dtype=bfloat16 that would make it fit (those that keep the run's
bits first), or says that none does. A GPU run checks its own plan before loading (Preflight).
The synchronous loop frees the KV pool while the update runs (rollout.Sampler.release_kv): the pool is then
part of the sampler's phase, not beside the trainer's. On a GPU the sampler takes --kv_memory_fraction of
the memory it finds free for its pool (at least what is counted here).

The start-up: every rank holds its dense weights and its E/N experts in --master_dtype on the GPU before
FSDP2 shards them (from a checkpoint folder only those are read from disk); that peak must fit too. A
preset is drawn whole on every rank's host (CPU) memory first, then cut to its experts: said on a line of
its own.
"""
from __future__ import annotations

import dataclasses
import math
import os

from config import ConfigError, ModelConfig, RolloutConfig, TrainConfig, apply_command_line, parse_args
from support.checkpoint import model_config
from support.hooks import Hooks

GB = 1e9
# --plan's own keys: type, default, what it says
PLAN_KEYS = {
    "world_size": (int, None, "ranks of the planned run (default: $WORLD_SIZE, else 1)"),
    "gpu_memory_gb": (float, 80.0, "memory per GPU, in GB of 1e9 bytes"),
    "kv_tokens": (int, 0, "KV-pool positions per rank; 0: --num_blocks pages, else the rollout's own need "
                          "(its sequences x the longest prompt + the response limit)"),
}
TILE = 16                       # kernels.KV_BLOCK and ATTN_ROWS: the torch attention's key and query tiles


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
    load_peak: int = 0             # the start-up on a rank before FSDP2 shards: dense + E/N experts, --master_dtype
    host_peak: int = 0             # a preset drawn whole on the host before it is cut (0: a checkpoint folder)
    reference: int = 0             # --kl_coef's frozen reference policy
    buffers: int = 0               # the sampler's per-row token ids and log-probs
    grad_sums: int = 0             # --grad_reduce=exact's int64 accumulators (exact_sum.Reducer.reserve_bytes)
    activations: "Activations | None" = None
    offload: bool = False          # --offload_optimizer: masters, gradients, AdamW state and exact sums on the host
    kv_released: bool = False      # the synchronous loop: the KV pool is freed while the update runs
    reduce_on_device: bool = False   # FSDP2: the reduction in flight is on the GPU, also with offload
    largest_group: int = 0         # FSDP2: its largest group (root or block) whole, in --master_dtype
    sum_temps: int = 0             # exact sums: a gradient's conversion in flight (fp64 copy, two limbs: 24 bytes an
                                   # element of the largest tensor), during the backward
    step_temps: int = 0            # the step: AdamW's (foreach: one tensor the size of the state's moment), and the
                                   # norm's fp64 rows and the gradient scan's int32 buffer of the largest tensor
    frozen: int = 0                # --lora_rank: the frozen base in --dtype, one copy the trainer and the sampler read
    frozen_params: int = 0         # its parameters (whole); the fields above are then the adapters'
    states: int = 0                # hybrids/: the sampler rows' Gated DeltaNet state (freed with the KV pool)

    @property
    def optimizer(self) -> int:
        """The optimizer's own: masters, gradients, moments, exact sums (on the host with --offload_optimizer)."""
        return self.masters + self.grads + self.adamw + self.grad_sums

    @property
    def host(self) -> int:
        """What the host holds for the optimizer (--offload_optimizer), its phases' temporaries too; else 0."""
        host_sums = 0 if self.reduce_on_device else self.sum_temps
        # LoRA: the masters' model keeps its frozen base on the host too (the device's is a copy of it)
        return self.optimizer + self.frozen + max(host_sums, self.step_temps) if self.offload else 0

    @property
    def phase(self) -> int:
        """The GPU's largest phase, one after the other: the sampler's (its activations, and the KV pool where
        the update frees it), the trainer's activations (and, on the GPU, the exact sums' conversion), the
        optimizer step's temporaries (on the GPU)."""
        act = self.activations or Activations(0, 0, 0, 0)
        sampler = act.sampler + (self.kv_pool + self.states if self.kv_released else 0)
        on_device = self.sum_temps if self.reduce_on_device or not self.offload else 0
        train, step = act.train + on_device, 0 if self.offload else self.step_temps
        return max(sampler, train, step)

    @property
    def total(self) -> int:
        """The GPU's bytes."""
        return ((0 if self.offload else self.optimizer) + self.frozen + self.compute_copy + self.sampler_copy + self.reference
                + (0 if self.kv_released else self.kv_pool + self.states) + self.buffers + self.phase)


@dataclasses.dataclass
class Activations:
    """What the forwards hold besides the weights and the KV pool: the trainer's, the sampler's."""
    train_tokens: int              # M: the largest micro-batch
    train: int                     # its bytes kept for the backward, logits included
    sampler_tokens: int            # P or R: the largest prefill or decode step
    sampler: int

    @property
    def peak(self) -> int:
        return max(self.train, self.sampler)


def shard_rows(rows: int, ways: int) -> int:
    """Rows of dim 0 on the first (largest) of `ways` shards: torch.chunk's split, as FSDP2's Shard(0)."""
    return -(-rows // ways)


def memory_plan(shapes: list[tuple[tuple[int, ...], bool]], world: int, parallel: str, expert_parallel: int,
                dtype_bytes: int, sampler_bytes: int, kv_bytes_per_token: int, kv_tokens: int = 0,
                gpu_bytes: int = 0, kv_fraction: float = 0.5, kv_cap_tokens: int = 0, master_bytes: int = 4,
                sampler_apart: bool = False, from_checkpoint: bool = True, exact: bool = False,
                offload: bool = False, groups: tuple[int, int] = (0, 0)) -> MemoryPlan:
    """The weights' arithmetic. shapes: (shape, is_expert) of every parameter, experts stacked (E, ...).
    dtype_bytes: the compute dtype's size (== master_bytes: the masters compute); sampler_bytes: the
    rollout's; sampler_apart: the rollout has a copy of its own even in sampler_bytes == dtype_bytes.
    kv_tokens 0: kv_fraction of what gpu_bytes leaves, at most kv_cap_tokens (how the sampler sizes its
    pool on a GPU). from_checkpoint: read by shard (else a preset, drawn whole on the host). exact:
    --grad_reduce=exact's accumulators, 16 bytes an element of this rank's share, its E/N experts whole
    under EP (exact_sum.Reducer.reserve_bytes). offload: the masters, gradients, AdamW's state and the
    exact sums on the host (MemoryPlan.host), a compute copy on the GPU also when the masters' dtype
    computes (memory/offload.py). groups (FSDP2, gathered_groups): the elements of its root group and of
    its largest block, unsharded; FSDP2 casts each shard to --dtype as it gathers it, so the root and two
    blocks in --dtype are the trainer's compute copy: there is no copy of the shards (the sampler's whole
    copy is the one kept); a block's fp32 gradients (and exact: the limbs of a piece of them,
    parallel/fsdp.ExactReduceScatter.CHUNK elements a rank) are its reduction in flight."""
    N, fsdp = expert_parallel, parallel == "fsdp" and world > 1
    dense = sum(math.prod(s) for s, e in shapes if not e)
    expert = sum(math.prod(s) for s, e in shapes if e)
    mine = whole_dense = local_experts = sums = largest = largest_sum = 0
    for shape, is_expert in shapes:
        rows, rest = shape[0], math.prod(shape[1:])
        if is_expert:
            rows //= N                                                   # this rank's E/N experts
            local_experts += rows * rest
        else:
            whole_dense += rows * rest
        ways = (world // N if is_expert else world) if fsdp else 1
        mine += shard_rows(rows, ways) * rest
        summed = shard_rows(rows, ways) * rest if not (is_expert and N > 1) else rows * rest   # an EP shard: whole
        sums += summed
        largest, largest_sum = max(largest, shard_rows(rows, ways) * rest), max(largest_sum, summed)
    compute = mine * dtype_bytes if dtype_bytes != master_bytes or offload else 0
    root, block = groups
    if fsdp:
        compute = (root + 2 * block) * dtype_bytes
    # FSDP2's whole-weights copy in --dtype; the lab's rollout copy (another dtype, quantized) on top of it
    whole = whole_dense + local_experts
    lab = sampler_apart or sampler_bytes != dtype_bytes
    sampler = (whole * dtype_bytes if fsdp else 0) + (whole * sampler_bytes if lab else 0)
    mb = master_bytes                                                    # AdamW's moments: the masters' dtype
    plan = MemoryPlan(dense, expert, mine, mb * mine, mb * mine, 2 * mb * mine, compute, sampler, 0, kv_tokens,
                      whole * mb, 0 if from_checkpoint else (dense + expert) * mb)
    plan.grad_sums = 16 * sums if exact else 0
    plan.offload = offload
    plan.sum_temps = 24 * largest_sum if exact else 0
    if fsdp:         # a block's unsharded fp32 gradients, reduce-scattered (exact: as limbs, a piece at a time)
        from parallel.fsdp import ExactReduceScatter
        piece = min(block, world * ExactReduceScatter.CHUNK)
        plan.sum_temps, plan.reduce_on_device = 4 * block + (24 * piece if exact else 0), True
        plan.largest_group = max(root, block) * mb
    plan.step_temps = mb * mine + 12 * largest
    if not kv_tokens and gpu_bytes and kv_bytes_per_token:
        room = max(0, gpu_bytes - plan.total) * kv_fraction
        plan.kv_tokens = min(int(room // kv_bytes_per_token), kv_cap_tokens or math.inf)
    plan.kv_pool = plan.kv_tokens * kv_bytes_per_token
    return plan


# ---------------------------------------------------------------------------------------------------
# activations (the docstring's formula)
# ---------------------------------------------------------------------------------------------------
def layer_widths(cfg: ModelConfig) -> tuple[int, int, int]:
    """(D, Q, K): the hidden size, the query heads' and the KV heads' widths."""
    return cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim


def mlp_terms(cfg: ModelConfig, layer: int) -> tuple[int, int, int]:
    """(routed slots, their I, the dense width) of a layer's MLP: top_k experts of moe_intermediate_size
    and the shared experts' width (MoE), or none and intermediate_size (dense)."""
    if not cfg.is_moe_layer(layer):
        return 0, 0, cfg.intermediate_size
    shared = cfg.n_shared_experts * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size
    return cfg.num_experts_per_tok, cfg.moe_intermediate_size, shared


def train_bytes_per_token(cfg: ModelConfig, backend: str, dtype_bytes: int, seq_len: int,
                          recompute: str = "none", frozen_norms: bool = False) -> float:
    """A: what the trainer's forward keeps for the backward per token, over every layer (the docstring).
    recompute (--activation_checkpointing): a recomputed block (full) or MoE layer (moe) keeps its input
    alone, b D, and the backward holds one of them whole again at a time (the largest). frozen_norms
    (--lora_rank): the torch RMSNorm's normalised output is kept only for its weight's gradient, so a
    frozen norm keeps 4 D (4 Q + 4 K for q and k's norms) a token less."""
    D, Q, K = layer_widths(cfg)
    norms = 4 * (2 * D + (Q + K if cfg.qk_norm != "none" else 0)) if frozen_norms and backend == "torch" else 0
    kept = again = 0.0
    for layer in range(cfg.num_hidden_layers):
        attn, mlp = layer_bytes(cfg, backend, dtype_bytes, seq_len, layer)
        attn -= norms
        if recompute == "full":
            kept, again = kept + dtype_bytes * D, max(again, attn + mlp)
        elif recompute == "moe" and cfg.is_moe_layer(layer):
            kept, again = kept + attn + dtype_bytes * D, max(again, mlp)
        else:
            kept += attn + mlp
    final = 4 * ((2 if norms else 3) * D + cfg.head_dim) if backend == "torch" else 2 * dtype_bytes * D
    return kept + again + final


def layer_bytes(cfg: ModelConfig, backend: str, b: int, seq_len: int, layer: int) -> tuple[float, float]:
    """(attention and the norms, the MLP) of one layer's A, per token; a Gated DeltaNet layer's mixer
    (hybrids/) is gdn_bytes' in place of attention's."""
    D, Q, K = layer_widths(cfg)
    slots, I, dense = mlp_terms(cfg, layer)
    router = cfg.is_moe_layer(layer)
    # hybrids/' gated attention: the gate's half of q_proj and its fp32 sigmoid and product (measured on the CPU:
    # 20.25 Q bytes a token in fp32, 24 Q in bf16, over the plain attention's)
    gate = (20 if b == 4 else 24) * Q if cfg.layer_types and cfg.layer_types[layer] == "gated_attention" else 0
    if backend == "torch":                                           # 4-byte values
        attn = 4 * 2 * D + gdn_bytes(cfg, b, backend) if cfg.is_linear(layer) else \
            4 * (8 * D + 6 * Q + 5 * K + key_tiles(cfg, seq_len)) + gate
        return (attn, 4 * (slots * (2 * D + 6 * I) + (4 * cfg.num_experts + D if router else 0)
                           + (2 * D + 6 * dense if dense else 0)))
    attn, mlp = triton_layer_bytes(cfg, b, seq_len, slots, dense, router)
    return (b * 2 * D + gdn_bytes(cfg, b, backend) if cfg.is_linear(layer) else attn + gate), mlp


def gdn_bytes(cfg: ModelConfig, b: int, backend: str) -> float:
    """What a Gated DeltaNet layer's forward keeps for the backward per token (hybrids/gdn.py; the chunks are
    recomputed, so the chunk kernel's C x C matrices are not kept), counted from its saved tensors on the CPU:
    the projections' inputs (the torch backend's fp32 copies padded to 32-row chunks; a Triton GEMM keeps x
    and the output side's input), the conv's fp32 input and silu (16 conv_dim), the value-wide fp32 chain of
    the output (norm, gate: 30 V, and 2 V in the model dtype), the chunks' q and k (8 H dk), a chunk's start
    state per 64 positions (H dk dv / 16) and the gates' small terms (44 H)."""
    D, H, dk = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_key_head_dim
    V = H * cfg.linear_value_head_dim
    conv = 2 * cfg.linear_num_key_heads * dk + V
    linear = 4.25 * (4 * D + V) if backend == "torch" else b * (D + V)
    return linear + 16 * conv + 30 * V + 2 * b * V + 8 * H * dk + H * dk * cfg.linear_value_head_dim / 16 + 44 * H


def triton_layer_bytes(cfg: ModelConfig, b: int, seq_len: int, slots: int, dense: int,
                       router: bool) -> tuple[float, float]:
    """One layer on the Triton backend, per token, (attention and the norms, the MLP): the kernels keep
    their inputs (the norms' and the projections', the attention's q, k, v and output in its query-block
    layout, padded to whole blocks of triton_query_block() positions), the fused MoE its routing plan
    (16 + 8 k bytes) and recomputes the experts; RoPE (fp32 input), the router's fp32 softmax (12 E) and
    a dense SwiGLU (fp32 temporaries) are torch ops."""
    D, Q, K = layer_widths(cfg)
    blk = triton_query_block()
    pad = -(-seq_len // blk) * blk / seq_len
    attn = b * (4 * D + 4 * Q + 3 * K + pad * (2 * Q + 2 * K)) + 4 * (Q + K)
    mlp = 0.0
    if router:
        mlp += 12 * cfg.num_experts + 16 + 8 * slots
    if dense:
        mlp += b * 3 * dense + 4 * dense * (5 if b < 4 else 3)      # bf16: fp32 copies of gate and up too
    return attn, mlp


def triton_query_block() -> int:
    """The Triton forward's query rows per program, the packed layout's block (kernels.packed_block)."""
    try:
        from kernels_triton import ops as kernels_triton
    except ImportError:                                              # no triton here: its table's value
        return 64
    return max(16, kernels_triton.ATTN_TABLE["fwd"][0])


def key_tiles(cfg: ModelConfig, seq_len: int) -> float:
    """The torch attention's tiles per token (4-byte values): query block j of a sequence walks key tiles
    0..j, keeping per tile and head 16 x 16 scores and their exp, the key and value chunks and the running
    output (16 (48 head_dim + 592) values, with the mask and row statistics); per block and head its
    scaled queries and output (32 head_dim)."""
    n = -(-seq_len // TILE)                                          # query blocks of the sequence
    H, G, hd = cfg.num_attention_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    walks = n * (n + 1) / 2                                          # (block, tile) pairs
    return ((H * (48 * hd + 592) + 64 * G) * walks + 32 * H * hd * n) / seq_len


def logits_bytes(cfg: ModelConfig, backend: str, dtype_bytes: int, rows: int) -> int:
    return rows * cfg.vocab_size * (16 if backend == "torch" else 2 * dtype_bytes)


def sampler_bytes_per_token(cfg: ModelConfig) -> int:
    """One layer's temporaries per token of a no-grad forward (the largest layer's)."""
    D, Q, K = layer_widths(cfg)
    worst = max(slots * (3 * I + 2 * D) + 3 * dense for slots, I, dense in
                (mlp_terms(cfg, i) for i in range(cfg.num_hidden_layers)))
    return 4 * (worst + 6 * D + 2 * (Q + 2 * K))


def activations(cfg: ModelConfig, tcfg: TrainConfig, rcfg: RolloutConfig, backend: str, world: int,
                prompt_len: int, max_new: int) -> Activations:
    """The trainer's largest micro-batch and the sampler's largest step, in bytes (the docstring's formula)."""
    L = prompt_len + max_new
    seqs = tcfg.prompts_per_step // world * tcfg.group_size          # this rank's rollout batch
    mb_seqs = min(tcfg.minibatch_size // world, seqs)
    if tcfg.micro_batch_tokens:                                      # packed: whole sequences up to the budget
        cap = tcfg.micro_batch_size or mb_seqs
        M = min(mb_seqs * L, cap * L, max(tcfg.micro_batch_tokens, L))
    else:                                                            # padded: rows x the longest
        M = (tcfg.micro_batch_size or mb_seqs) * L
    b = {"float32": 4, "bfloat16": 2}[tcfg.dtype]
    recompute = getattr(tcfg, "activation_checkpointing", "none")   # memory/'s option ("none" without it)
    frozen = bool(getattr(tcfg, "lora_rank", 0))                     # lora/'s: the norms frozen
    train = M * train_bytes_per_token(cfg, backend, b, L, recompute, frozen)
    train += logits_bytes(cfg, backend, b, min(M, tcfg.logits_chunk or M))
    prefill = min(rcfg.max_num_batched_tokens, seqs * prompt_len)
    decode = min(rcfg.max_batch_size, seqs)
    per = sampler_bytes_per_token(cfg)
    sampler = max(prefill * per + logits_bytes(cfg, "torch", b, min(prefill, seqs)),
                  decode * per + logits_bytes(cfg, "torch", b, decode))
    return Activations(M, int(train), max(prefill, decode), int(sampler))


# ---------------------------------------------------------------------------------------------------
# the run's shapes: the model, the rollout's lengths
# ---------------------------------------------------------------------------------------------------
def named_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the model, from a meta-device build (no memory)."""
    import torch

    from model import Transformer
    with torch.device("meta"):
        model = Transformer(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def parameter_shapes(cfg: ModelConfig, named: list | None = None) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, is_expert) of every parameter of the model (named: named_shapes(cfg), if made already)."""
    from parallel.expert_parallel import is_expert
    return [(shape, is_expert(n)) for n, shape in named or named_shapes(cfg)]


def gathered_groups(cfg: ModelConfig, expert_parallel: int, named: list | None = None) -> tuple[int, int]:
    """FSDP2's groups, unsharded, in elements: (the root group's: embeddings, final norm, head, gathered
    for the forward and kept until the backward is done; the largest block's, with this rank's E/N
    experts whole). named: named_shapes(cfg), if made already."""
    from parallel.expert_parallel import is_expert
    blocks = [0] * cfg.num_hidden_layers
    root = 0
    for name, shape in named or named_shapes(cfg):
        n = math.prod(shape) // expert_parallel if is_expert(name) else math.prod(shape)
        if name.startswith("layers."):
            blocks[int(name.split(".")[1])] += n
        else:
            root += n
    return root, max(blocks)


def run_lengths(tcfg: TrainConfig, rcfg: RolloutConfig) -> tuple[int, int]:
    """(the longest prompt, the response limit) of the run: a digit task's are fixed; --task=jsonl's
    prompts are tokenized (as the run formats them), which needs --data and --tokenizer."""
    from support.tasks import JSONL_MAX_NEW_TOKENS, load_chat_template, load_tokenizer, read_jsonl
    if tcfg.task != "jsonl":
        return tcfg.n_digits + 2, rcfg.max_new_tokens or tcfg.n_digits + 1
    if not (tcfg.data and tcfg.tokenizer):
        raise ConfigError("--plan with --task=jsonl sizes the rollout from the prompts: pass --data and --tokenizer "
                          "(or --kv_tokens=N and --max_new_tokens)")
    tok = load_tokenizer(tcfg.tokenizer)
    render = (load_chat_template([os.path.dirname(os.path.abspath(tcfg.tokenizer))], tcfg.system_prompt)
              if tcfg.chat_template else None)
    texts = [render(r["prompt"]) if render else r["prompt"] for r in read_jsonl(tcfg.data)]
    longest = max(len(tok.encode(t, add_special_tokens=render is None).ids) for t in texts)
    return longest, rcfg.max_new_tokens or JSONL_MAX_NEW_TOKENS


def preset_or_folder(tcfg: TrainConfig) -> ModelConfig:
    """The model the run would build: the preset with its command-line fields and --vocab_size=N, or the folder's."""
    cfg = tcfg.preset_config()
    if cfg is None:
        return model_config(tcfg.init_from)
    return dataclasses.replace(cfg, vocab_size=int(tcfg.vocab_size)) if tcfg.vocab_size.isdigit() else cfg


# ---------------------------------------------------------------------------------------------------
# python train.py --plan ...
# ---------------------------------------------------------------------------------------------------
def plan_options(overrides: dict[str, str]) -> tuple[int, float, int]:
    """--plan's own keys out of the command line (popped): world_size, gpu_memory_gb, kv_tokens."""
    raw = {k: overrides.pop(k) for k in list(overrides) if k in PLAN_KEYS}
    raw.setdefault("world_size", os.environ.get("WORLD_SIZE", "1"))
    try:
        world, gpu_gb, kv_tokens = (PLAN_KEYS[k][0](raw.get(k, PLAN_KEYS[k][1])) for k in PLAN_KEYS)
    except ValueError:
        raise ConfigError(f"--plan: --world_size and --kv_tokens take integers, --gpu_memory_gb a number "
                          f"(got {raw})") from None
    if world < 1 or gpu_gb <= 0 or kv_tokens < 0:
        raise ConfigError("--plan: need --world_size >= 1, --gpu_memory_gb > 0, --kv_tokens >= 0")
    return world, gpu_gb, kv_tokens


def backend_of(tcfg: TrainConfig) -> str:
    """The kernels the run would use: --kernels_backend (or KERNELS_BACKEND), else Triton on a GPU and torch
    with --device=cpu."""
    chosen = tcfg.kernels_backend or os.environ.get("KERNELS_BACKEND", "auto")
    if chosen != "auto":
        return chosen
    return "torch" if tcfg.device == "cpu" else "triton"


def main(argv: list[str]) -> tuple[str, bool]:
    """The table for the command line's configs (plus PLAN_KEYS), and whether the run fits (if not, the
    verdict names the memory options that would make it fit, or says none can)."""
    overrides = parse_args(argv)
    world, gpu_gb, kv_tokens = plan_options(overrides)
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    apply_command_line(overrides, tcfg, rcfg)
    plan, copy, kv = plan_of(tcfg, rcfg, world, kv_tokens)
    table, fits = format_plan(plan, tcfg, world, gpu_gb, copy, backend_of(tcfg), kv)
    if not fits:
        lines = table.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("does not fit"))
        lines[at] += "; " + what_would_fit(tcfg, rcfg, world, gpu_gb, kv_tokens)
        table = "\n".join(lines)
    return table, fits


# the settings that trade memory, the run's bits kept first: (option, value, what it costs)
REMEDIES = [("offload_optimizer", True, "the same update, on the host"),
            ("activation_checkpointing", "full", "the same bits"),
            ("grad_reduce", "fast", "the bits then follow the world size"),
            ("master_dtype", "bfloat16", "updates below half a bf16 ulp are lost")]


def what_would_fit(tcfg: TrainConfig, rcfg: RolloutConfig, world: int, gpu_gb: float, kv_tokens: int) -> str:
    """The fewest REMEDIES (those not set already, whose plug-in is there) that make the plan fit, bits-keeping
    ones first, up to three such sets; or that none does."""
    import itertools
    free = [(k, v, why) for k, v, why in REMEDIES if hasattr(tcfg, k) and getattr(tcfg, k) != v
            and not (k == "master_dtype" and tcfg.dtype == "float32")]
    found = []
    for n in range(1, len(free) + 1):
        for chosen in itertools.combinations(free, n):
            try:
                changed = dataclasses.replace(tcfg, **{k: v for k, v, _ in chosen})
            except ConfigError:                                      # a pair the options refuse
                continue
            plan, _, _ = plan_of(changed, rcfg, world, kv_tokens)
            need = peak_bytes(plan, changed, world)
            if need <= gpu_gb * GB:
                options = " ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v, _ in chosen)
                costs = sorted({why for _, _, why in chosen if why != "the same bits"}) or ["the same bits"]
                found.append(f"{options} ({need / GB:.2f} GB; "
                             f"{', '.join(costs)})")
        if found:
            return "it fits with " + " or ".join(found[:3])
    names = ", ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v, _ in free)
    return (f"no setting of {names} makes it fit: more ranks, a larger --expert_parallel or larger GPUs"
            if names else "more ranks, a larger --expert_parallel or larger GPUs")


def plan_of(tcfg: TrainConfig, rcfg: RolloutConfig, world: int, kv_tokens: int = 0) -> tuple[MemoryPlan, str, str]:
    """The plan of these configs at `world` ranks -> (the plan, the sampler copy's dtypes, the KV line)."""
    from parallel import eplb
    from parallel.expert_parallel import check_degree, placement_of
    cfg = preset_or_folder(tcfg)
    check_degree(tcfg.expert_parallel, cfg.num_experts, world)
    placement_of(tcfg.expert_placement, tcfg.expert_parallel, cfg.num_experts)   # the run's one-line errors
    eplb.check(tcfg.eplb_redundant, tcfg.expert_parallel, cfg.num_experts)
    if tcfg.prompts_per_step % world:
        raise ConfigError(f"prompts_per_step ({tcfg.prompts_per_step}) must be divisible by --world_size ({world})")
    nbytes = {"float32": 4, "bfloat16": 2, "float16": 2}
    rollout_dtype, fault = lab_options(rcfg)
    quantized = getattr(rcfg, "quantized", False)                      # stored in --dtype, dequantized
    sampler_dtype = tcfg.dtype if quantized else rollout_dtype or tcfg.dtype
    lab_copy = (quantized or sampler_dtype != tcfg.dtype or fault != "none"         # lab.rollout_copy
                or getattr(rcfg, "rollout_linear_decode", "grid") != "grid")
    prompt_len, max_new = run_lengths(tcfg, rcfg)
    kv_per_token = kv_bytes_per_token(cfg, nbytes[sampler_dtype], rcfg.record_route_detail)
    need = rollout_positions(tcfg, rcfg, world, prompt_len + max_new)
    act = activations(cfg, tcfg, rcfg, backend_of(tcfg), world, prompt_len, max_new)
    named = trained = named_shapes(cfg)
    frozen = []
    if getattr(tcfg, "lora_rank", 0):                  # lora/'s option, where it is: the adapters train, the base not
        from lora.adapters import adapted_shapes
        trained, frozen = adapted_shapes(cfg, tcfg)
    plan = memory_plan(parameter_shapes(cfg, trained), world, tcfg.parallel, tcfg.expert_parallel, nbytes[tcfg.dtype],
                       nbytes[sampler_dtype], kv_per_token, kv_tokens or rcfg.num_blocks * rcfg.block_size or need,
                       master_bytes=nbytes[tcfg.master_dtype], sampler_apart=lab_copy,
                       from_checkpoint=os.path.isdir(tcfg.init_from),
                       exact=tcfg.grad_reduce == "exact" and not one_term(tcfg, world, act, prompt_len + max_new),
                       offload=getattr(tcfg, "offload_optimizer", False),          # memory/'s option, where it is
                       groups=gathered_groups(cfg, tcfg.expert_parallel, named))
    from parallel.expert_parallel import is_expert
    plan.frozen_params = sum(math.prod(shape) for _, shape in frozen)
    base = sum(math.prod(shape) // (tcfg.expert_parallel if is_expert(n) else 1) for n, shape in frozen)
    plan.frozen = base * nbytes[tcfg.dtype]
    plan.sampler_copy += plan.frozen if lab_copy else 0               # the lab's copy copies the base too
    whole = plan.load_peak // nbytes[tcfg.master_dtype] + base          # dense + this rank's experts
    plan.reference = whole * nbytes[tcfg.dtype] if tcfg.kl_coef > 0 else 0
    plan.buffers = (rcfg.max_batch_size + 1) * (prompt_len + max_new + 1) * 12
    snapshots = rcfg.state_snapshots if rcfg.prefix_cache else 0        # the prefix cache's boundary states
    plan.states = (rcfg.max_batch_size + 1) * state_bytes_per_sequence(cfg, nbytes[sampler_dtype]) + snapshots * \
        state_bytes_per_sequence(cfg, nbytes[sampler_dtype], snapshot=True) if paged_layers(cfg) < cfg.num_hidden_layers else 0
    plan.activations = act
    plan.kv_released = not (any(getattr(tcfg, k, 0) for k in ("max_staleness", "partial_rollout", "rollout_ranks"))
                            or getattr(rcfg, "rollout_episode_fault", "") == "stale_prefix_kv")   # its cache stays
    parts = [tcfg.dtype] if tcfg.parallel == "fsdp" and world > 1 else []        # FSDP2's whole copy
    if lab_copy:
        parts.append(f"{rollout_dtype} as {tcfg.dtype}" if quantized else
                     sampler_dtype if sampler_dtype != tcfg.dtype else f"{tcfg.dtype}, its router faulted")
    return plan, " + ".join(parts) or tcfg.dtype, kv_line(cfg, nbytes[sampler_dtype])


def peak_bytes(plan: MemoryPlan, tcfg: TrainConfig, world: int) -> int:
    """What the GPU must hold: the run's total, or the start-up's where that is more."""
    return max(plan.total, startup_bytes(plan, tcfg, world))


def startup_bytes(plan: MemoryPlan, tcfg: TrainConfig, world: int) -> int:
    """The GPU's start-up peak: FSDP2 shards a model first held whole (dense and this rank's experts) on
    each GPU; with the masters on the host (--offload_optimizer) it moves one group at a time to the GPU to
    shard it (the largest: the root's embeddings and head, or a block), in --master_dtype."""
    if not (tcfg.parallel == "fsdp" and world > 1):
        return 0
    return plan.largest_group if plan.offload else plan.load_peak


def lab_options(rcfg: RolloutConfig) -> tuple[str, str]:
    """--rollout_dtype and --rollout_router_fault: the lab's options ('' and none where lab/ was deleted)."""
    return getattr(rcfg, "rollout_dtype", ""), getattr(rcfg, "rollout_router_fault", "none")


def one_term(tcfg: TrainConfig, world: int, act: Activations, longest: int) -> bool:
    """Whether each exact sum has one term: one process, and a minibatch of the longest sequences fits
    one micro-batch; exact_sum.Limbs then keeps that gradient and makes no accumulator."""
    mb_seqs = min(tcfg.minibatch_size, tcfg.prompts_per_step * tcfg.group_size)
    return world == 1 and act.train_tokens >= mb_seqs * longest


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, detail: bool) -> int:
    """A KV-pool position: K and V of every paged layer (not a Gated DeltaNet's), and its routes (their weights
    and margins: detail)."""
    n_moe, k = len(cfg.moe_layers), cfg.num_experts_per_tok
    routes = n_moe * k * (1 if cfg.num_experts <= 256 else 2) + (4 * n_moe * (k + 1) if detail else 0)
    return paged_layers(cfg) * cfg.kv_numbers_per_token * dtype_bytes + routes     # MLA: its latent per layer


def paged_layers(cfg: ModelConfig) -> int:
    return cfg.num_hidden_layers - len(cfg.linear_layers)


def state_bytes_per_sequence(cfg: ModelConfig, dtype_bytes: int, snapshot: bool = False) -> int:
    """A sampler row's Gated DeltaNet memory over its linear layers (hybrids/gdn.GDNPool): the conv's K-1
    inputs and the open chunk's (64) in the model dtype, its g and beta (fp32), the boundary state (fp32);
    a snapshot (the prefix cache's) keeps the K-1 inputs and the state."""
    H, conv = cfg.linear_num_value_heads, 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim \
        + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    C = 0 if snapshot else 64
    per_layer = (cfg.linear_conv_kernel_dim - 1 + C) * conv * dtype_bytes + 2 * C * H * 4 \
        + H * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return (cfg.num_hidden_layers - paged_layers(cfg)) * per_layer


def rollout_positions(tcfg: TrainConfig, rcfg: RolloutConfig, world: int, longest: int) -> int:
    """KV positions this rank's rollout needs: its sequences, each at the longest in whole pages."""
    pages = -(-longest // rcfg.block_size)
    return tcfg.prompts_per_step // world * tcfg.group_size * pages * rcfg.block_size


def kv_line(cfg: ModelConfig, nbytes: int) -> str:
    """What the KV pool holds per token: the layers' numbers, and for MLA what per-head keys and values would."""
    per_token = paged_layers(cfg) * cfg.kv_numbers_per_token * nbytes
    line = (f"KV cache: {per_token:,} bytes per token ({paged_layers(cfg)} layers x "
            f"{cfg.kv_numbers_per_token:,} numbers")
    if paged_layers(cfg) < cfg.num_hidden_layers:                     # hybrids/: a state per sequence instead
        state = state_bytes_per_sequence(cfg, nbytes)
        line = (f"linear-attention state: {state / 2 ** 20:,.1f} MiB per sequence ({cfg.num_hidden_layers - paged_layers(cfg)}"
                f" Gated DeltaNet layers x {state / (cfg.num_hidden_layers - paged_layers(cfg)) / 2 ** 20:.2f} MiB: the "
                f"boundary state, the open chunk, the conv's inputs), whatever its length; " + line)
    windowed = sum(bool(cfg.window(i)) for i in range(cfg.num_hidden_layers))
    if windowed:                                  # rollout.Sampler's window pool
        return line + (f": keys and values of {cfg.num_key_value_heads} heads x {cfg.head_dim}); {windowed} sliding "
                       f"layers keep theirs in the window pool, freed below the {cfg.sliding_window}-key window, so a "
                       f"sequence holds {windowed * cfg.kv_numbers_per_token * nbytes:,} of those bytes per token of "
                       f"its last window only (the plan counts every position: a bound)")
    if not cfg.kv_lora_rank:
        return line + f": keys and values of {cfg.num_key_value_heads} heads x {cfg.head_dim})"
    expanded = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.head_dim + cfg.v_head_dim)
    return (line + f": MLA's latent {cfg.kv_lora_rank} + RoPE key {cfg.head_dim}; its {cfg.num_attention_heads} heads' "
            f"keys and values would be {expanded:,}, {expanded / cfg.kv_numbers_per_token:.1f}x as many)")


def format_plan(plan: MemoryPlan, tcfg: TrainConfig, world: int, gpu_gb: float, sampler_dtype: str,
                backend: str = "triton", kv: str = "") -> tuple[str, bool]:
    """The table, the start-up and the verdict (one line that says fits or does not fit, and by how much)."""
    layout = "FSDP2" if tcfg.parallel == "fsdp" and world > 1 else "DDP" if world > 1 else "one process"
    m = {"float32": "fp32", "bfloat16": "bf16"}[tcfg.master_dtype]
    act = plan.activations
    sums = "exact gradient sums (--grad_reduce=exact" + ("; one term: none)" if tcfg.grad_reduce == "exact" and
                                                         not plan.grad_sums else ")")
    fsdp = tcfg.parallel == "fsdp" and world > 1
    in_flight = ("gradients in flight (a block's fp32" + (", a piece's limbs" if plan.grad_sums else "") + ")" if fsdp
                 else "exact sums' conversion in flight (the largest tensor's limbs)", plan.sum_temps)
    optimizer = [(f"masters ({m})", plan.masters), (f"gradients ({m})", plan.grads),
                 (f"AdamW state ({m} x 2)", plan.adamw), (sums, plan.grad_sums)]
    optimizer += ([] if plan.reduce_on_device else [in_flight]) + [("the step's temporaries (AdamW's, the norm's)",
                                                                    plan.step_temps)]
    rows = [] if plan.offload else optimizer[:3]
    gathered = f"FSDP2's gathered weights ({tcfg.dtype}: embeddings and head, two blocks)"
    rows += [(f"frozen base (--lora_rank, {tcfg.dtype}: the trainer's and the sampler's)", plan.frozen)] if plan.frozen else []
    rows += [(gathered if fsdp else f"compute copy ({tcfg.dtype})" + (" of the adapters" if plan.frozen else ""),
              plan.compute_copy),
             (f"sampler's copy ({sampler_dtype})", plan.sampler_copy),
             ("reference policy (--kl_coef)", plan.reference)] + ([] if plan.offload else optimizer[3:])
    rows += [in_flight] if plan.reduce_on_device else []
    freed = "; freed while the update runs" if plan.kv_released else ""
    rows += [(f"KV pool ({plan.kv_tokens:,} tokens{freed})", plan.kv_pool), ("sampler's row buffers", plan.buffers)]
    rows += [(f"linear-attention state (a row per sampler row, the prefix cache's snapshots{freed})", plan.states)] \
        if plan.states else []
    if act is not None:
        recompute = getattr(tcfg, "activation_checkpointing", "none")
        how = backend + ("" if recompute == "none" else f", {recompute} recomputed")
        rows += [(f"activations, trainer ({act.train_tokens:,}-token micro-batch, {how})", act.train),
                 (f"activations, sampler ({act.sampler_tokens:,}-token step, apart from the trainer's)", act.sampler)]
    rows.append(("total (the largest phase: the trainer's, the sampler's or the step's)", plan.total))
    if plan.offload:                                                  # --offload_optimizer: apart, on the host
        rows += [(f"on the host: {name}", b) for name, b in optimizer] + [("on the host: total", plan.host)]
    gpu = gpu_gb * GB
    lines = [f"plan: {tcfg.init_from}, {plan.dense_params / 1e9:.2f}B dense + {plan.expert_params / 1e9:.2f}B expert "
             f"parameters; {world} rank(s), {layout}, --expert_parallel={tcfg.expert_parallel}, --dtype={tcfg.dtype}",
             f"per rank: {plan.params_per_rank / 1e9:.2f}B parameters"]
    if plan.frozen:
        lines[0] = (f"plan: {tcfg.init_from}, {plan.frozen_params / 1e9:.2f}B parameters frozen, LoRA rank {tcfg.lora_rank}: "
                    f"{(plan.dense_params + plan.expert_params) / 1e9:.3f}B adapter parameters; {world} rank(s), {layout}, "
                    f"--expert_parallel={tcfg.expert_parallel}, --dtype={tcfg.dtype}")
        lines[1] = f"per rank: {plan.params_per_rank / 1e9:.3f}B parameters trained (masters, gradients, AdamW)"
    startup = startup_bytes(plan, tcfg, world)                        # before FSDP2 shards (DDP: the masters)
    if startup:
        rows.append((f"start-up, FSDP2 sharding from the host: its largest group ({m})" if plan.offload else
                     f"start-up, before FSDP2 shards: dense weights and this rank's experts ({m})", startup))
    width = max(len(name) for name, _ in rows)
    lines += [f"  {name:<{width}} {b / GB:9.2f} GB" for name, b in rows]
    lines += [kv] if kv else []
    peak = peak_bytes(plan, tcfg, world)
    fits = peak <= gpu
    what = "the start-up" if startup > plan.total else "the run"
    lines.append(f"fits: {what} needs {peak / GB:.2f} GB of the {gpu_gb:g} GB per GPU ({(gpu - peak) / GB:.2f} GB spare)"
                 if fits else
                 f"does not fit: {what} needs {peak / GB:.2f} GB per GPU, {(peak - gpu) / GB:.2f} GB more than "
                 f"{gpu_gb:g} GB")
    if plan.offload:
        node = min(world, 8)
        lines.append(f"host memory (--offload_optimizer): {max(plan.host, plan.load_peak) / GB:.2f} GB a rank, "
                     f"{node * max(plan.host, plan.load_peak) / GB:.2f} GB for {node} rank(s) on a host of 8 GPUs"
                     + (" (the start-up's whole weights, before FSDP2 shards them)" if plan.load_peak > plan.host else ""))
    if plan.host_peak > plan.load_peak:                               # cut to this rank's experts
        lines.append(f"host memory: a preset is drawn whole on each rank's CPU first ({plan.host_peak / GB:.2f} GB a rank "
                     f"in {m}), then cut to its experts; a checkpoint folder of it is read by shard")
    return "\n".join(lines), fits


class Preflight(Hooks):
    """--preflight (a GPU run): the plan of the run's own configs against this GPU's memory, before the
    model is loaded; a run that does not fit ends in one line that says what would make it fit."""

    def __init__(self, tcfg: TrainConfig, rcfg: RolloutConfig, gpu_bytes: int):
        self.tcfg, self.rcfg, self.gpu_bytes = tcfg, rcfg, gpu_bytes

    def check_build(self, task, config) -> None:
        world = int(os.environ.get("WORLD_SIZE", "1")) - getattr(self.tcfg, "rollout_ranks", 0)
        plan, _, _ = plan_of(self.tcfg, self.rcfg, world)
        need, gpu_gb = peak_bytes(plan, self.tcfg, world), self.gpu_bytes / GB
        if need > self.gpu_bytes:
            raise ConfigError(f"this run needs {need / GB:.2f} GB per GPU by its plan, more than this GPU's "
                              f"{gpu_gb:.2f} GB; {what_would_fit(self.tcfg, self.rcfg, world, gpu_gb, 0)} (the table: "
                              "the same options with --plan; to start anyway: --preflight=false)")


def help_text() -> str:
    """--plan and its own keys, for train.py --help."""
    lines = ["--plan (python train.py --plan [options]): the memory per rank of the run these options describe, "
             "nothing loaded (tooling/plan.py);", "  exits 1 when it does not fit. Its own keys:"]
    opts = [(f"--{k}={'$WORLD_SIZE or 1' if d is None else repr(d)}", doc) for k, (_, d, doc) in PLAN_KEYS.items()]
    width = max(len(o) for o, _ in opts)
    return "\n".join(lines + [f"  {o:<{width}}  {doc}" for o, doc in opts])


def cli(argv: list[str]) -> None:
    """`train.py --plan`: print the table; a plan that does not fit is a ConfigError (one line, exit 1)."""
    table, fits = main(argv)
    print(table, flush=True)
    if not fits:
        raise ConfigError("--plan: this run does not fit (the table above; its verdict names the memory options that "
                          "would make it fit, if any); also: lower --micro_batch_tokens or --logits_chunk, shard more "
                          "(--parallel=fsdp, --expert_parallel, more ranks), or pass --kv_tokens / --gpu_memory_gb")
