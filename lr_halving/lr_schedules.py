"""--lr_schedule=halving: after the warmup, lr halves every --lr_decay_period steps, never below
lr * min_lr_ratio; it has no horizon, so a longer --steps on resume keeps halving. With --halving_start=surge
lr holds until the step S a response-length surge is detected on (the core's runlog.LengthSurge, which a
checkpoint saves), then halves from step S + 1 and every period after. The lr of a step is a function of
the config and S alone, so a resume gives the uninterrupted run's lr.
"""
from __future__ import annotations

from support.hooks import Hooks


def halving_lr(step: int, cfg, surge: int | None) -> float:
    """The lr of optimizer step `step` (0-based, past the warmup); surge: the step (1-based) a surge was
    detected on, or None (--halving_start=surge then holds lr at --lr)."""
    if cfg.halving_start == "warmup":
        halvings = (step - cfg.warmup_steps) // cfg.lr_decay_period
    else:                                                            # lr holds until the surge, halves on the step after
        halvings = 0 if surge is None or step < surge else 1 + (step - surge) // cfg.lr_decay_period
    return cfg.lr * max(cfg.min_lr_ratio, 0.5 ** halvings)


class Halving(Hooks):
    """The schedule as a step hook: the lr after the warmup (support/distributed.lr_at asks it)."""

    def __init__(self):
        self.surge = None                    # the run's runlog.LengthSurge (setup): its step once one is seen

    def setup(self, run, resumed) -> None:
        self.surge = run.surge

    def lr(self, step: int, cfg) -> float:
        return halving_lr(step, cfg, None if self.surge is None else self.surge.step)
