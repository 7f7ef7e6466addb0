"""RL post-training of the MoE transformer: GRPO / GSPO and variants, with the train-inference fixes.

    python train.py                                   # CPU default: a tiny MoE learns to copy digits
    python train.py --help                            # every option and its default
    python train.py --loss=gspo --replay=r3 --steps=50 --out_dir=out/gspo
    python train.py --resume --out_dir=out            # continue from out/latest

Each step reads top to bottom as its phases (`_train`):
1. rollout: sample `group_size` responses for each of `prompts_per_step` prompts with the Sampler (the
   same model object, the same kernels);
2. rewards and advantages: the task's rewards, group-normalised (A_i = (r_i - mean) / (std + 1e-6));
3. the old policy: its log-probs (the rollout's own bits, unless --recompute_old_logp), the reference's
   (--kl_coef) and the corrections' weights;
4. the updates: optimizer steps over minibatches of the batch, each a loss over micro-batches of
   `model.score` (losses.token_objective), the routes replayed or filtered as asked (replay.py); under
   torchrun the batch is global and the micro-batches are dealt to the ranks, their gradients summed
   exactly (support/exact_sum.py): the same run at every world size;
5. metrics and log: one row of metrics.jsonl, the route audit included; an eval, a probe, a checkpoint.
In the default invariant mode the rollout log-probs ARE the old policy's log-probs, so the logged
train-rollout KL, max |logp diff| and route flip fraction are exactly 0 (replay.route_audit).
Formulas: docs/design.md, "RL losses" (ratio r_t = exp(logp_t - old_logp_t)).

Where the rest lives: the objectives' tables, losses.py; a route's life, replay.py; the batch and its
micro-batches, support/packing.py; where a batch comes from (bounded staleness, in-flight updates, rollout
ranks), asynchrony/pipeline.py; the weights' copies and the end of an optimizer step, distributed.Policy;
the lab's faults, lab/faults.py; checkpoints and resume, support/checkpoint.py; what a run shows and writes,
support/runlog.py.

Reliability (docs/design.md, "Reliability"): a non-finite reward, loss or gradient norm stops the run
(or skips the step, --skip_nonfinite_steps) before it reaches the weights; checkpoints are written only
from finite weights, whole or not at all; an out_dir that holds a run is continued (--resume=true) or
started over (--overwrite=true), never overwritten silently; every user mistake is one line `error:`;
SIGINT / SIGTERM save the step under way and exit 130 / 143.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import math
import os
import signal
import sys
import time
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

import kernels
import replay
from config import ConfigError, configs, help_text, model_help, parse_args
from losses import Normalisers, correction_weights, group_advantages, rejects, token_objective
from model import Transformer
from rollout import Sampler
from support.checkpoint import (RunError, build_model, check_finite_weights, command_line_configs, load_optimizer_state,
                                optimizer_state, prepare_out_dir, resume, run_task, save_checkpoint, trim_metrics)
from support.distributed import (Dist, Policy, all_cat, all_owned, check_in_sync, gather_scored, global_batch,
                                 init_distributed, lr_at, on_host, reduce_metrics, store_routers, update_is_finite)
from support.hooks import (Hooks, PeerLost, Rollout, Stopped, Synchronous, adapt, after_update, batch_source, exported,
                           held_experts, master_device, plugin_hooks, rank_split, sampler_model, serving_hook, shard,
                           trainer_forward, whole_model, wrap_sampler)
from support.packing import (Batch, MicroBatch, Scored, in_row_order, lockstep, make_batch, micro_batches, this_ranks,
                             unpack)
from support.runlog import (Interrupted, LengthSurge, Outputs, StopRequest, banner, bar_postfix, episode_metrics,
                            latency_metrics, log_routes, log_row, open_outputs, run_cli, say,
                            stop_requested, summary, warn_low_entropy)
from support.tasks import Episodes, TaskError, compute_rewards

if TYPE_CHECKING:                     # a run's classes: config.configs_for
    from config import RolloutConfig, TrainConfig


@dataclasses.dataclass
class Run:
    """What the steps of a run share: configs, the policy's weights and optimizer, the sampler."""
    tcfg: TrainConfig
    rcfg: RolloutConfig
    d: Dist
    task: object
    policy: Policy                   # the weights' copies, the optimizer, the end of an optimizer step
    ref_model: Transformer | None    # the frozen initial policy when --kl_coef > 0
    sampler: Sampler
    start: int                       # the first step to run (> 0 on resume)
    skipped: int                     # optimizer steps skipped for a non-finite loss or gradient so far
    metrics_path: str
    outputs: Outputs | None = None   # identity of the exports, the progress bar (set by open_outputs)
    rollouts: Synchronous | None = None     # where each step's batch comes from (support/hooks.py; set by setup)
    surge: LengthSurge = dataclasses.field(default_factory=LengthSurge)   # --surge_window's detector (lr_halving/ reads it)
    sft_done: int = 0                # --sft_steps' supervised steps the weights have had (tooling/sft.py)
    hooks: list[Hooks] = dataclasses.field(default_factory=list)   # the plug-ins' (support/hooks.py)


# ---------------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------------
def train(tcfg: TrainConfig, rcfg: RolloutConfig) -> list[dict]:
    hooks = plugin_hooks(tcfg, rcfg)
    d = init_distributed(tcfg.device, rank_split(hooks))              # a plug-in's sides (--rollout_ranks), or one
    try:
        # one kernel backend for sampler and trainer: --kernels_backend, else KERNELS_BACKEND, else auto
        with kernels.set_backend(tcfg.kernels_backend or kernels.get_backend()):
            return _train(tcfg, rcfg, d, hooks)
    finally:
        if dist.is_initialized():                                     # torchrun, even with one rank
            gc.collect()           # the run's cycles (DDP's buckets, their gloo work) go while Python is alive
            dist.destroy_process_group()


def _train(tcfg: TrainConfig, rcfg: RolloutConfig, d: Dist, hooks: list[Hooks] | None = None) -> list[dict]:
    """The loop: each step reads top to bottom as its phases. A SIGINT / SIGTERM (runlog.run_cli) ends
    the step under way, then the run saves it and stops (Interrupted)."""
    rcfg.check_training(tcfg)
    hooks = plugin_hooks(tcfg, rcfg) if hooks is None else hooks
    if d.role != "train":                              # a rank a plug-in runs (--rollout_ranks: it generates)
        serving_hook(hooks, d.role).serve(tcfg, rcfg, d, hooks, Run=Run, rollout=rollout, sample=sample)
        return []
    run = setup(tcfg, rcfg, d, hooks)
    run.outputs = open_outputs(run)
    d.print0(banner(run, max_new_tokens(run), episode_tokens(run) if run.task.episodic else None))
    history, saved = [], run.start
    bar = tqdm(desc="train", disable=not run.outputs.bar, initial=run.start, total=run.tcfg.steps)
    exit_code = 1                                                     # what the hooks are told, unless set below
    try:
        for hook in run.hooks:                                        # the supervised phase (--sft_steps)
            hook.before_steps(run, forward, trainer_micro_batches, checkpoint)
        for step in range(run.start, run.tcfg.steps):
            t0 = time.perf_counter()
            ro = take_or_stop(run, step, saved)        # 1. rollout: batch `step`, now or (--max_staleness) earlier
            examples, outs, episodes = ro.examples, ro.outs, ro.episodes
            rewards = torch.tensor(compute_rewards(run.task, examples, outs, run.tcfg.group_size, step + 1, episodes))
            for hook in run.hooks:                                    # the sampled batch (trackers/' samples.jsonl)
                hook.samples(run, step, examples, outs, rewards)
            batch = make_batch(outs, group_advantages(rewards, run.tcfg.group_size, run.tcfg.adv_std_norm))  # 2.
            batch = global_batch(batch, d)                            # every rank's sequences, in global order
            old = old_policy(run, batch)                                             # 3. the old policy
            stats, first = run.rollouts.update(step, partial(update, run, batch, old, step))   # 4. the updates
            audited = old.audit or first                                             # 5. metrics and log
            row = step_metrics(run, step, batch, outs, rewards, audited, stats, ro, t0)
            if episodes is not None:                                  # a multi-turn task's (tasks.Episodes)
                row.update(episode_metrics(run, batch, outs, episodes, audited))
            for hook in run.hooks:                                    # the plug-ins': evaluations, re-plans
                row.update(hook.after_step(run, step, batch, rewards))
            mine, seen = this_ranks(batch, audited, run.d.rank, len(outs))   # per-rank files: this rank's sequences
            log_routes(run, step, mine, seen)                         # routes.jsonl
            for hook in run.hooks:                                    # a plug-in's files (diagnostics.jsonl)
                row.update(hook.rank_files(run, step, mine, outs, rewards, seen, old.held_out))
            row.update(run.surge.watch(run, row))                     # --surge_window: a response-length surge
            history.append(log_row(run, step, row))
            warn_low_entropy(run, history)
            bar.set_postfix(bar_postfix(row), refresh=False)
            bar.update()                                              # the step is done before its save line
            if (step + 1) % run.tcfg.save_every == 0 or step + 1 == run.tcfg.steps:
                checkpoint(run, step + 1)
                saved = step + 1
            signum = stop_requested(d)
            if signum:                                                # the step is whole: save it, then stop
                if saved != step + 1:
                    checkpoint(run, step + 1)
                exit_code = 128 + signum
                raise Interrupted(step + 1, signum)
        run.rollouts.close()
        exit_code = 0
    except Interrupted as e:
        exit_code = 128 + e.signum
        raise
    finally:
        bar.close()
        for hook in run.hooks:                                        # a tracker's run ends (trackers/)
            hook.finish(exit_code)
    return history


def take_or_stop(run: Run, step: int, saved: int) -> Rollout:
    """The step's batch; while it is awaited from the rollout ranks, a stop request (the launcher stopping
    the job after a rank died, or ^C) saves the last whole step and stops the run (Interrupted)."""
    try:
        return run.rollouts.take(step)
    except Stopped as e:
        if saved != step and step > 0:
            checkpoint(run, step)
        if isinstance(e, PeerLost):
            raise RunError(f"step {step + 1}: the rollout ranks stopped ({e}); step {step} is saved: resume with "
                           "--resume=true") from None
        raise Interrupted(step, StopRequest.signum or signal.SIGTERM) from None


# ---------------------------------------------------------------------------------------------------
# 1. rollout, 2. the batch
# ---------------------------------------------------------------------------------------------------
def rollout(run: Run, j: int, version: int, on_step=None, recompute_kv: bool = False) -> Rollout:
    """Batch j by the weights now (policy version `version`): every rank draws the same global prompts and
    samples its own slice (groups stay whole). An episodic task plays each sequence as an episode
    against its own environment (tasks.Episodes), token in, token out. on_step, recompute_kv: an
    in-flight update during the batch (pipeline.Colocated.update)."""
    tcfg, d = run.tcfg, run.d
    t0 = time.perf_counter()
    n_prompts = tcfg.prompts_per_step // d.world
    examples = run.task.sample(tcfg.prompts_per_step)[d.rank * n_prompts:(d.rank + 1) * n_prompts]
    offset = d.rank * n_prompts * tcfg.group_size
    episodes, budget = None, None
    if run.task.episodic:
        budget = episode_tokens(run)
        check_episode_room(run, examples, budget, j + 1)
        episodes = Episodes(run.task, examples, tcfg.group_size, j + 1, run.policy.master.config.vocab_size, offset)
    outs, counters = sample(run, j, [ex.prompt for ex in examples], max_new_tokens(run), n=tcfg.group_size,
                            index_offset=offset, on_turn_end=None if episodes is None else episodes.on_turn_end,
                            max_episode_tokens=budget, version=version, on_step=on_step, recompute_kv=recompute_kv)
    return Rollout(examples, outs, None if episodes is None else episodes.rewards, version, time.perf_counter() - t0,
                   counters)


def sample(run: Run, j: int, prompts: list[list[int]], max_new: int | list[int], draw: int | None = None,
           **kw) -> tuple[list, dict]:
    """Sampler.generate of batch j's prompts under the run's settings -> (outputs, the sampler's counters).
    draw: what keys the random draws (the batch j, or a partial rollout's round: asynchrony/partial_rollout.py); kw:
    generate's others (n, index_offset, on_turn_end, max_episode_tokens, version, on_step, recompute_kv)."""
    tcfg, rcfg = run.tcfg, run.rcfg
    run.policy.refresh()
    run.policy.master.eval()
    try:
        outs = run.sampler.generate(prompts, max_new_tokens=max_new, temperature=rcfg.temperature,
                                    **rcfg.sampling_filters(), stop_token_ids=run.task.stop_token_ids, progress=False,
                                    seed=tcfg.seed * 1_000_003 + (j if draw is None else draw), **kw)
    except TaskError:                                                  # an environment's answer: its own line
        raise
    except ValueError as e:                                           # the sampler's input checks: a prompt too long...
        raise ConfigError(f"step {j + 1}: the sampler refused this step's prompts: {e}") from None
    return outs, run.sampler.counters


def episode_tokens(run: Run) -> int:
    """An episode's token budget after its prompt: --max_episode_tokens, else the task's."""
    return run.rcfg.max_episode_tokens or run.task.max_episode_tokens


def check_episode_room(run: Run, examples, budget: int, step: int) -> None:
    """An episode must fit the context whole: its prompt and the budget (one line naming it, before
    anything is sampled or trained from it)."""
    context = run.policy.master.config.max_position_embeddings
    for i, ex in enumerate(examples):
        if len(ex.prompt) + budget > context:
            raise ConfigError(f"step {step}, episode {i * run.tcfg.group_size}: its prompt of {len(ex.prompt)} tokens "
                              f"and --max_episode_tokens={budget} go past the context of {context} tokens "
                              "(max_position_embeddings): lower --max_episode_tokens or shorten the prompts")


def max_new_tokens(run: Run) -> int:
    return run.rcfg.max_new_tokens or run.task.max_new_tokens


# ---------------------------------------------------------------------------------------------------
# 3. the old policy
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class OldPolicy:
    """What the updates weigh against: the old policy's log-probs, the reference's, correction weights."""
    logp: torch.Tensor               # (B, T-1): the rollout's, or the trainer's recomputed ones
    ref_logp: torch.Tensor | None    # (B, T-1) when --kl_coef > 0
    weights: torch.Tensor | None     # (B, T-1) the correction's importance weights (None without one)
    loss_mask: torch.Tensor          # (B, T-1) the tokens the loss counts (rejected ones dropped if asked)
    audit: Scored | None             # the recomputed old log-probs: a trainer forward before any update
    held_out: torch.Tensor           # (n,) rows a plug-in held out of loss_mask (Hooks.hold_out)


def old_policy(run: Run, batch: Batch) -> OldPolicy:
    """The old policy's log-probs (the rollout's, unless recomputed), the reference's, the corrections."""
    tcfg = run.tcfg
    micros = trainer_micro_batches(run, torch.arange(batch.tokens.shape[0]), batch.lengths)
    own = "r3" if tcfg.replay == "r3" else "none"     # R3 here too; under `old` these are the routes replayed later

    def scored(model):                                                # (B, ...) in the batch's row order
        score = partial(model.score, check=False)                     # no input checks (they read tensors back)
        parts = {}                                                    # micro-batch index (None: a null one) -> forward
        for i, micro in lockstep(micros, batch.lengths, run.d):       # this rank's share of the micro-batches
            mb = batch.select(micro.rows)
            parts[i] = forward(run, score, mb, micro, grad=False, counted=i is not None,
                               routes=replay.routes_to_replay(own, mb.routes, None))
        return in_row_order(gather_scored(parts, [len(m.rows) for m in micros], run.d))
    logp, audit, ref_logp = batch.rollout_logp, None, None
    if tcfg.recompute_old_logp:
        audit = scored(run.policy.full)
        logp = audit.logp
    if run.ref_model is not None:
        ref_logp = scored(run.ref_model).logp
    loss_mask, held = batch.mask, torch.zeros(0, dtype=torch.long)
    for hook in run.hooks:                                            # sequences a plug-in holds out (diagnostics/)
        loss_mask, held = hook.hold_out(run, batch, audit, loss_mask, held)
    weights = None
    if tcfg.correction != "none":
        weights = correction_weights(logp, batch.rollout_logp, batch.mask, tcfg)
        if tcfg.rejected_tokens == "drop" and rejects(tcfg):           # out of the loss, its mean and the KL
            loss_mask = loss_mask * (weights > 0)
    return OldPolicy(logp, ref_logp, weights, loss_mask, audit, held)


# ---------------------------------------------------------------------------------------------------
# 4. the updates
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class MinibatchResult:
    """One minibatch's forward and backward (gradients clipped, not yet applied); every sum is over the
    global minibatch, its micro-batches' values added in their order (the same at every world size)."""
    loss: float                      # the global minibatch loss
    clip_frac: float                 # clipped tokens over the global minibatch's tokens
    grad_norm: float                 # before clipping, over every rank
    scored: Scored | None            # this rank's forwards, on the host (None: it ran none of the micro-batches)
    entropy_sum: float               # entropy summed over its response tokens
    filtered: float                  # response tokens the route filter masked or down-weighted
    tokens: float                    # response tokens
    gathered: Scored | None = None   # with audit=True: every rank's forwards, in the micro-batches' order


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
        for k in ("entropy_sum", "filtered", "tokens"):
            setattr(self, k, getattr(self, k) + getattr(r, k))

    def add_update(self, r: MinibatchResult) -> None:
        self.grad_norm += r.grad_norm
        self.loss += r.loss
        self.clip_frac += r.clip_frac
        self.updates += 1

    def means(self) -> dict:
        return {k: getattr(self, k) / self.updates if self.updates else math.nan for k in ("loss", "clip_frac", "grad_norm")}


def update(run: Run, batch: Batch, old: OldPolicy, step: int) -> tuple[UpdateStats, Scored]:
    """Minibatches of the rollout batch, each one optimizer step (skipped if its loss or gradient is not
    finite and --skip_nonfinite_steps allows). Returns the summed stats and the first minibatch's
    forward: the policy had not moved yet, so it measures train vs rollout. The minibatches are drawn
    from the global batch with a generator of the step alone: the same at every world size."""
    tcfg, policy, B = run.tcfg, run.policy, batch.tokens.shape[0]
    mb_size = min(tcfg.minibatch_size, B)
    policy.master.train()
    stats, first = UpdateStats(), None
    perm_gen = torch.Generator().manual_seed(tcfg.seed * 7919 + step * 131)
    for epoch in range(tcfg.epochs):
        perm = torch.randperm(B, generator=perm_gen)
        for lo in range(0, B, mb_size):
            mode = replay.replay_mode(tcfg.replay, tcfg.replay_steps, epoch * -(-B // mb_size) + lo // mb_size)
            r = minibatch_step(run, batch, old, perm[lo:lo + mb_size], step, mode, audit=first is None)
            first = first or r.gathered
            stats.add_forward(r)
            if not update_is_finite(step + 1, r.loss, r.grad_norm, run.skipped, tcfg, run.d):
                run.skipped += 1                                      # as if this update had not run
                continue
            policy.step(partial(after_update, run.hooks, policy, r.scored, batch))   # router_training/'s bias
            stats.add_update(r)
    return stats, first


MICRO_STATS = ("loss", "clipped", "entropy_sum", "filtered", "tokens")   # micro_step's sums, then the hooks' micro_stats


def minibatch_step(run: Run, batch: Batch, old: OldPolicy, idx: torch.Tensor, step: int, mode: str,
                   audit: bool = False) -> MinibatchResult:
    """Forward and backward of one minibatch: micro-batches cut from it (the same at every world size)
    and dealt to the ranks in lockstep; the gradients summed over them and the ranks, clipped (not yet
    applied). mode: the replay mode of this update (replay.replay_mode). audit: also gather every rank's
    forwards (MinibatchResult.gathered)."""
    tcfg, policy = run.tcfg, run.policy
    # normalisers over the global minibatch, so the micro-batches' losses add up to the global one
    norm = Normalisers.of(old.loss_mask, idx, old.held_out, max_new_tokens(run), batch.lengths)
    policy.start_minibatch(lr_at(step, tcfg, run.hooks))
    micros = trainer_micro_batches(run, idx, batch.lengths)
    steps = lockstep(micros, batch.lengths, run.d)
    width = len(MICRO_STATS) + sum(len(h.micro_stats) for h in run.hooks)
    table = torch.zeros(len(micros), width, dtype=torch.float64)     # row i: micro-batch i's, by its rank
    parts = {}                                                        # micro-batch index (None: a null one) -> forward
    for n, (i, micro) in enumerate(steps):
        with policy.grad_sync(last=n == len(steps) - 1):
            parts[i], sums = micro_step(run, batch, old, micro, norm, mode, counted=i is not None)
        if i is not None:
            table[i] = torch.tensor(sums, dtype=torch.float64)
    gn = policy.finish_grads()          # summed over ranks (exact, or the wrappers' fp32), clipped
    loss, clipped, entropy, filtered, tokens, *extra = (sum(col) for col in all_owned(table, run.d).T.tolist())
    for h in run.hooks:                                               # the plug-ins' sums (--router_aux_loss_coef)
        h.minibatch_sums(extra[:len(h.micro_stats)])
        extra = extra[len(h.micro_stats):]
    real = sorted(i for i in parts if i is not None)
    scored = on_host([parts[i] for i in real]) if real else None
    gathered = gather_scored(parts, [len(m.rows) for m in micros], run.d) if audit else None
    return MinibatchResult(loss, clipped, gn, scored, entropy, filtered, tokens, gathered)


def micro_step(run: Run, batch: Batch, old: OldPolicy, micro: MicroBatch, norm: Normalisers, mode: str,
               counted: bool) -> tuple[Scored, list[float]]:
    """One micro-batch's forward and backward (its gradients go where Policy.grad_sync sends them) and
    its MICRO_STATS. A null micro-batch (counted=False) runs the same ops, its loss times 0."""
    tcfg, device = run.tcfg, run.d.device
    sub, mb = micro.rows, batch.select(micro.rows)
    old_routes = None if old.audit is None else old.audit.routes[sub]
    out = forward(run, run.policy.trainer, mb, micro, grad=True, with_entropy=True, counted=counted,
                  entropy_grad=any(h.entropy_grad for h in run.hooks), routes=replay.routes_to_replay(mode, mb.routes, old_routes))
    logp = out.logp.float()
    mask, response = old.loss_mask[sub].to(device), mb.mask.to(device)
    keep = None
    for h in run.hooks:                                               # the plug-ins' weights (route_filter/)
        w = h.token_weights(run, mb, out, response)
        if w is not None:
            keep = w if keep is None else keep * w
    weights = tuple(w for w in (None if old.weights is None else old.weights[sub].to(device), keep) if w is not None)
    terms = [t for t in (h.token_terms(run, out, mb) for h in run.hooks) if t is not None]   # entropy_bonus/'s
    loss, clipped = token_objective(logp, old.logp[sub].to(device), mb.adv.to(device), mask, tcfg, norm,
                                    weights, None if old.ref_logp is None else old.ref_logp[sub].to(device), terms)
    extra = []
    for h in run.hooks:                                               # the plug-ins' terms (router_training/)
        loss, sums = h.micro_loss(run, loss, out, mb, norm)
        extra += sums
    (loss * (run.policy.loss_scale if counted else 0.0)).backward()
    sums = [loss.item(), (clipped.float() * mask).sum().item() / norm.tokens, (out.entropy.detach() * response).sum().item(),
            0.0 if keep is None else ((keep < 1) * response).sum().item(), mb.mask.sum().item(), *extra]
    return dataclasses.replace(out, logp=logp, detail=dataclasses.replace(out.detail, logits=None)), sums   # logits freed


# ---------------------------------------------------------------------------------------------------
# the trainer's forwards over rows of the batch (packing.Scored)
# ---------------------------------------------------------------------------------------------------
def trainer_micro_batches(run: Run, rows: torch.Tensor, lengths: torch.Tensor) -> list[MicroBatch]:
    """packing.micro_batches under this run's config (padded: the minibatch per micro-batch if
    --micro_batch_size is 0), of rows of the global batch: the same at every world size."""
    tcfg = run.tcfg
    return micro_batches(rows, lengths, tcfg.micro_batch_tokens, tcfg.micro_batch_size, tcfg.minibatch_size)


def forward(run: Run, score: Callable, mb: Batch, micro: MicroBatch, *, grad: bool, with_entropy: bool = False,
            routes: torch.Tensor | None = None, entropy_grad: bool = False, counted: bool = True) -> Scored:
    """One forward of the micro-batch mb (rows micro.rows of the rollout batch) through score: the
    trainer's module (DDP / FSDP2 hook its call) or model.score unchecked (the old and reference policies),
    replaying `routes` (replay.routes_to_replay; -1 where unrecorded), packed or not. counted=False (a
    null micro-batch): outside the hooks' contexts (token dropping's counts).
    Returns logp (k, T-1), routes (k, T, n_moe, k) and the route detail per sequence. Nothing here reads
    a tensor back from the device: make_batch and pack_routes checked the batch on the host."""
    dev, T, pk, tokens = run.d.device, mb.tokens.shape[1], micro.packing, mb.tokens
    if pk is not None:
        tokens = pk.from_padded(tokens)                               # (1, sum of lengths)
        routes = None if routes is None else pk.from_padded(routes, fill=-1)
    with torch.set_grad_enabled(grad), trainer_forward(run, counted):
        out = score(tokens.to(dev), temperature=run.rcfg.temperature, routes=None if routes is None else routes.to(dev),
                    with_entropy=with_entropy, logits_chunk=run.tcfg.logits_chunk, packing=pk, route_detail=True,
                    entropy_grad=entropy_grad, router_logits=grad and any(h.router_logits for h in run.hooks))
        logp, used, entropy, detail = out[0], out[1], out[2] if with_entropy else None, out[-1]
        if pk is not None:
            logp, used = unpack(pk, logp, T - 1), unpack(pk, used, T, fill=-1)
            entropy = None if entropy is None else unpack(pk, entropy, T - 1)
            detail = detail.map(lambda x: unpack(pk, x, T))
    return Scored(logp, used, entropy, micro.rows, detail)


# ---------------------------------------------------------------------------------------------------
# 5. metrics, evaluation, the probe, checkpoints
# ---------------------------------------------------------------------------------------------------
def step_metrics(run: Run, step: int, batch: Batch, outs, rewards, audited: Scored, stats: UpdateStats,
                 ro: Rollout, t0: float) -> dict:
    """One row of metrics: rewards, the update's stats, the train-rollout audit of `audited` (the
    recomputed old log-probs, else the first minibatch's forward). Every value is global (the global
    batch, the gathered audit, sums in the micro-batches' order, integer counts summed), the same at
    every world size, but distributed.PER_RANK's (timings, the sampler's counters)."""
    rows, n_experts = audited.rows, run.policy.master.config.num_experts
    lengths = torch.tensor([sum(o.policy_mask) if o.policy_mask else len(o.tokens) for o in outs],
                           dtype=torch.float)                         # this rank's; all_cat: global
    all_rewards = all_cat(rewards, run.d)
    row = {"step": step + 1, "reward_mean": all_rewards.mean().item(), "reward_std": all_rewards.std().item(),
           "response_len": all_cat(lengths, run.d).mean().item(),
           **stats.means(),
           **replay.mismatch_metrics(audited.logp, batch.rollout_logp[rows], batch.mask[rows]),
           **replay.route_audit(batch.routes[rows], audited.routes, batch.route_mask[rows], n_experts, audited.detail),
           # the entropy of softmax(logits / T) at the response tokens, from the training forwards
           "entropy": stats.entropy_sum / stats.tokens,
           "neg_logp_mean": -(batch.rollout_logp * batch.mask).sum().item() / batch.mask.sum().item(),
           "route_filtered_frac": stats.filtered / stats.tokens,
           "lr": lr_at(step, run.tcfg, run.hooks), "rollout_tokens_per_s": lengths.sum().item() / ro.seconds,
           **latency_metrics(outs, run.d),
           "step_time": time.perf_counter() - t0, "skipped_steps": run.skipped, **ro.counters, **ro.metrics}
    for hook in run.hooks:                        # the plug-ins': drops, staleness, the EP ranks' load
        row.update(hook.step_metrics(run, step, batch, audited))
    return row if run.d.world == 1 else reduce_metrics(row, run.d)      # per-rank keys over the ranks


def checkpoint(run: Run, step: int) -> None:
    """Check the weights (finite, the same on every rank), then rank 0 writes the checkpoint."""
    p = run.policy
    run.rollouts.before_save(step)                                    # the batches the checkpoint holds
    p.refresh()
    check_finite_weights(p.full, step)                                # on every rank: they stop together
    if run.d.world > 1:
        digest = check_in_sync(p.full, run.d)                         # mixed precision: the compute copy
        if p.mp is not None and p.sharding is None:                   # mixed precision: and the masters
            check_in_sync(p.mp.master, run.d)
    masters = p.mp.master_state() if p.mp is not None else None       # collective under FSDP2 and EP
    opt_state = optimizer_state(p.trainer, p.optimizer, p.sharding)   # collective under FSDP2 and EP
    full = whole_model(run.hooks, p.full)                             # EP: whole experts (collective)
    if run.d.master:
        extra = {"skipped_steps": run.skipped, "rollouts": run.rollouts.state_dict(),
                 "length_surge": run.surge.state_dict(), "sft_done": run.sft_done,
                 "plugins": {h.name: h.state_dict() for h in run.hooks if h.name}}
        path = save_checkpoint(run.tcfg.out_dir, step, full, opt_state, run.tcfg, run.rcfg, run.task, extra=extra,
                               masters=masters, exported=exported(run.hooks, full), save_dtype=run.tcfg.save_dtype or run.tcfg.dtype,
                               keep=run.tcfg.keep_checkpoints, identity=run.outputs and run.outputs.identity)
        say(run, f"step {step}: saved {path}")
    if run.d.world > 1:
        dist.barrier()
        run.d.print0(f"step {step}: weights identical on {run.d.world} ranks (sha256 {digest[:16]})")


# ---------------------------------------------------------------------------------------------------
# setup: the model, its weights' copies, the sampler (or a resume of all of them)
# ---------------------------------------------------------------------------------------------------
def setup(tcfg: TrainConfig, rcfg: RolloutConfig, d: Dist, hooks: list[Hooks] | None = None) -> Run:
    """Check the configs against the ranks and the model, build (or resume) the model, the policy's
    copies and optimizer (distributed.Policy), the sampler and where the batches come from; hooks: the
    plug-ins' (None: those of the options)."""
    hooks = plugin_hooks(tcfg, rcfg) if hooks is None else hooks
    check_ranks(tcfg, d)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    prepare_out_dir(tcfg, d.master)
    if not tcfg.resume:                                               # the lr horizon, saved with the run
        tcfg = dataclasses.replace(tcfg, lr_decay_steps=tcfg.lr_decay_steps or tcfg.steps)
    task, preset, config = run_task(tcfg, rcfg)
    experts = held_experts(hooks, tcfg, config.num_experts, d.world)   # EP: this rank's (parallel/); None: all
    tcfg.check_model(config, task.vocab_size)
    for hook in hooks:
        hook.check_build(task, config)
    home = master_device(hooks, d)                                    # offload: the host (memory/)
    model = build_model(tcfg, home or d.device, getattr(torch, tcfg.master_dtype), preset, experts)
    adapt(hooks, model, experts)                                      # LoRA: its adapters, the base frozen (lora/)
    resumed = None
    if tcfg.resume:
        store_routers(model, tcfg)                                    # an fp32 router keeps its saved bits
        resumed = resume(tcfg, model, task, experts, d.print0)
        tcfg = resumed.tcfg
    ref_model = None
    if tcfg.kl_coef > 0:                  # a frozen copy of the initial policy (rebuilt from init_from on resume)
        ref_model = (build_model(tcfg, home or d.device, getattr(torch, tcfg.master_dtype), preset, experts) if tcfg.resume
                     else copy.deepcopy(model)).requires_grad_(False)
    for m in (model, ref_model):
        if m is not None:
            shard(hooks, m)                                           # EP: route its MoE layers through the exchange
    policy = Policy(model, tcfg, d, sampler_copy=partial(sampler_model, hooks), apart=home is not None, hooks=hooks)
    if ref_model is not None:                                         # mixed precision: the reference computes in bf16
        ref_model = policy.compute_copy(ref_model)
    start, skipped, sft_done = (resumed.start, resumed.skipped, resumed.sft_done) if resumed is not None else (0, 0, 0)
    metrics_path = os.path.join(tcfg.out_dir, "metrics.jsonl")
    if resumed is not None:
        load_optimizer_state(policy.trainer, policy.optimizer, resumed.optimizer, policy.sharding)
        if d.master:
            trim_metrics(metrics_path, start, sft_done)
    # the gradients and AdamW's moments are allocated after the sampler sizes its KV pool from the free
    # memory: set aside (Policy.reserve_bytes); activations and temporaries come out of the rest
    sampler = wrap_sampler(hooks, Sampler(policy.sampler, rcfg, reserve_bytes=policy.reserve_bytes()))
    run = Run(tcfg, rcfg, d, task, policy, ref_model, sampler, start, skipped, metrics_path, sft_done=sft_done,
              hooks=hooks)
    for hook in run.hooks:                                            # before any forward (EPLB's layouts)
        hook.setup(run, resumed)
    run.rollouts = batch_source(hooks, run, partial(rollout, run), partial(sample, run))   # staleness: asynchrony/
    run.surge.load_state_dict(resumed.surge if resumed is not None else None)   # where a surge was seen, if one was
    if resumed is not None and resumed.rollouts is not None:        # the batches generated ahead of the step
        run.rollouts.load_state_dict(resumed.rollouts)
    return run


def check_ranks(tcfg: TrainConfig, d: Dist) -> None:
    """The checks that need the ranks (TrainConfig.check_ranks), the batch notice."""
    tcfg.check_ranks(d.world, d.bridge.n_rollout if d.bridge is not None else 0)
    batch = tcfg.prompts_per_step * tcfg.group_size
    if tcfg.minibatch_size > batch:
        d.print0(f"--minibatch_size={tcfg.minibatch_size} is more than the batch of {batch} (prompts_per_step x "
                 f"group_size): one optimizer step of {batch} per epoch")


# ---------------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------------
def main(argv: list[str]) -> None:
    if "--help" in argv or "-h" in argv:
        print("\n".join([__doc__, help_text(*(cls() for cls in configs())), model_help(), *plugin_help()]))
        return
    if "--plan" in argv:                        # bytes per rank, nothing loaded (tooling/plan.py)
        from tooling import plan
        return plan.cli([a for a in argv if a != "--plan"])
    rank0 = int(os.environ.get("RANK", "0")) == 0
    # the defaults, or on --resume the saved run's configs, with this command line's options on top
    tcfg, rcfg = command_line_configs(parse_args(argv), print if rank0 else lambda *a: None)
    t0 = time.time()
    history = train(tcfg, rcfg)
    if history and int(os.environ.get("RANK", "0")) == 0:
        print(summary(history, time.time() - t0, tcfg.out_dir))


def plugin_help() -> list[str]:
    """--plan's own keys, where the tooling that answers it is there."""
    if not os.path.isfile(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tooling", "plan.py")):
        return []
    from tooling import plan
    return [plan.help_text()]


def cli(argv: list[str]) -> None:
    """main with one `error:` line per mistake and the exit statuses of runlog.run_cli."""
    run_cli(main, argv)


if __name__ == "__main__":
    cli(sys.argv[1:])
