"""The parallel plug-in's step hooks (support/hooks.py): token dropping's counts, the EP ranks' load, EPLB."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from model import MoE
from parallel import eplb, expert_parallel
from support.hooks import Hooks
from support.runlog import append_jsonl


class CapacityLimit:
    """--train_capacity_factor: under `with capacity_limit(limit, *models):` each of the models' MoE layers
    lets every expert take at most ceil(factor * M * k / E) of its M tokens' (token, slot) rows, kept in
    slot order (capacity_keep: earlier token positions of the flattened (B, T) batch first, padding
    included, then slots j ascending); a dropped row gets weight 0, so its token keeps the other
    experts' outputs (and the residual). Counts accumulate on the device (no host sync) until read."""

    def __init__(self, factor: float):
        self.factor, self.rows, self.dropped = factor, 0, 0

    def apply(self, ids: torch.Tensor, weights: torch.Tensor, n_experts: int) -> torch.Tensor:
        M, k = ids.shape
        keep = capacity_keep(ids, n_experts, math.ceil(self.factor * M * k / n_experts))
        self.rows, self.dropped = self.rows + M * k, self.dropped + (~keep).sum()
        return weights * keep

    def pop_metrics(self) -> dict:
        """The counts since the last call: dropped (token, slot) rows and their share of all rows."""
        dropped = float(self.dropped)
        out = {"capacity_dropped": dropped, "capacity_drop_frac": dropped / self.rows if self.rows else 0.0}
        self.rows, self.dropped = 0, 0
        return out


def capacity_keep(ids: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """Which (row, slot) pairs fit an expert capacity: ids (R, k) -> keep (R, k) bool.

    Each expert keeps its first `capacity` slots in slot order (s = row * k + j: earlier rows first,
    then the row's slots j ascending), the order kernels.sort_slots groups them in; the rest are dropped.
    Which rows are dropped depends on the whole batch by design: that is token dropping.
    """
    slot_expert = ids.reshape(-1)                                    # (R*k,)
    order = torch.sort(slot_expert, stable=True).indices             # grouped by expert, slot order inside
    counts = torch.bincount(slot_expert, minlength=n_experts)
    first = torch.cumsum(counts, 0) - counts                         # (E,) each expert's first sorted place
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=ids.device) - first[slot_expert[order]]
    return (rank < capacity).view(ids.shape)


def all_sum_counts(counts: list[int], d) -> list[int]:
    """Integer counts summed over the ranks (int64: exact)."""
    if d.world == 1:
        return counts
    t = torch.tensor(counts, dtype=torch.long, device=d.device)
    dist.all_reduce(t)
    return t.tolist()


@contextlib.contextmanager
def capacity_limit(limit: CapacityLimit, *models):
    """The models' MoE layers route under the limit inside the block: each layer's `route` (model.MoE.route)
    replaced by one that drops the overflow from its combine weights, the layer's own restored after."""
    layers = {id(m): m for model in models if model is not None for m in model.modules() if isinstance(m, MoE)}
    own = {i: moe.__dict__.get("route") for i, moe in layers.items()}   # a route set on the layer itself, if any
    for moe in layers.values():
        moe.route = _capped(moe, moe.route, limit)
    try:
        yield limit
    finally:
        for i, moe in layers.items():
            if own[i] is None:
                del moe.route                                         # the class's route again
            else:
                moe.route = own[i]


def _capped(moe: MoE, route, limit: CapacityLimit):
    def capped(logits, forced, detail):
        ids, weights, chosen, *extra = route(logits, forced, detail)
        return (ids, limit.apply(ids, weights, moe.n_experts), chosen, *extra)
    return capped


class TokenDropping(Hooks):
    """--train_capacity_factor: the trainer's counted forwards under capacity_limit (the trainer's module,
    the old policy's and the reference's); the step's drops, summed over the ranks (every rank calls: the
    limit exists from the start, forwards or not)."""

    def __init__(self, factor: float):
        self.limit = CapacityLimit(factor)

    def trainer_forward(self, run):
        p = run.policy
        return capacity_limit(self.limit, p.trainer, p.full, p.master, run.ref_model)

    def step_metrics(self, run, step: int, batch, audited) -> dict:
        c = self.limit
        c.rows, c.dropped = all_sum_counts([int(c.rows), int(c.dropped)], run.d)
        return c.pop_metrics()


class ExpertLayout(Hooks):
    """--expert_parallel / --expert_placement: this rank's EP group and experts (expert_parallel.layout, a
    collective), the model's MoE layers sharded onto them, whole experts gathered for a checkpoint."""

    def __init__(self):
        self.ep = None

    def experts(self, tcfg, n_experts: int, world: int):
        self.ep, experts = expert_parallel.layout(tcfg, n_experts, world)
        return experts

    def shard(self, model) -> None:
        if self.ep is not None:
            expert_parallel.shard_experts(model, self.ep, loaded=True)

    def whole_model(self, model):
        return expert_parallel.whole_model(model)


class DeviceLoad(Hooks):
    """--expert_parallel > 1: the audited forward's routed rows per EP rank (expert_parallel.device_load)."""

    def step_metrics(self, run, step: int, batch, audited) -> dict:
        ep = expert_parallel.of(run.policy.master)
        if ep is None:                                                # one rank: whole experts
            return {}
        return expert_parallel.device_load(audited.routes[batch.route_mask[audited.rows]], ep)


class Eplb(Hooks):
    """--eplb_redundant: the experts' replicas (eplb.Balancer), set before any forward; each step the load
    before / after and a re-plan when due (eplb.jsonl); diagnostics.jsonl's rows name the plan their step ran."""
    name = "eplb"

    def setup(self, run, resumed) -> None:
        ep = expert_parallel.of(run.policy.master)
        n_moe = len(run.policy.master.config.moe_layers)
        self.balancer = eplb.balancer(ep, run.tcfg, n_moe, resumed)

    def after_step(self, run, step: int, batch, rewards) -> dict:
        self.ran = self.balancer.plan_step                            # the layouts this step's forwards ran
        metrics, plans = self.balancer.step(step, batch, run.d.world)
        append_jsonl(run, step, "eplb.jsonl", plans)                  # a resume drops the rows past its step
        return metrics

    def diagnostics(self, rows: list[dict]) -> None:
        for row in rows:                                              # the step's own plan, not the next one's
            row["eplb_plan"] = self.ran

    def state_dict(self):
        return self.balancer.state_dict()
