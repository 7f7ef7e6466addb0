"""How the router's weights move besides the loss's gradient: its gates' learning rate (--router_lr_scale)
and the aux-loss-free balancing of its score-correction bias (--expert_bias_update_rate, DeepSeek-V3).
Two step hooks (support/hooks.py): `optimizer` (AdamW with the gates in a group of their own) and
`after_update` (the bias moved after each optimizer step, before the compute copy is cast from it)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from config import ConfigError
from model import MoE, Transformer
from replay import expert_load
from support.hooks import Hooks


class RouterLr(Hooks):
    """--router_lr_scale=S != 1: AdamW with the routers' gates in a second group whose lr is S times the
    first's, set just before each step (the loop sets every group's lr); S = 0 also drops their weight
    decay, so frozen gates keep their bits."""

    def __init__(self, scale: float):
        self.scale = scale

    def optimizer(self, model: Transformer, params: list, kw: dict) -> torch.optim.Optimizer:
        gates = {id(p) for m in model.modules() if isinstance(m, MoE) for p in m.gate.parameters()}
        if not gates:
            raise ConfigError(f"--router_lr_scale={self.scale}: the model has no MoE layer (no router)")
        opt = torch.optim.AdamW([{"params": [p for p in params if id(p) not in gates]},
                                 {"params": [p for p in params if id(p) in gates]}], **kw)

        def scale_router_lr(opt, args, kwargs):
            main, router = opt.param_groups
            router["lr"] = main["lr"] * self.scale
            router["weight_decay"] = kw["weight_decay"] if self.scale > 0 else 0.0
        opt.register_step_pre_hook(scale_router_lr)
        return opt


class ExpertBias(Hooks):
    """--expert_bias_update_rate=rate > 0: after each optimizer step, each MoE layer's score-correction
    bias moves by rate toward balance, from the expert load of the minibatch's scored positions."""

    def __init__(self, rate: float):
        self.rate = rate

    def after_update(self, policy, scored, batch) -> None:
        load = chosen_load(scored, batch.mask, policy.master.config)
        update_expert_bias(policy.master, load.to(policy.d.device), self.rate, policy.d)


def chosen_load(scored, mask: torch.Tensor, config) -> torch.Tensor:
    """(n_moe, E) a rank's expert load at the response-scoring positions (mask (B, T-1)) of its forwards'
    rows (scored: a packing.Scored; None: it ran none): what the aux-loss-free bias update sums over
    ranks (integers) and balances (ExpertBias). config: the model's."""
    if scored is None:
        return torch.zeros(len(config.moe_layers), config.num_experts, dtype=torch.long)
    chosen = scored.routes[:, :-1][mask[scored.rows].bool()]         # (N, n_moe, k)
    return expert_load(chosen, config.num_experts)


@torch.no_grad()
def update_expert_bias(model: Transformer, load: torch.Tensor, rate: float, d) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): bias += rate * sign(mean load - load), per MoE layer.

    load (n_moe, E) is this rank's count (replay.expert_load); it is summed over ranks first, so every
    rank applies the same update to its copy of the bias.
    """
    if d.world > 1:
        dist.all_reduce(load)
    load = load.double()
    step = rate * torch.sign(load.mean(-1, keepdim=True) - load)    # (n_moe, E): underloaded experts go up
    for j, i in enumerate(model.config.moe_layers):
        bias = model.layers[i].mlp.gate.e_score_correction_bias
        bias.add_(step[j].to(bias.device, bias.dtype))
