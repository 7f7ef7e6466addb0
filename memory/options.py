"""The memory plug-in's options: activation checkpointing (memory/checkpointing.py), the optimizer on the host
(memory/offload.py).

config.py composes these fields into TrainConfig (one flat --key=value namespace; --help lists them under
this class).
Nothing of the project is imported at this module's top: deleting the folder takes its options with it."""
from __future__ import annotations

from dataclasses import dataclass

CHECKPOINTING = ("none", "moe", "full")     # --activation_checkpointing


@dataclass
class MemoryOptions:
    """What the trainer keeps between its forward and backward."""
    FREE_ON_RESUME = ("activation_checkpointing",    # the same bits either way (memory/checkpointing.py)
                      "offload_optimizer")           # where the state lives: the checkpoint is the same
    activation_checkpointing: str = "none"   # none | moe (each MoE layer's forward, router and experts, recomputed in
                                             # the backward) | full (each block's): the same kernels on the same
                                             # inputs, so the same bits; activations of one layer, not all
    offload_optimizer: bool = False          # the fp32 masters, their gradient sums and AdamW's moments in host memory
                                             # (pinned), the update on the host; the device holds the compute copy
                                             # (on a CPU device a second copy: the same bits, for testing)

    def check(self):
        self.require(self.activation_checkpointing in CHECKPOINTING,
                     f"--activation_checkpointing={self.activation_checkpointing!r}: choose one of "
                     f"{', '.join(CHECKPOINTING)}")
        self.require(self.activation_checkpointing == "none" or not getattr(self, "train_capacity_factor", 0),
                     f"--activation_checkpointing={self.activation_checkpointing} with --train_capacity_factor: "
                     "the recompute would count the dropped tokens twice; drop one")
        self.require(not (self.offload_optimizer and getattr(self, "eplb_redundant", 0)),
                     "--offload_optimizer with --eplb_redundant: EPLB folds its replicas' sums on the device; "
                     "drop one")

    def check_with_model(self, model):
        self.require(self.activation_checkpointing != "moe" or bool(model.moe_layers),
                     "--activation_checkpointing=moe: the model has no MoE layer; use full (each block) or none")


def hooks(tcfg, rcfg) -> list:
    """The step hooks of the options that are set (support/hooks.py), their code imported only then."""
    found = []
    if tcfg.activation_checkpointing != "none":
        from memory.checkpointing import ActivationCheckpointing
        found.append(ActivationCheckpointing(tcfg.activation_checkpointing))
    if tcfg.offload_optimizer:
        from memory.offload import Offload
        found.append(Offload())
    return found


TRAIN = [MemoryOptions]
ROLLOUT = []
