"""The memory plug-in's options: activation checkpointing (memory/checkpointing.py).

config.py composes these fields into TrainConfig (one flat --key=value namespace; --help lists them under
this class).
Nothing of the project is imported at this module's top: deleting the folder takes its options with it."""
from __future__ import annotations

from dataclasses import dataclass

CHECKPOINTING = ("none", "moe", "full")     # --activation_checkpointing


@dataclass
class MemoryOptions:
    """What the trainer keeps between its forward and backward."""
    FREE_ON_RESUME = ("activation_checkpointing",)   # the same bits either way (memory/checkpointing.py)
    activation_checkpointing: str = "none"   # none | moe (each MoE layer's forward, router and experts, recomputed in
                                             # the backward) | full (each block's): the same kernels on the same
                                             # inputs, so the same bits; activations of one layer, not all

    def check(self):
        self.require(self.activation_checkpointing in CHECKPOINTING,
                     f"--activation_checkpointing={self.activation_checkpointing!r}: choose one of "
                     f"{', '.join(CHECKPOINTING)}")
        self.require(self.activation_checkpointing == "none" or not getattr(self, "train_capacity_factor", 0),
                     f"--activation_checkpointing={self.activation_checkpointing} with --train_capacity_factor: "
                     "the recompute would count the dropped tokens twice; drop one")

    def check_with_model(self, model):
        self.require(self.activation_checkpointing != "moe" or bool(model.moe_layers),
                     "--activation_checkpointing=moe: the model has no MoE layer; use full (each block) or none")


def hooks(tcfg, rcfg) -> list:
    """The step hooks of the options that are set (support/hooks.py), their code imported only then."""
    if tcfg.activation_checkpointing == "none":
        return []
    from memory.checkpointing import ActivationCheckpointing
    return [ActivationCheckpointing(tcfg.activation_checkpointing)]


TRAIN = [MemoryOptions]
ROLLOUT = []
