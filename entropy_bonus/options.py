"""The entropy-bonus plug-in's options (entropy_bonus/bonus.py).

config.py composes these fields into TrainConfig (one flat --key=value namespace; --help lists them under
this class).
Nothing of the project is imported at this module's top: deleting the folder takes its options with it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EntropyOptions:
    """An entropy bonus in the RL loss, against a collapse of the policy's entropy."""
    entropy_coef: float = 0.0         # an entropy bonus: minus this times the entropy of softmax(logits / T) at each
                                      # response token, aggregated as the loss (0: off; e.g. 1e-3 against a collapse)

    def check(self):
        self.require(self.entropy_coef >= 0, f"--entropy_coef={self.entropy_coef:g}: must be >= 0 (0: off)")


def hooks(tcfg, rcfg) -> list:
    """The bonus's hook when --entropy_coef > 0 (support/hooks.py), its code imported only then."""
    if not tcfg.entropy_coef:
        return []
    from entropy_bonus.bonus import EntropyBonus
    return [EntropyBonus(tcfg.entropy_coef)]


TRAIN = [EntropyOptions]
ROLLOUT = []
