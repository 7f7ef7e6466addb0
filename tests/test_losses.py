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
from route_filter.filter import route_filter_weights


def cfg(**kw) -> TrainConfig:
    """A TrainConfig; the corrections need the recomputed old log-probs, so they are on."""
    return TrainConfig(**{"recompute_old_logp": True, **kw})


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


def test_a_loss_built_on_grpo_takes_the_dual_clip(monkeypatch):
    """The table, not a loss's name, says which losses honour --dual_clip_c: a fork's loss on grpo_loss
    declares it in its entry (control: the same entry without the flag is refused)."""
    def halved(logp, old_logp, A, mask, c):
        loss, clipped = losses.grpo_loss(logp, old_logp, A, mask, c)
        return loss / 2, clipped
    monkeypatch.setitem(losses.LOSSES, "halved", losses.Loss(halved, "token_mean", dual_clip=True))
    assert cfg(loss="halved", dual_clip_c=3.0).dual_clip_c == 3.0
    monkeypatch.setitem(losses.LOSSES, "halved", losses.Loss(halved, "token_mean"))
    with pytest.raises(ConfigError, match="dual_clip_c.*grpo"):
        cfg(loss="halved", dual_clip_c=3.0)


def test_auto_aggregation_follows_each_paper():
    assert cfg(loss="grpo").aggregation == "token_mean"
    assert cfg(loss="gspo").aggregation == cfg(loss="gspo_token").aggregation == "seq_mean_token_mean"


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


@pytest.mark.parametrize("loss", list(losses.LOSSES))
def test_ratio_one_reduces_to_reinforce(loss):
    """At ratio 1 (logp == old_logp) every policy loss's gradient is REINFORCE's under its own aggregation."""
    logp0, mask, adv = _toy()
    agg = losses.LOSSES[loss].aggregation
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
def test_gspo_and_gspo_token_gradients_are_equal_without_token_weights(scale):
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


def test_gspo_gives_each_token_its_own_weight_by_hand():
    """--loss=gspo with per-token weights (a token correction, the route filter): each token's gradient
    carries its own weight, so a token IcePop zeroes gets none. By hand, inside the clip, for
    seq_mean_token_mean: d loss / d logp_t = -A_i s_i w_t / (|y_i| n_seq). The value is GSPO's."""
    g = torch.Generator().manual_seed(7)
    B, T = 3, 5
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
    logp = (-torch.rand(B, T, generator=g)).requires_grad_()
    old = logp.detach() + 1e-5 * torch.randn(B, T, generator=g)     # s_i within 1e-4 of 1: inside the clip
    adv = torch.tensor([1.0, -0.5, 2.0])
    w = torch.rand(B, T, generator=g) + 0.5
    w[0, 1] = w[1, 3] = 0.0                                          # tokens a band rejects
    c, norm = cfg(loss="gspo"), losses.Normalisers(float(mask.sum()), B, T)
    loss, _ = losses.token_objective(logp, old, adv, mask, c, norm, weights=(w,))
    grad, = torch.autograd.grad(loss, logp)
    s = torch.exp(losses.seq_mean(logp.detach() - old, mask))        # (B,)
    want = -(adv * s)[:, None] * w * mask / (mask.sum(-1, keepdim=True) * B)
    assert torch.allclose(grad, want, rtol=1e-6, atol=1e-9)
    assert grad[0, 1] == 0 and grad[1, 3] == 0 and (grad[mask.bool() & (w > 0)] != 0).all()
    seq_form = losses.gspo_loss(logp, old, adv[:, None], mask, c)[0] * w      # the sequence form's value ...
    value = losses.aggregate(seq_form, mask, c.aggregation, norm.tokens, B, T)
    assert torch.equal(loss.detach(), value.detach())                # ... is the objective's, bit for bit
    # control: the sequence form with the weights multiplied after it gives each token its sequence's mean weight
    bad, = torch.autograd.grad(value, logp)
    mean_w = losses.seq_mean(w, mask)
    assert bad[0, 1] != 0 and torch.allclose(bad, -(adv * s * mean_w)[:, None] * mask / (mask.sum(-1, keepdim=True) * B),
                                             rtol=1e-6, atol=1e-9)
    # without weights the objective is the sequence form itself (GSPO's own gradient)
    plain, _ = losses.token_objective(logp, old, adv, mask, c, norm)
    g_plain, = torch.autograd.grad(plain, logp)
    assert torch.allclose(g_plain, -(adv * s)[:, None] * mask / (mask.sum(-1, keepdim=True) * B), rtol=1e-6, atol=1e-9)


def test_each_correction_by_hand():
    mu = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.5, 2.0, 0.1, 3.0]]))          # rho = 1, 4, 0.2, 6
    mask = torch.ones(1, 4)
    w = {c: losses.correction_weights(old, mu, mask, cfg(correction=c))
         for c in ("is", "tis", "mis", "reject", "icepop")}
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
    mask[1, 2:] = 0                                                # padding: the seq_* means skip it
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


def test_route_filter_by_hand():
    ov = torch.tensor([[0.75, 0.5]])                               # each token's overlap (route_filter.filter.token_overlap)
    assert torch.equal(route_filter_weights(ov, "mask", 0.6), torch.tensor([[1.0, 0.0]]))
    assert torch.equal(route_filter_weights(ov, "downweight", 0.6), torch.tensor([[1.0, 0.5]]))
    assert torch.equal(route_filter_weights(ov, "none", 0.6), torch.ones(1, 2))
    assert torch.equal(route_filter_weights(torch.ones(1, 2), "mask", 0.6), torch.ones(1, 2))   # no flips: 1


def test_sequence_route_filter_by_hand():
    """level=sequence: each response's mean overlap over its tokens decides for all its tokens. Row 0:
    tokens (1, 0.5, 1) -> mean 5/6; row 1: (0.25, 0.25) -> 1/4; the padding (mask 0) does not count."""
    ov = torch.tensor([[1.0, 0.5, 1.0, 0.0], [0.25, 0.25, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    w = route_filter_weights(ov, "mask", 0.6, "sequence", mask)
    assert torch.equal(w, torch.tensor([[1.0] * 4, [0.0] * 4]))
    w = route_filter_weights(ov, "downweight", 0.9, "sequence", mask)
    assert torch.allclose(w[0], torch.full((4,), 5 / 6)) and torch.allclose(w[1], torch.full((4,), 0.25))
    # the token level on the same input masks row 0's second token: the two levels differ
    assert route_filter_weights(ov, "mask", 0.6)[0, 1] == 0
    # no mismatch: exactly 1 everywhere, at any threshold, with a row without response tokens too
    ones, m = torch.ones(3, 5), torch.tensor([[1.0] * 5, [1, 1, 0, 0, 0], [0.0] * 5])
    for mode in ("mask", "downweight"):
        assert torch.equal(route_filter_weights(ones, mode, 1.0, "sequence", m), ones)


# ---------------------------------------------------------------------------------------------------
# cross-check against verl (verl-project/verl at 1dda039: trainer/ppo/core_algos.py and
# rollout_corr_helper.py): the formulas below are re-derived from reading that code, as references
# ---------------------------------------------------------------------------------------------------
def _verl_agg(loss, mask, mode, n_seq):
    if mode == "token-mean":                                         # batch_num_tokens: the kept tokens
        return (loss * mask).sum() / mask.sum()
    seq = (loss * mask).sum(-1) / (mask.sum(-1) + 1e-8)              # seq-mean-token-mean
    return seq.sum() / n_seq


def _verl_pg(kind, old, logp, A, mask, c):
    """Per-token policy loss of verl's vanilla (dual-clip), gspo (token form), sapo, cispo; A is (B, T)."""
    if kind == "gspo":
        seq = ((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        s = torch.exp((logp - logp.detach() + seq.detach()[:, None]).clamp(max=10.0))
        return torch.maximum(-A * s, -A * s.clamp(1 - c.gspo_eps_low, 1 + c.gspo_eps_high))
    r = torch.exp((logp - old).clamp(-20.0, 20.0))
    if kind == "sapo":
        tau = torch.where(A > 0, c.sapo_tau_pos, c.sapo_tau_neg)
        return -torch.sigmoid(tau * (r - 1)) * (4.0 / tau) * A
    if kind == "cispo":
        return -r.clamp(1 - c.eps_low, 1 + c.eps_high).detach() * A * logp
    clip1 = torch.maximum(-A * r, -A * r.clamp(1 - c.eps_low, 1 + c.eps_high))
    return torch.where(A < 0, torch.minimum(-A * c.dual_clip_c, clip1), clip1)


def _verl_kl(logp, ref, kind):
    if kind == "k1":
        return logp - ref
    if kind == "k2":
        return 0.5 * (logp - ref) ** 2
    kl = (ref - logp).clamp(-20.0, 20.0)                             # low_var_kl
    return (torch.exp(kl) - kl - 1).clamp(-10.0, 10.0)


def _verl_is_weights(log_ratio, mask, level, upper, lower=None):
    """rollout_is=token|sequence (the product); a float threshold truncates (TIS), lower_upper masks (IcePop)."""
    lr = log_ratio if level == "token" else (log_ratio * mask).sum(-1, keepdim=True)
    w = torch.exp(lr.clamp(-20.0, 20.0)).expand_as(log_ratio) * mask
    return w.clamp(max=upper) if lower is None else torch.where((w >= lower) & (w <= upper), w, 0.0)


def _verl_rs_keep(log_ratio, mask, level, lower, upper):
    """rollout_rs=token_k1|seq_mean_k1 with threshold lower_upper: keep lower <= mu / pi_old <= upper."""
    k1 = -log_ratio.clamp(-20.0, 20.0)
    if level == "seq":
        k1 = ((k1 * mask).sum(-1) / (mask.sum(-1) + 1e-8))[:, None].expand_as(k1)
    return ((k1 >= math.log(lower)) & (k1 <= math.log(upper))).float()


def _batch(seed=0, B=6, T=7):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(B, T, generator=g) * 3                          # rollout log-probs
    old = mu + 0.6 * torch.randn(B, T, generator=g)                  # trainer's: rho from ~0.2 to ~5
    logp = old + 0.3 * torch.randn(B, T, generator=g)                # the updated policy
    ref = logp + 0.8 * torch.randn(B, T, generator=g)
    mask = torch.ones(B, T)
    mask[1, 4:] = 0
    mask[4, 2:] = 0
    return logp, old, mu, ref, torch.randn(B, generator=g), mask


def _ours(c, logp0, old, mu, ref, adv, mask):
    """The loss of train.py's update on one minibatch (losses.token_objective: weights, loss mask, KL,
    aggregation, as train.minibatch_step composes it) and its gradient."""
    logp = logp0.clone().requires_grad_(True)
    w = losses.correction_weights(old, mu, mask, c) if c.correction != "none" else None
    m = mask * (w > 0) if c.rejected_tokens == "drop" and losses.rejects(c) else mask
    norm = losses.Normalisers(int(m.sum()), mask.shape[0], mask.shape[1])
    loss, _ = losses.token_objective(logp, old, adv, m, c, norm, weights=() if w is None else (w,),
                                     ref_logp=ref if c.kl_coef > 0 else None)
    loss.backward()
    return loss.detach(), logp.grad


def _verl(c, kind, mode, logp0, old, mu, ref, adv, mask, is_=None, rs=None, kl=None):
    logp = logp0.clone().requires_grad_(True)
    m = mask * _verl_rs_keep(old - mu, mask, *rs) if rs else mask     # rejection edits response_mask
    pg = _verl_pg(kind, old, logp, adv[:, None].expand_as(logp), m, c)
    if is_:
        pg = pg * _verl_is_weights(old - mu, mask, *is_)
    loss = _verl_agg(pg, m, mode, mask.shape[0])
    if kl:
        loss = loss + c.kl_coef * _verl_agg(_verl_kl(logp, ref, kl), m, mode, mask.shape[0])
    loss.backward()
    return loss.detach(), logp.grad


# ours (TrainConfig overrides) -> verl (loss_mode, loss_agg_mode, rollout IS, rollout RS, KL type). Our band
# [mis_low, mis_high] = [0.5, 5] keeps rho; verl's k1 bounds are on mu / pi_old: [1/5, 1/0.5].
VERL_CASES = {
    "grpo_dual_clip": (dict(dual_clip_c=3.0), ("vanilla", "token-mean", None, None, None)),
    "grpo_k1": (dict(dual_clip_c=3.0, kl_coef=0.1, kl_estimator="k1"), ("vanilla", "token-mean", None, None, "k1")),
    "grpo_k2": (dict(dual_clip_c=3.0, kl_coef=0.1, kl_estimator="k2"), ("vanilla", "token-mean", None, None, "k2")),
    "grpo_k3": (dict(dual_clip_c=3.0, kl_coef=0.1, kl_estimator="k3_clamped"),
                ("vanilla", "token-mean", None, None, "k3")),
    "gspo": (dict(loss="gspo", gspo_log_ratio_max=10.0), ("gspo", "seq-mean-token-mean", None, None, None)),
    "gspo_token": (dict(loss="gspo_token", gspo_log_ratio_max=10.0), ("gspo", "seq-mean-token-mean", None, None, None)),
    "tis": (dict(dual_clip_c=3.0, correction="tis"), ("vanilla", "token-mean", ("token", 2.0), None, None)),
    "seq_tis": (dict(dual_clip_c=3.0, correction="seq_tis", seq_rho="product"),
                ("vanilla", "token-mean", ("sequence", 2.0), None, None)),
    "icepop": (dict(dual_clip_c=3.0, correction="icepop"), ("vanilla", "token-mean", ("token", 5.0, 0.5), None, None)),
    "seq_icepop": (dict(dual_clip_c=3.0, correction="seq_icepop", seq_rho="product"),
                   ("vanilla", "token-mean", ("sequence", 5.0, 0.5), None, None)),
    "reject": (dict(dual_clip_c=3.0, correction="reject", rejected_tokens="drop"),
               ("vanilla", "token-mean", None, ("token", 0.2, 2.0), None)),
    "seq_reject": (dict(dual_clip_c=3.0, correction="seq_reject", rejected_tokens="drop"),
                   ("vanilla", "token-mean", None, ("seq", 0.2, 2.0), None)),
    "gspo_reject": (dict(loss="gspo", gspo_log_ratio_max=10.0, correction="reject", rejected_tokens="drop"),
                    ("gspo", "seq-mean-token-mean", None, ("token", 0.2, 2.0), None)),
    # GSPO with per-token weights: verl's token form carries each token's own weight, and so does ours
    "gspo_tis": (dict(loss="gspo", gspo_log_ratio_max=10.0, correction="tis"),
                 ("gspo", "seq-mean-token-mean", ("token", 2.0), None, None)),
    "gspo_icepop": (dict(loss="gspo", gspo_log_ratio_max=10.0, correction="icepop"),
                    ("gspo", "seq-mean-token-mean", ("token", 5.0, 0.5), None, None)),
}


@pytest.mark.parametrize("name", VERL_CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_losses_and_gradients_equal_verls(name, seed):
    over, (kind, mode, is_, rs, kl) = VERL_CASES[name]
    c = cfg(**over)
    logp, old, mu, ref, adv, mask = _batch(seed)
    rho = torch.exp(old - mu)[mask > 0]
    assert ((rho < 0.5) | (rho > 5)).any() and (rho > 2).any()       # the caps and bands do act here
    ours, g_ours = _ours(c, logp, old, mu, ref, adv, mask)
    ref_loss, g_ref = _verl(c, kind, mode, logp, old, mu, ref, adv, mask, is_, rs, kl)
    assert torch.allclose(ours, ref_loss, rtol=1e-5, atol=1e-7), (ours, ref_loss)
    assert torch.allclose(g_ours, g_ref, rtol=1e-5, atol=1e-7)
    assert g_ours.abs().sum() > 0


def test_verl_gspo_clamp_acts_and_the_default_differs_there():
    logp, old, mu, ref, adv, mask = _batch(3)
    logp, adv = logp.clone(), adv.clone()
    logp[0] += 12.0                                                  # row 0: a sequence log-ratio of ~12, ...
    adv[0] = -1.0                                                    # ... and A < 0, so the clip does not cap it
    c10, c20 = cfg(loss="gspo", gspo_log_ratio_max=10.0), cfg(loss="gspo")
    verl_loss, verl_g = _verl(c10, "gspo", "seq-mean-token-mean", logp, old, mu, ref, adv, mask)
    ours, g = _ours(c10, logp, old, mu, ref, adv, mask)
    assert torch.allclose(ours, verl_loss, rtol=1e-5) and torch.allclose(g, verl_g, rtol=1e-5, atol=1e-7)
    assert torch.equal(g[0], torch.zeros_like(g[0]))                 # past the clamp: no gradient in either
    default, _ = _ours(c20, logp, old, mu, ref, adv, mask)
    assert not torch.allclose(default, verl_loss, rtol=1e-3)         # control: +-20 keeps exp(12) there


def test_the_documented_differences_from_verl_are_real():
    """Each default that docs/design.md lists as differing from verl does differ on this batch."""
    logp, old, mu, ref, adv, mask = _batch(4)
    ref = ref.clone()
    ref[0, 0] = logp[0, 0] + 3.0                                     # k3 = e^3 - 4 = 16 > 10
    run = lambda c, *a, **kw: (_ours(c, logp, old, mu, ref, adv, mask)[0],  # noqa: E731
                               _verl(c, *a, logp, old, mu, ref, adv, mask, **kw)[0])
    ours, verl = run(cfg(dual_clip_c=3.0, kl_coef=0.1, kl_estimator="k3"), "vanilla", "token-mean", kl="k3")
    assert not torch.allclose(ours, verl, rtol=1e-4)                 # k3 unclamped
    ours, verl = run(cfg(dual_clip_c=3.0, correction="seq_tis"), "vanilla", "token-mean", is_=("sequence", 2.0))
    assert not torch.allclose(ours, verl, rtol=1e-4)                 # seq_* on the geometric mean
    ours, verl = run(cfg(dual_clip_c=3.0, correction="icepop", rejected_tokens="drop"), "vanilla", "token-mean",
                     is_=("token", 5.0, 0.5))
    assert not torch.allclose(ours, verl, rtol=1e-4)                 # verl's IcePop keeps the tokens counted
    ours, verl = run(cfg(loss="gspo", gspo_log_ratio_max=10.0, correction="reject"), "gspo", "seq-mean-token-mean",
                     rs=("token", 0.2, 2.0))
    assert not torch.allclose(ours, verl, rtol=1e-4)                 # zero_weight: GSPO's ratio covers them


# ---------------------------------------------------------------------------------------------------
# the entropy bonus (--entropy_coef)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [0, 7])                       # whole logits, and _ChunkedLogprobs' backward
def test_entropy_gradient_equals_autograd_of_a_plain_reference(chunk):
    """score(with_entropy=True, entropy_grad=True)'s entropy and its gradient (every parameter) against
    plain torch autograd of -sum softmax(z / T) log_softmax(z / T) over the model's own logits (fp32, within
    1e-5 relative); logp keeps its bits. Controls: the detached entropy carries no gradient, and the
    reference at another temperature misses the values."""
    from conftest import make_model
    model, T = make_model(seed=3), 0.7
    tokens = torch.randint(0, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    w = torch.rand(3, 8, generator=torch.Generator().manual_seed(2))   # per-token weights: every row counts

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]
    logp, _, ent = model.score(tokens, temperature=T, with_entropy=True, entropy_grad=True, logits_chunk=chunk)
    ours = grads((ent * w).sum())
    z = model(tokens)[:, :-1].float() / T                            # (B, T-1, V) the same forward's logits
    ref = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    assert torch.allclose(ent, ref, rtol=1e-6, atol=1e-6)
    theirs = grads((ref * w).sum())
    for a, b in zip(ours, theirs):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-8
    plain = model.score(tokens, temperature=T, with_entropy=True, logits_chunk=chunk)
    assert torch.equal(plain[0], logp) and torch.equal(plain[2], ent.detach())        # the same bits
    assert not plain[2].requires_grad                                                  # control: detached
    z1 = model(tokens)[:, :-1].float()
    assert not torch.allclose(ent, -(torch.softmax(z1, -1) * torch.log_softmax(z1, -1)).sum(-1), rtol=1e-3)
