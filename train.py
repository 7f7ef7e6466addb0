"""RL post-training of the MoE transformer: GRPO / GSPO and variants, with the train-inference fixes.

    python train.py                                   # CPU default: a tiny MoE learns to copy digits
    python train.py --help                            # every option and its default
    python train.py --loss=gspo --replay=r3 --steps=50 --out_dir=out/gspo
    python train.py --resume --out_dir=out            # continue from out/latest

Each step: sample `group_size` responses for each of `prompts_per_step` prompts with the Sampler (the
same model object, the same kernels), reward them, compute group-normalised advantages, then take
optimizer steps over minibatches of the rollout batch on `model.score`. In the default invariant mode
the rollout log-probs ARE the old policy's log-probs, so the logged train-rollout KL, max |logp diff|
and route flip fraction are exactly 0. Metrics go to out_dir/metrics.jsonl, one JSON object per step.
Formulas: DESIGN.md section 5 (A_i = (r_i - mean) / (std + 1e-6); ratio r_t = exp(logp_t - old_logp_t)).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm

import kernels
from config import ConfigError, ModelConfig, RolloutConfig, TrainConfig, apply_overrides, help_text, parse_args
from model import Transformer, hf_to_state, read_safetensors_dir
from replay import pack_routes, route_audit
from rollout import Sampler
from tasks import make_task


# ---------------------------------------------------------------------------------------------------
# losses: per-token loss L (B, T) to be aggregated; every tensor here is (B, T) unless said otherwise
# ---------------------------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int, std_norm: bool = True) -> torch.Tensor:
    """A_i = (r_i - mean_group) / (std_group + 1e-6); rewards (B,) grouped consecutively -> (B,)."""
    r = rewards.view(-1, group_size)                                  # (n_groups, G)
    a = r - r.mean(-1, keepdim=True)
    if std_norm:
        a = a / (r.std(-1, keepdim=True) + 1e-6)
    return a.view(-1)


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each sequence's masked tokens: (B, T) -> (B,)."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def policy_loss(logp, old_logp, adv, mask, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss (B, T) of cfg.loss, and a (B, T) bool tensor of clipped tokens.

    logp carries the gradient; old_logp is the behaviour policy's (no gradient); adv (B,).
    """
    A = adv[:, None]
    log_ratio = (logp - old_logp).clamp(-20, 20)
    if cfg.loss in ("gspo", "gspo_token"):
        seq_log_ratio = seq_mean(log_ratio, mask)                     # (B,) log s_i
        lo, hi = 1 - cfg.gspo_eps_low, 1 + cfg.gspo_eps_high
        if cfg.loss == "gspo":
            s = torch.exp(seq_log_ratio)[:, None].expand_as(logp)    # s_i on every token
        else:   # log s_it = sg[log s_i] + logp_t - sg[logp_t]: value s_i, gradient per token
            s = torch.exp(seq_log_ratio.detach()[:, None] + logp - logp.detach())
        l1, l2 = -A * s, -A * s.clamp(lo, hi)
        return torch.maximum(l1, l2), l2 > l1
    ratio = torch.exp(log_ratio)
    if cfg.loss == "grpo":                                            # PPO-clip with clip-higher
        l1, l2 = -A * ratio, -A * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
        return torch.maximum(l1, l2), l2 > l1
    if cfg.loss == "sapo":                                            # soft gate instead of a hard clip
        tau = torch.where(A > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
        gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
        return -gate * A, torch.zeros_like(mask, dtype=torch.bool)
    if cfg.loss == "cispo":                                           # clipped IS weight, no gradient through it
        w = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high).detach()
        return -w * A * logp, (ratio < 1 - cfg.eps_low) | (ratio > 1 + cfg.eps_high)
    raise ValueError(cfg.loss)


def aggregate(loss_tok, mask, agg: str, n_tokens: int, n_seqs: int, max_new_tokens: int) -> torch.Tensor:
    """Reduce a micro-batch's per-token loss with the minibatch's normalisers (so micro-batches add up)."""
    if agg == "token_mean":
        return (loss_tok * mask).sum() / n_tokens
    if agg == "seq_mean_token_mean":
        return seq_mean(loss_tok, mask).sum() / n_seqs
    if agg == "seq_mean_token_sum":
        return (loss_tok * mask).sum() / n_seqs
    if agg == "drgrpo":                                               # a constant normaliser
        return (loss_tok * mask).sum() / (n_seqs * max_new_tokens)
    raise ValueError(agg)


def correction_weights(old_logp, rollout_logp, mask, cfg: TrainConfig) -> torch.Tensor:
    """Importance weights against the rollout policy mu, rho = pi_old / mu (no gradient), (B, T).

    tis: min(rho_t, C); mis (IcePop): 1 inside [low, high], else 0; seq_*: the same with the
    sequence's geometric-mean rho. With zero mismatch rho == 1 exactly, so every weight is exactly 1.
    """
    log_rho = (old_logp - rollout_logp).detach()
    if cfg.correction.startswith("seq_"):
        log_rho = seq_mean(log_rho, mask)[:, None].expand_as(log_rho)
    rho = torch.exp(log_rho.clamp(-20, 20))
    if cfg.correction in ("tis", "seq_tis"):
        return rho.clamp(max=cfg.tis_cap)
    if cfg.correction in ("mis", "seq_mis"):
        return ((rho >= cfg.mis_low) & (rho <= cfg.mis_high)).float()
    return torch.ones_like(rho)


def kl_penalty(logp, ref_logp, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate from samples of pi (Schulman's k1, k2, k3)."""
    d = (ref_logp - logp).clamp(-20, 20)                             # as the ratio: exp must not overflow
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.exp(d) - d - 1


def mismatch_metrics(train_logp, rollout_logp, mask) -> dict:
    """How far the trainer's log-probs are from the rollout's, on the response tokens."""
    m = mask.bool()
    t, r = train_logp[m].double(), rollout_logp[m].double()
    d = t - r
    rho = torch.exp(d)
    return {
        "train_rollout_kl": (-d).mean().item(),                      # k1 of KL(mu || pi)
        "train_rollout_k3": (rho - d - 1).mean().item(),
        "logp_max_abs_diff": d.abs().max().item(),
        "extreme_token_frac": (d.abs() > math.log(2)).double().mean().item(),
        "is_ratio_min": rho.min().item(), "is_ratio_mean": rho.mean().item(), "is_ratio_max": rho.max().item(),
    }


# ---------------------------------------------------------------------------------------------------
# rollout -> padded training batch
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor          # (B, T) prompt + response, right-padded
    mask: torch.Tensor            # (B, T-1) 1 where logp[:, j] scores a response token
    rollout_logp: torch.Tensor    # (B, T-1)
    routes: torch.Tensor          # (B, T, n_moe, k), -1 where unrecorded
    route_mask: torch.Tensor      # (B, T) positions whose routes the rollout recorded
    adv: torch.Tensor             # (B,)

    def select(self, idx):
        return Batch(*(getattr(self, f.name)[idx] for f in dataclasses.fields(self)))


def make_batch(outs, adv: torch.Tensor) -> Batch:
    lengths = [len(o.prompt) + len(o.tokens) for o in outs]
    B, T = len(outs), max(lengths)
    tokens = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T - 1)
    rollout_logp = torch.zeros(B, T - 1)
    route_mask = torch.zeros(B, T, dtype=torch.bool)
    for i, o in enumerate(outs):
        P, N = len(o.prompt), len(o.tokens)
        tokens[i, :P + N] = torch.tensor(o.prompt + o.tokens)
        mask[i, P - 1:P - 1 + N] = 1                                  # logp[:, j] scores tokens[:, j + 1]
        rollout_logp[i, P - 1:P - 1 + N] = o.logprobs
        route_mask[i, :P + N - 1] = True
    routes = pack_routes([o.routes for o in outs], lengths, T)
    return Batch(tokens, mask, rollout_logp, routes, route_mask, adv)


# ---------------------------------------------------------------------------------------------------
# distributed: one process, or one rank of a torchrun job (which sets RANK, WORLD_SIZE, LOCAL_RANK)
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def master(self) -> bool:
        return self.rank == 0

    def print0(self, *args):
        if self.master:
            print(*args, flush=True)


def init_distributed(device: str) -> Dist:
    """NCCL with one GPU per local rank, or gloo on CPU; a single process when not under torchrun."""
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ:
        return Dist(0, 1, torch.device(("cuda" if use_cuda else "cpu") if device == "auto" else device))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if use_cuda:
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    return Dist(rank, world, dev)


class Scorer(nn.Module):
    """model.score as a module call: DDP and FSDP2 hook __call__, so training goes through this."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, tokens, temperature, routes=None):
        logp, used = self.model.score(tokens, temperature, routes)
        return logp.clone(), used                                     # FSDP2 wants no view outputs


def parallelize(model: Transformer, tcfg: TrainConfig, d: Dist):
    """-> (the scorer to train through, a full-weight model for the sampler and checkpoints, sync() refreshing it).

    ddp: every rank holds the full model; the sampler reads it directly.
    fsdp: FSDP2 shards each block and the rest; the sampler reads a full copy, refreshed by an
    all-gather before each rollout (bit-identical to the weights the trainer computes with).
    """
    scorer = Scorer(model)
    if d.world == 1:
        return scorer, model, lambda: None
    if tcfg.parallel == "ddp":
        return DDP(scorer, device_ids=[d.device.index] if d.device.type == "cuda" else None), model, lambda: None
    from torch.distributed.fsdp import fully_shard
    full_copy = copy.deepcopy(model).requires_grad_(False)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(scorer)
    full_params = dict(full_copy.named_parameters())
    full_buffers = dict(full_copy.named_buffers())

    @torch.no_grad()
    def sync():
        for name, p in model.named_parameters():
            full_params[name].copy_(p.full_tensor())
        for name, b in model.named_buffers():                         # FSDP2 leaves buffers whole on each rank
            full_buffers[name].copy_(b)
    return scorer, full_copy, sync


def lower_precision_copy(source: Transformer, dtype: torch.dtype, sync_source):
    """The mismatch lab's rollout weights: a copy of `source` in `dtype`, refreshed before each rollout."""
    copy_ = copy.deepcopy(source).to(dtype).requires_grad_(False)
    pairs = list(zip(model_state(source), model_state(copy_)))       # the router bias is rounded too

    @torch.no_grad()
    def sync():
        sync_source()
        for p, q in pairs:
            q.copy_(p)
    return copy_, sync


def model_state(model: nn.Module) -> list[torch.Tensor]:
    """Everything a weight sync must carry: the parameters, then the buffers (the routers'
    score-correction biases); DDP broadcasts buffers from rank 0 at each forward on its own."""
    return list(model.parameters()) + list(model.buffers())


def expert_load(routes: torch.Tensor, mask: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(n_moe, E) int64: how often each expert was chosen at the positions that score a response token.

    routes (B, T, n_moe, k) from the trainer's forward; mask (B, T-1): position j predicts token j + 1.
    """
    r = routes[:, :-1][mask.bool()]                                  # (N, n_moe, k)
    return F.one_hot(r, n_experts).sum(dim=(0, 2))                   # (n_moe, E)


@torch.no_grad()
def update_expert_bias(model: Transformer, load: torch.Tensor, rate: float, d: Dist) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): bias += rate * sign(mean load - load), per MoE layer.

    load (n_moe, E) is this rank's count; it is summed over ranks first, so every rank applies the
    same update to its copy of the bias.
    """
    if d.world > 1:
        dist.all_reduce(load)
    load = load.double()
    step = rate * torch.sign(load.mean(-1, keepdim=True) - load)    # (n_moe, E): underloaded experts go up
    for j, i in enumerate(model.config.moe_layers):
        bias = model.layers[i].mlp.gate.e_score_correction_bias
        bias.add_(step[j].to(bias.dtype))


def grad_sync(scorer, enabled: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of an optimizer step."""
    if isinstance(scorer, DDP) and not enabled:
        return scorer.no_sync()
    if hasattr(scorer, "set_requires_gradient_sync"):                # FSDP2
        scorer.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def all_sum(x: float, d: Dist) -> float:
    if d.world == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=d.device)
    dist.all_reduce(t)
    return t.item()


def all_cat(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world == 1:
        return t
    parts = [torch.empty_like(t, device=d.device) for _ in range(d.world)]
    dist.all_gather(parts, t.to(d.device))
    return torch.cat(parts).cpu()


SUMMED = ("loss", "clip_frac", "rollout_tokens_per_s", "preemptions")
SHARED = ("step", "lr")


def reduce_metrics(row: dict, d: Dist) -> dict:
    """Combine per-rank metrics: sums for SUMMED, max/min for *max*/*min*, the mean otherwise (ranks
    hold equal numbers of sequences, so a mean of rank means; token-level means are approximate)."""
    if d.world == 1:
        return row
    rows = [None] * d.world
    dist.all_gather_object(rows, row)
    out = {}
    for k, v in row.items():
        vals = [r[k] for r in rows]
        if k in SHARED:
            out[k] = v
        elif isinstance(v, list):
            out[k] = [sum(x) / d.world for x in zip(*vals)]
        elif k in SUMMED:
            out[k] = sum(vals)
        elif "max" in k:
            out[k] = max(vals)
        elif "min" in k:
            out[k] = min(vals)
        else:
            out[k] = sum(vals) / d.world
    return out


def check_in_sync(model: Transformer, d: Dist) -> str:
    """Raise unless every rank holds bit-identical weights (and buffers); returns their digest."""
    h = hashlib.sha256()
    for p in model_state(model):
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    digests = [None] * d.world
    if d.world > 1:
        dist.all_gather_object(digests, h.hexdigest())
    else:
        digests = [h.hexdigest()]
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks hold different weights: {digests}")
    return digests[0]


# ---------------------------------------------------------------------------------------------------
# checkpoints: out_dir/ckpt-NNNNNN/ (HF weights + trainer_state.pt), out_dir/latest names the newest.
# The weights are saved full (FSDP2 gathers them), by rank 0 alone.
# ---------------------------------------------------------------------------------------------------
def optimizer_state(scorer, opt, full: bool):
    if not full:
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    return get_optimizer_state_dict(scorer, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(scorer, opt, state, full: bool):
    if not full:
        return opt.load_state_dict(state)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(scorer, opt, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def save_checkpoint(out_dir, step, model, opt_state, tcfg, rcfg, task):
    final = os.path.join(out_dir, f"ckpt-{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    torch.save({"step": step, "optimizer": opt_state, "train_config": dataclasses.asdict(tcfg),
                "rollout_config": dataclasses.asdict(rcfg), "model_config": dataclasses.asdict(model.config),
                "task": task.state_dict()},
               os.path.join(tmp, "trainer_state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)                                            # a checkpoint appears whole or not at all
    with open(os.path.join(out_dir, "latest.tmp"), "w") as f:
        f.write(os.path.basename(final))
    os.replace(os.path.join(out_dir, "latest.tmp"), os.path.join(out_dir, "latest"))
    for name in os.listdir(out_dir):                                  # keep only the newest
        if name.startswith("ckpt-") and name != os.path.basename(final):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)


def latest_checkpoint(out_dir) -> str:
    path = os.path.join(out_dir, "latest")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--resume: no checkpoint in {out_dir!r} (no 'latest' file); drop --resume to start fresh")
    with open(path) as f:
        return os.path.join(out_dir, f.read().strip())


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def build_model(tcfg: TrainConfig, device, dtype) -> Transformer:
    """The same initial weights on every rank: from a checkpoint, or a preset seeded by --seed."""
    if os.path.isdir(tcfg.init_from):
        return Transformer.from_pretrained(tcfg.init_from, dtype=dtype, device=device)
    torch.manual_seed(tcfg.seed)
    return Transformer(ModelConfig.preset(tcfg.init_from)).to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------------
def train(tcfg: TrainConfig, rcfg: RolloutConfig) -> list[dict]:
    d = init_distributed(tcfg.device)
    try:
        # one kernel backend for sampler and trainer: --kernels_backend, else KERNELS_BACKEND, else auto
        with kernels.set_backend(tcfg.kernels_backend or kernels.get_backend()):
            return _train(tcfg, rcfg, d)
    finally:
        if d.world > 1:
            dist.destroy_process_group()


def _train(tcfg: TrainConfig, rcfg: RolloutConfig, d: Dist) -> list[dict]:
    if tcfg.prompts_per_step % d.world or tcfg.minibatch_size % d.world:
        raise ConfigError(f"prompts_per_step ({tcfg.prompts_per_step}) and minibatch_size ({tcfg.minibatch_size}) "
                          f"must be divisible by the number of ranks ({d.world})")
    device, dtype = d.device, {"float32": torch.float32, "bfloat16": torch.bfloat16}[tcfg.dtype]
    rollout_deviates = rcfg.rollout_mode != "invariant" or rcfg.router_bf16 or rcfg.rollout_dtype not in ("", tcfg.dtype)
    if rollout_deviates and tcfg.correction != "none" and not tcfg.recompute_old_logp:
        raise ConfigError(f"--correction={tcfg.correction} weighs the trainer's old log-probs against the rollout's; "
                          "with a deviating rollout they differ only if recomputed: add --recompute_old_logp=true")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    os.makedirs(tcfg.out_dir, exist_ok=True)
    task = make_task(tcfg.task, tcfg.seed, tcfg.n_digits, tcfg.data, tcfg.tokenizer, tcfg.reward_fn, rcfg.max_new_tokens)
    model = build_model(tcfg, device, dtype)
    balance = tcfg.expert_bias_update_rate > 0                      # aux-loss-free balancing of the router bias
    if balance and not model.config.score_correction_bias:
        raise ConfigError("--expert_bias_update_rate needs a model with a score-correction bias "
                          "(score_correction_bias=True: e.g. --init_from=tiny-sigmoid or a glm4_moe checkpoint)")
    if task.vocab_size > model.config.vocab_size:
        raise ConfigError(f"task {tcfg.task!r} uses {task.vocab_size} token ids, the model has vocab_size="
                          f"{model.config.vocab_size}")
    start, metrics_path, state = 0, os.path.join(tcfg.out_dir, "metrics.jsonl"), None
    if tcfg.resume:
        ckpt = latest_checkpoint(tcfg.out_dir)
        # on the CPU: every rank would otherwise put rank 0's optimizer tensors on rank 0's GPU
        state = torch.load(os.path.join(ckpt, "trainer_state.pt"), map_location="cpu", weights_only=False)
        if ModelConfig(**state["model_config"]) != model.config:       # fields added since take their defaults
            raise ConfigError(f"{ckpt} was trained with a different model config than --init_from={tcfg.init_from!r}")
        weights = hf_to_state(read_safetensors_dir(ckpt), model)
        model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in weights.items()})
        task.load_state_dict(state["task"])
        start = state["step"]
    ref_model = None
    if tcfg.kl_coef > 0:                  # a frozen copy of the initial policy (rebuilt from init_from on resume)
        ref_model = (build_model(tcfg, device, dtype) if tcfg.resume else copy.deepcopy(model)).requires_grad_(False)
    scorer, full_model, sync_full_weights = parallelize(model, tcfg, d)
    rollout_model, sync_rollout_weights = full_model, sync_full_weights
    fsdp = d.world > 1 and tcfg.parallel == "fsdp"
    opt = torch.optim.AdamW(scorer.parameters(), lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2),
                            weight_decay=tcfg.weight_decay)
    if state is not None:
        load_optimizer_state(scorer, opt, state["optimizer"], fsdp)
        state = None                                                  # free the host copy
    if d.master:
        if tcfg.resume:                                               # drop lines logged after the checkpoint
            kept = []
            if os.path.exists(metrics_path):
                with open(metrics_path) as f:
                    kept = [line for line in f if json.loads(line)["step"] <= start]
            with open(metrics_path, "w") as f:
                f.writelines(kept)
        elif os.path.exists(metrics_path):
            os.remove(metrics_path)

    if rcfg.rollout_dtype and getattr(torch, rcfg.rollout_dtype) != dtype:
        rollout_model, sync_rollout_weights = lower_precision_copy(rollout_model, getattr(torch, rcfg.rollout_dtype),
                                                                   sync_rollout_weights)
    # The gradients (first backward) and AdamW's two moment buffers (first step; already there on resume)
    # are allocated after the sampler sizes its KV pool from the free memory: set them aside, for this
    # rank's shard of the parameters under FSDP. Activations and temporaries come out of the rest.
    param_bytes = sum(getattr(p, "to_local", lambda: p)().nbytes for p in scorer.parameters())
    reserve = (1 if opt.state else 3) * param_bytes
    sampler = Sampler(rollout_model, block_size=rcfg.block_size, num_blocks=rcfg.num_blocks or None,
                      max_batch_size=rcfg.max_batch_size, mode=rcfg.rollout_mode, router_bf16=rcfg.router_bf16,
                      kv_memory_fraction=rcfg.kv_memory_fraction, reserve_bytes=reserve)
    max_new = rcfg.max_new_tokens or task.max_new_tokens
    G, history = tcfg.group_size, []
    n_prompts = tcfg.prompts_per_step // d.world                     # this rank's share; groups stay whole
    bar = tqdm(range(start, tcfg.steps), desc="train", disable=not (tcfg.progress and d.master),
               initial=start, total=tcfg.steps)
    for step in bar:
        t0 = time.perf_counter()
        # ---- rollout: every rank draws the same global prompts and samples its own slice ----
        sync_rollout_weights()
        model.eval()
        examples = task.sample(tcfg.prompts_per_step)[d.rank * n_prompts:(d.rank + 1) * n_prompts]
        outs = sampler.generate([ex.prompt for ex in examples], max_new_tokens=max_new, n=G,
                                temperature=rcfg.temperature, top_p=rcfg.top_p, top_k=rcfg.top_k,
                                stop_token_ids=task.stop_token_ids, seed=tcfg.seed * 1_000_003 + step,
                                progress=False, index_offset=d.rank * n_prompts * G)
        t_rollout = time.perf_counter() - t0
        rewards = torch.tensor([task.reward(examples[i // G], o.tokens) for i, o in enumerate(outs)])
        batch = make_batch(outs, group_advantages(rewards, G, tcfg.adv_std_norm))
        B = batch.tokens.shape[0]
        replay = tcfg.replay == "r3"
        mb_size = min(tcfg.minibatch_size // d.world, B)
        micro = tcfg.micro_batch_size or mb_size

        def score(fn, b: Batch, grad: bool):
            with torch.set_grad_enabled(grad):
                return fn(b.tokens.to(device), rcfg.temperature, b.routes.to(device) if replay else None)

        # ---- old-policy log-probs (the rollout's, unless asked to recompute) ----
        old_logp, audit = batch.rollout_logp, None
        chunks = [batch.select(slice(i, i + micro)) for i in range(0, B, micro)]
        if tcfg.recompute_old_logp:
            scored = [score(full_model.score, c, False) for c in chunks]
            old_logp = torch.cat([s[0].float().cpu() for s in scored])
            audit = (old_logp, torch.cat([s[1].cpu() for s in scored]), torch.arange(B))
        if ref_model is not None:
            ref_logp = torch.cat([score(ref_model.score, c, False)[0].float().cpu() for c in chunks])
        weights = correction_weights(old_logp, batch.rollout_logp, batch.mask, tcfg)

        # ---- updates: minibatches of the rollout batch, each one optimizer step ----
        model.train()
        stats = {"loss": 0.0, "clip_frac": 0.0, "grad_norm": 0.0}
        n_updates, auditing = 0, audit is None
        perm_gen = torch.Generator().manual_seed(tcfg.seed * 7919 + step * 131 + d.rank)
        for epoch in range(tcfg.epochs):
            perm = torch.randperm(B, generator=perm_gen)
            for lo in range(0, B, mb_size):
                idx = perm[lo:lo + mb_size]
                # normalisers over the global minibatch, so every rank's loss adds up to the global one
                n_tok, n_seq = all_sum(float(batch.mask[idx].sum()), d), len(idx) * d.world
                lr = lr_at(step, tcfg)
                for g in opt.param_groups:
                    g["lr"] = lr
                opt.zero_grad(set_to_none=True)
                micro_starts = list(range(0, len(idx), micro))
                load = 0                                              # expert counts for the bias update
                for mlo in micro_starts:
                    sub = idx[mlo:mlo + micro]
                    mb = batch.select(sub)
                    with grad_sync(scorer, enabled=mlo == micro_starts[-1]):
                        logp, train_routes = score(scorer, mb, True)
                        logp = logp.float()
                        if balance:
                            load = load + expert_load(train_routes, mb.mask.to(device), model.config.num_experts)
                        if auditing and n_updates == 0:
                            # the policy has not moved yet: this forward measures train vs rollout
                            part = (logp.detach().cpu(), train_routes.cpu(), sub)
                            audit = part if mlo == 0 else tuple(torch.cat([a, b]) for a, b in zip(audit, part))
                        mask = mb.mask.to(device)
                        loss_tok, clipped = policy_loss(logp, old_logp[sub].to(device), mb.adv.to(device), mask, tcfg)
                        loss_tok = loss_tok * weights[sub].to(device)
                        if ref_model is not None:
                            loss_tok = loss_tok + tcfg.kl_coef * kl_penalty(logp, ref_logp[sub].to(device),
                                                                             tcfg.kl_estimator)
                        loss = aggregate(loss_tok, mask, tcfg.aggregation, n_tok, n_seq, max_new)
                        (loss * d.world).backward()                   # DDP / FSDP average over ranks
                    stats["loss"] += loss.item()
                    stats["clip_frac"] += (clipped.float() * mask).sum().item() / n_tok
                gn = torch.nn.utils.clip_grad_norm_(scorer.parameters(), tcfg.grad_clip)
                stats["grad_norm"] += gn.full_tensor().item() if hasattr(gn, "full_tensor") else gn.item()
                opt.step()
                if balance:
                    update_expert_bias(model, load, tcfg.expert_bias_update_rate, d)
                n_updates += 1

        # ---- metrics (reduced over ranks; rank 0 logs) ----
        a_logp, a_routes, a_idx = audit
        lengths = torch.tensor([len(o.tokens) for o in outs], dtype=torch.float)
        all_rewards = all_cat(rewards, d)
        row = {"step": step + 1, "reward_mean": all_rewards.mean().item(), "reward_std": all_rewards.std().item(),
               "response_len": all_cat(lengths, d).mean().item(),
               **{k: v / n_updates for k, v in stats.items()},
               **mismatch_metrics(a_logp, batch.rollout_logp[a_idx], batch.mask[a_idx]),
               **route_audit(batch.routes[a_idx], a_routes, batch.route_mask[a_idx], model.config.num_experts),
               "entropy": -(batch.rollout_logp * batch.mask).sum().item() / batch.mask.sum().item(),
               "lr": lr, "rollout_tokens_per_s": lengths.sum().item() / t_rollout,
               "step_time": time.perf_counter() - t0, "preemptions": sampler.num_preemptions}
        row = reduce_metrics(row, d)
        history.append(row)
        if d.master and ((step + 1) % tcfg.log_every == 0 or step + 1 == tcfg.steps):
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", kl=f"{row['train_rollout_kl']:.1e}",
                        flip=f"{row.get('route_flip_frac', 0):.3f}")
        if (step + 1) % tcfg.save_every == 0 or step + 1 == tcfg.steps:
            sync_full_weights()
            digest = check_in_sync(full_model, d)
            opt_state = optimizer_state(scorer, opt, fsdp)            # collective under FSDP2
            if d.master:
                save_checkpoint(tcfg.out_dir, step + 1, full_model, opt_state, tcfg, rcfg, task)
            if d.world > 1:
                dist.barrier()
                d.print0(f"step {step + 1}: weights identical on {d.world} ranks (sha256 {digest[:16]})")
    bar.close()
    return history


def main(argv: list[str]) -> None:
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        print(help_text(tcfg, rcfg))
        return
    overrides = parse_args(argv)
    if overrides.get("resume", "false").lower() in ("1", "true", "yes", "on"):
        # continue the saved run: its configs, with this command line's overrides on top
        state = torch.load(os.path.join(latest_checkpoint(overrides.get("out_dir", tcfg.out_dir)),
                                        "trainer_state.pt"), weights_only=False)
        tcfg, rcfg = TrainConfig(**state["train_config"]), RolloutConfig(**state["rollout_config"])
    apply_overrides(overrides, tcfg, rcfg)
    t0 = time.time()
    history = train(tcfg, rcfg)
    if history and int(os.environ.get("RANK", "0")) == 0:
        n = max(1, len(history) // 10)
        first = sum(h["reward_mean"] for h in history[:n]) / n
        last = sum(h["reward_mean"] for h in history[-n:]) / n
        worst_kl = max(abs(h["train_rollout_kl"]) for h in history)
        worst_flip = max(h.get("route_flip_frac", 0.0) for h in history)
        print(f"done: {len(history)} steps in {time.time() - t0:.0f}s; reward {first:.3f} (first tenth) -> "
              f"{last:.3f} (last tenth); max |train-rollout KL| {worst_kl:.2e}; max route flips {worst_flip:.2e}; "
              f"metrics in {os.path.join(tcfg.out_dir, 'metrics.jsonl')}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"config error: {e}")
