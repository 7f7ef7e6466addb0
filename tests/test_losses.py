"""losses.py: each objective against a hand-computed value, and the gradient identities.

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
    assert losses.rejects(cfg(correction="icepop")) and losses.rejects(cfg(correction="seq_mis"))
    assert not losses.rejects(cfg(correction="tis"))


@pytest.mark.parametrize("corr", [c for c in losses.CORRECTIONS if c != "none"])
def test_every_correction_is_an_exact_noop_without_mismatch(corr):
    g = torch.Generator().manual_seed(2)
    logp = -torch.rand(3, 4, generator=g)
    w = losses.correction_weights(logp.clone(), logp.clone(), torch.ones(3, 4), cfg(correction=corr))
    assert torch.equal(w, torch.ones_like(w))


def test_route_overlap_and_filter_by_hand():
    rollout = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]])               # (B=1, T=2, n_moe=2, k=2)
    train = torch.tensor([[[[1, 0], [2, 9]], [[4, 5], [8, 9]]]])
    ov = losses.route_overlap(rollout, train)
    assert torch.allclose(ov, torch.tensor([[(1 + 0.5) / 2, (1 + 0) / 2]]))   # 0.75, 0.5
    assert torch.equal(losses.route_filter_weights(ov, "mask", 0.6), torch.tensor([[1.0, 0.0]]))
    assert torch.equal(losses.route_filter_weights(ov, "downweight", 0.6), torch.tensor([[1.0, 0.5]]))
    assert torch.equal(losses.route_filter_weights(ov, "none", 0.6), torch.ones(1, 2))
    assert torch.equal(losses.route_overlap(rollout, rollout), torch.ones(1, 2))   # no flips: weight 1
