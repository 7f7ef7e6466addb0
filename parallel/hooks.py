"""The parallel plug-in's step hooks (support/hooks.py): token dropping's counts, the EP ranks' load, EPLB."""
from __future__ import annotations

from model import CapacityLimit, capacity_limit
from parallel import eplb, expert_parallel
from support.distributed import all_sum_counts
from support.hooks import Hooks
from support.runlog import append_jsonl


class TokenDropping(Hooks):
    """--train_capacity_factor: the trainer's counted forwards under model.capacity_limit; the step's drops,
    summed over the ranks (every rank calls: the limit exists from the start, forwards or not)."""

    def __init__(self, factor: float):
        self.limit = CapacityLimit(factor)

    def trainer_forward(self, run):
        return capacity_limit(self.limit)

    def step_metrics(self, run, step: int, batch, audited) -> dict:
        c = self.limit
        c.rows, c.dropped = all_sum_counts([int(c.rows), int(c.dropped)], run.d)
        return c.pop_metrics()


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
