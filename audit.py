"""The train-inference mismatch, measured: route packing, the route audit, top-k overlap, log-prob metrics, expert load.

    from audit import pack_routes, route_audit, mismatch_metrics
    routes = pack_routes([o.routes for o in outs], lengths, T)      # the rollout's routes, batch-shaped
    row = {**mismatch_metrics(train_logp, rollout_logp, mask), **route_audit(routes, train_routes, route_mask, E)}

Routes are top-k expert ids per token per MoE layer, int, shape (tokens, n_moe_layers, top_k).
The sampler records them (rollout.SequenceOutput.routes); `pack_routes` lays them out like the
trainer's padded token batch, with -1 where nothing was recorded (the last token of each sequence,
whose output is never used, and the padding). `model.score(tokens, routes=packed)` then replays them (R3).
`topk_overlap` and `expert_load` are the two measures everything else is built from: the route audit
logs them, the route filter (losses.route_filter_weights) weighs tokens by the overlap, and the
aux-loss-free bias update (train.update_expert_bias) balances the load.
"""
from __future__ import annotations

import math

import torch


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


def topk_overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|set a & set b| / k of each routing decision: routes (..., k) -> (...) float in [0, 1]."""
    k = a.shape[-1]
    hit = (a[..., :, None] == b[..., None, :]).any(-1)               # (..., k): is a's id among b's
    return hit.sum(-1).float() / k


def token_overlap(rollout: torch.Tensor, train: torch.Tensor) -> torch.Tensor:
    """Each token's top-k overlap averaged over MoE layers: routes (B, T, n_moe, k) -> (B, T); 1 where
    the model has no MoE layer (nothing can flip)."""
    if rollout.shape[2] == 0:
        return torch.ones(rollout.shape[:2], device=rollout.device)
    return topk_overlap(rollout, train).mean(-1)


def expert_load(routes: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(n_moe, E) int64: how often each expert was chosen, over routes (N, n_moe, k) (chosen positions only, no -1)."""
    N, n_moe, k = routes.shape
    offset = torch.arange(n_moe, device=routes.device)[None, :, None] * n_experts   # layer j's experts at j * E
    return torch.bincount((routes + offset).reshape(-1), minlength=n_moe * n_experts).view(n_moe, n_experts)


def route_audit(rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor, n_experts: int) -> dict:
    """Compare rollout and trainer routes (B, T, n_moe, k) at the positions where mask (B, T) is True.

    route_flip_frac: fraction of (token, layer) decisions whose top-k *set* differs.
    route_flip_frac_layer: the same per MoE layer. topk_overlap: mean |set intersection| / k.
    top1_flip_frac: the first choice differs. token_any_flip_frac: tokens with a flip in any layer.
    expert_load_max: the busiest expert's share of the trainer's routed slots over a uniform share
    (1.0 = perfectly balanced), worst layer.
    """
    m = mask.bool()
    a, b = rollout[m], train[m]                               # (N, n_moe, k)
    if a.numel() == 0:
        return {}
    overlap = topk_overlap(a, b)                              # (N, n_moe)
    flipped = overlap < 1
    load = expert_load(b, n_experts)
    load = load.float() / load.sum(-1, keepdim=True) * n_experts    # (n_moe, E), 1.0 = uniform
    return {
        "route_flip_frac": flipped.float().mean().item(),
        "route_flip_frac_layer": [round(v, 6) for v in flipped.float().mean(0).tolist()],
        "topk_overlap": overlap.mean().item(),
        "top1_flip_frac": (a[..., 0] != b[..., 0]).float().mean().item(),
        "token_any_flip_frac": flipped.any(-1).float().mean().item(),
        "expert_load_max": load.max().item(),
    }


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
