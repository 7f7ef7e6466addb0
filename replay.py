"""The life of a route: record -> pack -> replay -> audit (-> filter: route_filter/, a plug-in).

    from replay import pack_routes, routes_to_replay, route_audit
    routes = pack_routes([o.routes for o in outs], lengths, T)     # the rollout's routes, batch-shaped
    forced = routes_to_replay("r3", routes, old_routes=None)       # what the trainer's forward replays
    logp, used = model.score(tokens, routes=forced)                # used: the router's own choice
    row = {**mismatch_metrics(logp, rollout_logp, mask), **route_audit(routes, used, route_mask, E)}

A route is the top-k expert ids of one token at one MoE layer; a batch of them is int, shape
(B, T, n_moe_layers, top_k), -1 where nothing was recorded.
1. **Record.** The sampler writes the router's choice for every position it feeds (rollout.ModelRunner,
   beside the KV), so SequenceOutput.routes has every position but the last token's, which no forward
   fed (its output is never used).
2. **Pack.** `pack_routes` lays them out like the trainer's padded token batch and checks that they fit
   the tokens: the one place routes are checked on the host, so the trainer replays them unread.
3. **Replay.** `routes_to_replay(mode, ...)`: R3 replays the rollout's routes, `old` the old-policy
   forward's (vanilla routing replay), `none` nothing; `replay_mode` bounds it to a batch's first
   updates. The mechanism is the model's: `model.score(routes=...)` hands each MoE layer its forced ids
   (kernels.route gathers the router's own scores at them, so the router still gets gradients and
   replaying one's own routes is the free forward, bitwise).
4. **Audit.** `route_audit` compares the rollout's routes with the trainer's (flips per layer, top-k
   overlap, top-1 flips, expert load, margins and router entropy from model.RouteDetail);
   `mismatch_metrics` does the same for log-probs; `load_histogram` feeds routes.jsonl (diagnostics.jsonl
   is the diagnostics/ plug-in's, the probe's route drift tooling/'s).
5. **Filter.** route_filter/ (a plug-in): the loss weights of tokens by their top-k overlap (the cheaper
   alternative to R3) and of key tokens whose top-1 expert flipped, through the step's `token_weights` seam.
`topk_overlap` and `expert_load` are the two measures the rest is built from (router_training/'s bias
update balances the load; `sequence_hotness`, one sequence's load, feeds the lab and diagnostics.jsonl).
The replay options' names are the table below (REPLAY_MODES); config.TrainConfig validates --replay
against it.
"""
from __future__ import annotations

import math

import torch

REPLAY_MODES = ("none", "r3", "old")          # --replay: nothing, the rollout's routes, the old policy's


def pack_routes(routes: list[torch.Tensor], lengths: list[int], T: int) -> torch.Tensor:
    """Per-sequence routes (L_i - 1 or L_i, n_moe, k) -> (B, T, n_moe, k) int64, -1 where unrecorded.

    lengths[i] is the number of real tokens of sequence i in the batch. A sequence whose routes do
    not cover its tokens (all but possibly the last) is an error: replay must never silently skip.
    This is where the trainer's routes are checked (on the host, as the batch is built), so the
    trainer's forward replays them without reading them back.
    """
    n_moe, k = routes[0].shape[1:]
    out = torch.full((len(routes), T, n_moe, k), -1, dtype=torch.long)
    for i, (r, L) in enumerate(zip(routes, lengths)):
        if r.shape[0] not in (L - 1, L) or tuple(r.shape[1:]) != (n_moe, k):
            raise ValueError(f"sequence {i}: routes of shape {tuple(r.shape)} do not fit its {L} tokens "
                             f"(need ({L - 1} or {L}, {n_moe}, {k})); were they recorded for these tokens?")
        out[i, :r.shape[0]] = r
    return out


def routes_to_replay(mode: str, rollout_routes: torch.Tensor | None,
                     old_routes: torch.Tensor | None) -> torch.Tensor | None:
    """The routes a trainer forward replays under --replay=mode (REPLAY_MODES): the rollout's (r3), the
    old-policy forward's (old: "vanilla routing replay"), or None (the router chooses). A mode whose
    routes are missing is an error, never a silent free forward."""
    routes = {"none": None, "r3": rollout_routes, "old": old_routes}[mode]
    if mode != "none" and routes is None:
        raise ValueError(f"--replay={mode}: no {'rollout' if mode == 'r3' else 'old-policy'} routes to replay")
    return routes


def replay_mode(mode: str, bound: int, update: int) -> str:
    """The replay mode of optimizer step `update` (0-based) on a batch: `mode`, or "none" from step `bound`
    on (--replay_steps; 0: no bound). Bounded replay: forcing the rollout's (or the old policy's) routes
    on every update keeps the router from moving a boundary the policy has learned to move; after `bound`
    updates the router's own choice computes the forward, and the ratio then carries the routing change."""
    return mode if bound == 0 or update < bound else "none"


def topk_overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|set a & set b| / k of each routing decision: routes (..., k) -> (...) float in [0, 1]."""
    k = a.shape[-1]
    hit = (a[..., :, None] == b[..., None, :]).any(-1)               # (..., k): is a's id among b's
    return hit.sum(-1).float() / k


def expert_load(routes: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(n_moe, E) int64: how often each expert was chosen, over routes (N, n_moe, k) (chosen positions only, no -1)."""
    N, n_moe, k = routes.shape
    offset = torch.arange(n_moe, device=routes.device)[None, :, None] * n_experts   # layer j's experts at j * E
    return torch.bincount((routes + offset).reshape(-1), minlength=n_moe * n_experts).view(n_moe, n_experts)


def route_audit(rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor, n_experts: int,
                detail=None) -> dict:
    """Compare rollout and trainer routes (B, T, n_moe, k) at the positions where mask (B, T) is True.

    route_flip_frac: fraction of (token, layer) decisions whose top-k *set* differs.
    route_flip_frac_layer: the same per MoE layer. topk_overlap: mean |set intersection| / k.
    top1_flip_frac: the first choice differs. token_any_flip_frac: tokens with a flip in any layer.
    expert_load_max: the busiest expert's share of the trainer's routed slots over a uniform share
    (1.0 = perfectly balanced), worst layer; load_imbalance_layer: the same (max / mean) per layer.
    detail: the trainer's model.RouteDetail (B, T, ...) of `train`: adds margin_stats and router_entropy_layer.
    """
    m = mask.bool()
    a, b = rollout[m], train[m]                               # (N, n_moe, k)
    if a.numel() == 0:
        return {}
    overlap = topk_overlap(a, b)                              # (N, n_moe)
    flipped = overlap < 1
    load = expert_load(b, n_experts)
    load = load.float() / load.sum(-1, keepdim=True) * n_experts    # (n_moe, E), 1.0 = uniform
    row = {
        "route_flip_frac": flipped.float().mean().item(),
        "route_flip_frac_layer": [round(v, 6) for v in flipped.float().mean(0).tolist()],
        "topk_overlap": overlap.mean().item(),
        "top1_flip_frac": (a[..., 0] != b[..., 0]).float().mean().item(),
        "token_any_flip_frac": flipped.any(-1).float().mean().item(),
        "expert_load_max": load.max().item(),
        "load_imbalance_layer": [round(v, 6) for v in load.max(-1).values.tolist()],
    }
    if detail is not None:
        row.update(margin_stats(flipped, detail.margin[m]))
        row["router_entropy_layer"] = [round(v, 6) for v in detail.entropy[m].mean(0).tolist()]
    return row


MARGIN_BINS = (1e-4, 1e-3, 1e-2)     # route margins binned as < 1e-4, < 1e-3, < 1e-2, larger


def margin_bin(margin: torch.Tensor) -> torch.Tensor:
    """Each margin's bin index in 0..len(MARGIN_BINS) (the last: >= 1e-2, inf included)."""
    return torch.bucketize(margin.float(), torch.tensor(MARGIN_BINS, device=margin.device), right=True)


def margin_stats(flipped: torch.Tensor, margin: torch.Tensor) -> dict:
    """Flips against the trainer's margins: flipped (N, n_moe) bool, margin (N, n_moe) fp32.

    route_margin_frac[i]: the share of (token, layer) decisions in margin bin i (MARGIN_BINS);
    route_flip_frac_by_margin[i]: the share of decisions that flipped AND sit in bin i (they sum to
    route_flip_frac), so bin i's flip rate is the ratio of the two and "what share of the flips sat
    below 1e-3" is (b0 + b1) / sum.
    """
    bins = margin_bin(margin).reshape(-1)
    n = len(MARGIN_BINS) + 1
    every = torch.bincount(bins, minlength=n).double() / bins.numel()
    flips = torch.bincount(bins[flipped.reshape(-1)], minlength=n).double() / bins.numel()
    return {"route_margin_frac": [round(v, 8) for v in every.tolist()],
            "route_flip_frac_by_margin": [round(v, 8) for v in flips.tolist()]}


def load_histogram(rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor, n_experts: int) -> dict:
    """Per-expert load counts of each MoE layer, {rollout, train}: (n_moe, E) lists of ints, at the
    positions where mask (B, T) is True (the rows of routes.jsonl)."""
    m = mask.bool()
    return {"rollout": expert_load(rollout[m], n_experts).tolist(), "train": expert_load(train[m], n_experts).tolist()}


def mismatch_metrics(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """How far the trainer's log-probs (B, T-1) are from the rollout's, on the response tokens (mask 1)."""
    m = mask.bool()
    t, r = train_logp[m].double(), rollout_logp[m].double()
    d = t - r
    rho = torch.exp(d)
    return {
        "train_rollout_kl": (-d).mean().item(),                      # k1 of KL(mu || pi)
        "train_rollout_k3": (rho - d - 1).mean().item(),
        "logp_max_abs_diff": d.abs().max().item(),
        "extreme_token_frac": (d.abs() > math.log(2)).double().mean().item(),
        "is_ratio_min": rho.min().item(), "is_ratio_mean": rho.mean().item(), "is_ratio_max": rho.max().item(),
    }


def sequence_hotness(routes: torch.Tensor, n_experts: int) -> dict:
    """Per-request expert hotness of one sequence from its rollout routes (N, n_moe, k) at the positions
    the sampler fed (unrecorded -1 rows are left out): expert_hist, per MoE layer the count of its
    (token, slot) choices each expert took ((n_moe, E) lists of ints), and expert_hot_frac, the busiest
    expert's share of them, averaged over the layers (from 1/E, spread evenly, to 1/k, one expert in every
    position's top-k; None with nothing to count)."""
    routes = routes[(routes >= 0).flatten(1).all(1)]                      # the recorded positions
    hist = expert_load(routes, n_experts)                                 # (n_moe, E)
    choices = routes.shape[0] * routes.shape[2]                           # per layer: N positions x k slots
    hot = (hist.max(1).values.double() / choices).mean().item() if choices and hist.shape[0] else None
    return {"expert_hist": hist.tolist(), "expert_hot_frac": None if hot is None else round(hot, 6)}
