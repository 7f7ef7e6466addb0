"""The step's seams: what a plug-in does in a run, at fixed points of train.py's loop.

A plug-in folder's options.py may define `hooks(tcfg, rcfg) -> list[Hooks]`: the hooks its set options ask
for, importing the plug-in's code only then. train.py calls every hook at its point, in the folders' order,
on every rank (a hook may run collectives); the loop itself never tests a plug-in's option.

    check_build(task, config)   before the model is built: the options against the task and the model
    sampler_model(full, refresh)   -> (the model the sampler runs, its refresh): a copy of the compute weights
    wrap_sampler(sampler)    -> the sampler the run rolls out with
    setup(run, resumed)      the run is built, no forward has run; resumed: checkpoint.Resumed or None
    before_steps(run, forward, micro_batches, save)   before RL step 1 (the supervised phase), with train.py's
                             forward, trainer_micro_batches and checkpoint: no second training path
    trainer_forward(run)     a context around each counted trainer forward (not the null micro-batches)
    step_metrics(run, step, batch, audited)   keys beside the step's metrics, before their reduction
    after_step(run, step, batch, rewards)     keys after the step's metrics: evaluations, re-plans (rewards:
                             this rank's, (n,); batch: the global one)
    diagnostics(rows)        its keys on diagnostics.jsonl's rows
    state_dict()             saved in the checkpoint under `name`, handed back as resumed.plugins[name]
"""
from __future__ import annotations

import contextlib

import config


class Hooks:
    """A plug-in's hooks; each does nothing here."""
    name = ""                        # its key in a checkpoint's plugin state ("": it keeps none)

    def check_build(self, task, config) -> None:
        pass

    def sampler_model(self, full, refresh):
        return full, refresh

    def wrap_sampler(self, sampler):
        return sampler

    def setup(self, run, resumed) -> None:
        pass

    def before_steps(self, run, forward, micro_batches, save) -> None:
        pass

    def trainer_forward(self, run):
        return contextlib.nullcontext()

    def step_metrics(self, run, step: int, batch, audited) -> dict:
        return {}

    def after_step(self, run, step: int, batch, rewards) -> dict:
        return {}

    def diagnostics(self, rows: list[dict]) -> None:
        pass

    def state_dict(self):
        return None


def plugin_hooks(tcfg, rcfg) -> list[Hooks]:
    """Every plug-in's hooks for this run's options, in the folders' order (config.plugin_modules)."""
    return [h for m in config.plugin_modules() if hasattr(m, "hooks") for h in m.hooks(tcfg, rcfg)]


def sampler_model(hooks: list[Hooks], full, refresh):
    """-> (the sampler's model, its refresh): each hook's copy of the one before (the compute weights first)."""
    model = full, refresh
    for h in hooks:
        model = h.sampler_model(*model)
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
