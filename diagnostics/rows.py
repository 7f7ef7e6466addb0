"""diagnostics.jsonl's rows: the step's most mismatched sequences (their tokens, log-probs on both sides,
routes, margins and hotness), and --diagnostics_holdout's choice of them before the update."""
from __future__ import annotations

import math

import torch

from replay import sequence_hotness, topk_overlap


def _rounded(t: torch.Tensor | list) -> list:
    """A tensor as (nested) lists of floats with 7 significant digits; inf / nan become None (strict JSON)."""
    values = t.tolist() if isinstance(t, torch.Tensor) else t         # a sampler output's logprobs are a list
    return [[_rounded_one(v) for v in r] if isinstance(r, list) else _rounded_one(r) for r in values]


def _rounded_one(v: float):
    return float(f"{v:.7g}") if math.isfinite(v) else None


def sequence_mismatch(train_logp: torch.Tensor, rollout_logp: torch.Tensor, weight: torch.Tensor | None,
                      rollout_routes: torch.Tensor, train_routes: torch.Tensor) -> tuple[tuple, bool, torch.Tensor]:
    """One response's mismatch over the N positions that score it: log-probs (N,), weight (N,) 0 at an episode's
    environment ids (no log-prob; None: none), routes (N, n_moe, k). Returns its rank key (mean top-k overlap,
    minus the max |logp diff|: the most mismatched sort first), whether it qualifies for diagnostics (a
    route flipped in some layer, or a token is extreme: |logp diff| > ln 2) and the overlaps (N, n_moe)."""
    diff = (train_logp.double() - rollout_logp.double()).abs()
    if weight is not None:
        diff = diff * weight.double()
    overlap = topk_overlap(rollout_routes, train_routes)                   # (N, n_moe)
    mean_overlap = overlap.mean().item() if overlap.numel() else 1.0
    return (mean_overlap, -diff.max().item()), mean_overlap < 1 or bool((diff > math.log(2)).any()), overlap


def hold_out(batch, audit, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """--diagnostics_holdout: the loss mask (B, T-1) without the step's diagnostics sequences (out of the loss,
    its normalisers and the KL: what diagnostics.jsonl shows is not trained on), and their rows (n,) int64 of
    the global batch (packing.Batch): the cfg.diagnostics most mismatched by `diagnostics`' rule, most
    mismatched first, chosen before the update from the old-policy forward over the whole batch (audit: a
    packing.Scored of rows 0..B-1): a function of the two alone, the same on every rank and world size."""
    if not cfg.diagnostics_holdout:
        return batch.mask, torch.zeros(0, dtype=torch.long)
    scoring = batch.mask.bool() | batch.observed[:, 1:]                  # (B, T-1): the positions scoring a response
    picked = []
    for r in range(scoring.shape[0]):
        at = scoring[r].nonzero()[:, 0]                                  # P - 1 .. P + N - 2, as diagnostics' slice
        key, qualifies, _ = sequence_mismatch(audit.logp[r, at], batch.rollout_logp[r, at], batch.mask[r, at],
                                              batch.routes[r, at], audit.routes[r, at])
        if qualifies:
            picked.append((key, r))
    picked.sort(key=lambda p: p[0])                                      # stable: ties keep the batch's order
    rows = torch.tensor([r for _, r in picked[:cfg.diagnostics]], dtype=torch.long)
    mask = batch.mask.clone()
    mask[rows] = 0
    return mask, rows


def diagnostics(step: int, outs: list, rows: torch.Tensor, train_logp: torch.Tensor, train_routes: torch.Tensor,
                rollout_routes: torch.Tensor, rewards: torch.Tensor, n: int, *, n_experts: int,
                train_margin: torch.Tensor | None = None, decode=None, only: list[int] | None = None,
                offset: int = 0) -> list[dict]:
    """The rows of diagnostics.jsonl: up to n of the sequences `rows` whose routes or log-probs disagree.

    A sequence qualifies if any response token's routes flipped in some layer or a token is extreme
    (|logp train - logp rollout| > ln 2); the n with the lowest mean top-k overlap go first (ties: the
    larger max |logp diff|) (sequence_mismatch). only: these sequences instead, in this order (the ones
    hold_out chose; their rows say "held_out": true). train_logp (R, T-1), train_routes / rollout_routes
    (R, T, n_moe, k) and train_margin (R, T, n_moe) are for the sequences outs[rows[j]]; a row's "sequence"
    is offset + its index in outs (its row of the global batch). Per response token j the route fields are
    those of the position that scores it (the one before it, as the log-prob); `expert_hist` and
    `expert_hot_frac` are the whole sequence's (sequence_hotness, over the n_experts experts).
    """
    picked = []
    for j, r in enumerate(rows.tolist()):
        o = outs[r]
        P, N = len(o.prompt), len(o.tokens)
        at = slice(P - 1, P - 1 + N)                                  # the positions scoring the response
        weight = torch.as_tensor(o.policy_mask) if getattr(o, "policy_mask", None) else None   # an episode
        key, qualifies, overlap = sequence_mismatch(train_logp[j, at], torch.as_tensor(o.logprobs, dtype=torch.float64),
                                                    weight, rollout_routes[j, at], train_routes[j, at])
        if (qualifies if only is None else r in only):
            picked.append((key, j, r, at, overlap))
    picked.sort(key=lambda p: p[0] if only is None else only.index(p[2]))
    out = []
    for (mean_overlap, neg_diff), j, r, at, overlap in picked[:n] if only is None else picked:
        o = outs[r]
        row = {"step": step, "sequence": offset + r, "reward": float(rewards[r]), "prompt": list(o.prompt),
               "response": list(o.tokens), "logp_train": _rounded(train_logp[j, at]),
               "logp_rollout": _rounded(o.logprobs), "flipped_layers": (overlap < 1).sum(-1).tolist(),
               "topk_overlap": round(mean_overlap, 6), "logp_max_abs_diff": _rounded_one(-neg_diff),
               **sequence_hotness(rollout_routes[j, :at.stop], n_experts)}   # its fed positions: P + N - 1
        if only is not None:
            row["held_out"] = True
        if train_margin is not None:
            row["margin_train"] = _rounded(train_margin[j, at])
        if o.route_margins is not None:
            row["margin_rollout"] = _rounded(o.route_margins[at])
        if decode is not None:
            row["prompt_text"], row["response_text"] = decode(list(o.prompt)), decode(list(o.tokens))
        out.append(row)
    return out
