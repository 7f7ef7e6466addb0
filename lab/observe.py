"""The lab's observations of every request: how concentrated each sequence's routing is (--log_hotness),
and where in a response the train-rollout gap lies (--mismatch_split).

A request whose tokens all go to a few experts loads those experts' ranks (the third article's "per-request
expert hotness"). diagnostics.jsonl has it only for the most mismatched sequences; Hotness measures every
sequence of the step, from the rollout's routes at the positions the sampler fed. "Long responses and
multi-turn rollouts amplify the mismatch" (the first and third articles) is a claim about position:
MismatchSplit measures the step's gap per bucket of a token's index in its response and per episode turn.
Each costs nothing when off.
"""
from __future__ import annotations

import torch

import replay
from support.distributed import all_cat
from support.hooks import Hooks
from support.runlog import append_jsonl

QUANTILES = (50, 90)          # request_hot_frac_pNN in metrics.jsonl, with the max
POSITIONS = (8, 32, 128)      # the response-index buckets' upper ends: 1-8, 9-32, 33-128, later
TURNS = 4                     # turns 1, 2, 3, and 4 and later


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


class MismatchSplit(Hooks):
    """The step's audit (the forward metrics.jsonl's train-rollout keys come from) split into buckets:
    kl_by_position, extreme_by_position, flips_by_position (a response token's index, over every turn's
    policy tokens) and kl_by_turn, extreme_by_turn, flips_by_turn; None where a bucket holds no token."""

    def step_metrics(self, run, step: int, batch, audited) -> dict:
        sub = batch.select(audited.rows)
        index, turn = token_places(sub.mask, sub.observed)
        buckets = {"position": torch.bucketize(index, torch.tensor(POSITIONS)),   # 1-8 -> 0, 9-32 -> 1, ...
                   "turn": turn.clamp(max=TURNS) - 1}
        n_experts = run.policy.master.config.num_experts
        out = {}
        for name, which in buckets.items():
            cells = [gap(audited, sub, (which == b) & sub.mask.bool(), n_experts)
                     for b in range(len(POSITIONS) + 1 if name == "position" else TURNS)]
            for i, key in enumerate(("kl", "extreme", "flips")):
                out[f"{key}_by_{name}"] = [None if c is None else c[i] for c in cells]
        return out


def token_places(mask: torch.Tensor, observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each log-prob column j (it scores token j + 1), (B, T-1) each: the token's index among its
    sequence's policy tokens, from 1 (every turn's, in order), and its turn, from 1 (1 + the observation
    segments before it; a single-turn response is turn 1)."""
    index = mask.long().cumsum(1)
    obs = observed.bool()
    starts = obs & ~torch.nn.functional.pad(obs, (1, 0))[:, :-1]       # where an observation segment begins
    turn = 1 + starts.long().cumsum(1)[:, 1:]
    return index, turn


def gap(audited, sub, m: torch.Tensor, n_experts: int) -> tuple[float, float, float] | None:
    """(mean k3 KL, extreme-token fraction, route-flip fraction) over the tokens m (B, T-1); None if none."""
    if not m.any():
        return None
    kl = replay.mismatch_metrics(audited.logp, sub.rollout_logp, m)
    at = torch.zeros(m.shape[0], m.shape[1] + 1, dtype=torch.bool)
    at[:, :-1] = m & sub.route_mask[:, :-1]                           # position j's route scores token j + 1
    flips = replay.route_audit(sub.routes, audited.routes, at, n_experts).get("route_flip_frac", 0.0)
    return kl["train_rollout_k3"], kl["extreme_token_frac"], flips
