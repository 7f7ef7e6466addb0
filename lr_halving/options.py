"""The lr-halving plug-in's options: --lr_schedule=halving's period and its start (lr_halving/lr_schedules.py).

config.py composes these fields into TrainConfig (one flat --key=value namespace; --help lists them under
this class); the core's --lr_schedule takes `halving` from LR_SCHEDULES below (config.declared_by).
Nothing of the project is imported at this module's top: deleting the folder takes its options with it."""
from __future__ import annotations

from dataclasses import dataclass

LR_SCHEDULES = ("halving",)


@dataclass
class HalvingOptions:
    """--lr_schedule=halving: lr halved every period after the warmup (or from a response-length surge)."""
    LR_PLAN = ("lr_decay_period", "halving_start")   # with --lr_schedule, the lr's plan (checkpoint.resume_plan)
    lr_decay_period: int = 0          # --lr_schedule=halving: steps per halving (required there, 0 elsewhere)
    halving_start: str = "warmup"     # --lr_schedule=halving counts its periods from: warmup (its end) | surge (lr
                                      # holds until a response-length surge, halves on the next step, then every
                                      # period)

    def check(self):
        halving = self.lr_schedule == "halving"
        self.require(not halving or self.lr_decay_period >= 1,
                     f"--lr_decay_period={self.lr_decay_period}: --lr_schedule=halving needs a period of >= 1 steps")
        self.require(halving or self.lr_decay_period == 0,
                     f"--lr_decay_period={self.lr_decay_period}: only --lr_schedule=halving uses it "
                     f"(this run's is {self.lr_schedule})")
        self.require(not halving or 0 <= self.min_lr_ratio <= 1,
                     f"--min_lr_ratio={self.min_lr_ratio}: --lr_schedule=halving needs a floor in [0, 1]")
        self.require(self.halving_start in ("warmup", "surge"),
                     f"--halving_start={self.halving_start!r}: warmup or surge")
        self.require(self.halving_start == "warmup" or halving,
                     f"--halving_start={self.halving_start}: only --lr_schedule=halving uses it (this run's is "
                     f"{self.lr_schedule})")
        self.require(self.halving_start == "warmup" or self.surge_window >= 1,
                     "--halving_start=surge waits for a response-length surge: it needs --surge_window >= 1")


def hooks(tcfg, rcfg) -> list:
    """The schedule's hook under --lr_schedule=halving (support/hooks.py), its code imported only then."""
    if tcfg.lr_schedule != "halving":
        return []
    from lr_halving.lr_schedules import Halving
    return [Halving()]


TRAIN = [HalvingOptions]
ROLLOUT = []
