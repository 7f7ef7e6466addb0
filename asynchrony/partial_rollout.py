"""Partial rollouts (--partial_rollout=true): a response unfinished at its batch's token budget is carried
over and continues in the next batch's generation, by the version current then, so one long response
does not hold its batch back (Kimi k1.5's partial rollouts; slime's and AReaL's).

    gen = PartialRollouts(task, sample, prompts_per_step=P, group_size=G, budget=T, max_new_tokens=N, context=C)
    ro = gen(j, version)              # a pipeline.Generate: batch j, P whole groups
    state = gen.state_dict()          # what is in flight, as plain data (saved with the pipeline's state)

The generation keeps P groups in flight (a batch's width, as without it) and runs in rounds. Before a
round the free slots take new prompts from the task's stream; in the round every unfinished sequence
draws at most T more tokens (one Sampler.generate with a budget per sequence: what a sequence draws is a
function of the sequence alone, not of the batch, the KV pool or preemption, so the engine's settings
stay free on resume); a group whose members have all ended (a stop token, max_new_tokens, the context)
leaves its slot for the queue of whole groups. Batch j is the queue's first P groups (the oldest first:
carried groups before new ones) as soon as it holds P, so the trained batch keeps its size; the rest,
the groups in their slots and the whole ones past P, is carried to batch j + 1. Advantages need whole
groups: a group's ended members wait for the others as they were recorded.

A carried sequence goes on by a prefill of its prompt and its tokens so far under the round's weights:
its KV is recomputed, never kept across batches (the checkpoint then holds plain data, and no KV block
is held through an update). Within a batch the rounds run by the same weights, so the prefix cache (on
by default) serves the full blocks the round before computed: only a sequence's last block is prefilled
again, with a cold run's bits. The tokens it drew before keep their recorded bits (log-probs and routes:
the behaviour policy's) and versions; each new token records the version that drew it (token_versions)
and the oldest version of the KV it was drawn on (kv_versions: the round's own after the recompute,
older where an in-flight keep_kv update landed in the round). The contract covers the tokens whose two
versions agree: the trainer's forward of the whole sequence at that version recomputes their log-probs
and the routes that drew them bitwise; a token drawn on older KV is no single version's function
(tests/test_pipeline.py, with that control).

Staleness: an unfinished sequence draws T tokens a round and each batch runs at least one round, so a
group ends within ceil(N / T) batches' generations and waits at most one more in the queue: its oldest
token is at most K + ceil(N / T) updates old when it is trained on. Round r's draws are keyed by (seed,
r) and each sequence's place in the round, so a run is the same bits every time, and a resume (the
groups in their slots and in the queue, the round count, the task's stream) continues it exactly. With
T >= N every group ends in its first round: each batch is one round of P new prompts keyed as batch j,
the loop without partial rollouts bit for bit.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from config import ConfigError
from rollout import SequenceOutput
from support.hooks import Rollout
from support.tasks import Example

UNFINISHED = "partial"      # an in-flight output's finish_reason until its sequence ends ("stop" / "length")

# sample(j, prompts, max_new_tokens (one per prompt), draw=r, version=v, on_step=..., recompute_kv=...)
#   -> (outputs, the sampler's counters): one Sampler.generate under the run's settings (train.sample)
Sample = Callable[..., tuple[list[SequenceOutput], dict]]


@dataclasses.dataclass
class Group:
    """One prompt's group_size sequences in flight: each one's output so far (None before its first round)."""
    example: Example
    outs: list[SequenceOutput | None]
    born: int                   # the batch whose generation drew its prompt
    carried: int = 0            # its tokens drawn before the generation of the batch under way

    def unfinished(self) -> list[int]:
        return [m for m, o in enumerate(self.outs) if o is None or o.finish_reason == UNFINISHED]


class PartialRollouts:
    """Batch j's P whole groups, from the groups in flight; see the module docstring."""

    def __init__(self, task, sample: Sample, prompts_per_step: int, group_size: int, budget: int,
                 max_new_tokens: int, context: int):
        if task.episodic:
            raise ConfigError("--partial_rollout carries single responses over; this task's episodes hold "
                              "environments it cannot carry: drop --partial_rollout")
        self.task, self.sample = task, sample
        self.P, self.G, self.T, self.N, self.context = prompts_per_step, group_size, budget, max_new_tokens, context
        self.slots: list[Group] = []      # the unfinished groups, oldest first (at most P)
        self.ready: list[Group] = []      # whole groups not trained on yet, in the order they ended
        self.rounds = 0                   # rounds run so far: round r's draws are keyed by r

    @classmethod
    def of(cls, run, sample: Sample, max_new_tokens: int) -> "PartialRollouts":
        """A run's (train.py): its task, its sample, --rollout_token_budget (0: max_new_tokens // 2)."""
        tcfg = run.tcfg
        return cls(run.task, sample, tcfg.prompts_per_step, tcfg.group_size,
                   tcfg.rollout_token_budget or max(1, max_new_tokens // 2), max_new_tokens,
                   run.policy.master.config.max_position_embeddings)

    def __call__(self, j: int, version: int, on_step=None, recompute_kv: bool = False) -> Rollout:
        """Batch j: rounds by `version` (then by the one an in-flight update brings, on_step) until P groups
        are whole; -> those P groups, with the batch's partial_* metrics."""
        t0 = time.perf_counter()
        for g in self.slots + self.ready:
            g.carried = sum(len(o.tokens) for o in g.outs if o is not None)
        now = [version]                                               # the weights' version, as the rounds go
        hook = None if on_step is None else _tracking(on_step, now)
        counters = []
        while len(self.ready) < self.P:
            self.slots += [Group(ex, [None] * self.G, j) for ex in self.task.sample(self.P - len(self.slots))]
            counters.append(self._round(j, now[0], hook, recompute_kv, time.perf_counter() - t0))
        batch, self.ready = self.ready[:self.P], self.ready[self.P:]
        metrics = {"partial_carried_seqs": self.G * sum(g.born < j for g in batch),
                   "partial_carried_tokens": sum(g.carried for g in batch),
                   "partial_pending_seqs": self.G * (len(self.slots) + len(self.ready)),
                   "partial_rounds": len(counters)}
        return Rollout([g.example for g in batch], [o for g in batch for o in g.outs], None, version,
                       time.perf_counter() - t0, summed(counters), metrics)

    def _round(self, j: int, version: int, on_step, recompute_kv: bool, start: float) -> dict:
        """Every unfinished sequence draws up to T more tokens, on the KV its prefill recomputes; the groups
        whole then move from their slots to the queue. start: the round's offset in the batch's generation.
        -> the sampler's counters."""
        todo = [(g, m) for g in self.slots for m in g.unfinished()]
        so_far = [[] if g.outs[m] is None else g.outs[m].tokens for g, m in todo]
        budgets = [min(self.T, self._cap(g) - len(t)) for (g, _), t in zip(todo, so_far)]
        outs, counters = self.sample(j, [g.example.prompt + t for (g, _), t in zip(todo, so_far)], budgets,
                                     draw=self.rounds, version=version, on_step=on_step, recompute_kv=recompute_kv)
        self.rounds += 1
        for (g, m), new in zip(todo, outs):
            out = extend(g.outs[m], new, start)
            ended = out.finish_reason == "stop" or len(out.tokens) >= self._cap(g)
            g.outs[m] = out if ended else dataclasses.replace(out, finish_reason=UNFINISHED)
        self.ready += [g for g in self.slots if not g.unfinished()]
        self.slots = [g for g in self.slots if g.unfinished()]
        return counters

    def _cap(self, g: Group) -> int:
        """A sequence's whole budget of new tokens: max_new_tokens, within the context (at least 1: a prompt
        that fills the context is the sampler's to refuse, in its words)."""
        return max(1, min(self.N, self.context - len(g.example.prompt)))

    def state_dict(self) -> dict:
        """What is in flight, as plain data: the groups in their slots and in the queue, the rounds run and
        the task's stream after them (a resumed rollout rank draws on from there: pipeline.serve)."""
        return {"slots": [group_state(g) for g in self.slots], "ready": [group_state(g) for g in self.ready],
                "rounds": self.rounds, "task": self.task.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.slots = [group_from_state(g) for g in state["slots"]]
        self.ready = [group_from_state(g) for g in state["ready"]]
        self.rounds = state["rounds"]
        self.task.load_state_dict(state["task"])


def extend(before: SequenceOutput | None, new: SequenceOutput, start: float = 0.0) -> SequenceOutput:
    """A sequence's output so far continued by `new`, which was generated from its prompt and its tokens so
    far: the earlier tokens keep their recorded log-probs, routes and versions; new's routes take over at
    the earlier last token's position (fed first in this round, its route drew new's first token). start:
    the round's offset in the batch's generation (finish_time counts from the batch's start)."""
    if before is None:
        return dataclasses.replace(new, finish_time=new.finish_time + start)
    n = len(before.tokens)
    cut = len(before.prompt) + n - 1                                  # before's fed positions: [0, cut)

    def join(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:   # (positions, ...) each
        return None if a is None else torch.cat([a, b[cut:]])
    return SequenceOutput(before.prompt, before.tokens + new.tokens, before.logprobs + new.logprobs,
                          join(before.routes, new.routes), new.finish_reason, join(before.route_weights, new.route_weights),
                          join(before.route_margins, new.route_margins), policy_mask=before.policy_mask + new.policy_mask,
                          turns=[(0, n + len(new.tokens))], weights_version=new.weights_version,
                          finish_time=new.finish_time + start, token_versions=before.token_versions + new.token_versions,
                          kv_versions=before.kv_versions + new.kv_versions)


def summed(parts: list[dict]) -> dict:
    """The rounds' sampler counters as the batch's: the counts added, the rates of the sums."""
    from support.distributed import sampler_rates
    out = {k: sum(p[k] for p in parts) for k in parts[0]}
    return out | sampler_rates(out)


def _tracking(on_step, now: list[int]):
    """on_step, remembering the version an in-flight update brings: the rounds after it sample by that one."""
    def hook():
        version = on_step()
        if version is not None:
            now[0] = version
        return version
    return hook


def group_state(g: Group) -> dict:
    outs = [None if o is None else dataclasses.asdict(o) for o in g.outs]
    return {"example": dataclasses.asdict(g.example), "outs": outs, "born": g.born, "carried": g.carried}


def group_from_state(state: dict) -> Group:
    outs = [None if o is None else SequenceOutput(**o) for o in state["outs"]]
    return Group(Example(**state["example"]), outs, state["born"], state["carried"])
