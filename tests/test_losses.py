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


def test_each_correction_by_hand():
    mu = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.5, 2.0, 0.1, 3.0]]))          # rho = 1, 4, 0.2, 6
    mask = torch.ones(1, 4)
    w = {c: losses.correction_weights(old, mu, mask, cfg(correction=c)) for c in ("is", "tis", "mis", "reject", "icepop")}
    assert torch.allclose(w["is"], torch.tensor([[1.0, 4.0, 0.2, 6.0]]))        # vanilla IS: uncapped
    assert torch.allclose(w["tis"], torch.tensor([[1.0, 2.0, 0.2, 2.0]]))       # min(rho, 2)
    assert torch.allclose(w["mis"], torch.tensor([[1.0, 4.0, 0.2, 0.0]]))       # masked IS: rho up to 5, 0 above
    assert torch.equal(w["reject"], torch.tensor([[1.0, 1.0, 0.0, 0.0]]))      # band [0.5, 5]: 1 inside
    assert torch.allclose(w["icepop"], torch.tensor([[1.0, 4.0, 0.0, 0.0]]))   # rho inside, 0 outside
    assert not torch.equal(w["mis"], w["reject"])                              # masked IS is not rejection
    geo = (1 * 4 * 0.2 * 6) ** 0.25                                            # 1.57: inside the band
    seq = lambda c, **kw: losses.correction_weights(old, mu, mask, cfg(correction=c, **kw))  # noqa: E731
    assert torch.allclose(seq("seq_is"), torch.full((1, 4), geo))
    assert torch.allclose(seq("seq_icepop"), torch.full((1, 4), geo))
    assert torch.allclose(seq("seq_mis"), torch.full((1, 4), geo))
    assert torch.equal(seq("seq_reject"), torch.ones(1, 4))
    # the product of rho (4.8): seq_tis truncates it to 2, seq_mis keeps it (<= 5), seq_icepop too
    assert torch.allclose(seq("seq_tis", seq_rho="product"), torch.full((1, 4), 2.0))
    assert torch.allclose(seq("seq_mis", seq_rho="product"), torch.full((1, 4), 4.8))
    assert torch.allclose(seq("seq_mis", seq_rho="product", mis_high=4.0), torch.zeros(1, 4))
    assert torch.allclose(seq("seq_tis"), torch.full((1, 4), geo))              # control: geo_mean is below the cap
    pad = torch.tensor([[1.0, 1.0, 0.0, 0.0]])                                 # padding is outside the sequence
    assert torch.allclose(losses.correction_weights(old, mu, pad, cfg(correction="seq_is", seq_rho="product")),
                          torch.full((1, 4), 4.0))
    for c in ("mis", "reject", "icepop", "seq_mis", "seq_icepop"):
        assert losses.rejects(cfg(correction=c))
    for c in ("none", "is", "tis", "seq_tis"):
        assert not losses.rejects(cfg(correction=c))


@pytest.mark.parametrize("seq_rho", losses.SEQ_RHOS)
@pytest.mark.parametrize("corr", [c for c in losses.CORRECTIONS if c != "none"])
def test_every_correction_is_an_exact_noop_without_mismatch(corr, seq_rho):
    g = torch.Generator().manual_seed(2)
    logp = -torch.rand(3, 4, generator=g)
    mask = torch.ones(3, 4)
    mask[1, 2:] = 0
    w = losses.correction_weights(logp.clone(), logp.clone(), mask, cfg(correction=corr, seq_rho=seq_rho))
    assert torch.equal(w, torch.ones_like(w))
    shifted = losses.correction_weights(logp + 2.0, logp, mask, cfg(correction=corr, seq_rho=seq_rho))
    assert not torch.equal(shifted, torch.ones_like(w))                        # control: a mismatch moves it


def test_the_old_mis_alias_is_gone_and_bands_must_keep_rho_one():
    with pytest.raises(ConfigError, match="mis_low <= 1 <= mis_high"):
        cfg(mis_low=1.5, mis_high=5.0)                                         # would reject on-policy tokens
    with pytest.raises(ConfigError, match="seq_rho"):
        cfg(seq_rho="sum")
    with pytest.raises(ConfigError, match="gspo_log_ratio_max"):
        cfg(gspo_log_ratio_max=25.0)
    with pytest.raises(ConfigError, match="choose one of none, is, tis, mis, reject, icepop"):
        cfg(correction="seq_none")


def test_gspo_log_ratio_max_and_k3_clamped_by_hand():
    logp, old, mask = torch.tensor([[12.0, 12.0]]), torch.zeros(1, 2), torch.ones(1, 2)
    for c, value in ((cfg(loss="gspo"), math.exp(12.0)), (cfg(loss="gspo", gspo_log_ratio_max=10.0), math.exp(10.0))):
        loss, _ = losses.policy_loss(logp, old, torch.tensor([-1.0]), mask, c)
        assert torch.allclose(loss, torch.full((1, 2), value))
    d = torch.tensor([-1.0, 3.0])                                              # ref - logp: k3 = e^-1, e^3 - 4
    assert torch.allclose(losses.kl_penalty(torch.zeros(2), d, "k3"), torch.tensor([math.exp(-1.0), math.exp(3.0) - 4]))
    assert torch.allclose(losses.kl_penalty(torch.zeros(2), d, "k3_clamped"), torch.tensor([math.exp(-1.0), 10.0]))


def test_route_overlap_and_filter_by_hand():
    rollout = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]])               # (B=1, T=2, n_moe=2, k=2)
    train = torch.tensor([[[[1, 0], [2, 9]], [[4, 5], [8, 9]]]])
    ov = losses.route_overlap(rollout, train)
    assert torch.allclose(ov, torch.tensor([[(1 + 0.5) / 2, (1 + 0) / 2]]))   # 0.75, 0.5
    assert torch.equal(losses.route_filter_weights(ov, "mask", 0.6), torch.tensor([[1.0, 0.0]]))
    assert torch.equal(losses.route_filter_weights(ov, "downweight", 0.6), torch.tensor([[1.0, 0.5]]))
    assert torch.equal(losses.route_filter_weights(ov, "none", 0.6), torch.ones(1, 2))
    assert torch.equal(losses.route_overlap(rollout, rollout), torch.ones(1, 2))   # no flips: weight 1
