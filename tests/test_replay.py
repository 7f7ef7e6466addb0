"""replay.py: route packing, the top-k overlap, the expert load, the route audit and the log-prob
mismatch metrics, each against a hand-computed value.

    python -m pytest -q tests/test_replay.py
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import replay
from route_filter import filter as rf


def test_pack_routes_lays_out_and_refuses_routes_that_do_not_fit():
    r0 = torch.tensor([[[0, 1]], [[2, 3]]])                        # 3 tokens: routes of the first 2
    r1 = torch.tensor([[[4, 5]], [[6, 7]], [[1, 2]]])              # 3 tokens: all 3 recorded
    out = replay.pack_routes([r0, r1], [3, 3], 4)
    assert out.shape == (2, 4, 1, 2) and out.dtype == torch.long
    assert torch.equal(out[0, :2], r0) and torch.equal(out[1, :3], r1)
    assert (out[0, 2:] == -1).all() and (out[1, 3:] == -1).all()   # unrecorded and padding: -1
    with pytest.raises(ValueError, match="do not fit"):
        replay.pack_routes([r0[:1], r1], [3, 3], 4)                 # one row short: never a silent skip
    with pytest.raises(ValueError, match="do not fit"):
        replay.pack_routes([r0, r1[..., :1]], [3, 3], 4)            # a different top-k


def test_topk_overlap_and_token_overlap_by_hand():
    rollout = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]])               # (B=1, T=2, n_moe=2, k=2)
    train = torch.tensor([[[[1, 0], [2, 9]], [[4, 5], [8, 9]]]])
    assert torch.equal(replay.topk_overlap(rollout, train), torch.tensor([[[1.0, 0.5], [1.0, 0.0]]]))  # sets, not order
    ov = rf.token_overlap(rollout, train)
    assert torch.allclose(ov, torch.tensor([[(1 + 0.5) / 2, (1 + 0) / 2]]))   # 0.75, 0.5
    assert torch.equal(rf.token_overlap(rollout, rollout), torch.ones(1, 2))   # no flips: 1
    none = torch.zeros(1, 2, 0, 2, dtype=torch.long)                             # a dense model: no MoE layer
    assert torch.equal(rf.token_overlap(none, none), torch.ones(1, 2))


def test_expert_load_counts_per_layer():
    routes = torch.tensor([[[0, 1], [3, 2]], [[0, 2], [3, 0]], [[1, 2], [3, 1]]])   # (N=3, n_moe=2, k=2)
    load = replay.expert_load(routes, 4)
    assert load.dtype == torch.int64
    assert load.tolist() == [[2, 2, 2, 0], [1, 1, 1, 3]]
    assert torch.equal(load.sum(-1), torch.full((2,), 3 * 2))      # every routed slot counted once


def test_route_audit_counts_flips():
    a = torch.tensor([[[[0, 1], [2, 3]], [[0, 1], [2, 3]]]])      # (1, 2 tokens, 2 layers, k=2)
    b = torch.tensor([[[[1, 0], [2, 4]], [[0, 1], [2, 3]]]])
    m = torch.ones(1, 2, dtype=torch.bool)
    r = replay.route_audit(a, b, m, 5)
    assert r["route_flip_frac"] == pytest.approx(1 / 4)           # only token 0, layer 1 changed its set
    assert r["top1_flip_frac"] == pytest.approx(1 / 4)            # token 0 layer 0 swapped order only
    assert r["token_any_flip_frac"] == pytest.approx(1 / 2)
    assert r["topk_overlap"] == pytest.approx((1 + 0.5 + 1 + 1) / 4)
    assert r["route_flip_frac_layer"] == [0.0, 0.5]
    # trainer load per layer: layer 0 experts {0: 2, 1: 2} of 4 slots -> max share 2/4 * 5 = 2.5
    assert r["expert_load_max"] == pytest.approx(2.5)
    assert replay.route_audit(a, b, torch.zeros(1, 2, dtype=torch.bool), 5) == {}   # nothing to compare


def test_mismatch_metrics_by_hand():
    rollout = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.9]]))
    train = torch.log(torch.tensor([[0.5, 0.75, 0.2, 0.1]]))      # rho = 1, 1.5, 0.4 (the last token is masked)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    r = replay.mismatch_metrics(train, rollout, mask)
    d = [0.0, math.log(1.5), math.log(0.4)]
    assert r["train_rollout_kl"] == pytest.approx(-sum(d) / 3, abs=1e-7)
    assert r["train_rollout_k3"] == pytest.approx(sum(math.exp(x) - x - 1 for x in d) / 3, abs=1e-7)
    assert r["logp_max_abs_diff"] == pytest.approx(abs(math.log(0.4)), abs=1e-7)
    assert r["extreme_token_frac"] == pytest.approx(1 / 3)       # only |log 0.4| > ln 2
    assert (r["is_ratio_min"], r["is_ratio_max"]) == (pytest.approx(0.4), pytest.approx(1.5))
    assert r["is_ratio_mean"] == pytest.approx((1 + 1.5 + 0.4) / 3)
    same = replay.mismatch_metrics(rollout, rollout, mask)
    assert same["train_rollout_kl"] == 0 and same["logp_max_abs_diff"] == 0 and same["is_ratio_mean"] == 1


def test_margin_stats_and_router_stats_by_hand():
    """4 decisions (2 tokens x 2 layers) with trainer margins 5e-5, 5e-4, 5e-3, 0.5; the first two flipped."""
    a = torch.tensor([[[[0, 1], [2, 3]], [[0, 1], [2, 3]]]])      # (1, 2 tokens, 2 layers, k=2)
    b = torch.tensor([[[[0, 2], [2, 4]], [[0, 1], [2, 3]]]])
    margin = torch.tensor([[[5e-5, 5e-4], [5e-3, 0.5]]])
    entropy = torch.tensor([[[1.0, 2.0], [3.0, 0.5]]])
    detail = SimpleNamespace(weights=None, margin=margin, entropy=entropy)
    r = replay.route_audit(a, b, torch.ones(1, 2, dtype=torch.bool), 5, detail)
    assert r["route_margin_frac"] == [0.25, 0.25, 0.25, 0.25]
    assert r["route_flip_frac_by_margin"] == [0.25, 0.25, 0.0, 0.0]
    assert sum(r["route_flip_frac_by_margin"]) == r["route_flip_frac"]
    assert r["router_entropy_layer"] == [2.0, 1.25]                # per layer, over the tokens
    # trainer load: layer 0 {0: 2, 1: 1, 2: 1} of 4 slots over 5 experts -> 2/4 * 5; layer 1 {2: 2, 3: 1, 4: 1}
    assert r["load_imbalance_layer"] == [2.5, 2.5]
    assert replay.margin_bin(torch.tensor([0.0, 1e-4, 9.99e-4, 1e-2, float("inf")])).tolist() == [0, 1, 1, 3, 3]


def test_route_drift_and_load_histogram():
    from tooling.eval import route_drift
    a = torch.tensor([[[[0, 1]], [[2, 3]], [[4, 5]]]])             # (1, 3 tokens, 1 layer, k=2)
    b = torch.tensor([[[[1, 0]], [[2, 4]], [[0, 0]]]])
    m = torch.tensor([[True, True, False]])
    assert route_drift(a, b, m) == 0.5                              # token 1 changed its set; 0 only its order
    assert route_drift(a, a, m) == 0.0
    h = replay.load_histogram(a, b, m, 6)
    assert h == {"rollout": [[1, 1, 1, 1, 0, 0]], "train": [[1, 1, 1, 0, 1, 0]]}


def test_sequence_hotness_by_hand():
    """Per-request expert hotness: 3 fed positions and an unrecorded one (-1), 2 MoE layers, top-2 of 4
    experts. Layer 0 sends every position to expert 0 (3 of 6 choices: the most a top-2 expert can take);
    layer 1 spreads them (2 of 6 at most)."""
    routes = torch.tensor([[[0, 1], [2, 3]],
                           [[0, 2], [0, 1]],
                           [[3, 0], [1, 2]],
                           [[-1, -1], [-1, -1]]])                       # (N=4, n_moe=2, k=2); the last: unrecorded
    h = replay.sequence_hotness(routes, 4)
    assert h["expert_hist"] == [[3, 1, 1, 1], [1, 2, 2, 1]]              # each layer's choices: 3 positions x 2 slots
    assert h["expert_hot_frac"] == round((3 / 6 + 2 / 6) / 2, 6)         # 0.416667: the busiest's share, mean over layers
    assert replay.sequence_hotness(routes[3:], 4) == {"expert_hist": [[0] * 4] * 2, "expert_hot_frac": None}
    dense = replay.sequence_hotness(torch.zeros(3, 0, 2, dtype=torch.long), 4)   # no MoE layer: nothing to count
    assert dense == {"expert_hist": [], "expert_hot_frac": None}


def test_key_token_weights_by_hand():
    """A key token (ids 3, 7) loses its weight where the top-1 expert of the position scoring it flipped in
    some MoE layer; a change of the second choice, a flip before a non-key token, or an unrecorded position
    does not. With --route_filter too, the two weights multiply; without a mismatch all are exactly 1."""
    rollout = torch.tensor([[0, 1], [2, 3]]).expand(2, 6, 2, 2).clone()    # (B, T, 2 layers, k)
    train = rollout.clone()
    train[0, 1, 1] = torch.tensor([4, 3])                             # pos 1, layer 1: top-1 flips (token 2: key)
    train[0, 2, 0] = torch.tensor([0, 5])                             # pos 2: the second choice only (token 3: key)
    train[0, 3, 0] = torch.tensor([1, 0])                             # pos 3: top-1 flips, the set does not (token 4)
    train[0, 4, 1] = torch.tensor([5, 3])                             # pos 4: top-1 flips (token 5: key)
    train[1, 1, 1] = torch.tensor([4, 3])                             # row 1: the same flip, but ...
    rollout[1, 1] = -1                                                # ... nothing was recorded there
    tokens = torch.tensor([[9, 9, 3, 3, 11, 7], [9, 9, 3, 3, 11, 7]])
    table = rf.key_token_table((3, 7), 13)
    assert table.tolist() == [i in (3, 7) for i in range(13)] and rf.key_token_table((), 13) is None
    w = rf.key_token_weights(rollout, train, tokens, table)
    assert torch.equal(w, torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]]))
    mask = torch.ones(2, 5)
    cfg = SimpleNamespace(route_filter="downweight", route_filter_threshold=0.9, route_filter_level="token")
    both = rf.route_filter(rollout, train, mask, cfg, tokens, table)
    assert torch.equal(both[0], torch.tensor([1.0, 0.0, 0.75, 1.0, 0.0]))   # overlaps 1, .75, .75, 1, .75
    alone = rf.route_filter(rollout, train, mask, SimpleNamespace(route_filter="none"), tokens, table)
    assert torch.equal(alone, w) and rf.route_filter(rollout, train, mask, SimpleNamespace(route_filter="none")) is None
    assert torch.equal(rf.key_token_weights(rollout, rollout.clone(), tokens, table), torch.ones(2, 5))
