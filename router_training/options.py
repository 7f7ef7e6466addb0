"""The router-training plug-in's options: the router's load-balancing and z-losses added to the RL loss
(router_training/router.py), its gates' learning rate and its bias's balancing rule (router_training/balance.py).

config.py composes these fields into TrainConfig (one flat --key=value namespace; --help lists them under
this class).
Nothing of the project is imported at this module's top: deleting the folder takes its options with it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RouterLossOptions:
    """The router's training losses, on the gate logits of the trainer's forward."""
    router_aux_loss_coef: float = 0.0 # + this times Switch's load-balancing loss E sum_i f_i P_i (1 when balanced;
                                      # per sequence and MoE layer; router_training.router.load_balancing_loss; 0: off;
                                      # e.g. 1e-3)
    router_z_loss_coef: float = 0.0   # + this times ST-MoE's router z-loss, the mean of logsumexp(router logits)^2
                                      # (router_training.router.router_z_loss; 0: off; e.g. 1e-3)

    def check(self):
        self.require_range("router_aux_loss_coef router_z_loss_coef", lambda v: v >= 0, ">= 0 (0: off)")

    def check_with_model(self, model):
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            self.require(not getattr(self, name) or bool(model.moe_layers),
                         f"--{name}={getattr(self, name)}: the model has no MoE layer (no routes); drop it")


@dataclass
class RouterUpdateOptions:
    """How the router's weights move besides the loss's gradient: the gates' lr, the bias's balancing."""
    router_lr_scale: float = 1.0      # the MoE router gate weights train at lr * S (0 freezes them; the
                                      # score-correction bias is --expert_bias_update_rate's)
    expert_bias_update_rate: float = 0.0  # > 0: after each optimizer step, bias += rate * sign(mean load - load)

    def check(self):
        self.require(self.router_lr_scale >= 0,
                     f"--router_lr_scale={self.router_lr_scale}: must be >= 0 (0 freezes the router)")
        self.require_range("expert_bias_update_rate", lambda v: v >= 0, ">= 0 (0: the bias is frozen)")
        self.require(self.expert_bias_update_rate == 0 or self.master_dtype == "float32"
                     or self.router_dtype == "float32",
                     "--expert_bias_update_rate needs a float32 bias: keep --master_dtype=float32 (or pass "
                     "--router_dtype=float32); a bf16 bias would round away updates smaller than its precision")

    def check_with_model(self, model):
        self.require(self.expert_bias_update_rate == 0 or model.score_correction_bias,
                     "--expert_bias_update_rate needs a model with a score-correction bias "
                     "(score_correction_bias=True: e.g. --init_from=tiny-sigmoid or a glm4_moe checkpoint)")

    def check_with_saved(self, saved: dict):
        """A resume: the optimizer's state holds one param group or two (the gates apart when S != 1)."""
        scale = saved.get("router_lr_scale", 1.0)
        self.require((scale == 1) == (self.router_lr_scale == 1),
                     f"--router_lr_scale={self.router_lr_scale}: the checkpoint's optimizer was built with "
                     f"router_lr_scale={scale}; resume with 1 on both sides or != 1 on both sides")


def hooks(tcfg, rcfg) -> list:
    """The step hooks of the options that are set (support/hooks.py), their code imported only then."""
    out = []
    if tcfg.router_aux_loss_coef or tcfg.router_z_loss_coef:
        from router_training.router import RouterLosses
        out.append(RouterLosses())
    if tcfg.router_lr_scale != 1 or tcfg.expert_bias_update_rate:
        from router_training.balance import ExpertBias, RouterLr
        out += [RouterLr(tcfg.router_lr_scale)] if tcfg.router_lr_scale != 1 else []
        out += [ExpertBias(tcfg.expert_bias_update_rate)] if tcfg.expert_bias_update_rate else []
    return out


TRAIN = [RouterLossOptions, RouterUpdateOptions]
ROLLOUT = []
