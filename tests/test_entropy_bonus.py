"""The entropy-bonus plug-in (entropy_bonus/): --entropy_coef=c subtracts c times each response token's
entropy from the per-token loss (the token_terms seam), with the entropy's gradient, in the trainer's loss.

    python -m pytest -q tests/test_entropy_bonus.py
"""
from types import SimpleNamespace

import pytest
import torch

import losses
from entropy_bonus.bonus import EntropyBonus
from entropy_bonus.options import hooks
from test_losses import cfg
from test_train import TINY_RUN, _run


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_entropy_bonus_is_minus_coef_times_the_aggregated_entropy(loss):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=g) - 0.1
    old, ent = logp + 0.05 * torch.randn(4, 6, generator=g), torch.rand(4, 6, generator=g).requires_grad_()
    adv, mask = torch.randn(4, generator=g), (torch.rand(4, 6, generator=g) > 0.3).float()
    norm = losses.Normalisers(float(mask.sum()), 4, 6)
    base, _ = losses.token_objective(logp, old, adv, mask, cfg(loss=loss), norm)
    term = EntropyBonus(0.01).token_terms(None, SimpleNamespace(entropy=ent), None)
    with_bonus, _ = losses.token_objective(logp, old, adv, mask, cfg(loss=loss, entropy_coef=0.01), norm, terms=[term])
    agg = cfg(loss=loss).aggregation
    expected = base - 0.01 * losses.aggregate(ent, mask, agg, norm.tokens, norm.sequences, 6)
    assert torch.allclose(with_bonus, expected, rtol=1e-6)
    with_bonus.backward()
    assert torch.allclose(ent.grad, -0.01 * torch.autograd.grad(losses.aggregate(ent, mask, agg, norm.tokens,
                                                                                 norm.sequences, 6), ent)[0])
    assert hooks(cfg(loss=loss), None) == []                            # control: coef 0 adds no hook, no term


def test_the_entropy_bonus_is_in_the_trainers_loss(tmp_path):
    """One minibatch a step (token mean): the loss with --entropy_coef=c is the loss without it minus c times
    the logged entropy at step 1 (the same rollout)."""
    off = _run(tmp_path / "a", TINY_RUN + ["--steps=1"])[0]
    on = _run(tmp_path / "b", TINY_RUN + ["--steps=1", "--entropy_coef=0.5"])[0]
    assert on["entropy"] == off["entropy"] and on["reward_mean"] == off["reward_mean"]
    assert on["loss"] == pytest.approx(off["loss"] - 0.5 * off["entropy"], rel=1e-5, abs=1e-7)
