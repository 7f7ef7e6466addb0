"""The LoRA plug-in's options: adapters on attention, dense MLPs, experts and (opt-in) the router, the base
frozen in its compute dtype (lora/adapters.py).

config.py composes these fields into TrainConfig (one flat --key=value namespace; --help lists them under
this class).
Nothing of the project is imported at this module's top: deleting the folder takes its options with it."""
from __future__ import annotations

from dataclasses import dataclass

TARGETS = ("attention", "mlp", "experts", "router")   # --lora_targets' words
FACTORS = ("per_expert", "shared_outer")              # --lora_expert_factors


@dataclass
class LoraOptions:
    """Low-rank adapters: y = x W + (alpha / r) (x A) B, W frozen; only A and B are trained. --init_from a
    --lora_rank run's checkpoint continues its adapters on its base (without --lora_rank: its merged weights)."""
    lora_rank: int = 0                        # r > 0: train LoRA adapters of rank r, the weights frozen; 0: off
    lora_alpha: float = 32.0                  # the adapters' scale is alpha / r (PEFT's lora_alpha)
    lora_targets: str = "attention,mlp,experts"   # comma-separated: attention (every projection; a Gated DeltaNet's
                                              # in_proj_qkv, in_proj_z, out_proj), mlp (dense MLPs
                                              # and shared experts), experts (the routed experts, stacked by
                                              # expert), router (the MoE gate)
    lora_expert_factors: str = "per_expert"   # per_expert: A and B for every expert | shared_outer: the factors on
                                              # the hidden side (gate/up's A, down's B) shared by all experts
    lora_init: str = ""                       # a PEFT adapter folder (python -m lora.export's) to start the adapters
                                              # from; its base must be --init_from's weights (adapter_config's hash)

    def lora_target_set(self) -> set[str]:
        return {t.strip() for t in self.lora_targets.split(",") if t.strip()}

    def check(self):
        targets = self.lora_target_set()
        self.require(self.lora_rank >= 0, f"--lora_rank={self.lora_rank}: must be >= 0 (0: off)")
        self.require(self.lora_alpha > 0, f"--lora_alpha={self.lora_alpha}: must be > 0")
        self.require(targets <= set(TARGETS) and targets,
                     f"--lora_targets={self.lora_targets!r}: a comma-separated subset of {', '.join(TARGETS)}")
        self.require(self.lora_expert_factors in FACTORS,
                     f"--lora_expert_factors={self.lora_expert_factors!r}: choose one of {', '.join(FACTORS)}")
        self.require(not self.lora_init or self.lora_rank, "--lora_init needs --lora_rank (the adapters' rank)")
        if self.lora_rank:
            ep = getattr(self, "expert_parallel", 1) > 1 and "experts" in targets
            self.require(not ep or self.lora_expert_factors == "per_expert",
                         "--lora_expert_factors=shared_outer with --expert_parallel > 1: a factor shared by every "
                         "expert is not an expert's row to shard; use per_expert under EP")
            self.require(not ep or not getattr(self, "eplb_redundant", 0),
                         "--lora_rank with --eplb_redundant and experts among --lora_targets: not supported yet; "
                         "drop --eplb_redundant (or experts from --lora_targets)")
            self.require(getattr(self, "parallel", "ddp") != "fsdp",
                         "--lora_rank with --parallel=fsdp: not supported yet; use ddp (the frozen base is "
                         "not sharded: one copy a rank)")


@dataclass
class LoraRolloutOptions:
    """The mismatch lab's LoRA fault: the rollout's weights with the adapter merged in, as engines refit."""
    lora_rollout: str = "adapter"             # adapter: the sampler runs the adapters unmerged, as the trainer does |
                                              # merged: a copy with W + s B A folded into the weights' dtype after each
                                              # update (an engine's refit; bf16 weights round it)

    def check(self):
        self.require(self.lora_rollout in ("adapter", "merged"),
                     f"--lora_rollout={self.lora_rollout!r}: adapter or merged")


def hooks(tcfg, rcfg) -> list:
    """The step hooks of the options that are set (support/hooks.py), their code imported only then."""
    if not tcfg.lora_rank:
        return []
    from lora.hooks import Lora
    return [Lora(tcfg, rcfg)]


TRAIN = [LoraOptions]
ROLLOUT = [LoraRolloutOptions]
