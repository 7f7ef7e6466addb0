"""The policy-losses plug-in's options: SAPO's gate temperatures (policy_losses/losses.py).

config.py composes these fields into TrainConfig (one flat --key=value namespace; --help lists them under
this class); --loss takes the names in LOSSES below, and naming one brings this plug-in (config.configs_for).
Nothing of the project is imported at this module's top: deleting the folder takes its options and losses
with it."""
from __future__ import annotations

from dataclasses import dataclass

LOSSES = ("sapo", "cispo")


@dataclass
class SapoOptions:
    """SAPO's soft gate (--loss=sapo)."""
    sapo_tau_pos: float = 1.0         # SAPO's gate temperature for A > 0
    sapo_tau_neg: float = 1.05        # ... for A < 0


TRAIN = [SapoOptions]
ROLLOUT = []
