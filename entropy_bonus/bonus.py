"""--entropy_coef=c: L_t -= c H_t, H_t the entropy of softmax(logits_t / T) over the whole vocabulary at
response token t, aggregated as the loss and not importance-weighted. The trainer's forward computes H in the
same pass as the log-probs; the hook's `entropy_grad` asks it to carry its gradient (kernels.softmax_entropy,
also in the chunked logits' backward).
"""
from __future__ import annotations

from support.hooks import Hooks


class EntropyBonus(Hooks):
    entropy_grad = True                  # the trainer's forwards: the entropy with its gradient

    def __init__(self, coef: float):
        self.coef = coef

    def token_terms(self, run, out, mb):
        """-c H_t, added to the per-token loss after the policy loss's weights and the KL (losses.token_objective)."""
        return -(self.coef * out.entropy)
