"""The LoRA plug-in's step hook (support/hooks.py): the adapters added before any weight is loaded, the
lab's merged-refit fault, a checkpoint's merged export. Apart from lora/adapters.py, so that the adapters'
code and lora/export.py (which reads and writes them) import each other in one direction."""
from __future__ import annotations

import torch

from config import ConfigError
from lora.adapters import adapt, check_targets, continue_from, is_lora_checkpoint, merged, merged_state
from lora.export import read_adapter
from model import Transformer
from support.hooks import Hooks


class Lora(Hooks):
    """--lora_rank: the adapters added before any weight is loaded (a resume reads them back with the
    rest), the base frozen; a checkpoint's HF export holds the merged weights (exported), its masters
    file the base and the adapter apart (what a resume reads)."""

    def __init__(self, tcfg, rcfg=None):
        self.tcfg, self.merged_rollout = tcfg, getattr(rcfg, "lora_rollout", "adapter") == "merged"
        self.words = tcfg.lora_target_set()

    def check_build(self, task, config) -> None:
        with torch.device("meta"):
            check_targets(Transformer(config), self.words, self.tcfg.lora_rank)
        if self.merged_rollout and getattr(self.tcfg, "expert_parallel", 1) > 1:
            raise ConfigError("--lora_rollout=merged with --expert_parallel > 1: the merged copy holds whole "
                              "experts; run the lab's fault at EP=1")

    def adapt(self, model, experts=None) -> None:
        from support.distributed import router_dtype                 # a hook's code may read the core's rules
        t = self.tcfg
        adapt(model, t.lora_rank, t.lora_alpha, self.words, t.lora_expert_factors == "shared_outer", t.seed + 1,
              getattr(torch, t.dtype), router_dtype(t, model.config.model_type), experts)
        if is_lora_checkpoint(t.init_from):
            continue_from(model, t.init_from, t, experts)
        if t.lora_init:
            read_adapter(model, t.lora_init, t.lora_rank, t.lora_alpha, experts)

    def sampler_model(self, model, refresh):
        """--lora_rollout=merged (the lab's fault): the sampler runs a plain copy, the adapter merged into its
        weights' dtype after each update, as an engine's refit does; else the adapted model itself."""
        if not self.merged_rollout:
            return model, refresh
        copy = merged(model)
        state = copy.state_dict()

        @torch.no_grad()
        def sync():
            refresh()
            for k, v in merged_state(model).items():
                state[k].copy_(v)
        return copy, sync

    def exported(self, model):
        return None if model is None else merged(model, "cpu")      # on the host: a GPU never holds a second base
