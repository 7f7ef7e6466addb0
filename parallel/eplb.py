"""EPLB: redundant experts placed by measured load under expert parallelism (--eplb_redundant=R).

    layout = place(load, n_extra=R)                  # load (N, E): rows group rank s sent to expert e
    b = balancer(ep, tcfg, n_moe)                    # parallel/hooks.Eplb.setup: sets ep.eplb, the layouts
    metrics, rows = b.step(step, batch, world)       # each step: the load before / after; a re-plan

Under EP a layer's exchange waits for its busiest rank, and the routes are skewed: a few hot experts
take several times the mean's rows. As DeepSeek's EPLB does, R more physical slots per MoE layer hold
replicas of the most loaded logical experts, and all E + R slots are packed onto the N ranks, (E+R)/N
each, so that every rank computes about the mean's rows:
1. replicas: R times, the expert whose heaviest slot is the heaviest (ties: fewer slots, then the lower
   id) gets one more slot, up to N. A source rank sends all its rows of expert e to one slot, s % r_e
   (expert_parallel.Placement), so a slot's load is the rows of its sources;
2. packing: the slots by load, heaviest first, each onto the least loaded rank with room, preferring a
   rank that does not hold that expert yet (ties: the lower rank); a rank's slots in expert order.
The load is measured: per MoE layer, the (token, slot) rows of the rollouts since the last plan, each
counted at the group rank that sampled its sequence (the rollout is most of a step's MoE rows). The
first plan, before any measure, takes every (source, expert) pair alike. Why no bit moves under any
layout: parallel/expert_parallel.py's docstring; the rule and its costs: docs/design.md, "Redundant experts by
measured load (EPLB)".
"""
from __future__ import annotations

import math

import torch

from config import ConfigError
from parallel.expert_parallel import ExpertParallel, Placement, Replicas


def check(n_extra: int, n: int, n_experts: int) -> None:
    """--eplb_redundant=R against the model (config.py checks the flags alone): the E + R slots split
    evenly over the N ranks of a group, at most N slots an expert (one per source rank)."""
    if n_extra and (n_experts + n_extra) % n:
        raise ConfigError(f"--eplb_redundant={n_extra}: the {n_experts} experts and {n_extra} replicas must split "
                          f"evenly over the --expert_parallel={n} ranks (E + R divisible by {n})")
    if n_extra > n_experts * (n - 1):
        raise ConfigError(f"--eplb_redundant={n_extra}: at most {n_experts * (n - 1)}, each of the {n_experts} "
                          f"experts on at most {n} slots (one per source rank)")


# ---------------------------------------------------------------------------------------------------
# the plan: replicas, then packing
# ---------------------------------------------------------------------------------------------------
def slot_loads(col: list[int], r: int) -> list[int]:
    """col[s]: the rows source rank s sends to an expert -> the rows each of its r slots computes."""
    return [sum(col[j::r]) for j in range(r)]


def replica_counts(cols: list[list[int]], n_extra: int, n: int) -> list[int]:
    """cols[e][s]: rows of expert e from source s -> each expert's number of slots (n_extra more in all)."""
    r = [1] * len(cols)
    for _ in range(n_extra):
        e = max((e for e in range(len(cols)) if r[e] < n), key=lambda e: (max(slot_loads(cols[e], r[e])), -r[e], -e))
        r[e] += 1
    return r


def pack(items: list[tuple[int, int, int]], n: int) -> list[list[tuple[int, int]]]:
    """items (load, expert, replica index j) -> per rank the (expert, j) it holds, len(items) / n each:
    heaviest first onto the least loaded rank with room (one not holding the expert yet if it can)."""
    per, held, loads = len(items) // n, [[] for _ in range(n)], [0] * n
    for load, e, j in sorted(items, key=lambda t: (-t[0], t[1], t[2])):
        q = min((q for q in range(n) if len(held[q]) < per),
                key=lambda q: (any(x == e for x, _ in held[q]), loads[q], q))
        held[q].append((e, j))
        loads[q] += load
    return [sorted(h) for h in held]


def place(load: torch.Tensor, n_extra: int) -> Placement:
    """load (N, E) int: the rows group rank s sent to logical expert e -> the layout of the E + n_extra
    slots (replica j of expert e is the slot its sources s with s % r_e == j use)."""
    L = load.tolist()
    N, E = len(L), len(L[0])
    cols = [[L[s][e] for s in range(N)] for e in range(E)]
    r = replica_counts(cols, n_extra, N)
    held = pack([(load_j, e, j) for e in range(E) for j, load_j in enumerate(slot_loads(cols[e], r[e]))], N)
    per = (E + n_extra) // N
    slot = {item: q * per + i for q, items in enumerate(held) for i, item in enumerate(items)}
    return Placement(tuple(slot[(e, 0)] for e in range(E)), N,
                     tuple((e, slot[(e, j)]) for e in range(E) for j in range(1, r[e])))


# ---------------------------------------------------------------------------------------------------
# the measure
# ---------------------------------------------------------------------------------------------------
def measured_load(routes: torch.Tensor, mask: torch.Tensor, world: int, n: int, n_experts: int) -> torch.Tensor:
    """The rollout's rows by (MoE layer, source rank in its EP group, logical expert): routes (B, T,
    n_moe, k) logical ids of the global batch (rank r sampled rows r*B/world ...), mask (B, T) the
    recorded positions -> (n_moe, N, E) int64, summed over the EP groups."""
    B, n_moe = routes.shape[0], routes.shape[2]
    source = (torch.arange(B) // (B // world)) % n                    # (B,) the group rank that sampled it
    ids = routes[mask].long()                                         # (tokens, n_moe, k)
    at = source[:, None].expand(mask.shape)[mask][:, None] * n_experts   # (tokens, 1) the source's first key
    out = []
    for j in range(n_moe):
        key = at + ids[:, j]                                          # (tokens, k) source * E + expert
        out.append(torch.bincount(key[ids[:, j] >= 0], minlength=n * n_experts).view(n, n_experts))
    return torch.stack(out) if out else torch.zeros(0, n, n_experts, dtype=torch.long)


def imbalance(layouts: list[Placement], load: torch.Tensor) -> float:
    """Each layer's exchange waits for its busiest rank: over the layers, the busiest rank's rows summed,
    over the mean rank's summed (1.0: balanced; nan: no rows). load (n_moe, N, E)."""
    rows = torch.stack([pl.rank_rows(part) for pl, part in zip(layouts, load)]).double()   # (n_moe, N)
    total = rows.sum().item()
    return rows.max(-1).values.sum().item() / (total / rows.shape[1]) if total else math.nan


# ---------------------------------------------------------------------------------------------------
# a run's balancer
# ---------------------------------------------------------------------------------------------------
def balancer(ep: ExpertParallel | None, tcfg, n_moe: int, resumed=None) -> "Balancer | None":
    """The run's Balancer under --eplb_redundant (None when off), on resume (checkpoint.Resumed) from
    the saved state. Made before any forward: the MoE layers run ep.eplb's layouts from the first."""
    if not tcfg.eplb_redundant:
        return None
    out = Balancer(ep, n_moe, tcfg.eplb_redundant, tcfg.eplb_interval)
    if resumed is not None:
        out.resume(resumed.start, resumed.plugins.get("eplb"))
    return out


class Balancer:
    """A run's EPLB: the layouts its MoE layers run (ep.eplb), the load measured since the last plan,
    a re-plan every `interval` steps, eplb.jsonl's rows (one per plan) and the step's metrics."""

    def __init__(self, ep: ExpertParallel, n_moe: int, n_extra: int, interval: int):
        self.ep, self.n_extra, self.interval = ep, n_extra, interval
        N, E = ep.size, ep.placement.n_experts
        self.load = torch.zeros(n_moe, N, E, dtype=torch.long)      # since the last plan
        ep.eplb = Replicas([place(torch.ones(N, E, dtype=torch.long), n_extra)] * n_moe)
        self.plan_step = 0                                           # the step whose load made the layouts
        self.rows = [self.plan_row()]                                # eplb.jsonl's rows not yet written

    def step(self, step: int, batch, world) -> tuple[dict, list[dict]]:
        """After step `step`'s forwards: its rollout's load under the home placement and the layouts it
        ran (the metrics), then the re-plan if one is due (the next step's forwards run it). -> the metrics
        and eplb.jsonl's new rows (the caller writes them: runlog owns the run's files)."""
        load = measured_load(batch.routes, batch.route_mask, world, self.ep.size, self.ep.placement.n_experts)
        out = {"eplb_imbalance_before": imbalance([self.ep.placement] * len(load), load),
               "eplb_imbalance_after": imbalance(self.ep.eplb.layouts, load)}
        self.load += load
        if (step + 1) % self.interval == 0:
            self.ep.eplb.set([place(part, self.n_extra) for part in self.load])
            self.plan_step = step + 1
            self.rows.append(self.plan_row(self.load))
            self.load = torch.zeros_like(self.load)
        rows, self.rows = self.rows, []
        return out, rows

    def plan_row(self, load: torch.Tensor | None = None) -> dict:
        """eplb.jsonl's row of the layouts now: from step plan_step + 1 on, per MoE layer the physical
        slots of each logical expert, the rank of each slot, and the load planned from (null: the first)."""
        layers = []
        for j, pl in enumerate(self.ep.eplb.layouts):
            slots = [list(pl.slots_of(e)) for e in range(pl.n_experts)]
            planned = math.nan if load is None else imbalance([pl], load[j:j + 1])
            layers.append({"slots": slots, "ranks": [[p // pl.per_rank for p in s] for s in slots],
                           "load": None if load is None else load[j].sum(0).tolist(),
                           "imbalance_planned": planned if math.isfinite(planned) else None})   # strict JSON
        return {"step": self.plan_step, "layers": layers}

    def state_dict(self) -> dict:
        return {"plan_step": self.plan_step, "load": self.load.tolist(), "shape": [self.ep.size, self.n_extra],
                "layouts": [[list(pl.table), [list(r) for r in pl.replicas]] for pl in self.ep.eplb.layouts]}

    def resume(self, start: int, state: dict | None) -> None:
        """The layouts, the load since their plan and its step, as saved at step `start`. A checkpoint
        written without EPLB, or at another EP degree or R, starts from the first plan (the bits are the
        same under any layout; only the eplb metrics and eplb.jsonl see it)."""
        if state is None or state["shape"] != [self.ep.size, self.n_extra]:
            self.plan_step, self.rows = start, [self.plan_row()]
            return
        self.plan_step, self.load, self.rows = state["plan_step"], torch.tensor(state["load"], dtype=torch.long), []
        self.ep.eplb.set([Placement(tuple(t), self.ep.size, tuple(map(tuple, r))) for t, r in state["layouts"]])
