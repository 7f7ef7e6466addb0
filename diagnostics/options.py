"""The diagnostics plug-in's options (diagnostics/log.py). config.py composes these fields into TrainConfig
(one flat --key=value namespace; --help lists them under this class). Nothing of the project is imported at
this module's top: deleting the folder takes its options with it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DiagnosticsOptions:
    """The step's most mismatched sequences, written (and held out of the update if asked)."""
    FREE_ON_RESUME = ("diagnostics",)
    diagnostics: int = 0              # > 0: each step, the N most mismatched sequences to diagnostics.jsonl
    diagnostics_holdout: bool = False  # --diagnostics' sequences, chosen from the recomputed old policy, are held
                                       # out of the update (diagnostics_held_out counts them; needs
                                       # --recompute_old_logp)

    def check(self):
        self.require(self.diagnostics >= 0, f"--diagnostics={self.diagnostics}: must be >= 0 (0: off)")
        self.require(not self.diagnostics_holdout or (self.recompute_old_logp and self.diagnostics > 0),
                     "--diagnostics_holdout=true holds out the sequences --diagnostics=N picks before the update, "
                     "from the recomputed old policy: add --recompute_old_logp=true and --diagnostics=N (N > 0)")


def hooks(tcfg, rcfg) -> list:
    """The step hook when --diagnostics is on, its code imported only then."""
    if not tcfg.diagnostics:
        return []
    from diagnostics.log import Diagnostics
    return [Diagnostics()]


TRAIN = [DiagnosticsOptions]
ROLLOUT = []
