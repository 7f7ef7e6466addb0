"""SAPO and CISPO: each a per-token loss (B, T) and its (B, T) bool of clipped tokens, as losses.LOSSES's
entries take them (logp carries the gradient, old_logp is the behaviour policy's, A is (B, 1)). Importing
this module adds them to that table (config.py does when --loss names one).
"""
from __future__ import annotations

import torch

from losses import LOSSES, Loss, _ratio


def sapo_loss(logp, old_logp, A, mask, cfg):
    """SAPO: a soft gate instead of a hard clip, f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau per sign of A."""
    ratio = _ratio(logp, old_logp)
    tau = torch.where(A > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    return -gate * A, torch.zeros_like(mask, dtype=torch.bool)


def cispo_loss(logp, old_logp, A, mask, cfg):
    """CISPO: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp: the clipped IS weight, no gradient through it."""
    ratio = _ratio(logp, old_logp)
    w = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high).detach()
    return -w * A * logp, (ratio < 1 - cfg.eps_low) | (ratio > 1 + cfg.eps_high)


LOSSES["sapo"] = Loss(sapo_loss, "seq_mean_token_mean")      # averaged per sequence, then over sequences
LOSSES["cispo"] = Loss(cispo_loss, "token_mean")
