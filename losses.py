"""The RL objectives as tables: policy losses, aggregations, off-policy corrections, KL estimators.

    from losses import Normalisers, correction_weights, token_objective
    w = correction_weights(old_logp, rollout_logp, mask, cfg)            # (B, T), no gradient
    loss, clipped = token_objective(logp, old_logp, adv, mask, cfg, Normalisers(n_tok, n_seq, T), weights=(w,))

Every tensor is (B, T) (a sequence per row, a response token per column, `mask` 1 on response tokens)
unless said otherwise; adv is (B,). The formulas are written out in docs/design.md ("RL losses"). A new
loss, aggregation or correction is one function and one table entry: config validation, the training
loop and the tests all read these tables. `token_objective` composes one micro-batch's loss from them
(a plug-in's per-token weights come through the step's seam: route_filter/); a plug-in adds its own terms through the step's seam
(support/hooks.Hooks.micro_loss: router_training/'s load-balancing and z-losses).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

LOG_RATIO_CLAMP = 20.0            # exp(+-20) stays finite in fp32


def group_advantages(rewards: torch.Tensor, group_size: int, std_norm: bool = True) -> torch.Tensor:
    """A_i = (r_i - mean_group) / (std_group + 1e-6); rewards (B,) grouped consecutively -> (B,)."""
    r = rewards.view(-1, group_size)                                  # (n_groups, G)
    a = r - r.mean(-1, keepdim=True)
    if std_norm:
        a = a / (r.std(-1, keepdim=True) + 1e-6)
    return a.view(-1)


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each sequence's masked tokens: (B, T) -> (B,)."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)


# ---------------------------------------------------------------------------------------------------
# policy losses: (logp, old_logp, A (B, 1), mask, cfg) -> per-token loss (B, T), clipped (B, T) bool
# ---------------------------------------------------------------------------------------------------
def _ratio(logp, old_logp):
    return torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def grpo_loss(logp, old_logp, A, mask, cfg):
    """PPO-clip with clip-higher: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); with dual_clip_c = c > 0,
    tokens with A < 0 are capped at -A c (the loss of a huge ratio stays bounded)."""
    ratio = _ratio(logp, old_logp)
    l1, l2 = -A * ratio, -A * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    loss, clipped = torch.maximum(l1, l2), l2 > l1
    if cfg.dual_clip_c > 0:
        cap = -A * cfg.dual_clip_c
        capped = (A < 0) & (loss > cap)
        loss, clipped = torch.where(capped, cap, loss), clipped | capped
    return loss, clipped


def _gspo_log_ratio(logp, old_logp, mask, cfg):
    """log s_i = mean_t(logp - old_logp), clamped as a whole (the sequence's ratio, not each token's) to
    [-20, cfg.gspo_log_ratio_max]; and whether it is inside the clamp (outside, the gradient is zero in
    both GSPO forms)."""
    hi = cfg.gspo_log_ratio_max
    m = seq_mean(logp - old_logp, mask)                               # (B,)
    inside = (m.detach() > -LOG_RATIO_CLAMP) & (m.detach() < hi)
    return m.clamp(-LOG_RATIO_CLAMP, hi)[:, None], inside[:, None]


def _gspo_clip(s, A, cfg):
    l1, l2 = -A * s, -A * s.clamp(1 - cfg.gspo_eps_low, 1 + cfg.gspo_eps_high)
    return torch.maximum(l1, l2), l2 > l1


def gspo_loss(logp, old_logp, A, mask, cfg):
    """GSPO: s_i = exp(log s_i) on every token of sequence i, then the sequence-level clip."""
    log_s, _ = _gspo_log_ratio(logp, old_logp, mask, cfg)
    return _gspo_clip(torch.exp(log_s).expand_as(logp), A, cfg)


def gspo_token_loss(logp, old_logp, A, mask, cfg):
    """GSPO-token: log s_it = sg[log s_i] + logp_t - sg[logp_t]. Value s_i, gradient per token; with the
    per-sequence mean it equals GSPO's gradient (also at the clamp, where both are zero)."""
    log_s, inside = _gspo_log_ratio(logp, old_logp, mask, cfg)
    s = torch.exp(log_s.detach() + torch.where(inside, logp - logp.detach(), 0.0))
    return _gspo_clip(s, A, cfg)


@dataclass(frozen=True)
class Loss:
    fn: Callable
    aggregation: str              # what --agg=auto resolves to (the paper's)
    per_sequence: bool = False    # defined with the per-sequence mean only: other --agg values are refused
    weighted: Callable | None = None   # the form that carries per-token weights, if fn does not (GSPO: its
                                       # token form, equal values; see token_objective)
    dual_clip: bool = False       # fn honours cfg.dual_clip_c (a loss built on grpo_loss does: set it True)


LOSSES: dict[str, Loss] = {
    "grpo": Loss(grpo_loss, "token_mean", dual_clip=True),
    "gspo": Loss(gspo_loss, "seq_mean_token_mean", per_sequence=True, weighted=gspo_token_loss),
    "gspo_token": Loss(gspo_token_loss, "seq_mean_token_mean", per_sequence=True),
}


def policy_loss(logp, old_logp, adv, mask, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss (B, T) of cfg.loss and a (B, T) bool of clipped tokens. logp carries the gradient;
    old_logp is the behaviour policy's (no gradient); adv (B,)."""
    return LOSSES[cfg.loss].fn(logp, old_logp, adv[:, None], mask, cfg)


# ---------------------------------------------------------------------------------------------------
# aggregation: a micro-batch's per-token loss with the minibatch's normalisers (micro-batches add up)
# ---------------------------------------------------------------------------------------------------
AGGREGATIONS: dict[str, Callable] = {
    "token_mean": lambda l, m, n_tok, n_seq, T: (l * m).sum() / n_tok,
    "seq_mean_token_mean": lambda l, m, n_tok, n_seq, T: seq_mean(l, m).sum() / n_seq,
    "seq_mean_token_sum": lambda l, m, n_tok, n_seq, T: (l * m).sum() / n_seq,
    "drgrpo": lambda l, m, n_tok, n_seq, T: (l * m).sum() / (n_seq * T),     # a constant normaliser
}


def aggregate(loss_tok, mask, agg: str, n_tokens: int, n_seqs: int, max_new_tokens: int) -> torch.Tensor:
    return AGGREGATIONS[agg](loss_tok, mask, n_tokens, n_seqs, max_new_tokens)


# ---------------------------------------------------------------------------------------------------
# the per-token objective, composed once
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Normalisers:
    """What a micro-batch's loss is divided by: the global minibatch's counts, so micro-batches and ranks add up."""
    tokens: float                 # loss tokens in the minibatch, over every rank
    sequences: int                # sequences in the minibatch, over every rank
    max_new_tokens: int           # drgrpo's constant
    router_tokens: float = 0.0    # token positions the router saw in the minibatch (prompts too), over every rank
                                  # (router_training/'s normaliser)

    @classmethod
    def of(cls, loss_mask: torch.Tensor, idx: torch.Tensor, held_out: torch.Tensor, max_new_tokens: int,
           lengths: torch.Tensor) -> "Normalisers":
        """The global minibatch idx's: its loss tokens (loss_mask (B, T)) and its sequences but the held-out
        rows (--diagnostics_holdout, diagnostics/rows.hold_out), each at least 1 (nothing left to learn from: loss 0);
        the router's tokens, every sequence's (lengths (B,): the router's losses see every sequence)."""
        n_seq = len(idx) - int(torch.isin(idx, held_out).sum())
        return cls(max(1.0, float(loss_mask[idx].sum())), max(1, n_seq), max_new_tokens, float(lengths[idx].sum()))


def token_objective(logp, old_logp, adv, mask, cfg, norm: Normalisers, weights=(), ref_logp=None, terms=()):
    """The loss of one micro-batch, and its (B, T) bool of clipped tokens.

    policy loss (cfg.loss) -> times each per-token weight in `weights` in turn (the correction's
    importance weights, the route filter's; (B, T) each, no gradient) -> plus kl_coef times the KL to the
    reference (ref_logp given) -> plus each per-token term in `terms` in turn ((B, T) each, not importance-
    weighted: a plug-in's, entropy_bonus/'s -c H_t) -> aggregated (cfg.aggregation) with the minibatch's normalisers.
    A loss whose gradient reaches a token only through a shared sequence ratio (GSPO) cannot carry a
    weight per token: multiplied afterwards, every token would get its sequence's mean weight (a token
    IcePop zeroes would still get gradient). With weights it runs its `weighted` form (GSPO-token: the
    same values, the gradient per token), so each token's gradient carries its own weight."""
    loss = LOSSES[cfg.loss]
    fn = loss.weighted if weights and loss.weighted is not None else loss.fn
    loss_tok, clipped = fn(logp, old_logp, adv[:, None], mask, cfg)
    for w in weights:
        loss_tok = loss_tok * w
    if ref_logp is not None:
        loss_tok = loss_tok + cfg.kl_coef * kl_penalty(logp, ref_logp, cfg.kl_estimator)
    for term in terms:
        loss_tok = loss_tok + term
    return aggregate(loss_tok, mask, cfg.aggregation, norm.tokens, norm.sequences, norm.max_new_tokens), clipped


# ---------------------------------------------------------------------------------------------------
# corrections against the rollout policy mu: weights from rho = pi_old / mu (no gradient)
# ---------------------------------------------------------------------------------------------------
def _in_band(rho, cfg):
    return (rho >= cfg.mis_low) & (rho <= cfg.mis_high)


TOKEN_CORRECTIONS: dict[str, Callable] = {
    "none": lambda rho, cfg: torch.ones_like(rho),
    "is": lambda rho, cfg: rho,                                                # vanilla IS: uncapped
    "tis": lambda rho, cfg: rho.clamp(max=cfg.tis_cap),                         # truncated IS: min(rho, C)
    "mis": lambda rho, cfg: torch.where(rho <= cfg.mis_high, rho, 0.0),         # masked IS: rho up to C, 0 above
    "reject": lambda rho, cfg: _in_band(rho, cfg).float(),                     # rejection: 1 inside the band
    "icepop": lambda rho, cfg: torch.where(_in_band(rho, cfg), rho, 0.0),      # IcePop: rho inside, 0 outside
}
REJECTING = ("mis", "reject", "icepop")                                        # the ones that can weigh a token 0
CORRECTIONS = tuple(TOKEN_CORRECTIONS) + tuple(f"seq_{c}" for c in TOKEN_CORRECTIONS if c != "none")
SEQ_RHOS = ("geo_mean", "product")


def _seq_log_rho(log_rho, mask, seq_rho: str):
    """A sequence's log rho on each of its tokens: the mean of the token log-ratios (the geometric mean of
    rho, length-independent) or their sum (the product of rho, the sequence's own likelihood ratio)."""
    agg = seq_mean(log_rho, mask) if seq_rho == "geo_mean" else (log_rho * mask).sum(-1)
    return agg[:, None].expand_as(log_rho)


def correction_weights(old_logp, rollout_logp, mask, cfg) -> torch.Tensor:
    """Importance weights (B, T). seq_* weigh every token by the sequence's rho (cfg.seq_rho says which).
    With zero mismatch rho == 1 exactly, so every weight is exactly 1 (the corrections are no-ops under
    the contract; config keeps 1 inside [mis_low, mis_high])."""
    name = cfg.correction
    log_rho = (old_logp - rollout_logp).detach()
    if name.startswith("seq_"):
        log_rho, name = _seq_log_rho(log_rho, mask, cfg.seq_rho), name[4:]
    return TOKEN_CORRECTIONS[name](torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), cfg)


def rejects(cfg) -> bool:
    """Whether cfg.correction can give a token weight 0 (then --rejected_tokens decides what else it loses)."""
    return cfg.correction.removeprefix("seq_") in REJECTING


# ---------------------------------------------------------------------------------------------------
# KL to a reference policy, from samples of pi (Schulman's estimators)
# ---------------------------------------------------------------------------------------------------
K3_CLAMP = 10.0                   # k3_clamped: verl's low_var_kl bound


KL_ESTIMATORS: dict[str, Callable] = {
    "k1": lambda d: -d,
    "k2": lambda d: 0.5 * d * d,
    "k3": lambda d: torch.exp(d) - d - 1,
    "k3_clamped": lambda d: (torch.exp(d) - d - 1).clamp(max=K3_CLAMP),     # no gradient past the bound
}


def kl_penalty(logp, ref_logp, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate; d = ref_logp - logp, clamped as the ratio (exp must not overflow)."""
    return KL_ESTIMATORS[estimator]((ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
