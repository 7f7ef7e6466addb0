"""A supervised start for RL (--sft_steps=N): cross-entropy on the task's reference answers, then RL as usual.

    python train.py --sft_steps=20 --out_dir=out/sft        # 20 supervised steps on copy's answers, then GRPO
    python train.py --init_from=out/sft/ckpt-000000 ...     # another run's RL from those supervised weights

Post-training runs RL on a supervised model, not on random weights, and the mismatch lab's rows should start
there too (docs/design.md, "A supervised start"). Each supervised step draws minibatch_size examples from the
task (its own stream, saved in checkpoints, as the RL steps' prompts), lays out prompt + task.reference(example)
(the response that earns the full reward, its stop token included) and takes one optimizer step on

    sft_loss = -(1 / n) sum of log p(token | what precedes it) over the n reference tokens of the step

(the prompts are in the forward, out of the loss). It runs what an RL update runs: train.forward (model.score
through the trainer's module, packed micro-batches dealt to the ranks in lockstep), the same AdamW, and
distributed.Policy's end of an optimizer step (the gradients summed over micro-batches and ranks, exactly by
default, clipped; the compute copy recast); the next rollout refreshes the sampler's copy. Its log-probs are of
softmax(logits / --temperature), the distribution the sampler draws from; lr is --lr after the same warmup,
constant. The router's losses and the KL / entropy terms are RL's, not in this loss.

Step numbering: the phase comes before RL step 1 and counts none of the RL steps. Its rows in metrics.jsonl are
{"step": 0, "phase": "sft", "sft_step": k, "sft_loss": ...} (k = 1..N); RL's rows are numbered 1..--steps as
without it. Its end is saved as ckpt-000000 (kept beside the newest checkpoints). Resume: a stop during the
phase saves ckpt-000000 at the supervised step it finished, and --resume=true continues the phase from there,
bitwise; from ckpt-000000 at the phase's end, or any later checkpoint, it continues RL.
"""
from __future__ import annotations

import dataclasses
import json
import time
from functools import partial

import torch

from config import ConfigError
from support.distributed import all_owned, lr_at, on_host, update_is_finite
from support.hooks import Hooks, after_update
from support.packing import Batch, lockstep
from support.runlog import Interrupted, json_row, say, stop_requested


class Supervised(Hooks):
    """--sft_steps as a step hook (support/hooks.py): the supervised phase before RL step 1."""

    def before_steps(self, run, forward, micro_batches, save) -> None:
        supervised_phase(run, forward, micro_batches, save)


def supervised_phase(run, forward, micro_batches, save) -> None:
    """--sft_steps' phase, before RL step 1, from the step a resume left it at; saves step 0 at its end (or at a
    stop, then Interrupted). forward, micro_batches, save: train.forward, train.trainer_micro_batches and
    train.checkpoint, called with run first (the trainer's own, so this is no second training path)."""
    n = run.tcfg.sft_steps
    if run.start > 0:                     # RL began: a resume that changed --sft_steps (--resume_changes=allow)
        if run.sft_done != n:
            raise ConfigError(f"--sft_steps={n}: this run's RL began after {run.sft_done} supervised steps; the "
                              f"supervised phase runs before RL step 1 only: resume with --sft_steps={run.sft_done}")
        return
    if run.sft_done >= n:
        return
    if run.d.master:
        say(run, f"sft: supervised steps {run.sft_done + 1}..{n} on the task's reference answers (--sft_steps={n}), "
                 "then RL from step 1")
    for k in range(run.sft_done, n):
        t0 = time.perf_counter()
        row = sft_step(run, forward, micro_batches, k)
        run.sft_done = k + 1
        log_sft_row(run, dict(row, step_time=time.perf_counter() - t0))
        signum = stop_requested(run.d)
        if signum or k + 1 == n:
            save(run, 0)
        if signum:
            raise Interrupted(0, signum)


def sft_step(run, forward, micro_batches, k: int) -> dict:
    """Supervised step k (0-based): a batch of reference answers, its gradients, one optimizer step (skipped
    if the loss or the gradient norm is not finite and --skip_nonfinite_steps allows). Returns its row."""
    tcfg, policy = run.tcfg, run.policy
    examples = run.task.sample(min(tcfg.minibatch_size, tcfg.prompts_per_step * tcfg.group_size))   # same on every rank
    batch = reference_batch(run.task, examples, policy.master.config, k + 1)
    lr = lr_at(k, dataclasses.replace(tcfg, lr_schedule="constant"))   # the warmup, then --lr
    loss, grad_norm, scored = gradients(run, forward, micro_batches, batch, lr)
    if update_is_finite(0, loss, grad_norm, run.skipped, tcfg, run.d):
        policy.step(partial(after_update, run.hooks, policy, scored, batch))   # router_training/'s bias
    else:
        run.skipped += 1
    return {"step": 0, "phase": "sft", "sft_step": k + 1, "sft_loss": loss, "grad_norm": grad_norm, "lr": lr,
            "sft_tokens": int(batch.mask.sum()), "skipped_steps": run.skipped}


def gradients(run, forward, micro_batches, batch: Batch, lr: float):
    """The step's forward and backward, as an RL minibatch's (train.minibatch_step): micro-batches cut from the
    whole batch and dealt to the ranks, each one's loss over the step's reference tokens (so they add up), the
    gradients summed and clipped (Policy.finish_grads). -> (loss, grad norm before clipping, this rank's
    forwards on the host or None)."""
    policy, d = run.policy, run.d
    n_tokens = max(1.0, float(batch.mask.sum()))
    policy.master.train()
    policy.start_minibatch(lr)
    micros = micro_batches(run, torch.arange(batch.tokens.shape[0]), batch.lengths)
    steps = lockstep(micros, batch.lengths, d)
    losses = torch.zeros(len(micros), 1, dtype=torch.float64)      # row i: micro-batch i's, by its rank
    parts = []
    for j, (i, micro) in enumerate(steps):
        with policy.grad_sync(last=j == len(steps) - 1):
            mb = batch.select(micro.rows)
            out = forward(run, policy.trainer, mb, micro, grad=True, counted=i is not None)
            loss = sft_loss(out.logp.float(), mb.mask.to(d.device), n_tokens)
            (loss * (policy.loss_scale if i is not None else 0.0)).backward()   # a null micro-batch: times 0
        if i is not None:
            losses[i] = loss.item()
            parts.append(dataclasses.replace(out, detail=None))
    grad_norm = policy.finish_grads()
    return float(all_owned(losses, d).sum()), grad_norm, on_host(parts) if parts else None


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, n_tokens: float) -> torch.Tensor:
    """Cross-entropy of a micro-batch's reference tokens: -sum(logp * mask) / n_tokens; logp, mask (k, T-1);
    n_tokens: the whole step's reference tokens (the micro-batches' losses add up to its token mean)."""
    return -(logp * mask).sum() / n_tokens


def reference_batch(task, examples, config, sft_step: int) -> Batch:
    """prompt + task.reference(example) for each example, right-padded as packing.make_batch lays out a rollout:
    mask 1 where logp[:, j] scores a reference token (tokens[:, j + 1]); no routes recorded (-1), nothing
    observed, no advantages. Checked here, where the references enter: each fits the model's context."""
    refs = [list(task.reference(ex)) for ex in examples]
    lengths = [len(ex.prompt) + len(r) for ex, r in zip(examples, refs)]
    for ex, r, L in zip(examples, refs, lengths):
        if not r or L > config.max_position_embeddings:
            shown = ex.text if ex.text is not None else task.decode(ex.prompt)
            why = "is empty" if not r else (f"of {len(r)} tokens after its prompt of {len(ex.prompt)} goes past the "
                                            f"context of {config.max_position_embeddings} (max_position_embeddings)")
            raise ConfigError(f"sft step {sft_step}: the reference answer of {shown[:80]!r} {why}; fix the data "
                              "or drop --sft_steps")
    B, T = len(examples), max(lengths)
    tokens = torch.tensor([ex.prompt + r + [0] * (T - L) for ex, r, L in zip(examples, refs, lengths)])   # (B, T)
    mask = torch.tensor([[0.0] * (len(ex.prompt) - 1) + [1.0] * len(r) + [0.0] * (T - L)
                         for ex, r, L in zip(examples, refs, lengths)])                                   # (B, T-1)
    routes = torch.full((B, T, len(config.moe_layers), config.num_experts_per_tok), -1)   # (B, T, n_moe, k)
    zeros = torch.zeros(B, T - 1, dtype=torch.long)
    return Batch(tokens, mask, torch.zeros(B, T - 1), routes, torch.zeros(B, T, dtype=torch.bool), torch.zeros(B),
                 torch.tensor(lengths), torch.zeros(B, T, dtype=torch.bool), zeros, zeros)


def log_sft_row(run, row: dict) -> None:
    """A supervised step's row to metrics.jsonl (rank 0, every --log_every steps and the last) and a line on the
    console. The trackers (--log_to) get RL's rows only: their x axis is the RL step."""
    k, n = row["sft_step"], run.tcfg.sft_steps
    if not run.d.master or (k % run.tcfg.log_every and k != n):
        return
    with open(run.metrics_path, "a") as f:
        f.write(json.dumps(json_row(row), allow_nan=False) + "\n")
    say(run, f"sft step {k}/{n}: loss {row['sft_loss']:.4f}, grad norm {row['grad_norm']:.3g}, lr {row['lr']:.3g}, "
             f"{row['step_time']:.2f} s")
