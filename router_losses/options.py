"""The router-losses plug-in's options: the router's load-balancing and z-losses added to the RL loss
(router_losses/router.py).

config.py composes these fields into TrainConfig (one flat --key=value namespace; --help lists them under
this class).
Nothing of the project is imported at this module's top: deleting the folder takes its options with it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RouterLossOptions:
    """The router's training losses, on the gate logits of the trainer's forward."""
    router_aux_loss_coef: float = 0.0 # + this times Switch's load-balancing loss E sum_i f_i P_i (1 when balanced;
                                      # per sequence and MoE layer; router_losses.router.load_balancing_loss; 0: off;
                                      # e.g. 1e-3)
    router_z_loss_coef: float = 0.0   # + this times ST-MoE's router z-loss, the mean of logsumexp(router logits)^2
                                      # (router_losses.router.router_z_loss; 0: off; e.g. 1e-3)

    def check(self):
        self.require_range("router_aux_loss_coef router_z_loss_coef", lambda v: v >= 0, ">= 0 (0: off)")

    def check_with_model(self, model):
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            self.require(not getattr(self, name) or bool(model.moe_layers),
                         f"--{name}={getattr(self, name)}: the model has no MoE layer (no routes); drop it")


def hooks(tcfg, rcfg) -> list:
    """The step hook when either loss is on (support/hooks.py), its code imported only then."""
    if tcfg.router_aux_loss_coef == 0 and tcfg.router_z_loss_coef == 0:
        return []
    from router_losses.router import RouterLosses
    return [RouterLosses()]


TRAIN = [RouterLossOptions]
ROLLOUT = []
