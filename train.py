"""RL post-training of the MoE transformer: GRPO / GSPO and variants, with the train-inference fixes.

    python train.py                                   # CPU default: a tiny MoE learns to copy digits
    python train.py --help                            # every option and its default
    python train.py --loss=gspo --replay=r3 --steps=50 --out_dir=out/gspo
    python train.py --resume --out_dir=out            # continue from out/latest

Each step: sample `group_size` responses for each of `prompts_per_step` prompts with the Sampler (the
same model object, the same kernels), reward them, compute group-normalised advantages, then take
optimizer steps over minibatches of the rollout batch on `model.score`. In the default invariant mode
the rollout log-probs ARE the old policy's log-probs, so the logged train-rollout KL, max |logp diff|
and route flip fraction are exactly 0 (measured by audit.py). Metrics go to out_dir/metrics.jsonl, one
JSON object per step.
Formulas: docs/design.md, "RL losses" (A_i = (r_i - mean) / (std + 1e-6); ratio r_t = exp(logp_t - old_logp_t)).

The loop (`_train`) reads as one step's phases: rollout; rewards and advantages; the old policy's
log-probs and corrections; the updates; metrics and log; checkpoint. The objectives are tables in
losses.py, the mismatch measurement is audit.py, torchrun's wrappers and reductions live in
distributed.py, checkpoints in checkpoint.py, what a run shows and writes (the banner, metrics rows,
loggers, samples, signals) in runlog.py.

Reliability: a non-numeric or non-finite reward, loss or gradient norm stops the run (or skips the
optimizer step, up to --skip_nonfinite_steps) before it reaches the weights; a checkpoint is written
only from finite weights, to a temporary folder renamed into place. An out_dir that holds a run is
continued with --resume=true or started over with --overwrite=true, never overwritten silently; what a
resume keeps (the lr horizon among it) is in docs/design.md ("Reliability", "The learning-rate horizon"). Every user mistake ends in one
line `error: ...` and a non-zero exit (under torchrun printed by rank 0 alone). A SIGINT or SIGTERM
ends the step under way, saves it and exits 130 / 143 ("interrupted at step N; resume with --resume=true").

What a run shows: a start banner, a line per checkpoint, --log_samples=N responses a step (samples.jsonl),
a line every --log_every steps with --progress=false, --eval_data's reward and pass@k (eval.py) in
metrics.jsonl, a copy of each row to --log_to=tensorboard|wandb. Every checkpoint carries the token ids
and tokenizer files of --init_from (or --tokenizer), so transformers' generate stops at its EOS.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import signal
import sys
import time
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from tqdm.auto import tqdm

import eval as evaluation
import expert_parallel
import kernels
import plan
import audit
from audit import expert_load, mismatch_metrics, pack_routes, route_audit, token_overlap
from config import (QUANT_FORMATS, ConfigError, ModelConfig, RolloutConfig, TrainConfig, apply_overrides, help_text,
                    parse_args, parse_bool)
from losses import (aggregate, correction_weights, group_advantages, kl_penalty, policy_loss, rejects,
                    route_filter_weights)
from checkpoint import (RunError, check_finite_weights, latest_checkpoint, load_optimizer_state,  # noqa: F401
                        load_trainer_state, load_weights, optimizer_state, prepare_out_dir, save_checkpoint,
                        saved_configs, trim_metrics)
from distributed import (Dist, MixedPrecision, all_cat, all_sum, check_in_sync, finish_grads, grad_sync,
                         init_distributed, lower_precision_copy, place_weights, quantized_copy, reduce_metrics,
                         store_routers)
from hf import CheckpointError, eos_token_ids
from model import CapacityLimit, MoE, RouteDetail, Transformer, capacity_limit
from packing import Packing, pack
from rollout import Sampler
from runlog import (Interrupted, Outputs, StopRequest, append_jsonl, banner, is_log_step, log_row, log_samples, open_logger,
                    open_outputs, stop_requested, summary, tell_launcher)
from tasks import TaskError, compute_rewards, make_task


# ---------------------------------------------------------------------------------------------------
# the finiteness checks (rewards: tasks.compute_rewards; the loss formulas are in losses.py, the
# mismatch metrics in audit.py)
# ---------------------------------------------------------------------------------------------------
def update_is_finite(step: int, loss: float, grad_norm: float, skipped: int, tcfg: TrainConfig, d: "Dist") -> bool:
    """Before an optimizer step: True if the loss and the gradient norm are finite on every rank.

    Otherwise the step is skipped (False) while fewer than --skip_nonfinite_steps were, else RunError:
    a NaN never reaches the weights, so nothing non-finite is ever saved.
    """
    loss = all_sum(loss, d)                                           # the global loss (the norm already is)
    bad = [f"{name} is {v}" for name, v in (("loss", loss), ("gradient norm", grad_norm)) if not math.isfinite(v)]
    if not bad:
        return True
    if skipped < tcfg.skip_nonfinite_steps:
        d.print0(f"step {step}: {' and '.join(bad)}; skipping this optimizer step "
                 f"({skipped + 1} of --skip_nonfinite_steps={tcfg.skip_nonfinite_steps})")
        return False
    raise RunError(f"step {step}: the {' and the '.join(bad)} before the optimizer step; stopped before it reached "
                   "the weights (the last checkpoint is good). Lower --lr or check the rewards, then --resume; "
                   f"--skip_nonfinite_steps=N skips up to N such steps ({skipped} skipped so far)")


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
    lengths: torch.Tensor         # (B,) prompt + response tokens of each sequence

    def select(self, idx):
        return Batch(*(getattr(self, f.name)[idx] for f in dataclasses.fields(self)))


def make_batch(outs, adv: torch.Tensor) -> Batch:
    """The sampler's outputs as one right-padded batch: where the trainer's data enters. Its tokens are
    the sampler's (prompts checked there, ids drawn from the model's vocabulary) and pack_routes checks
    that the routes fit them, so the trainer's forwards run without checks that read tensors back."""
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
        rollout_logp[i, P - 1:P - 1 + N] = torch.tensor(o.logprobs, dtype=torch.float32)   # the fp32 bits, exactly
        route_mask[i, :P + N - 1] = True
    routes = pack_routes([o.routes for o in outs], lengths, T)
    return Batch(tokens, mask, rollout_logp, routes, route_mask, adv, torch.tensor(lengths))


@torch.no_grad()
def update_expert_bias(model: Transformer, load: torch.Tensor, rate: float, d: Dist) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): bias += rate * sign(mean load - load), per MoE layer.

    load (n_moe, E) is this rank's count (audit.expert_load); it is summed over ranks first, so every
    rank applies the same update to its copy of the bias.
    """
    if d.world > 1:
        dist.all_reduce(load)
    load = load.double()
    step = rate * torch.sign(load.mean(-1, keepdim=True) - load)    # (n_moe, E): underloaded experts go up
    for j, i in enumerate(model.config.moe_layers):
        bias = model.layers[i].mlp.gate.e_score_correction_bias
        bias.add_(step[j].to(bias.dtype))


def plan_resume(tcfg: TrainConfig, state: dict, d: "Dist") -> TrainConfig:
    """Check --steps against the checkpoint and keep the run's lr horizon (see lr_at)."""
    done = state["step"]
    if tcfg.steps <= done:
        raise ConfigError(f"--resume: the checkpoint in {tcfg.out_dir!r} is at step {done} and --steps={tcfg.steps}"
                          + (": the run is finished" if tcfg.steps == done else "")
                          + f"; pass --steps=N with N > {done} to train further")
    ckpt_cfg = state["train_config"]
    saved = ckpt_cfg.get("lr_decay_steps") or ckpt_cfg["steps"]
    horizon = tcfg.lr_decay_steps or saved
    if tcfg.lr_schedule == "cosine" and tcfg.steps > horizon:
        d.print0(f"resume: --steps={tcfg.steps} extends the run past its lr horizon of {horizon} steps: lr follows "
                 f"the planned cosine to step {horizon}, then holds at {tcfg.lr * tcfg.min_lr_ratio:.3g} "
                 f"(pass --lr_decay_steps={tcfg.steps} to re-plan the schedule instead)")
    was = (ckpt_cfg.get("lr_schedule", "cosine"), ckpt_cfg.get("lr_decay_period", 0))
    if was != (tcfg.lr_schedule, tcfg.lr_decay_period):     # halving needs no horizon: its period is its plan
        d.print0(f"resume: the lr schedule changes from {was[0]} (period {was[1]}) to {tcfg.lr_schedule} "
                 f"(period {tcfg.lr_decay_period}): lr is re-planned from step {done + 1}")
    scale = ckpt_cfg.get("router_lr_scale", 1.0)
    if (scale == 1) != (tcfg.router_lr_scale == 1):          # one param group or two: see build_optimizer
        raise ConfigError(f"--router_lr_scale={tcfg.router_lr_scale}: the checkpoint's optimizer was built with "
                          f"router_lr_scale={scale}; resume with 1 on both sides or != 1 on both sides")
    return dataclasses.replace(tcfg, lr_decay_steps=horizon)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if cfg.lr_schedule == "halving":                                 # halved every period, down to the floor
        return cfg.lr * max(cfg.min_lr_ratio, 0.5 ** ((step - cfg.warmup_steps) // cfg.lr_decay_period))
    horizon = cfg.lr_decay_steps or cfg.steps                        # past it, lr stays at its minimum
    progress = 1.0 if step >= horizon else (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def initial_config(tcfg: TrainConfig, preset: ModelConfig | None = None) -> ModelConfig:
    """The model config --init_from names, read before any weight: a checkpoint's config.json, or a
    preset (given: with --vocab_size applied, TrainConfig.model_preset)."""
    if preset is not None and not os.path.isdir(tcfg.init_from):
        return preset
    return plan.model_config(tcfg.init_from)


def build_model(tcfg: TrainConfig, device, dtype, preset: ModelConfig | None = None,
                experts: list[int] | None = None) -> Transformer:
    """The same initial weights on every rank: from a checkpoint, or a preset seeded by --seed.
    experts: keep only these of every MoE layer (an expert-parallel rank's shard). A checkpoint then
    reads only them from disk; a preset is drawn whole (the same bits at every EP degree), then cut."""
    if os.path.isdir(tcfg.init_from):
        return Transformer.from_pretrained(tcfg.init_from, dtype=dtype, device=device, experts=experts)
    torch.manual_seed(tcfg.seed)
    model = Transformer(initial_config(tcfg, preset))
    if experts is not None:
        expert_parallel.keep_experts(model, experts)
    return model.to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------------
def check_device(device: str) -> None:
    """--device must name a device this torch build has (the syntax is checked by TrainConfig)."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device={device}: this machine has no usable CUDA GPU (torch {torch.__version__}, "
                              f"CUDA build: {torch.version.cuda or 'no'}); use --device=cpu or --device=auto")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(f"--device={device}: only {torch.cuda.device_count()} CUDA device(s) visible")


def train(tcfg: TrainConfig, rcfg: RolloutConfig) -> list[dict]:
    check_device(tcfg.device)
    d = init_distributed(tcfg.device)
    try:
        # one kernel backend for sampler and trainer: --kernels_backend, else KERNELS_BACKEND, else auto
        with kernels.set_backend(tcfg.kernels_backend or kernels.get_backend()):
            return _train(tcfg, rcfg, d)
    finally:
        if dist.is_initialized():                                     # torchrun, even with one rank
            dist.destroy_process_group()


@dataclasses.dataclass
class Weights:
    """The policy's copies, and which reads which. sync() refreshes full and rollout from trained."""
    trained: Transformer             # the weights the optimizer steps (sharded under FSDP2)
    scorer: nn.Module                # trained.score as a module: DDP / FSDP2 hook its __call__
    full: Transformer                # full weights: checkpoints, the old policy's forward (trained itself off FSDP2)
    rollout: Transformer             # what the sampler runs: full, or the mismatch lab's lower-precision copy
    refresh: Callable[[], None]      # full <- trained (an all-gather under FSDP2), then rollout <- full
    mp: MixedPrecision | None        # bf16 compute over fp32 masters: trained holds the masters, full the copy

    def sync(self) -> None:
        self.refresh()


def build_weights(model: Transformer, tcfg: TrainConfig, rcfg: RolloutConfig, d: Dist) -> Weights:
    scorer, full, refresh, mp = place_weights(model, tcfg, d)
    rollout_model = full
    if rcfg.rollout_dtype in QUANT_FORMATS:                          # the lab's quantized copy
        rollout_model, refresh = quantized_copy(full, rcfg.rollout_dtype, refresh, rcfg.rollout_quant_router)
    elif rcfg.rollout_dtype and rcfg.rollout_dtype != tcfg.dtype:    # the lab's copy, from the compute weights
        rollout_model, refresh = lower_precision_copy(full, getattr(torch, rcfg.rollout_dtype), refresh)
    if rcfg.rollout_router_fault != "none":
        rollout_model, refresh = faulty_router_copy(rollout_model, full, rcfg.rollout_router_fault, refresh)
    return Weights(model, scorer, full, rollout_model, refresh, mp)


def faulty_router_copy(rollout_model: Transformer, full: Transformer, fault: str, refresh):
    """The rollout's weights with their routers wrong in one way (config.ROUTER_FAULTS); a copy of its
    own, so the trainer's model never carries the fault."""
    c = full.config
    if fault in ("no_bias", "bias_sign", "bias_in_weights") and not c.score_correction_bias:
        raise ConfigError(f"--rollout_router_fault={fault} needs a router with a score-correction bias "
                          "(--init_from=tiny-sigmoid or a glm4_moe checkpoint)")
    if fault == "no_renorm" and not c.norm_topk_prob:
        raise ConfigError("--rollout_router_fault=no_renorm: this model does not renormalise its top-k weights")
    if not c.moe_layers:
        raise ConfigError(f"--rollout_router_fault={fault}: the model has no MoE layer (no router)")
    if rollout_model is full:                                        # a copy in the same dtype
        rollout_model, refresh = lower_precision_copy(full, None, refresh)
    for layer in rollout_model.layers:
        if layer.is_moe:
            layer.mlp.router_fault = fault
    return rollout_model, refresh


@dataclasses.dataclass
class Run:
    """What the steps of a run share: configs, the weights, optimizer, sampler."""
    tcfg: TrainConfig
    rcfg: RolloutConfig
    d: Dist
    task: object
    weights: Weights
    ref_model: Transformer | None    # the frozen initial policy when --kl_coef > 0
    opt: torch.optim.Optimizer
    sampler: Sampler
    start: int                       # the first step to run (> 0 on resume)
    skipped: int                     # optimizer steps skipped for a non-finite loss or gradient so far
    metrics_path: str
    outputs: "Outputs | None" = None  # identity of the exports, eval task, logger (set by open_outputs)
    capacity: CapacityLimit | None = None   # --train_capacity_factor's drop counts (see trainer_capacity)
    probe: "Probe | None" = None     # --probe_every: the fixed probe set, drawn at the first probe

    @property
    def fsdp(self) -> bool:
        return self.d.world > 1 and self.tcfg.parallel == "fsdp"


@dataclasses.dataclass
class Scored:
    """A trainer forward over some rows of the rollout batch."""
    logp: torch.Tensor               # (N, T-1) log-probs of tokens[:, 1:]
    routes: torch.Tensor             # (N, T, n_moe, k) the router's own choice (also under R3 replay)
    entropy: torch.Tensor | None     # (N, T-1) when asked for (detached)
    rows: torch.Tensor               # (N,) which rows of the rollout batch
    detail: RouteDetail | None = None   # (N, T, ...) the routes' weights, margins, router entropy


@dataclasses.dataclass
class OldPolicy:
    """What the updates weigh against: the old policy's log-probs, the reference's, correction weights."""
    logp: torch.Tensor               # (B, T-1): the rollout's, or the trainer's recomputed ones
    ref_logp: torch.Tensor | None    # (B, T-1) when --kl_coef > 0
    weights: torch.Tensor            # (B, T-1) the correction's importance weights (1 without one)
    loss_mask: torch.Tensor          # (B, T-1) the tokens the loss counts (rejected ones dropped if asked)
    audit: Scored | None             # the recomputed old log-probs: a trainer forward before any update


def build_optimizer(scorer: nn.Module, tcfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the scorer's parameters, one param group. With --router_lr_scale=S != 1 the MoE router
    gates get a second group whose lr is S times the first's, set just before each step (the loop sets
    every group's lr); S = 0 also drops their weight decay, so frozen gates keep their bits."""
    kw = dict(lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay)
    if tcfg.router_lr_scale == 1:
        return torch.optim.AdamW(scorer.parameters(), **kw)
    gates = {id(p) for m in scorer.modules() if isinstance(m, MoE) for p in m.gate.parameters()}
    if not gates:
        raise ConfigError(f"--router_lr_scale={tcfg.router_lr_scale}: the model has no MoE layer (no router)")
    params = list(scorer.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if id(p) not in gates]},
                             {"params": [p for p in params if id(p) in gates]}], **kw)

    def scale_router_lr(opt, args, kwargs):
        main, router = opt.param_groups
        router["lr"] = main["lr"] * tcfg.router_lr_scale
        router["weight_decay"] = tcfg.weight_decay if tcfg.router_lr_scale > 0 else 0.0
    opt.register_step_pre_hook(scale_router_lr)
    return opt


def check_run_configs(tcfg: TrainConfig, rcfg: RolloutConfig, d: Dist) -> None:
    """The checks that need both configs or the number of ranks (each config checks itself)."""
    if tcfg.prompts_per_step % d.world or tcfg.minibatch_size % d.world:
        raise ConfigError(f"prompts_per_step ({tcfg.prompts_per_step}) and minibatch_size ({tcfg.minibatch_size}) "
                          f"must be divisible by the number of ranks ({d.world})")
    if tcfg.correction != "none" and not tcfg.recompute_old_logp:      # else rho = pi_old / mu is 1 by definition
        raise ConfigError(f"--correction={tcfg.correction} weighs the trainer's old log-probs against the rollout's; "
                          "without --recompute_old_logp=true they are the rollout's own: add it")
    batch = tcfg.prompts_per_step * tcfg.group_size
    if tcfg.minibatch_size > batch:
        d.print0(f"--minibatch_size={tcfg.minibatch_size} is more than the batch of {batch} (prompts_per_step x "
                 f"group_size): one optimizer step of {batch} per epoch")
    elif batch % tcfg.minibatch_size:
        raise ConfigError(f"--minibatch_size={tcfg.minibatch_size} must divide the batch of {batch} (prompts_per_step "
                          "x group_size): uneven minibatches would weigh their sequences unequally")
    if tcfg.log_to:
        open_logger(tcfg.log_to, tcfg.out_dir, probe=True)               # a missing package: one line, before work


def check_moe_options(tcfg: TrainConfig, config: ModelConfig) -> None:
    """The options that act on routes refuse a model without a router (they would do nothing)."""
    if config.moe_layers:
        return
    for name, off in (("train_capacity_factor", 0.0), ("replay", "none"), ("route_filter", "none")):
        if getattr(tcfg, name) != off:
            raise ConfigError(f"--{name}={getattr(tcfg, name)}: the model has no MoE layer (no routes); drop it")


def setup(tcfg: TrainConfig, rcfg: RolloutConfig, d: Dist) -> Run:
    """Check the configs against each other, build (or resume) the model, optimizer and sampler."""
    check_run_configs(tcfg, rcfg, d)
    device, dtype = d.device, getattr(torch, tcfg.master_dtype)       # the trained weights: the masters
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    prepare_out_dir(tcfg, d.master)
    if not tcfg.resume:                                               # the lr horizon, saved with the run
        tcfg = dataclasses.replace(tcfg, lr_decay_steps=tcfg.lr_decay_steps or tcfg.steps)
    from_dir = os.path.isdir(tcfg.init_from)
    task = make_task(tcfg.task, tcfg.seed, tcfg.n_digits, tcfg.data, tcfg.tokenizer, tcfg.reward_fn, rcfg.max_new_tokens,
                     stop_tokens=rcfg.stop_token_ids, model_eos=eos_token_ids(tcfg.init_from) if from_dir else ((), ""),
                     chat_template=tcfg.chat_template, system_prompt=tcfg.system_prompt,
                     checkpoint=tcfg.init_from if from_dir else "")
    preset = tcfg.model_preset(task.vocab_size, tokenizer=tcfg.task == "jsonl")
    config = initial_config(tcfg, preset)
    expert_parallel.check_degree(tcfg.expert_parallel, config.num_experts, d.world)
    placement = expert_parallel.placement_of(tcfg.expert_placement, tcfg.expert_parallel, config.num_experts)
    check_moe_options(tcfg, config)
    if tcfg.expert_bias_update_rate > 0 and not config.score_correction_bias:
        raise ConfigError("--expert_bias_update_rate needs a model with a score-correction bias "
                          "(score_correction_bias=True: e.g. --init_from=tiny-sigmoid or a glm4_moe checkpoint)")
    if task.vocab_size > config.vocab_size:
        raise ConfigError(f"task {tcfg.task!r} uses {task.vocab_size} token ids, the model has vocab_size="
                          f"{config.vocab_size}")
    ep = experts = None
    if tcfg.expert_parallel > 1:          # each rank holds its E/N experts from the start: no rank reads them all
        ep = expert_parallel.init_expert_parallel(tcfg.expert_parallel, placement, config.num_experts)
        experts = ep.placement.experts_of(ep.rank)
    model = build_model(tcfg, device, dtype, preset, experts)
    start, metrics_path, state, skipped = 0, os.path.join(tcfg.out_dir, "metrics.jsonl"), None, 0
    if tcfg.resume:
        ckpt = latest_checkpoint(tcfg.out_dir)
        state = load_trainer_state(ckpt)
        tcfg = plan_resume(tcfg, state, d)
        if ModelConfig(**state["model_config"]) != model.config:       # fields added since take their defaults
            raise ConfigError(f"{ckpt} was trained with a different model config than --init_from={tcfg.init_from!r}")
        store_routers(model, tcfg)                                    # an fp32 router keeps its saved bits
        want = model.state_dict()
        model.load_state_dict({k: v.to(device=device, dtype=want[k].dtype)
                               for k, v in load_weights(ckpt, model, experts).items()})
        task.load_state_dict(state["task"])
        start, skipped = state["step"], state.get("skipped_steps", 0)
    ref_model = None
    if tcfg.kl_coef > 0:                  # a frozen copy of the initial policy (rebuilt from init_from on resume)
        ref_model = (build_model(tcfg, device, dtype, preset, experts) if tcfg.resume
                     else copy.deepcopy(model)).requires_grad_(False)
    for m in (model, ref_model) if ep else ():
        if m is not None:
            expert_parallel.shard_experts(m, ep, loaded=True)         # route its MoE layers through the exchange
    policy = build_weights(model, tcfg, rcfg, d)
    scorer, rollout_model, mp = policy.scorer, policy.rollout, policy.mp
    if mp is not None and ref_model is not None:                      # mixed precision: the reference computes in bf16
        ref_model = mp.cast(ref_model)
    opt = build_optimizer(model, tcfg)                                # the masters under mixed precision
    if state is not None:
        load_optimizer_state(scorer, opt, state["optimizer"], d.world > 1 and tcfg.parallel == "fsdp")
        state = None                                                  # free the host copy
    if d.master and tcfg.resume:
        trim_metrics(metrics_path, start)
    # The gradients (first backward) and AdamW's two moment buffers (first step; already there on resume)
    # are allocated after the sampler sizes its KV pool from the free memory: set them aside, for this
    # rank's shard of the parameters under FSDP. Activations and temporaries come out of the rest.
    param_bytes = sum(getattr(p, "to_local", lambda: p)().nbytes for p in scorer.parameters())
    reserve = mp.reserve_bytes(bool(opt.state)) if mp else (1 if opt.state else 3) * param_bytes
    sampler = Sampler(rollout_model, rcfg, reserve_bytes=reserve)
    return Run(tcfg, rcfg, d, task, policy, ref_model, opt, sampler, start, skipped, metrics_path)


def _train(tcfg: TrainConfig, rcfg: RolloutConfig, d: Dist) -> list[dict]:
    """The loop: each step reads top to bottom as its phases. A SIGINT / SIGTERM (see `cli`) ends the
    step under way, then the run saves it and stops (Interrupted)."""
    run = setup(tcfg, rcfg, d)
    run.outputs = open_outputs(run)
    d.print0(banner(run, max_new_tokens(run)))
    history, saved = [], run.start
    bar = tqdm(range(run.start, run.tcfg.steps), desc="train", disable=not (run.tcfg.progress and d.master),
               initial=run.start, total=run.tcfg.steps)
    exit_code = 1                                                     # what the logger is told, unless set below
    try:
        for step in bar:
            t0 = time.perf_counter()
            examples, outs = rollout(run, step)
            t_rollout = time.perf_counter() - t0
            rewards = torch.tensor(compute_rewards(run.task, examples, outs, run.tcfg.group_size, step + 1))
            log_samples(run, step, examples, outs, rewards)
            batch = make_batch(outs, group_advantages(rewards, run.tcfg.group_size, run.tcfg.adv_std_norm))
            old = old_policy(run, batch)
            stats, first = update(run, batch, old, step)
            row = step_metrics(run, step, batch, outs, rewards, old.audit or first, stats, t_rollout, t0)
            row.update(maybe_evaluate(run, step))
            row.update(probe(run, step))                              # --probe_every: the fixed probe's audit
            log_routes(run, step, batch, outs, rewards, old.audit or first)   # routes.jsonl, diagnostics.jsonl
            history.append(log_row(run, step, row))
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", kl=f"{row['train_rollout_kl']:.1e}",
                            flip=f"{row.get('route_flip_frac', 0):.3f}")
            if (step + 1) % run.tcfg.save_every == 0 or step + 1 == run.tcfg.steps:
                checkpoint(run, step + 1)
                saved = step + 1
            signum = stop_requested(d)
            if signum:                                                # the step is whole: save it, then stop
                if saved != step + 1:
                    checkpoint(run, step + 1)
                exit_code = 128 + signum
                raise Interrupted(step + 1, signum)
        exit_code = 0
    finally:
        bar.close()
        run.outputs.close(exit_code)
    return history


def maybe_evaluate(run: Run, step: int) -> dict:
    """--eval_data: eval.evaluate's keys every --eval_every steps and at the last step, else nothing."""
    tcfg = run.tcfg
    every = tcfg.eval_every or tcfg.steps
    if run.outputs.eval_task is None or not ((step + 1) % every == 0 or step + 1 == tcfg.steps):
        return {}
    run.weights.sync()
    run.weights.trained.eval()
    return evaluation.evaluate(run.sampler, run.outputs.eval_task, samples=tcfg.eval_samples,
                               max_new_tokens=max_new_tokens(run), temperature=run.rcfg.temperature,
                               top_p=run.rcfg.top_p, top_k=run.rcfg.top_k,
                               stop_token_ids=run.task.stop_token_ids, step=step + 1, d=run.d)


# ---- the phases of a step -------------------------------------------------------------------------
def rollout(run: Run, step: int):
    """Every rank draws the same global prompts and samples its own slice (groups stay whole)."""
    tcfg, rcfg, d = run.tcfg, run.rcfg, run.d
    run.weights.sync()
    run.weights.trained.eval()
    n_prompts = tcfg.prompts_per_step // d.world
    examples = run.task.sample(tcfg.prompts_per_step)[d.rank * n_prompts:(d.rank + 1) * n_prompts]
    try:
        outs = run.sampler.generate([ex.prompt for ex in examples], max_new_tokens=max_new_tokens(run),
                                    n=tcfg.group_size, temperature=rcfg.temperature, top_p=rcfg.top_p,
                                    top_k=rcfg.top_k, stop_token_ids=run.task.stop_token_ids,
                                    seed=tcfg.seed * 1_000_003 + step, progress=False,
                                    index_offset=d.rank * n_prompts * tcfg.group_size)
    except ValueError as e:                                           # the sampler's input checks: a prompt too long...
        raise ConfigError(f"step {step + 1}: the sampler refused this step's prompts: {e}") from None
    return examples, outs


def max_new_tokens(run: Run) -> int:
    return run.rcfg.max_new_tokens or run.task.max_new_tokens


def unchecked(model: Transformer) -> Callable:
    """model.score without its input checks (they read tensors back): for batches make_batch built."""
    return partial(model.score, check=False)


def trainer_capacity(run: Run):
    """The trainer's forwards under --train_capacity_factor (model.capacity_limit); dropless at 0."""
    if run.tcfg.train_capacity_factor == 0:
        return contextlib.nullcontext()
    if run.capacity is None:
        run.capacity = CapacityLimit(run.tcfg.train_capacity_factor)
    return capacity_limit(run.capacity)


# ---- micro-batches: whole sequences packed by a token budget (packing.pack), or padded slices ----------
# A packed micro-batch puts its sequences back to back in one row, each with its own positions and
# attending only to itself, so no position is padding and every token gets the padded forward's bits
# (packing.Packing). Its results are laid back per sequence, right-padded to the batch's width, so the
# loss math (losses.py, the global normalisers of minibatch_step) is the padded path's, unchanged.
@dataclasses.dataclass
class Micro:
    """One forward/backward: rows of the rollout batch and, packed, where their sequences lie."""
    rows: torch.Tensor               # (k,) int64, in the forward's order
    packing: Packing | None          # None: the rows' right-padded (k, T) tokens


def micro_batches(run: Run, rows: torch.Tensor, lengths: torch.Tensor) -> list[Micro]:
    """rows (of the rollout batch, whose lengths (B,) are given) as micro-batches.

    Packed (--micro_batch_tokens=N): packing.pack's first fit decreasing, each micro-batch at most N
    tokens (a longer sequence alone) and, with --micro_batch_size=S, at most S sequences. A function of
    the rows' lengths and the config alone: the same micro-batches on every run, rank and rank count
    (under torchrun, even_out then cuts a rank's to the count of the rank with the most).
    Padded (--micro_batch_tokens=0): consecutive slices of S rows (0: a rank's minibatch)."""
    tcfg = run.tcfg
    if tcfg.micro_batch_tokens == 0:
        k = tcfg.micro_batch_size or tcfg.minibatch_size // run.d.world
        return [Micro(rows[lo:lo + k], None) for lo in range(0, len(rows), k)]
    n = lengths[rows].tolist()                                        # host tensors: make_batch's
    out = []
    for mb in pack(n, tcfg.micro_batch_tokens):
        cap = tcfg.micro_batch_size or len(mb.indices)                # cut into pieces of at most S sequences
        for lo in range(0, len(mb.indices), cap):
            ix = list(mb.indices[lo:lo + cap])
            out.append(Micro(rows[ix], Packing.concat([n[i] for i in ix])))
    return out


def even_out(micros: list[Micro], n: int) -> list[Micro]:
    """micros cut until there are n: the packed one with the most tokens (the first of equals) is halved,
    again and again. Under torchrun every rank runs as many forwards (FSDP2 all-gathers the weights in
    each); n is the most any rank packed, never more than a rank's sequences, so a cut always exists."""
    micros = list(micros)
    while len(micros) < n:
        cuttable = [i for i, m in enumerate(micros) if len(m.rows) > 1]
        j = max(cuttable, key=lambda i: (sum(micros[i].packing.lengths), -i))
        m, h = micros[j], len(micros[j].rows) // 2
        L = m.packing.lengths
        micros[j:j + 1] = [Micro(m.rows[:h], Packing.concat(L[:h])), Micro(m.rows[h:], Packing.concat(L[h:]))]
    return micros


def unpack(packing: Packing, x: torch.Tensor, width: int, fill=0) -> torch.Tensor:
    """A packed result (1, N - 1 or N, ...) laid out per sequence as the padded forward's: (k, width, ...),
    `fill` past each sequence (a log-prob column a sequence does not own is masked, as padded)."""
    y = packing.to_padded(x, fill)                                    # (k, longest, ...)
    if y.shape[1] >= width:
        return y[:, :width]
    return torch.cat([y, y.new_full((y.shape[0], width - y.shape[1], *y.shape[2:]), fill)], dim=1)


def forward(run: Run, score: Callable, mb: Batch, micro: Micro, *, grad: bool, with_entropy: bool = False,
            replay: torch.Tensor | None = None) -> Scored:
    """One forward of the micro-batch mb (rows micro.rows of the rollout batch) through score: the
    trainer's scorer (DDP / FSDP2 hook its call) or unchecked(model) (the old and reference policies);
    under R3 it replays the rollout's routes, else `replay` if given (--replay=old), packed with them
    (-1 where unrecorded). Returns logp (k, T-1), routes (k, T, n_moe, k) and the route detail per
    sequence, packed or not. Nothing here reads a tensor back from the device: make_batch and
    pack_routes checked the batch on the host."""
    dev, T, pk = run.d.device, mb.tokens.shape[1], micro.packing
    tokens, routes = mb.tokens, mb.routes if run.tcfg.replay == "r3" else replay
    if pk is not None:
        tokens = pk.from_padded(tokens)                               # (1, sum of lengths)
        routes = None if routes is None else pk.from_padded(routes, fill=-1)
    with torch.set_grad_enabled(grad), trainer_capacity(run):
        out = score(tokens.to(dev), temperature=run.rcfg.temperature,
                    routes=None if routes is None else routes.to(dev),
                    with_entropy=with_entropy, logits_chunk=run.tcfg.logits_chunk, packing=pk, route_detail=True)
        logp, used, entropy, detail = out[0], out[1], out[2] if with_entropy else None, out[-1]
        if pk is not None:
            logp, used = unpack(pk, logp, T - 1), unpack(pk, used, T, fill=-1)
            entropy = None if entropy is None else unpack(pk, entropy, T - 1)
            detail = RouteDetail(*(unpack(pk, x, T) for x in (detail.weights, detail.margin, detail.entropy)))
    return Scored(logp, used, entropy, micro.rows, detail)


def on_host(parts: list[Scored]) -> Scored:
    """Forwards of consecutive row sets as one, on the host: logp in fp32, detached (entropy dropped)."""
    detail = None
    if all(p.detail is not None for p in parts):
        detail = RouteDetail(*(torch.cat([getattr(p.detail, f).cpu() for p in parts]) for f in ("weights", "margin", "entropy")))
    return Scored(torch.cat([p.logp.detach().float().cpu() for p in parts]), torch.cat([p.routes.cpu() for p in parts]),
                  None, torch.cat([p.rows for p in parts]), detail)


def in_row_order(s: Scored) -> Scored:
    """s with its rows ascending: forwards over the whole rollout batch, as (B, ...) tensors."""
    order = torch.argsort(s.rows)
    detail = None if s.detail is None else RouteDetail(s.detail.weights[order], s.detail.margin[order],
                                                       s.detail.entropy[order])
    return Scored(s.logp[order], s.routes[order], None, s.rows[order], detail)


def old_policy(run: Run, batch: Batch) -> OldPolicy:
    """The old policy's log-probs (the rollout's, unless recomputed), the reference's, the corrections."""
    micros = micro_batches(run, torch.arange(batch.tokens.shape[0]), batch.lengths)
    chunks = [(batch.select(m.rows), m) for m in micros]

    def scored(model):                                                # (B, ...) in the batch's row order
        return in_row_order(on_host([forward(run, unchecked(model), c, m, grad=False) for c, m in chunks]))
    logp, audit, ref_logp = batch.rollout_logp, None, None
    if run.tcfg.recompute_old_logp:
        audit = scored(run.weights.full)
        logp = audit.logp
    if run.ref_model is not None:
        ref_logp = scored(run.ref_model).logp
    weights = correction_weights(logp, batch.rollout_logp, batch.mask, run.tcfg)
    loss_mask = batch.mask
    if run.tcfg.rejected_tokens == "drop" and rejects(run.tcfg):        # out of the loss, its mean and the KL
        loss_mask = batch.mask * (weights > 0)
    return OldPolicy(logp, ref_logp, weights, loss_mask, audit)


def old_routes(run: Run, old: OldPolicy, rows: torch.Tensor) -> torch.Tensor | None:
    """--replay=old: the routes the old-policy forward chose for these rows (vanilla routing replay)."""
    return old.audit.routes[rows] if run.tcfg.replay == "old" else None


@dataclasses.dataclass
class MinibatchResult:
    """One minibatch's forward and backward (gradients clipped, not yet applied)."""
    loss: float                      # this rank's share of the global minibatch loss
    clip_frac: float                 # clipped tokens over the global minibatch's tokens
    grad_norm: float                 # before clipping, over every rank
    scored: Scored                   # its forward, on the host (rows idx)
    entropy_sum: float               # entropy summed over its response tokens
    filtered: float                  # response tokens the route filter masked or down-weighted
    tokens: float                    # response tokens


@dataclasses.dataclass
class UpdateStats:
    """A step's minibatches, summed: loss, clip_frac, grad_norm over the applied updates; the entropy and
    the route filter over every forward (a skipped update's forward still measured the policy)."""
    loss: float = 0.0
    clip_frac: float = 0.0
    grad_norm: float = 0.0
    updates: int = 0
    entropy_sum: float = 0.0
    filtered: float = 0.0
    tokens: float = 0.0

    def add_forward(self, r: MinibatchResult) -> None:
        self.entropy_sum += r.entropy_sum
        self.filtered += r.filtered
        self.tokens += r.tokens

    def add_update(self, r: MinibatchResult) -> None:
        self.grad_norm += r.grad_norm
        self.loss += r.loss
        self.clip_frac += r.clip_frac
        self.updates += 1

    def means(self) -> dict:
        n = self.updates
        return {k: getattr(self, k) / n if n else math.nan for k in ("loss", "clip_frac", "grad_norm")}


def update(run: Run, batch: Batch, old: OldPolicy, step: int) -> tuple[UpdateStats, Scored]:
    """Minibatches of the rollout batch, each one optimizer step (skipped if its loss or gradient is not
    finite and --skip_nonfinite_steps allows). Returns the summed stats and the first minibatch's
    forward: the policy had not moved yet, so it measures train vs rollout."""
    tcfg, d, model = run.tcfg, run.d, run.weights.trained
    B = batch.tokens.shape[0]
    mb_size = min(tcfg.minibatch_size // d.world, B)
    model.train()
    stats, first = UpdateStats(), None
    perm_gen = torch.Generator().manual_seed(tcfg.seed * 7919 + step * 131 + d.rank)
    for epoch in range(tcfg.epochs):
        perm = torch.randperm(B, generator=perm_gen)
        for lo in range(0, B, mb_size):
            idx = perm[lo:lo + mb_size]
            r = minibatch_step(run, batch, old, idx, step)
            if first is None:
                first = r.scored
            stats.add_forward(r)
            if not update_is_finite(step + 1, r.loss, r.grad_norm, run.skipped, tcfg, d):
                run.skipped += 1                                      # as if this update had not run
                continue
            run.opt.step()
            if tcfg.expert_bias_update_rate > 0:                      # aux-loss-free balancing of the router bias
                # (N, n_moe, k) at the response-scoring positions of the forward's rows
                chosen = r.scored.routes[:, :-1][batch.mask[r.scored.rows].bool()]
                load = expert_load(chosen, model.config.num_experts)
                update_expert_bias(model, load.to(d.device), tcfg.expert_bias_update_rate, d)
            if run.weights.mp is not None:                            # mixed precision: recast the compute copy
                run.weights.mp.refresh()
            stats.add_update(r)
    return stats, first


def minibatch_step(run: Run, batch: Batch, old: OldPolicy, idx: torch.Tensor, step: int) -> MinibatchResult:
    """Forward and backward of one minibatch in micro-batches, gradients clipped (not yet applied)."""
    tcfg, d, device = run.tcfg, run.d, run.d.device
    # normalisers over the global minibatch, so every rank's loss adds up to the global one
    n_tok, n_seq = all_sum(float(old.loss_mask[idx].sum()), d), len(idx) * d.world
    lr = lr_at(step, tcfg)
    for g in run.opt.param_groups:
        g["lr"] = lr
    run.opt.zero_grad(set_to_none=True)
    micros = micro_batches(run, idx, batch.lengths)
    if d.world > 1 and tcfg.micro_batch_tokens:                       # packed: as many forwards on every rank
        micros = even_out(micros, int(all_cat(torch.tensor([len(micros)]), d).max()))
    total, clipped_tok, entropy_sum, filtered, tokens, parts = 0.0, 0.0, 0.0, 0.0, 0.0, []
    for n, micro in enumerate(micros):
        sub = micro.rows
        mb = batch.select(sub)
        with grad_sync(run.weights.scorer, enabled=n == len(micros) - 1):    # the gradients reduce once
            out = forward(run, run.weights.scorer, mb, micro, grad=True, with_entropy=True,
                          replay=old_routes(run, old, sub))
            logp = out.logp.float()
            mask = old.loss_mask[sub].to(device)
            loss_tok, clipped = policy_loss(logp, old.logp[sub].to(device), mb.adv.to(device), mask, tcfg)
            loss_tok = loss_tok * old.weights[sub].to(device)
            if tcfg.route_filter != "none":                           # rollout vs trainer experts, per token
                overlap = token_overlap(mb.routes[:, :-1].to(device), out.routes[:, :-1])
                keep = route_filter_weights(overlap, tcfg.route_filter, tcfg.route_filter_threshold,
                                            tcfg.route_filter_level, mb.mask.to(device))
                loss_tok = loss_tok * keep
                filtered += ((keep < 1) * mb.mask.to(device)).sum().item()
            if run.ref_model is not None:
                loss_tok = loss_tok + tcfg.kl_coef * kl_penalty(logp, old.ref_logp[sub].to(device), tcfg.kl_estimator)
            loss = aggregate(loss_tok, mask, tcfg.aggregation, n_tok, n_seq, max_new_tokens(run))
            (loss * d.world).backward()                               # DDP / FSDP average over ranks
        total += loss.item()
        clipped_tok += (clipped.float() * mask).sum().item() / n_tok
        entropy_sum += (out.entropy * mb.mask.to(device)).sum().item()
        tokens += mb.mask.sum().item()
        parts.append(dataclasses.replace(out, logp=logp))
    # what the wrappers did not reduce (mixed precision's fp32 grads, expert shards), then clipping
    gn = finish_grads(run.weights.trained, run.weights.mp, tcfg.grad_clip, d)   # the masters
    return MinibatchResult(total, clipped_tok, gn, on_host(parts), entropy_sum, filtered, tokens)


def step_metrics(run: Run, step: int, batch: Batch, outs, rewards, audited: Scored, stats: UpdateStats,
                 t_rollout: float, t0: float) -> dict:
    """One row of metrics (reduced over ranks): rewards, the update's stats, the train-rollout audit of
    `audited` (the recomputed old log-probs, else the first minibatch's forward)."""
    rows, n_experts = audited.rows, run.weights.trained.config.num_experts
    lengths = torch.tensor([len(o.tokens) for o in outs], dtype=torch.float)
    all_rewards = all_cat(rewards, run.d)
    row = {"step": step + 1, "reward_mean": all_rewards.mean().item(), "reward_std": all_rewards.std().item(),
           "response_len": all_cat(lengths, run.d).mean().item(),
           **stats.means(),
           **mismatch_metrics(audited.logp, batch.rollout_logp[rows], batch.mask[rows]),
           **route_audit(batch.routes[rows], audited.routes, batch.route_mask[rows], n_experts, audited.detail),
           # the entropy of softmax(logits / T) at the response tokens, from the training forwards
           "entropy": stats.entropy_sum / stats.tokens,
           "neg_logp_mean": -(batch.rollout_logp * batch.mask).sum().item() / batch.mask.sum().item(),
           "route_filtered_frac": stats.filtered / stats.tokens,
           "lr": lr_at(step, run.tcfg), "rollout_tokens_per_s": lengths.sum().item() / t_rollout,
           "step_time": time.perf_counter() - t0, "preemptions": run.sampler.num_preemptions,
           "skipped_steps": run.skipped}
    if run.capacity is not None:                                      # --train_capacity_factor's drops
        row.update(run.capacity.pop_metrics())
    ep = expert_parallel.of(run.weights.trained)
    if ep is not None:                                                # rows per rank: the device load
        row.update(expert_parallel.device_load(audited.routes[batch.route_mask[rows]], ep))
    return reduce_metrics(row, run.d)


# ---- what the routes say: routes.jsonl, diagnostics.jsonl, the fixed probe ------------------------
def log_routes(run: Run, step: int, batch: Batch, outs, rewards, audited: Scored) -> None:
    """The per-expert load histograms of the step (routes.jsonl, at logged steps, summed over ranks)
    and, with --diagnostics=N, the step's most mismatched sequences (diagnostics.jsonl, audit.diagnostics)."""
    rows, E = audited.rows, run.weights.trained.config.num_experts
    if is_log_step(run, step):
        m = batch.route_mask[rows]
        loads = torch.stack([expert_load(batch.routes[rows][m], E), expert_load(audited.routes[m], E)])
        loads = all_cat(loads[None], run.d).sum(0)                    # (2, n_moe, E) over every rank
        append_jsonl(run, step, "routes.jsonl", [{"step": step + 1, "expert_load_rollout": loads[0].tolist(),
                                                  "expert_load_train": loads[1].tolist()}])
    if run.tcfg.diagnostics:
        found = audit.diagnostics(step + 1, outs, rows, audited.logp, audited.routes, batch.routes[rows],
                                  rewards, run.tcfg.diagnostics, decode=getattr(run.task, "decode", None),
                                  train_margin=None if audited.detail is None else audited.detail.margin)
        if run.d.world > 1:
            every = [None] * run.d.world
            dist.all_gather_object(every, found)
            found = [r for part in every for r in part]
        append_jsonl(run, step, "diagnostics.jsonl", found)


@dataclasses.dataclass
class Probe:
    """The fixed probe set (--probe_every): K prompts drawn once, and the first probe's sequences with
    the trainer's routes of them then (what route drift is measured against)."""
    prompts: list[list[int]]
    first: Batch | None = None
    first_routes: torch.Tensor | None = None     # (K, T, n_moe, k)


def probe(run: Run, step: int) -> dict:
    """--probe_every=N: every N steps the probe prompts are rolled out greedily by the current weights
    and re-scored by the trainer: probe_* is the audit of that rollout (as the step's), and
    probe_route_drift the share of (token, layer) of the first probe's sequences whose top-k set the
    current weights change. Drawing the prompts leaves the task's own stream where it was."""
    tcfg = run.tcfg
    if not tcfg.probe_every or (step + 1) % tcfg.probe_every:
        return {}
    if run.probe is None:
        state = run.task.state_dict()
        run.probe = Probe([ex.prompt for ex in run.task.sample(tcfg.probe_prompts)])
        run.task.load_state_dict(state)
    run.weights.sync()
    outs = run.sampler.generate(run.probe.prompts, max_new_tokens=max_new_tokens(run), temperature=0.0,
                                stop_token_ids=run.task.stop_token_ids, progress=False)
    batch = make_batch(outs, torch.zeros(len(outs)))
    logp, routes, detail = probe_score(run, batch.tokens)
    E = run.weights.full.config.num_experts
    row = {**mismatch_metrics(logp, batch.rollout_logp, batch.mask),
           **route_audit(batch.routes, routes, batch.route_mask, E, detail)}
    if run.probe.first is None:
        run.probe.first, run.probe.first_routes = batch, routes
    _, now, _ = probe_score(run, run.probe.first.tokens)
    row["route_drift"] = audit.route_drift(run.probe.first_routes, now, run.probe.first.route_mask)
    return {f"probe_{k}": v for k, v in row.items()}


def probe_score(run: Run, tokens: torch.Tensor):
    """The trainer's own forward of the probe (no replay), at the greedy rollout's temperature 0."""
    with torch.no_grad():
        logp, routes, detail = unchecked(run.weights.full)(tokens.to(run.d.device), temperature=0.0, route_detail=True)
    return logp.float().cpu(), routes.cpu(), RouteDetail(detail.weights.cpu(), detail.margin.cpu(), detail.entropy.cpu())


def checkpoint(run: Run, step: int) -> None:
    """Check the weights (finite, the same on every rank), then rank 0 writes the checkpoint."""
    run.weights.sync()
    check_finite_weights(run.weights.full, step)                      # on every rank: they stop together
    digest = check_in_sync(run.weights.full, run.d)                   # mixed precision: the compute copy
    mp = run.weights.mp
    if mp is not None and not run.fsdp:                               # mixed precision: and the masters
        check_in_sync(mp.master, run.d)
    masters = mp.master_state() if mp is not None else None           # collective under FSDP2 and EP
    opt_state = optimizer_state(run.weights.scorer, run.opt, run.fsdp)   # collective under FSDP2 and EP
    full = expert_parallel.whole_model(run.weights.full)              # EP: whole experts (collective)
    if run.d.master:
        path = save_checkpoint(run.tcfg.out_dir, step, full, opt_state, run.tcfg, run.rcfg, run.task,
                               extra={"skipped_steps": run.skipped}, masters=masters,
                               save_dtype=run.tcfg.save_dtype or run.tcfg.dtype, keep=run.tcfg.keep_checkpoints,
                               identity=run.outputs.identity if run.outputs is not None else None)
        line = f"step {step}: saved {path}"
        tqdm.write(line) if run.tcfg.progress else print(line, flush=True)
    if run.d.world > 1:
        dist.barrier()
        run.d.print0(f"step {step}: weights identical on {run.d.world} ranks (sha256 {digest[:16]})")


def main(argv: list[str]) -> None:
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        print(help_text(tcfg, rcfg))
        return
    if "--plan" in argv:                        # bytes per rank, nothing loaded (plan.py)
        return print(plan.main([a for a in argv if a != "--plan"]))
    overrides = parse_args(argv)
    if parse_bool("resume", overrides.get("resume", "false")):
        # continue the saved run: its configs, with this command line's overrides on top
        ckpt = latest_checkpoint(overrides.get("out_dir", tcfg.out_dir))
        tcfg, rcfg = saved_configs(load_trainer_state(ckpt), ckpt)
    apply_overrides(overrides, tcfg, rcfg)
    t0 = time.time()
    history = train(tcfg, rcfg)
    if history and int(os.environ.get("RANK", "0")) == 0:
        print(summary(history, time.time() - t0, tcfg.out_dir))


LAUNCHER_GRACE_S = 10.0     # a rank but 0, on a mistake, waits this long for rank 0 to print it first


def cli(argv: list[str]) -> None:
    """main, with user mistakes and stopped runs as one line `error: ...` and exit status 1, no traceback;
    under torchrun rank 0 alone prints it (every rank meets the same mistake), every rank exits 1 and
    tells torchrun why (`tell_launcher`). The other ranks first give rank 0 up to LAUNCHER_GRACE_S to
    print and fail: torchrun stops every rank once one has failed, and a rank 0 still importing when a
    faster rank failed would be stopped before its line.
    SIGINT / SIGTERM save the last whole step and exit 130 / 143 (128 + the signal's number)."""
    rank0 = int(os.environ.get("RANK", "0")) == 0
    handlers = {sig: signal.signal(sig, StopRequest.handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        main(argv)
    except (ConfigError, CheckpointError, RunError, TaskError) as e:
        tell_launcher(f"error: {e}")
        if not rank0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)             # torchrun's stop ends the wait
            time.sleep(LAUNCHER_GRACE_S)
        sys.exit(f"error: {e}" if rank0 else 1)
    except Interrupted as e:
        tell_launcher(f"interrupted at step {e.step}; resume with --resume=true")
        if rank0:
            print(f"interrupted at step {e.step}; resume with --resume=true", file=sys.stderr, flush=True)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:                                         # a second signal, or one before the loop
        if rank0:
            print("interrupted; the step under way is not saved (the last checkpoint, if any, is kept)",
                  file=sys.stderr, flush=True)
        sys.exit(128 + (StopRequest.signum or signal.SIGINT))
    finally:
        StopRequest.signum = 0
        for sig, h in handlers.items():
            signal.signal(sig, h)


if __name__ == "__main__":
    cli(sys.argv[1:])
