"""diagnostics.jsonl's rows and --diagnostics_holdout's choice (diagnostics/rows.py), by hand.

    python -m pytest -q tests/test_diagnostics.py
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from diagnostics.rows import diagnostics as rows_of
from diagnostics.rows import hold_out


def test_diagnostics_pick_the_mismatched_sequences():
    """Three sequences (prompt 2 tokens, response 2): 0 agrees, 1 has a route flip, 2 an extreme token."""
    outs = [SimpleNamespace(prompt=[1, 2], tokens=[3, 4], logprobs=torch.tensor([-1.0, -2.0]),
                            route_margins=None) for _ in range(3)]
    outs[1].route_margins = torch.tensor([[0.1], [0.2], [0.3]])
    routes = torch.tensor([0, 1]).expand(3, 4, 1, 2).clone()        # (B, T, 1 layer, k)
    train_routes = routes.clone()
    train_routes[1, 2, 0] = torch.tensor([0, 3])                   # position 2 scores response token 2
    logp = torch.tensor([[0.0, -1.0, -2.0]]).repeat(3, 1)          # (B, T-1): response at positions 1, 2
    logp[2, 1] = -1.0 - 0.7                                        # |diff| 0.7 > ln 2
    rows = rows_of(5, outs, torch.arange(3), logp, train_routes, routes, torch.tensor([0.0, 0.5, 1.0]),
                             n=5, n_experts=4, decode=lambda ids: "".join(map(str, ids)),
                             train_margin=torch.full((3, 4, 1), 0.25))
    assert [r["sequence"] for r in rows] == [1, 2]                 # lowest overlap first; 0 does not qualify
    r = json.loads(json.dumps(rows[0], allow_nan=False))
    assert r["step"] == 5 and r["reward"] == 0.5 and r["flipped_layers"] == [0, 1]
    assert r["topk_overlap"] == 0.75 and r["margin_rollout"] == [[0.2], [0.3]] and r["margin_train"] == [[0.25]] * 2
    assert r["prompt_text"] == "12" and r["response_text"] == "34"
    assert rows[1]["logp_max_abs_diff"] == pytest.approx(0.7) and "margin_rollout" not in rows[1]
    # the rollout's routes at the 3 fed positions (prompt 2 + response 2 - 1): experts 0 and 1 every time
    assert r["expert_hist"] == [[3, 3, 0, 0]] and r["expert_hot_frac"] == 0.5
    assert len(rows_of(5, outs, torch.arange(3), logp, train_routes, routes, torch.zeros(3), n=1,
                                  n_experts=4)) == 1


def _mismatched_batch():
    """Four sequences (prompt 2 tokens, response 2; logp columns 1, 2 score the response): 0 agrees, 1 has
    one route flip (overlap 0.75), 2 an extreme token (|diff| 0.7), 3 two flips (overlap 0.5); the batch
    (packing.Batch's fields that hold_out reads), the audit (a packing.Scored's) and the matching outs."""
    B, T = 4, 4
    routes = torch.tensor([0, 1]).expand(B, T, 1, 2).clone()          # (B, T, 1 layer, k)
    train_routes = routes.clone()
    train_routes[1, 2, 0] = torch.tensor([0, 3])
    train_routes[3, 1, 0] = torch.tensor([4, 1])
    train_routes[3, 2, 0] = torch.tensor([0, 5])
    rollout_logp = torch.tensor([[0.0, -1.0, -2.0]]).repeat(B, 1)
    logp = rollout_logp.clone()
    logp[2, 1] = -1.0 - 0.7
    mask = torch.tensor([[0.0, 1.0, 1.0]]).repeat(B, 1)
    batch = SimpleNamespace(mask=mask, observed=torch.zeros(B, T, dtype=torch.bool), rollout_logp=rollout_logp,
                            routes=routes)
    outs = [SimpleNamespace(prompt=[1, 2], tokens=[3, 4], logprobs=[-1.0, -2.0], route_margins=None) for _ in range(B)]
    return batch, SimpleNamespace(logp=logp, routes=train_routes), outs


def test_hold_out_takes_the_sequences_diagnostics_would_write():
    """--diagnostics_holdout chooses from the batch and the old-policy audit by diagnostics' rule: the same
    sequences in the same order; their loss-mask rows are 0, the others untouched; off, the mask is the batch's."""
    batch, audit, outs = _mismatched_batch()
    for n in (1, 2, 5):
        mask, rows = hold_out(batch, audit, SimpleNamespace(diagnostics_holdout=True, diagnostics=n))
        found = rows_of(1, outs, torch.arange(4), audit.logp, audit.routes, batch.routes, torch.zeros(4), n,
                                   n_experts=6)
        assert rows.tolist() == [r["sequence"] for r in found] == [3, 1, 2][:n]
        assert (mask[rows] == 0).all() and torch.equal(mask[[r for r in range(4) if r not in rows]],
                                                       batch.mask[[r for r in range(4) if r not in rows]])
    mask, rows = hold_out(batch, audit, SimpleNamespace(diagnostics_holdout=False, diagnostics=2))
    assert mask is batch.mask and rows.numel() == 0
    agree = SimpleNamespace(logp=batch.rollout_logp.clone(), routes=batch.routes.clone())     # no mismatch
    mask, rows = hold_out(batch, agree, SimpleNamespace(diagnostics_holdout=True, diagnostics=2))
    assert rows.numel() == 0 and torch.equal(mask, batch.mask)       # nothing qualifies: nothing held out
    # the rows of held-out sequences: those asked for, in that order, marked, numbered in the global batch
    held = rows_of(1, outs, torch.arange(4), audit.logp, audit.routes, batch.routes, torch.zeros(4), 5,
                              n_experts=6, only=[1, 3], offset=8)
    assert [r["sequence"] for r in held] == [9, 11] and all(r["held_out"] for r in held)
