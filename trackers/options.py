"""The trackers plug-in's options: a copy of each metrics row to tensorboard or wandb (trackers/log.py), and
sampled responses to samples.jsonl (trackers/samples.py).

config.py composes these fields into TrainConfig (one flat --key=value namespace; --help lists them under
this class).
Nothing of the project is imported at this module's top: deleting the folder takes its options with it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrackerOptions:
    """What a run writes beside metrics.jsonl: an experiment tracker's copy, sampled responses."""
    FREE_ON_RESUME = ("log_to", "log_samples")
    log_to: str = ""                  # "" (metrics.jsonl only) | tensorboard | wandb: a copy of each row
    log_samples: int = 0              # N sampled responses per step to out_dir/samples.jsonl (one shown)

    def check(self):
        self.require(self.log_to in ("", "tensorboard", "wandb"), f"--log_to={self.log_to!r}: '', tensorboard or wandb")
        self.require(self.log_samples >= 0, f"--log_samples={self.log_samples}: must be >= 0")


def hooks(tcfg, rcfg) -> list:
    """The tracker's hook under --log_to (its package checked now: one line before any work), the samples'
    under --log_samples."""
    out = []
    if tcfg.log_to:
        from trackers.log import Tracker
        out.append(Tracker(tcfg.log_to))
    if tcfg.log_samples:
        from trackers.samples import SampleLog
        out.append(SampleLog(tcfg.log_samples))
    return out


TRAIN = [TrackerOptions]
ROLLOUT = []
