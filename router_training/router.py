"""The router's training losses on the gate logits of the trainer's forward (model.RouteDetail.logits):
Switch's load-balancing loss and ST-MoE's z-loss (--router_aux_loss_coef, --router_z_loss_coef), and the
step hook that adds them to each micro-batch's loss (support/hooks.Hooks.micro_loss)."""
from __future__ import annotations

import torch

from losses import Normalisers
from support.hooks import Hooks


ROUTER_LOSSES = {"router_aux_loss": "router_aux_loss_coef", "router_z_loss": "router_z_loss_coef"}  # metric: coef


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (a bf16 router's logits); fp64 stays fp64 (the gradient checks)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def router_probs(logits: torch.Tensor, scoring: str = "softmax") -> torch.Tensor:
    """The distribution the balancing loss averages, (..., E) -> (..., E) fp32, from the family's own scores:
    softmax over all E experts (Qwen, Mixtral, OLMoE; gpt-oss's topk_softmax too, as transformers' gpt-oss
    load_balancing_loss_func takes it), or for sigmoid routers (DeepSeek-V3, GLM-4.5) the sigmoid scores
    normalised to sum 1, s_i / sum_j s_j, as DeepSeek-V3's sequence-wise balance loss (its eq. 19-20;
    without the score-correction bias, which moves the choice only)."""
    x = _upcast(logits)
    if scoring == "sigmoid":
        s = torch.sigmoid(x)
        return s / s.sum(-1, keepdim=True)
    return torch.softmax(x, -1)


def load_balancing_loss(logits, chosen, valid, scoring: str = "softmax") -> torch.Tensor:
    """Switch Transformer's load-balancing loss (its eq. 4) in the top-k form, per row (a sequence):

        L = (1 / n_moe) sum_l  E sum_i f_li P_li
        f_li = (1 / (k n)) sum_t sum_j [chosen_tlj = i]     layer l's share of (token, slot) assignments to expert i
        P_li = (1 / n) sum_t p_tli                          the mean router probability of expert i (router_probs)

    over the row's n valid tokens t; every one of the k slots counts, as in transformers' Mixtral / Qwen-MoE
    form. logits (N, T, n_moe, E) carry the gradient (through P: f is a count, without one); chosen (N, T,
    n_moe, k): the router's own top-k (score's routes: under replay too, so the loss balances the router's
    choice); valid (N, T) bool. -> (N,) fp32; 0 for a row without valid tokens.
    L = 1 when the assignments are balanced (f = 1/E) or the router is uniform (P = 1/E); k = 1 all on one
    expert: E. transformers' load_balancing_loss_func on ONE layer's logits is k * L (its count per expert is
    over tokens, k at balance); given several layers at once it pools their tokens into one f and one P
    (products across layers), where L is the mean of the layers' own losses (the paper's: one per layer)."""
    N, T, L, E = logits.shape
    if L == 0:
        return _upcast(logits).new_zeros(N)
    k, m = chosen.shape[-1], valid[:, :, None, None]                   # m (N, T, 1, 1)
    n = valid.sum(1).clamp(min=1)[:, None, None]                         # (N, 1, 1)
    experts = torch.arange(E, device=logits.device)
    hits = sum((chosen[..., j, None] == experts).float() for j in range(k))   # (N, T, L, E): no atomics
    f = torch.where(m, hits, 0.0).sum(1) / (k * n)                        # (N, L, E)
    P = torch.where(m, router_probs(logits, scoring), 0.0).sum(1) / n     # (N, L, E)
    return E * (f * P).sum(-1).mean(-1)


def router_z_loss(logits, valid) -> torch.Tensor:
    """ST-MoE's router z-loss (its eq. 5), per row: (1 / n_moe) sum_l (1 / n) sum_t (log sum_j exp x_tlj)^2
    over the row's n valid tokens; logits (N, T, n_moe, E), valid (N, T) bool -> (N,) fp32."""
    N, T, L, E = logits.shape
    if L == 0:
        return _upcast(logits).new_zeros(N)
    z2 = torch.where(valid[..., None], torch.logsumexp(_upcast(logits), -1) ** 2, 0.0)   # (N, T, L)
    return z2.sum(1).mean(-1) / valid.sum(1).clamp(min=1)


def router_objective(loss, logits, chosen, lengths, cfg, norm: Normalisers, scoring: str = "softmax"):
    """loss + router_aux_loss_coef * aux + router_z_loss_coef * z for one micro-batch, and (aux, z)
    unweighted (a detached (2,) tensor), the micro-batch's shares: summed over the micro-batches they are
    the minibatch's values. logits (N, T, n_moe, E) with their gradient and chosen (N, T, n_moe, k) as
    load_balancing_loss (the padded layout: a packed forward's unpacked); scoring: the model's
    router_scoring (router_probs); lengths (N,): each row's tokens, its prompt (and observations)
    included: every token goes through the router and the papers count them all; padding and packed
    tails do not count.

    Each sequence's losses weigh its n_s tokens over norm.router_tokens N (the global minibatch's):
    aux = sum_s n_s L_s / N, z = the mean over the minibatch's tokens of mean_l lse^2. A sequence is the
    balancing loss's group of tokens (f and P are means over it, as DeepSeek-V3's sequence-wise loss):
    micro-batches are whole sequences, so the sum is the same at every micro-batch split and world size
    (a group of the whole minibatch would need its f before any micro-batch's backward).
    Both coefficients 0: loss itself, untouched, nothing computed."""
    if cfg.router_aux_loss_coef == 0 and cfg.router_z_loss_coef == 0:
        return loss, torch.zeros(2)
    if not norm.router_tokens > 0:
        raise ValueError("router_objective needs Normalisers.router_tokens: the minibatch's tokens, prompts included")
    valid = torch.arange(logits.shape[1], device=logits.device) < lengths.to(logits.device)[:, None]   # (N, T)
    n = valid.sum(1)
    aux = (n * load_balancing_loss(logits, chosen, valid, scoring)).sum() / norm.router_tokens
    z = (n * router_z_loss(logits, valid)).sum() / norm.router_tokens
    for coef, term in ((cfg.router_aux_loss_coef, aux), (cfg.router_z_loss_coef, z)):
        if coef:                                      # a term at 0 adds nothing, not even zeros
            loss = loss + coef * term
    return loss, torch.stack([aux, z]).detach()


def router_metrics(cfg, forwards: list) -> dict:
    """The logged router losses of a step: each one whose coefficient is > 0, unweighted, the mean over the
    step's forwards (forwards: each minibatch's (aux, z), router_objective's summed over its micro-batches)."""
    return {name: sum(f[i] for f in forwards) / len(forwards)
            for i, (name, coef) in enumerate(ROUTER_LOSSES.items()) if getattr(cfg, coef) > 0 and forwards}


class RouterLosses(Hooks):
    """--router_aux_loss_coef / --router_z_loss_coef in the step: the trainer's forwards keep the gate
    logits, each micro-batch's loss gains the terms (router_objective) and its row of sums their unweighted
    shares, summed over the ranks in the micro-batches' order by the core (the same at every world size);
    the step's metrics are their means over its minibatches' forwards (a skipped update's too)."""
    router_logits = True
    micro_stats = ("router_aux", "router_z")

    def __init__(self):
        self.forwards = []

    def micro_loss(self, run, loss, out, mb, norm):
        scoring = run.policy.master.config.router_scoring
        loss, router = router_objective(loss, out.detail.logits, out.routes, mb.lengths, run.tcfg, norm, scoring)
        return loss, router.tolist()

    def minibatch_sums(self, sums: list[float]) -> None:
        self.forwards.append(sums)

    def step_metrics(self, run, step, batch, audited) -> dict:
        row, self.forwards = router_metrics(run.tcfg, self.forwards), []
        return row


