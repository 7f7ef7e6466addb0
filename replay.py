"""Routing replay (R3) and the route audit: what the rollout's expert choices were, and how the trainer's differ.

Routes are top-k expert ids per token per MoE layer, int, shape (tokens, n_moe_layers, top_k).
The sampler records them (rollout.SequenceOutput.routes); `pack_routes` lays them out like the
trainer's padded token batch, with -1 where nothing was recorded (the last token of each sequence,
whose output is never used, and the padding). `model.score(tokens, routes=packed)` then replays them.
`route_audit` compares two route tensors decision by decision.
"""
from __future__ import annotations

import torch


def pack_routes(routes: list[torch.Tensor], lengths: list[int], T: int) -> torch.Tensor:
    """Per-sequence routes (L_i - 1 or L_i, n_moe, k) -> (B, T, n_moe, k) int64, -1 where unrecorded.

    lengths[i] is the number of real tokens of sequence i in the batch. A sequence whose routes do
    not cover its tokens (all but possibly the last) is an error: replay must never silently skip.
    """
    n_moe, k = routes[0].shape[1:]
    out = torch.full((len(routes), T, n_moe, k), -1, dtype=torch.long)
    for i, (r, L) in enumerate(zip(routes, lengths)):
        if r.shape[0] not in (L - 1, L) or tuple(r.shape[1:]) != (n_moe, k):
            raise ValueError(f"sequence {i}: routes of shape {tuple(r.shape)} do not fit its {L} tokens "
                             f"(need ({L - 1} or {L}, {n_moe}, {k})); were they recorded for these tokens?")
        out[i, :r.shape[0]] = r
    return out


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
    k = a.shape[-1]
    # set overlap: for each rollout id, is it among the trainer's k ids
    hit = (a[..., :, None] == b[..., None, :]).any(-1)       # (N, n_moe, k)
    overlap = hit.sum(-1).float() / k                         # (N, n_moe)
    flipped = overlap < 1
    load = torch.stack([torch.bincount(b[:, l].reshape(-1), minlength=n_experts) for l in range(b.shape[1])])
    load = load.float() / load.sum(-1, keepdim=True) * n_experts    # (n_moe, E), 1.0 = uniform
    return {
        "route_flip_frac": flipped.float().mean().item(),
        "route_flip_frac_layer": [round(v, 6) for v in flipped.float().mean(0).tolist()],
        "topk_overlap": overlap.mean().item(),
        "top1_flip_frac": (a[..., 0] != b[..., 0]).float().mean().item(),
        "token_any_flip_frac": flipped.any(-1).float().mean().item(),
        "expert_load_max": load.max().item(),
    }
