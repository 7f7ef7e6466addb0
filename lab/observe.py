"""The lab's observations of every request (--log_hotness): how concentrated each sequence's routing is.

A request whose tokens all go to a few experts loads those experts' ranks (the third article's "per-request
expert hotness"). diagnostics.jsonl has it only for the most mismatched sequences; this hook measures every
sequence of the step, from the rollout's routes at the positions the sampler fed, and costs nothing when off.
"""
from __future__ import annotations

import torch

import replay
from support.distributed import all_cat
from support.hooks import Hooks
from support.runlog import append_jsonl

QUANTILES = (50, 90)          # request_hot_frac_pNN in metrics.jsonl, with the max


class Hotness(Hooks):
    """hotness.jsonl: a row per sequence of the global batch (its index, reward, response tokens, hotness
    per MoE layer and their mean, replay.sequence_hotness); the step's quantiles over its sequences."""

    def after_step(self, run, step: int, batch, rewards) -> dict:
        rewards = all_cat(rewards, run.d)                             # the global batch's order (every rank)
        n_experts = run.policy.master.config.num_experts
        rows = [request_row(step, i, batch, rewards[i].item(), n_experts) for i in range(batch.tokens.shape[0])]
        append_jsonl(run, step, "hotness.jsonl", rows)
        fracs = torch.tensor([r["expert_hot_frac"] for r in rows if r["expert_hot_frac"] is not None],
                             dtype=torch.float64)
        if not fracs.numel():                                         # a dense model: no routes
            return {}
        out = {f"request_hot_frac_p{q}": torch.quantile(fracs, q / 100).item() for q in QUANTILES}
        return {**out, "request_hot_frac_max": fracs.max().item()}


def request_row(step: int, i: int, batch, reward: float, n_experts: int) -> dict:
    """Sequence i's row: the busiest expert's share of its (token, slot) choices in each MoE layer, from
    its routes at the fed positions (Batch.route_mask), and their mean (expert_hot_frac)."""
    routes = batch.routes[i][batch.route_mask[i]]                     # (N, n_moe, k)
    hot = replay.sequence_hotness(routes, n_experts)
    hist = torch.tensor(hot["expert_hist"], dtype=torch.float64)      # (n_moe, E)
    per_layer = (hist.max(1).values / hist.sum(1).clamp(min=1)).tolist() if hist.numel() else []
    return {"step": step + 1, "sequence": i, "reward": reward, "response_tokens": int(batch.mask[i].sum()),
            "expert_hot_frac": hot["expert_hot_frac"], "layer_hot_frac": [round(x, 6) for x in per_layer]}
