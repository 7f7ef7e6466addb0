"""The trackers plug-in's options: a copy of each metrics row to tensorboard or wandb (trackers/log.py).

config.py composes these fields into TrainConfig (one flat --key=value namespace; --help lists them under
this class).
Nothing of the project is imported at this module's top: deleting the folder takes its options with it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrackerOptions:
    """An experiment tracker beside metrics.jsonl."""
    FREE_ON_RESUME = ("log_to",)
    log_to: str = ""                  # "" (metrics.jsonl only) | tensorboard | wandb: a copy of each row

    def check(self):
        self.require(self.log_to in ("", "tensorboard", "wandb"), f"--log_to={self.log_to!r}: '', tensorboard or wandb")


def hooks(tcfg, rcfg) -> list:
    """The tracker's hook under --log_to (its package checked now: one line before any work)."""
    if not tcfg.log_to:
        return []
    from trackers.log import Tracker
    return [Tracker(tcfg.log_to)]


TRAIN = [TrackerOptions]
ROLLOUT = []
