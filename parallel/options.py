"""The parallel plug-in's options: FSDP2, expert parallelism, EPLB, token dropping
(parallel/fsdp.py, parallel/expert_parallel.py, parallel/eplb.py, parallel/hooks.capacity_limit).

config.py composes these fields into TrainConfig (one flat --key=value namespace; --help lists them under
this class).
Nothing of the project is imported at this module's top: deleting the folder takes its options with it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParallelOptions:
    """FSDP2, expert parallelism, EPLB, token dropping."""
    FREE_ON_RESUME = ("parallel", "expert_parallel", "expert_placement",   # the layout, like the world size
                      "eplb_redundant", "eplb_interval")                   # where EPLB's replicas compute: no bit moves
    parallel: str = "ddp"             # under torchrun: ddp (full model per rank) | fsdp (FSDP2 sharding)
    expert_parallel: int = 1          # N ranks per EP group, each holding E/N experts (parallel/expert_parallel.py)
    expert_placement: list[int] = field(default_factory=list)   # "" contiguous | physical slot of each logical
                                      # expert, comma-separated (a permutation; slot p on rank p // (E/N))
    eplb_redundant: int = 0           # EPLB: R more expert slots per MoE layer, replicas of the most loaded experts,
                                      # all slots packed onto the EP ranks by measured load (parallel/eplb.py); 0: off
    eplb_interval: int = 1            # EPLB: re-plan every N steps, from the rollouts' load since the last plan
    train_capacity_factor: float = 0.0    # > 0: in the trainer's forwards each expert takes at most
                                          # ceil(C * tokens * k / E) (token, slot) rows (parallel/hooks.py);
                                          # 0: dropless. The rollout is always dropless

    def check(self):
        """The sharding, the EP degree, EPLB's replicas (the checks that need the model: eplb.check)."""
        R = self.eplb_redundant
        self.require(self.parallel in ("ddp", "fsdp"), f"--parallel={self.parallel!r}: ddp or fsdp")
        self.require(self.expert_parallel >= 1, f"--expert_parallel={self.expert_parallel}: must be >= 1")
        self.require(R >= 0, f"--eplb_redundant={R}: must be >= 0 (0: off)")
        self.require(self.eplb_interval >= 1,
                     f"--eplb_interval={self.eplb_interval}: must be >= 1 (steps between re-plans)")
        self.require(R == 0 or self.expert_parallel > 1,
                     f"--eplb_redundant={R}: replicas spread experts over EP ranks; it needs --expert_parallel > 1")
        self.require(R == 0 or self.grad_reduce == "exact", f"--eplb_redundant={R}: the replicas' gradients are "
                     "folded into their experts' exact sums; it needs --grad_reduce=exact")
        self.require(self.train_capacity_factor >= 0,
                     f"--train_capacity_factor={self.train_capacity_factor}: 0 (dropless) or > 0")

    def check_with_model(self, model):
        if self.eplb_redundant:                                       # the replicas against the experts
            from parallel.eplb import check
            check(self.eplb_redundant, self.expert_parallel, model.num_experts)
        self.require(self.train_capacity_factor == 0 or bool(model.moe_layers),
                     f"--train_capacity_factor={self.train_capacity_factor}: the model has no MoE layer (no "
                     "routes); drop it")


def hooks(tcfg, rcfg) -> list:
    """The step hooks of the options that are set (support/hooks.py), their code imported only then."""
    layout = tcfg.expert_parallel > 1 or bool(tcfg.expert_placement)
    if not (tcfg.train_capacity_factor or layout):
        return []
    from parallel.hooks import DeviceLoad, Eplb, ExpertLayout, TokenDropping
    return ([ExpertLayout()] if layout else []) + \
        ([TokenDropping(tcfg.train_capacity_factor)] if tcfg.train_capacity_factor else []) + \
        ([DeviceLoad()] if tcfg.expert_parallel > 1 else []) + ([Eplb()] if tcfg.eplb_redundant else [])


def sharding(tcfg, d):
    """FSDP2's sharding of the trained weights (support/distributed.sharding's seam) under --parallel=fsdp
    over several ranks, else None (DDP, the core's)."""
    if tcfg.parallel != "fsdp" or d.world == 1:
        return None
    from parallel.fsdp import Fsdp
    return Fsdp()


TRAIN = [ParallelOptions]
ROLLOUT = []
