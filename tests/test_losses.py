"""losses.py: each objective, aggregation, correction, KL estimator and the route filter against a
hand-computed value, and the gradient identities.

    python -m pytest -q tests/test_losses.py
"""
from __future__ import annotations

import math

import pytest
import torch

import losses
from config import ConfigError, TrainConfig


def cfg(**kw) -> TrainConfig:
    return TrainConfig(**kw)


def test_tables_drive_config_validation():
    for name in losses.LOSSES:
        assert cfg(loss=name).loss == name
    for name in losses.CORRECTIONS:
        assert cfg(correction=name).correction == name
    with pytest.raises(ConfigError, match="choose one of grpo"):
        cfg(loss="ppo2")
    with pytest.raises(ConfigError, match="per-sequence"):
        cfg(loss="gspo", agg="token_mean")
    with pytest.raises(ConfigError, match="dual_clip_c"):
        cfg(dual_clip_c=0.5)
    with pytest.raises(ConfigError, match="dual_clip_c"):
        cfg(dual_clip_c=3.0, loss="gspo")


def test_auto_aggregation_follows_each_paper():
    assert cfg(loss="grpo").aggregation == "token_mean"
    assert cfg(loss="cispo").aggregation == "token_mean"
    assert cfg(loss="gspo").aggregation == cfg(loss="gspo_token").aggregation == "seq_mean_token_mean"
    assert cfg(loss="sapo").aggregation == "seq_mean_token_mean"      # per sequence, then over sequences
    assert cfg(loss="sapo", agg="token_mean").aggregation == "token_mean"


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    a = losses.group_advantages(r, 4)
    std = math.sqrt(((0.75 ** 2) + 3 * (0.25 ** 2)) / 3)        # unbiased std of [1, 0, 0, 0]
    assert torch.allclose(a[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-6))
    assert torch.equal(a[4:], torch.zeros(4))                      # a group with equal rewards learns nothing
    assert torch.allclose(losses.group_advantages(r, 4, std_norm=False)[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_grpo_clip_by_hand():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))           # with old = 0: ratios 1.5, 0.5, 1.1
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    pos, _ = losses.policy_loss(logp, old, torch.tensor([2.0]), mask, cfg())
    # A > 0: max(-A r, -A clip(r, 0.8, 1.28)) -> -2*1.28, -2*0.5, -2*1.1
    assert torch.allclose(pos, torch.tensor([[-2.56, -1.0, -2.2]]))
    neg, clipped = losses.policy_loss(logp, old, torch.tensor([-1.0]), mask, cfg())
    # A < 0: max(r, clip(r)) -> 1.5, 0.8, 1.1
    assert torch.allclose(neg, torch.tensor([[1.5, 0.8, 1.1]]))
    assert clipped.tolist() == [[False, True, False]]


def test_gspo_by_hand():
    logp = torch.tensor([[0.1, -0.1, 0.3, 0.0]])
    old = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])                  # the last token is padding
    c = cfg(loss="gspo")
    loss, clipped = losses.policy_loss(logp, old, torch.tensor([1.0]), mask, c)
    s = math.exp((0.1 - 0.1 + 0.3) / 3)                           # geometric mean ratio, padding excluded
    assert s > 1 + c.gspo_eps_high
    assert torch.allclose(loss, torch.full((1, 4), -(1 + c.gspo_eps_high)))
    assert clipped[0, :3].all()


def test_sapo_and_cispo_by_hand():
    logp = torch.log(torch.tensor([[1.2, 0.9]]))
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    loss, _ = losses.policy_loss(logp, old, torch.tensor([1.0]), mask, cfg(loss="sapo"))
    r = torch.tensor([1.2, 0.9])
    assert torch.allclose(loss[0], -(torch.sigmoid(r - 1) * 4))
    loss, _ = losses.policy_loss(logp, old, torch.tensor([-2.0]), mask, cfg(loss="sapo"))
    assert torch.allclose(loss[0], 2 * torch.sigmoid(1.05 * (r - 1)) * 4 / 1.05)
    loss, _ = losses.policy_loss(logp, old, torch.tensor([1.0]), mask, cfg(loss="cispo"))
    assert torch.allclose(loss[0], -torch.tensor([1.2, 0.9]) * logp[0])


def test_aggregations_by_hand():
    L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert losses.aggregate(L, m, "token_mean", 4, 2, 3).item() == pytest.approx(10 / 4)
    assert losses.aggregate(L, m, "seq_mean_token_mean", 4, 2, 3).item() == pytest.approx((2 + 4) / 2)
    assert losses.aggregate(L, m, "seq_mean_token_sum", 4, 2, 3).item() == pytest.approx((6 + 4) / 2)
    assert losses.aggregate(L, m, "drgrpo", 4, 2, 3).item() == pytest.approx(10 / 6)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert losses.kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert losses.kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)
    assert losses.kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)


def _toy(seed=0, B=4, T=5):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g) * 3)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    adv = torch.randn(B, generator=g)
    return logp, mask, adv


def _grad_agg(loss_name, logp0, old, mask, adv, agg):
    logp = logp0.clone().requires_grad_(True)
    c = cfg(loss=loss_name)
    L, _ = losses.policy_loss(logp, old, adv, mask, c)
    losses.aggregate(L, mask, agg, int(mask.sum()), mask.shape[0], mask.shape[1]).backward()
    return logp.grad


@pytest.mark.parametrize("loss", ["grpo", "sapo", "cispo", "gspo", "gspo_token"])
def test_ratio_one_reduces_to_reinforce(loss):
    logp0, mask, adv = _toy()
    agg = "seq_mean_token_mean" if loss.startswith("gspo") else "token_mean"
    g = _grad_agg(loss, logp0, logp0.clone(), mask, adv, agg)
    # REINFORCE with the same aggregation: loss = agg(-A * logp)
    logp = logp0.clone().requires_grad_(True)
    losses.aggregate(-adv[:, None] * logp, mask, agg, int(mask.sum()), 4, 5).backward()
    assert torch.allclose(g, logp.grad, atol=1e-6), loss
    assert g.abs().sum() > 0


def test_dual_clip_by_hand():
    logp, old, mask = torch.log(torch.tensor([[5.0, 1.5]])), torch.zeros(1, 2), torch.ones(1, 2)
    off, _ = losses.policy_loss(logp, old, torch.tensor([-1.0]), mask, cfg())
    assert torch.allclose(off, torch.tensor([[5.0, 1.5]]))                      # max(r, clip(r)) = r
    on, clipped = losses.policy_loss(logp, old, torch.tensor([-1.0]), mask, cfg(dual_clip_c=3.0))
    assert torch.allclose(on, torch.tensor([[3.0, 1.5]])) and clipped.tolist() == [[True, False]]
    pos, _ = losses.policy_loss(logp, old, torch.tensor([1.0]), mask, cfg(dual_clip_c=3.0))
    assert torch.allclose(pos, torch.tensor([[-1.28, -1.28]]))                  # A > 0: untouched


def test_gspo_clamps_the_sequence_log_ratio_by_hand():
    logp, old = torch.tensor([[30.0, 0.0, 0.0]]), torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = losses.policy_loss(logp, old, torch.tensor([-1.0]), mask, cfg(loss="gspo"))
    # the mean is 15 (inside the clamp): s = exp(15); a per-token clamp would give exp(10)
    assert torch.allclose(loss[0, :2], torch.full((2,), math.exp(15.0)))
    big = torch.tensor([[50.0, 40.0, 0.0]])
    loss, _ = losses.policy_loss(big, old, torch.tensor([-1.0]), mask, cfg(loss="gspo"))
    assert torch.allclose(loss[0, :2], torch.full((2,), math.exp(20.0)))


def _grad(name, logp0, old, mask, adv):
    logp = logp0.clone().requires_grad_(True)
    c = cfg(loss=name)
    L, _ = losses.policy_loss(logp, old, adv, mask, c)
    losses.aggregate(L, mask, c.aggregation, int(mask.sum()), mask.shape[0], mask.shape[1]).backward()
    return logp.grad


@pytest.mark.parametrize("scale", [3e-4, 0.05, 30.0])      # inside the clip, clipped, past the +-20 clamp
def test_gspo_and_gspo_token_gradients_are_equal_everywhere(scale):
    g = torch.Generator().manual_seed(3)
    logp0 = -torch.rand(6, 5, generator=g) * 3
    old = logp0 + scale * torch.randn(6, 5, generator=g)
    mask = torch.ones(6, 5)
    mask[1, 3:] = 0
    adv = torch.randn(6, generator=g)
    ga, gb = _grad("gspo", logp0, old, mask, adv), _grad("gspo_token", logp0, old, mask, adv)
    assert torch.allclose(ga, gb, atol=1e-7, rtol=1e-5)
    assert ga.abs().sum() > 0                                      # control: the gradients are not all zero
    if scale == 30.0:
        m = losses.seq_mean(logp0 - old, mask)
        assert (m.abs() > 20).any() and torch.equal(ga[m.abs() > 20], torch.zeros_like(ga[m.abs() > 20]))


def test_rejection_icepop_and_tis_by_hand():
    mu = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.5, 2.0, 0.1, 3.0]]))          # rho = 1, 4, 0.2, 6
    mask = torch.ones(1, 4)
    w = {c: losses.correction_weights(old, mu, mask, cfg(correction=c)) for c in ("tis", "reject", "mis", "icepop")}
    assert torch.allclose(w["tis"], torch.tensor([[1.0, 2.0, 0.2, 2.0]]))
    assert torch.equal(w["reject"], torch.tensor([[1.0, 1.0, 0.0, 0.0]]))     # band [0.5, 5]: 1 inside
    assert torch.equal(w["mis"], w["reject"])                                 # the old name, same thing
    assert torch.allclose(w["icepop"], torch.tensor([[1.0, 4.0, 0.0, 0.0]]))  # rho inside, 0 outside
    geo = (1 * 4 * 0.2 * 6) ** 0.25                                           # 1.57: inside the band
    assert torch.allclose(losses.correction_weights(old, mu, mask, cfg(correction="seq_icepop")), torch.full((1, 4), geo))
    assert torch.equal(losses.correction_weights(old, mu, mask, cfg(correction="seq_reject")), torch.ones(1, 4))
    assert torch.allclose(losses.correction_weights(old, mu, mask, cfg(correction="seq_tis")), torch.full((1, 4), geo))
    assert losses.rejects(cfg(correction="icepop")) and losses.rejects(cfg(correction="seq_mis"))
    assert not losses.rejects(cfg(correction="tis"))


@pytest.mark.parametrize("corr", [c for c in losses.CORRECTIONS if c != "none"])
def test_every_correction_is_an_exact_noop_without_mismatch(corr):
    g = torch.Generator().manual_seed(2)
    logp = -torch.rand(3, 4, generator=g)
    mask = torch.ones(3, 4)
    mask[1, 2:] = 0                                                # padding: the seq_* means skip it
    w = losses.correction_weights(logp.clone(), logp.clone(), mask, cfg(correction=corr))
    assert torch.equal(w, torch.ones_like(w))


def test_route_filter_by_hand():
    ov = torch.tensor([[0.75, 0.5]])                               # each token's overlap (audit.token_overlap)
    assert torch.equal(losses.route_filter_weights(ov, "mask", 0.6), torch.tensor([[1.0, 0.0]]))
    assert torch.equal(losses.route_filter_weights(ov, "downweight", 0.6), torch.tensor([[1.0, 0.5]]))
    assert torch.equal(losses.route_filter_weights(ov, "none", 0.6), torch.ones(1, 2))
    assert torch.equal(losses.route_filter_weights(torch.ones(1, 2), "mask", 0.6), torch.ones(1, 2))   # no flips: 1
