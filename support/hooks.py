"""The step's seams: what a plug-in does in a run, at fixed points of train.py's loop.

A plug-in folder's options.py may define `hooks(tcfg, rcfg) -> list[Hooks]`: the hooks its set options ask
for, importing the plug-in's code only then. train.py calls every hook at its point, in the folders' order,
on every rank (a hook may run collectives); the loop itself never tests a plug-in's option.

    check_build(task, config)   before the model is built: the options against the task and the model
    sampler_model(full, refresh)   -> (the model the sampler runs, its refresh): a copy of the compute weights
    wrap_sampler(sampler)    -> the sampler the run rolls out with
    adapt(model, experts)    the model was built, no weight is loaded yet (a resume's come next): add to its
                             layers (LoRA's adapters, lora/), freeze what stays fixed; experts: the logical
                             experts it holds (EP's shard, in its order), or None: every one
    setup(run, resumed)      the run is built, no forward has run; resumed: checkpoint.Resumed or None
    before_steps(run, forward, micro_batches, save)   before RL step 1 (the supervised phase), with train.py's
                             forward, trainer_micro_batches and checkpoint: no second training path
    trainer_forward(run)     a context around each counted trainer forward (not the null micro-batches)
    samples(run, step, examples, outs, rewards)   the step's sampled batch, this rank's: its examples, the
                             sampler's outputs and their rewards (n,), before training (trackers/' samples.jsonl)
    hold_out(run, batch, audit, mask, held)   -> (the loss mask (B, T-1), the global batch's rows (n,) held out
                             of the update): sequences out of the loss, its normalisers and the KL (diagnostics/);
                             audit: the recomputed old policy's packing.Scored, or None
    token_weights(run, mb, out, mask)   -> per-token loss weights (k, T-1) of a micro-batch's forward, or None:
                             multiplied into the objective (route_filter/); the core counts the tokens they lower
                             (route_filtered_frac); mask: the response tokens
    token_terms(run, out, mb)   -> a per-token term (k, T-1) added to a micro-batch's per-token loss before its
                             aggregation (after the corrections' weights and the KL), or None (entropy_bonus/)
    micro_loss(run, loss, out, mb, norm)   -> (the micro-batch's loss with the plug-in's terms, its sums: one
                             float per name in `micro_stats`); out: the forward (packing.Scored, the router's
                             logits in out.detail when `router_logits`), mb: the micro-batch, norm: losses.Normalisers
    minibatch_sums(sums)     the micro_stats' sums over the minibatch's micro-batches and the ranks (in the
                             micro-batches' order: the same at every world size), after each minibatch's forward
    step_metrics(run, step, batch, audited)   keys beside the step's metrics, before their reduction
    after_step(run, step, batch, rewards)     keys after the step's metrics: evaluations, re-plans (rewards:
                             this rank's, (n,); batch: the global one)
    rank_files(run, step, batch, outs, rewards, audited, held)   -> keys; a file of this rank's sequences (batch,
                             outs, rewards, audited: this rank's; held: hold_out's rows), rank 0 appending
    diagnostics(rows)        its keys on diagnostics.jsonl's rows
    log(row)                 a metrics row as rank 0 wrote it to metrics.jsonl (a log step's; trackers/)
    finish(exit_code)        the run ends: 0 finished, else it failed or stopped (128 + the signal)
    state_dict()             saved in the checkpoint under `name`, handed back as resumed.plugins[name]
    batch_source(run, generate, sample)   -> where each step's batch comes from (Synchronous's methods), or
                             None: the core's own, Synchronous (generate: train.rollout of the run; sample:
                             train.sample of the run)
    optimizer(model, params, kw)   -> the optimizer of the trained params (AdamW's kw: lr, betas, weight_decay), or
                             None: AdamW(params, **kw) (router_training/: the gates in a group of their own)
    lr(step, cfg)            -> the lr of optimizer step `step` (0-based) after the warmup, or None: --lr_schedule's
                             (lr_halving/'s halving; support/distributed.lr_at)
    after_update(policy, scored, batch)   after each optimizer step, before the compute copy is recast from the
                             masters (router_training/'s bias balancing); scored: the minibatch's forward
                             (packing.Scored), batch: the global batch
    master_device(d)         -> where the optimizer's weights live, apart from the compute weights on d.device (their
                             fp32 masters, gradient sums and AdamW's moments: memory/offload.py's host), or None
    experts(tcfg, n_experts, world)   -> the logical experts this rank holds (expert parallelism; a collective),
                             or None: every one
    shard(model)             the model was built with those experts only: route its layers to their owners
    whole_model(model)       -> the model with whole experts, for a checkpoint (a collective; None off rank 0)
    exported(model)          -> the model a checkpoint's HF export is written from (LoRA: merged), or None: model;
                             the checkpoint keeps model's own state beside it when the two differ
    split_ranks()            -> how a torchrun job's ranks divide into sides (support/distributed.init_distributed's
                             split), or None: one side; called before any process group exists
    serves(role)             whether the hook runs this rank's whole job (a Dist.role other than "train")
    serve(tcfg, rcfg, d, hooks, Run=, rollout=, sample=)   that job, given the run's hooks and train.py's Run,
                             rollout and sample (a plug-in does not import train.py: it runs as __main__)
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import config


class Hooks:
    """A plug-in's hooks; each does nothing here."""
    name = ""                        # its key in a checkpoint's plugin state ("": it keeps none)
    router_logits = False            # the trainer's forwards keep the gate logits, with their gradient (micro_loss's)
    entropy_grad = False             # the trainer's forwards' entropy carries its gradient (token_terms')
    micro_stats: tuple[str, ...] = ()   # the names of micro_loss's sums

    def check_build(self, task, config) -> None:
        pass

    def sampler_model(self, full, refresh):
        return full, refresh

    def wrap_sampler(self, sampler):
        return sampler

    def adapt(self, model, experts) -> None:
        pass

    def setup(self, run, resumed) -> None:
        pass

    def before_steps(self, run, forward, micro_batches, save) -> None:
        pass

    def trainer_forward(self, run):
        return contextlib.nullcontext()

    def samples(self, run, step: int, examples, outs, rewards) -> None:
        pass

    def hold_out(self, run, batch, audit, mask, held):
        return mask, held

    def token_weights(self, run, mb, out, mask):
        return None

    def token_terms(self, run, out, mb):
        return None

    def micro_loss(self, run, loss, out, mb, norm):
        return loss, []

    def minibatch_sums(self, sums: list[float]) -> None:
        pass

    def step_metrics(self, run, step: int, batch, audited) -> dict:
        return {}

    def after_step(self, run, step: int, batch, rewards) -> dict:
        return {}

    def rank_files(self, run, step: int, batch, outs, rewards, audited, held) -> dict:
        return {}

    def diagnostics(self, rows: list[dict]) -> None:
        pass

    def log(self, row: dict) -> None:
        pass

    def finish(self, exit_code: int) -> None:
        pass

    def state_dict(self):
        return None

    def batch_source(self, run, generate, sample):
        return None

    def optimizer(self, model, params, kw):
        return None

    def lr(self, step: int, cfg):
        return None

    def after_update(self, policy, scored, batch) -> None:
        pass

    def master_device(self, d):
        return None

    def experts(self, tcfg, n_experts: int, world: int):
        return None

    def shard(self, model) -> None:
        pass

    def whole_model(self, model):
        return model

    def exported(self, model):
        return None

    def split_ranks(self):
        return None

    def serves(self, role: str) -> bool:
        return False

    def serve(self, tcfg, rcfg, d, hooks, **loop) -> None:
        raise NotImplementedError


def plugin_hooks(tcfg, rcfg) -> list[Hooks]:
    """The hooks of the plug-ins this run's configs carry (config.configs_for), in the folders' order."""
    mods = sorted({*type(tcfg).plugins, *type(rcfg).plugins}, key=lambda m: m.__name__)
    return [h for m in mods if hasattr(m, "hooks") for h in m.hooks(tcfg, rcfg)]


def sampler_model(hooks: list[Hooks], full, refresh):
    """-> (the sampler's model, its refresh): each hook's copy of the one before (the compute weights first)."""
    model = full, refresh
    for h in hooks:
        model = h.sampler_model(*model)
    return model


def held_experts(hooks: list[Hooks], tcfg, n_experts: int, world: int) -> list[int] | None:
    """The experts this rank holds (a plug-in's layout: parallel/'s EP), or None: every one. Every hook is
    asked (each may run a collective), the first answer counts."""
    held = [h.experts(tcfg, n_experts, world) for h in hooks]
    return next((e for e in held if e is not None), None)


def after_update(hooks: list[Hooks], policy, scored, batch) -> None:
    for h in hooks:
        h.after_update(policy, scored, batch)


def master_device(hooks: list[Hooks], d):
    """Where a plug-in keeps the optimizer's weights apart from the compute weights, or None: with them."""
    return next((where for where in (h.master_device(d) for h in hooks) if where is not None), None)


def shard(hooks: list[Hooks], model) -> None:
    for h in hooks:
        h.shard(model)


def adapt(hooks: list[Hooks], model, experts: list[int] | None) -> None:
    for h in hooks:
        h.adapt(model, experts)


def exported(hooks: list[Hooks], model):
    """The model a checkpoint's HF export is written from: a hook's (LoRA's merged), else model itself."""
    return next((m for m in (h.exported(model) for h in hooks) if m is not None), model)


def whole_model(hooks: list[Hooks], model):
    for h in hooks:
        model = h.whole_model(model)
    return model


def wrap_sampler(hooks: list[Hooks], sampler):
    for h in hooks:
        sampler = h.wrap_sampler(sampler)
    return sampler


def trainer_forward(run, counted: bool) -> contextlib.ExitStack:
    """The hooks' contexts around one trainer forward; none around a null micro-batch's (counted=False)."""
    stack = contextlib.ExitStack()
    for h in run.hooks if counted else ():
        stack.enter_context(h.trainer_forward(run))
    return stack


# ---------------------------------------------------------------------------------------------------
# the batch source: where each step's batch comes from
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Rollout:
    """One batch as the trainer takes it: the examples, the sampler's outputs, each episode's turn rewards."""
    examples: list
    outs: list                                  # rollout.SequenceOutput, group_size per example
    turn_rewards: list[list[float]] | None      # episodes: each one's turns' rewards (tasks.Episodes.rewards)
    version: int                                # the version that started it
    seconds: float                              # its generation, wall clock
    counters: dict = dataclasses.field(default_factory=dict)   # the sampler's (preemptions, prefix cache), waits
    metrics: dict = dataclasses.field(default_factory=dict)    # the batch's own, global (partial_carried_seqs, ...)
    carry: dict | None = None                   # --partial_rollout on a rollout rank: what is in flight after it

    @property
    def episodes(self) -> "Recorded | None":
        return None if self.turn_rewards is None else Recorded(self.turn_rewards)


@dataclasses.dataclass
class Recorded:
    """An earlier batch's episodes as tasks.compute_rewards and the metrics read them: their turns' rewards."""
    rewards: list[list[float]]

    def episode_rewards(self) -> list[float]:
        return [sum(r) for r in self.rewards]


class Stopped(Exception):
    """A batch source's wait ended by a stop request (^C, or the launcher stopping the job)."""


class PeerLost(Stopped):
    """A batch source's wait ended because the ranks it waited on are gone (the message: the backend's)."""


class Synchronous:
    """The core's batch source: batch `step` generated now, by the weights now (version `step`), then
    trained on; the sampler's KV pool is freed while the update runs (nothing in it outlives a step:
    the next weights make every cached prefix stale), so the update's activations take its memory. A
    plug-in's source (Hooks.batch_source) has the same methods."""

    def __init__(self, generate: Callable[..., Rollout], release: Callable[[], None] = lambda: None):
        self.generate = generate             # generate(j, version=v) -> Rollout: train.rollout of the run
        self.release = release               # the sampler's release_kv

    def take(self, step: int) -> Rollout:
        batch = self.generate(step, version=step)
        self.release()
        return batch

    def update(self, step: int, fn: Callable[[], object]):
        """fn(): the update of `step`."""
        return fn()

    def before_save(self, step: int) -> None:
        """The checkpoint of `step` is about to be written (a source holding batches ahead completes them)."""

    def close(self) -> None:
        pass

    def state_dict(self) -> None:
        return None                          # nothing generated ahead

    def load_state_dict(self, state: dict) -> None:
        if state.get("ahead") or "partial" in state:
            raise config.ConfigError("the checkpoint holds batches generated ahead (--max_staleness or "
                                     "--partial_rollout) and no plug-in here takes them: resume with its options")


def batch_source(hooks: list[Hooks], run, generate, sample):
    """The first plug-in's batch source for this run, else the core's (Synchronous)."""
    for h in hooks:
        source = h.batch_source(run, generate, sample)
        if source is not None:
            return source
    return Synchronous(generate, run.sampler.release_kv)


def rank_split(hooks: list[Hooks]):
    """The one plug-in split of the job's ranks, or None."""
    splits = [s for s in (h.split_ranks() for h in hooks) if s is not None]
    if len(splits) > 1:
        raise config.ConfigError("two plug-ins split the ranks of this job; set the options of one")
    return splits[0] if splits else None


def serving_hook(hooks: list[Hooks], role: str) -> Hooks:
    """The plug-in that runs a rank of this role (Dist.role: --rollout_ranks' "rollout")."""
    for h in hooks:
        if h.serves(role):
            return h
    raise config.ConfigError(f"this rank's role is {role!r} and no plug-in here serves it")
