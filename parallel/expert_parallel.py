"""Expert parallelism: each rank of an EP group holds E/N experts of every MoE layer; tokens travel to them.

    ep = init_expert_parallel(2)                 # under torchrun: EP groups of 2 consecutive ranks
    shard_experts(model, ep)                     # keep this rank's E/N experts only (EXPERT_TENSORS)
    logp, routes = model.score(tokens)           # the same bits as at EP=1, routes as logical expert ids
    state = gather_experts(model, ep)            # whole experts on rank 0 (for saving in the HF layout)

How a MoE layer runs under EP (moe_experts below), and why it gives EP=1's bits:
* the router runs on the token's own rank; routes are logical expert ids everywhere outside this file,
  and the Placement table maps a logical id to (owner rank, local index);
* the token's rank sorts its (token, slot) rows by logical expert exactly as kernels.moe_experts does,
  groups them by owner rank (a stable sort) and sends the rows, their routing weights and local expert
  ids with all_to_all_single (row counts are exchanged first: prefill and training only);
* each owner runs kernels.grouped_experts on what it received: per expert, the row-chunked linear, whose
  bits for a row depend neither on the other rows nor on the row's position among them;
* the per-slot fp32 outputs go back the same way, and the token's rank puts them in slot order and sums
  them with kernels.combine_slots: a fixed-order fp32 sum over k, then one rounding to the model dtype.
So a token's bits depend neither on the EP degree, nor on the placement, nor on the tokens it shares an
expert with. A layer's experts are the tensors EXPERT_TENSORS names (gpt-oss's biases b13, b2 beside
w13, w2), cut, gathered, exchanged and saved together; the owner runs them with the layer's GLU
(kernels.py's clamped SwiGLU for gpt-oss), as at EP=1. The backward runs the exchanges in reverse
(Exchange below): gradients of x and of the routing weights return to the token's rank, the expert
tensors' gradients stay with their owner.

EPLB (--eplb_redundant=R; parallel/eplb.py plans the layouts, this file runs them): each MoE layer has E + R
physical slots, replicas of its most loaded experts among them, (E+R)/N a rank (ExpertParallel.eplb,
a Placement per layer). The trained weights stay as the placement puts them, E/N a rank, so the
optimizer, checkpoints and FSDP2 never see a replica; each model copy that runs a forward gathers its
slots' weights from their home ranks (exact copies) at its first forward after a weight update or a
re-plan (_layout). A replica computes the original's bits (the same weights, the same row-invariant
expert kernel): routes and log-probs do not move. A source rank sends all its rows of an expert to one
slot (Placement), so a slot's weight gradient from one source is EP=1's gradient of that micro-batch;
under the exact gradient sum these pieces are folded home as integer limbs (fold_slots, called by
exact_sum.Reducer), and the update is the one without replicas, bit for bit.

Run: tests/test_expert_parallel.py launches tests/ep_check.py and tests/eplb_check.py with torchrun
(gloo on the CPU).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

import kernels
from config import ConfigError
from model import expert_group
from support.distributed import unsharded
from support.exact_sum import Limbs, Reducer, all_reduce_limbs

# A MoE layer's stacked expert tensors, (E, ...) each: the weights, then gpt-oss's biases where the layer
# has them (model.MoE: b13 (E, 2I), b2 (E, D)), then LoRA's adapters stacked by expert where it adds them
# (lora/adapters.py; their rows are experts too). Wherever experts are cut, kept, gathered, exchanged or
# saved, all of them are.
EXPERT_TENSORS = ("w13", "w2", "b13", "b2", "lora_A13", "lora_B13", "lora_A2", "lora_B2")


# ---------------------------------------------------------------------------------------------------
# placement: logical expert id -> its physical slot(s) -> (owner rank, local index)
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Placement:
    """table[e] is the physical slot of logical expert e; `replicas` (EPLB) adds (e, slot) pairs, more
    slots computing e, so e lives at slots_of(e) = (table[e], its replicas' slots in the order given).
    The S = E + R slots are spread evenly: slot p lives on rank p // (S/N), local index p % (S/N).
    Without replicas table is a permutation; the identity is the contiguous placement: rank r owns
    [r*E/N, (r+1)*E/N). A row of expert e sent by rank s of the EP group goes to slot
    slots_of(e)[s % len(slots_of(e))]: all of one source's rows of an expert on one slot, so that a
    micro-batch's gradient of an expert is computed whole, EP=1's bits (module docstring)."""
    table: tuple[int, ...]
    ep_size: int
    replicas: tuple[tuple[int, int], ...] = ()
    _on: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)   # device -> (N, E) slots

    def __post_init__(self):
        E, S, N = len(self.table), self.n_slots, self.ep_size
        if N < 1 or S % N:
            raise ConfigError(f"a placement of {S} expert slots over {N} ranks: {N} must divide {S}")
        if not self.replicas and sorted(self.table) != list(range(E)):
            raise ConfigError(f"expert placement {list(self.table)}: not a permutation of 0..{E - 1}")
        if sorted([*self.table, *(p for _, p in self.replicas)]) != list(range(S)):
            raise ConfigError(f"expert placement: the slots of {E} experts and {S - E} replicas are not "
                              f"0..{S - 1} once each")
        if any(not 0 <= e < E for e, _ in self.replicas) or max(map(len, map(self.slots_of, range(E)))) > N:
            raise ConfigError(f"expert replicas {list(self.replicas)}: of experts 0..{E - 1}, at most {N} slots each")

    @classmethod
    def contiguous(cls, n_experts: int, ep_size: int) -> "Placement":
        return cls(tuple(range(n_experts)), ep_size)

    @property
    def n_experts(self) -> int:
        return len(self.table)

    @property
    def n_slots(self) -> int:
        return len(self.table) + len(self.replicas)

    @property
    def per_rank(self) -> int:
        return self.n_slots // self.ep_size

    def slots_of(self, e: int) -> tuple[int, ...]:
        return (self.table[e], *(p for r, p in self.replicas if r == e))

    def routing(self) -> list[list[int]]:
        """(N, E): the slot that rank s of the group sends its rows of expert e to (the class docstring)."""
        slots = [self.slots_of(e) for e in range(self.n_experts)]
        return [[s_e[s % len(s_e)] for s_e in slots] for s in range(self.ep_size)]

    def physical(self, ids: torch.Tensor, source: int = 0) -> torch.Tensor:
        """The physical slot of each logical id (any shape) sent by group rank `source`; the table is
        copied to a device once, so the decode step makes no host-to-device copy."""
        if ids.device not in self._on:
            self._on[ids.device] = torch.tensor(self.routing(), device=ids.device)
        return self._on[ids.device][source][ids]

    def owner(self, ids: torch.Tensor, source: int = 0) -> torch.Tensor:
        """The rank computing each logical expert id (any shape) for rows from `source`."""
        return self.physical(ids, source) // self.per_rank

    def local(self, ids: torch.Tensor, source: int = 0) -> torch.Tensor:
        """Each logical expert's slot index inside its owner's shard, for rows from `source`."""
        return self.physical(ids, source) % self.per_rank

    def experts_of(self, rank: int) -> list[int]:
        """The logical expert of each slot rank holds, in its local order (shard row j computes expert
        experts_of(rank)[j]; with replicas an expert may be held by several ranks)."""
        held = [0] * self.n_slots
        for e, p in [*enumerate(self.table), *self.replicas]:
            held[p] = e
        return held[rank * self.per_rank:(rank + 1) * self.per_rank]

    def rows_per_rank(self, routes: torch.Tensor) -> torch.Tensor:
        """Device load: (token, slot) rows each rank computes for these routes (any shape of logical
        ids, -1 for padding) -> (ep_size,) int64. Routes of one MoE layer give that layer's load."""
        ids = routes[routes >= 0]
        return torch.bincount(self.owner(ids).reshape(-1), minlength=self.ep_size)

    def rank_rows(self, load: torch.Tensor) -> torch.Tensor:
        """load (N, E): rows group rank s sends to logical expert e -> (N,) int64, the rows each rank
        computes under this placement's routing."""
        owner = torch.tensor(self.routing()) // self.per_rank                            # (N, E)
        return torch.zeros(self.ep_size, dtype=torch.long).scatter_add_(0, owner.reshape(-1), load.reshape(-1).long())


class Replicas:
    """EPLB's compute layout (--eplb_redundant): per MoE layer a Placement of the E + R slots with
    replicas (parallel/eplb.py plans them from the measured load). Each model copy that runs a forward keeps its
    slots' weights, (S/N, ...) of each expert tensor gathered from the home shards (ExpertParallel.placement, the
    trained ones), and gathers them again at its first forward after `version` moved: the weights
    changed (weights_changed) or the layouts did (set)."""

    def __init__(self, layouts: list[Placement]):
        self.layouts, self.version = list(layouts), 0
        self.copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # MoE module -> (version, {name: slots})

    def set(self, layouts: list[Placement]) -> None:
        if [(p.n_slots, p.ep_size) for p in layouts] != [(p.n_slots, p.ep_size) for p in self.layouts]:
            raise ValueError("an EPLB layout must keep the number of slots and ranks")
        self.layouts = list(layouts)
        self.version += 1


@dataclasses.dataclass
class ExpertParallel:
    """This rank's place in its EP group: the placement, the group (None: the default group) and the
    rank inside it; `replicas`, the ranks holding the same shard in the other EP groups (None: the
    default group; never used when there is only one EP group, n_replicas == 1)."""
    placement: Placement
    rank: int
    group: object = None
    replicas: object = None
    n_replicas: int = 1
    capacity: int = 0        # > 0: the sampler's decode step, fixed buffers of this many rows per destination
    host: object = None      # the EP group on gloo, for the sampler's per-step agreement (None: group itself)
    mesh: object = None      # FSDP2's DeviceMesh of the replicas (replica_mesh), made when first asked for
    grad_sink: object = None  # --grad_reduce=exact: exact_sum.Reducer, which takes each source's expert
                              # weight gradient apart (_owner_rows)
    eplb: Replicas | None = None   # --eplb_redundant > 0: the layers' layouts with replicas (None: placement)

    @property
    def size(self) -> int:
        return self.placement.ep_size

    def __deepcopy__(self, memo):
        return self                     # a model copy (the sampler's, the reference) shares the groups

    # the core's calls (support/checkpoint.py, support/distributed.py): through the object a sharded model
    # holds (model.expert_group), so the core imports nothing of this plug-in
    def gather_optimizer_state(self, opt, model, opt_state: dict) -> dict:
        return gather_optimizer_state(opt, model, opt_state)

    def shard_optimizer_state(self, opt, model, opt_state: dict) -> dict:
        return shard_optimizer_state(opt, model, opt_state)

    def expert_names(self, model: nn.Module) -> list[str]:
        return [n for n, _ in model.named_parameters() if is_expert(n)]

    def split_params(self, model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        return split_params(model)

    def reduce_grads(self, experts: list[nn.Parameter], world: int, device=None) -> None:
        reduce_expert_grads(experts, self, world, device)

    def finish_grads(self, model: nn.Module, max_norm: float, world: int, *, fsdp: bool, reduced: bool) -> float:
        """--grad_reduce=fast's end of a minibatch (support/distributed.finish_grads): the expert shards'
        gradients averaged as DDP averages the rest (FSDP2 averaged them over the replicas: divided by N
        here; reduced: mixed precision reduced its expert masters already), the norm over the whole
        model, clipped -> the norm before clipping."""
        dense, experts = split_params(model)
        if fsdp:
            for p in experts:
                if p.grad is not None:
                    p.grad.div_(self.size)
        elif not reduced:
            reduce_expert_grads(experts, self, world)
        return clip_grad_norm(dense, experts, max_norm, self)

    def exact_reducer(self, masters: nn.Module, d, **kw):
        """--grad_reduce=exact's Reducer of a model with expert shards (ExpertSums)."""
        experts = {id(p) for p in split_params(masters)[1]}
        return ExpertSums(masters, d, ep=self, experts=experts, **kw)

    def gather_experts(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        return gather_experts(model, self)

    def replica_mesh(self, device_type: str):
        return replica_mesh(self, device_type)

    def weights_changed(self, model: nn.Module) -> None:
        weights_changed(model)

    def slot_bytes(self, model: nn.Module) -> int:
        return slot_bytes(model)

    def sampler_step(self, model: nn.Module, runner, step, sp) -> tuple[bool, list | None]:
        """One engine step of the sampler (rollout.Sampler._run) on this rank of the group: step None
        when nothing is left here -> (every rank is done, the runner's finished sequences or None). The
        group agrees first (group_step), then runs its step, or the exchanges alone with zero rows."""
        all_done, prefill = group_step(step is None, step is not None and step.is_prefill, self)
        if all_done:
            return True, None
        # decode: fixed-size exchange buffers (no counts); a step with a prefill in the group: counted
        self.capacity = 0 if prefill else runner.max_batch_size * model.config.num_experts_per_tok * \
            (1 + runner.speculative_tokens)                           # a verify step feeds k + 1 tokens a row
        try:
            if step is None:
                idle_step(model)
                return False, None
            return False, runner.run(step, sp)
        finally:
            self.capacity = 0


def check_degree(n: int, n_experts: int, world: int) -> None:
    """--expert_parallel=n must divide the number of experts and the world size (one line otherwise)."""
    if n < 1:
        raise ConfigError(f"--expert_parallel={n}: must be >= 1")
    if n > 1 and n_experts == 0:
        raise ConfigError(f"--expert_parallel={n}: the model has no experts")
    if n_experts % n:
        raise ConfigError(f"--expert_parallel={n}: must divide the number of experts ({n_experts})")
    if world % n:
        raise ConfigError(f"--expert_parallel={n}: must divide the number of ranks ({world})")


def placement_of(table: list[int], n: int, n_experts: int) -> Placement | None:
    """--expert_placement: None for the contiguous default; a given table is checked here (one line)."""
    if not table:
        return None
    if n == 1:
        raise ConfigError("--expert_placement: needs --expert_parallel > 1 (one rank holds every expert)")
    if len(table) != n_experts:
        raise ConfigError(f"--expert_placement: {len(table)} slots for {n_experts} experts; give one per expert")
    return Placement(tuple(table), n)


def init_expert_parallel(n: int, placement: Placement | None = None, n_experts: int = 0) -> ExpertParallel:
    """EP groups of n consecutive ranks of the default group, and the replica groups across them (the
    ranks r, r + n, r + 2n, ... hold the same shard: their expert gradients are reduced together).
    Every rank creates every group, as torch.distributed requires. placement defaults to the contiguous
    one over n_experts."""
    world, rank = dist.get_world_size(), dist.get_rank()
    placement = placement or Placement.contiguous(n_experts, n)
    check_degree(n, placement.n_experts, world)
    mine = replicas = host = None
    on_gloo = dist.get_backend() == "gloo"
    for first in range(0, world, n):
        ranks = list(range(first, first + n))
        group = dist.new_group(ranks) if n < world else None
        cpu = None if on_gloo else dist.new_group(ranks, backend="gloo")
        if first <= rank < first + n:
            mine, host = group, cpu
    if 1 < n < world:
        for r in range(n):
            group = dist.new_group(list(range(r, world, n)))
            if rank % n == r:
                replicas = group
    return ExpertParallel(placement, rank % n, mine, replicas, world // n, host=host)


def layout(tcfg, n_experts: int, world: int) -> tuple[ExpertParallel | None, list[int] | None]:
    """A run's EP (--expert_parallel, --expert_placement; a TrainConfig): this rank's EP group among `world`
    ranks (its side's, under --rollout_ranks) and the experts it holds from the start, so no rank reads
    them all; (None, None) at EP = 1. A collective when EP > 1: every rank of the side calls it."""
    check_degree(tcfg.expert_parallel, n_experts, world)
    placement = placement_of(tcfg.expert_placement, tcfg.expert_parallel, n_experts)
    if tcfg.expert_parallel == 1:
        return None, None
    ep = init_expert_parallel(tcfg.expert_parallel, placement, n_experts)
    return ep, ep.placement.experts_of(ep.rank)


def of(model: nn.Module) -> ExpertParallel | None:
    """The ExpertParallel a model's MoE layers were sharded with (None: whole experts; model.expert_group)."""
    return expert_group(model)


def is_expert(name: str) -> bool:
    """Whether a parameter name (state_dict key) is a stacked expert tensor (EXPERT_TENSORS)."""
    return name.rsplit(".", 1)[-1] in EXPERT_TENSORS


def expert_tensors(m: nn.Module) -> dict[str, torch.Tensor]:
    """A MoE layer's expert tensors by name, in EXPERT_TENSORS' order (the biases where it has them)."""
    return {n: getattr(m, n) for n in EXPERT_TENSORS if getattr(m, n, None) is not None}


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the replicated parameters, the expert shards), in model order."""
    dense, experts = [], []
    for name, p in model.named_parameters():
        (experts if is_expert(name) else dense).append(p)
    return dense, experts


@torch.no_grad()
def reduce_expert_grads(experts: list[nn.Parameter], ep: ExpertParallel, world: int, device=None) -> None:
    """Average the expert shards' gradients as DDP averages the rest. Each owner's gradient already
    sums its EP group's tokens (the exchange brought them), so it is summed over the replicas of the
    shard only (fp32 where the master is, sent from device) and divided by the world size."""
    for p in experts:
        if p.grad is None:                                            # no rows reached it: every replica reduces
            p.grad = torch.zeros_like(p)
    if ep.n_replicas > 1:
        flat = torch.cat([p.grad.reshape(-1) for p in experts]).to(device)
        dist.all_reduce(flat, group=ep.replicas)
        for p, part in zip(experts, flat.split([p.numel() for p in experts])):
            p.grad.copy_(part.view_as(p))
    for p in experts:
        p.grad.div_(world)


@torch.no_grad()
def clip_grad_norm(dense: list[nn.Parameter], experts: list[nn.Parameter], max_norm: float,
                   ep: ExpertParallel) -> float:
    """clip_grad_norm_ over the whole model when the experts are sharded: the replicated part's squared
    norm (DTensor shards summed by full_tensor), plus the shards' squared norms summed over the EP
    group; every rank gets the same norm and scales by the same factor. -> the norm before clipping."""
    def sq(ps):
        total = torch.zeros((), dtype=torch.float64)
        for p in ps:
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                total += g.double().pow(2).sum().cpu()
        return total
    local = sq(experts)
    dist.all_reduce(local, group=ep.group)
    norm = (sq(dense) + local).sqrt().item()
    scale = max_norm / (norm + 1e-6)
    if scale < 1:
        for p in dense + experts:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


@torch.no_grad()
def device_load(routes: torch.Tensor, ep: ExpertParallel) -> dict:
    """Rows per rank per MoE layer: routes (N, n_moe, k) logical ids of the global batch's tokens ->
    {"ep_rows": per layer, the rows each rank of an EP group computes (with several EP groups, their
    mean); "ep_load_layer": per layer, the busiest rank's rows over the mean rank's (1.0 = balanced);
    "ep_load_max": the worst layer's}. A property of the layout, not of the run."""
    load = torch.stack([ep.placement.rows_per_rank(routes[:, j]) for j in range(routes.shape[1])])   # (n_moe, N)
    rows = load.tolist() if ep.n_replicas == 1 else (load.double() / ep.n_replicas).tolist()
    ratio = load.max(-1).values.double() / load.double().mean(-1).clamp(min=1e-12)
    return {"ep_rows": rows, "ep_load_layer": ratio.tolist(), "ep_load_max": ratio.max().item()}


def idle_step(model: nn.Module) -> None:
    """A step of a rank with nothing to run while its EP group steps: every MoE layer's exchange once,
    in layer order, with zero rows (the others' forwards wait on it)."""
    for _, m in _moe_layers(model):
        D, k = m.w13.shape[-1], m.top_k
        x = m.w13.new_zeros(0, D)
        ids = torch.zeros(0, k, dtype=torch.long, device=x.device)
        moe_experts(x, m.w13, m.w2, ids, torch.zeros(0, k, device=x.device), m.ep, m, **m.expert_extras())


def group_step(done: bool, prefill: bool, ep: ExpertParallel) -> tuple[bool, bool]:
    """The sampler's per-step agreement of an EP group: (every rank is done, some rank prefills), so the
    group ends together and runs one exchange protocol per step. Two flags the schedulers hold on the
    host, all-reduced between the host processes over gloo (as vLLM's data-parallel ranks agree on a
    step): no device sync, and the decode forward itself stays free of host reads."""
    t = torch.tensor([int(done), int(not prefill)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ep.host or ep.group)
    all_done, none_prefill = t.tolist()
    return bool(all_done), not none_prefill


# ---------------------------------------------------------------------------------------------------
# the exchange
# ---------------------------------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows x[: send[0]] to rank 0, the next send[1] to rank 1, ...; returns the rows received, by source."""
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class Exchange(torch.autograd.Function):
    """all_to_all_single whose backward sends the gradients back along the same rows (an exact copy)."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.route = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        send, recv, group = ctx.route
        return _all_to_all(grad, recv, send, group), None, None, None


def _exchange_counts(send: torch.Tensor, group) -> list[int]:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


# ---------------------------------------------------------------------------------------------------
# the MoE layer under EP
# ---------------------------------------------------------------------------------------------------
def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, ep: ExpertParallel, moe: nn.Module | None = None,
                b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                swiglu: tuple[float, float] | None = None, extra: dict | None = None, rows=None) -> torch.Tensor:
    """kernels.moe_experts with the experts on their owners: x (M, D) this rank's tokens; w13 (E/N, 2I, D),
    w2 (E/N, D, I) this rank's shard (b13 (E/N, 2I), b2 (E/N, D) and swiglu: gpt-oss's, as in
    kernels.moe_experts); ids (M, k) logical ids; weights (M, k) fp32 -> (M, D) in x.dtype.
    moe: the calling MoE module (under EPLB, its layer's layout and slot weights: _layout). Every rank
    of the group must call it (with M = 0 if it has no tokens). extra: more expert tensors by their
    EXPERT_TENSORS names (LoRA's adapters), which rows(x, ws, ids, weights, swiglu) -> (R, D) fp32, the
    owner's computation of each row through its expert (default: kernels.expert_rows), reads."""
    M, k = ids.shape
    given = dict(w13=w13, w2=w2, b13=b13, b2=b2, **(extra or {}))
    pl, ws, keys = _layout(moe, {n: given[n] for n in EXPERT_TENSORS if given.get(n) is not None}, ep)
    run = functools.partial(rows or _rows, swiglu=swiglu)
    # 1. the token's rank: its slots in EP=1's order (by logical expert). With a gradient, each expert's
    #    rows are gathered separately as grouped_experts does, so x's gradient sums a token's k slots in
    #    EP=1's order; the decode step (no gradient) gathers them at once, without reading counts back
    if ep.capacity:
        order = torch.sort(ids.reshape(-1), stable=True).indices
        x_sorted = x[order // k]                                   # (M*k, D) by logical expert
    else:
        order, counts = kernels.sort_slots(ids, pl.n_experts)
        x_sorted = torch.cat([x[part // k] for part in order.split(counts)])
    w_sorted = weights.reshape(-1)[order]                          # (M*k,) fp32
    e_sorted = ids.reshape(-1)[order]
    dest = pl.owner(e_sorted, ep.rank)                              # (M*k,) owner rank of each row
    by_dest = torch.sort(dest, stable=True).indices                 # grouped by owner, EP=1's order inside
    local_ids = pl.local(e_sorted, ep.rank)[by_dest]                # each row's slot in its owner's shard
    if ep.capacity:
        return _moe_experts_fixed(x, ws, run, x_sorted[by_dest], w_sorted[by_dest], local_ids,
                                  dest[by_dest], order[by_dest], (M, k), ep)
    send = torch.bincount(dest, minlength=ep.size)
    send_l = send.tolist()
    recv_l = _exchange_counts(send, ep.group)
    # 2. the owner: the rows of every source, source by source, through the same per-expert computation
    x_in = Exchange.apply(x_sorted[by_dest], send_l, recv_l, ep.group)          # (R, D)
    w_in = Exchange.apply(w_sorted[by_dest], send_l, recv_l, ep.group)          # (R,) fp32
    local = _all_to_all(local_ids, send_l, recv_l, ep.group)                    # (R,) local slot ids
    y = _owner_rows(x_in, ws, local, w_in, recv_l, ep, keys, run)               # (R, D) fp32, arrival order
    # 3. back to the token's rank: into slot order, then EP=1's combine
    y_back = Exchange.apply(y, recv_l, send_l, ep.group)                        # (M*k, D) in by_dest order
    slot_of_row = order[by_dest]                                                # row i holds slot slot_of_row[i]
    per_slot = y_back[torch.argsort(slot_of_row)]                               # (M*k, D) in slot order
    return kernels.combine_slots(per_slot.view(M, k, x.shape[1]), x.dtype)


def _layout(moe, ws: dict, ep: ExpertParallel):
    """ws: the expert tensors by name (EXPERT_TENSORS) -> (placement, the tensors to run, the gradient
    sink's key of each or None): the home shard and its placement, or under EPLB the layer's layout and
    this rank's slots' copies (S/N, ...) of every expert tensor, biases too, gathered when stale: a
    collective that every rank of the group reaches in the same forward. Their gradient pieces go to the
    sink under keys of their own, folded into the experts' at the end (fold_slots)."""
    sink = ep.grad_sink if torch.is_grad_enabled() else None
    keys = None if sink is None else {n: sink.key(t) for n, t in ws.items()}
    r = ep.eplb
    if r is None:
        return ep.placement, ws, keys
    if torch.is_grad_enabled() and any(t.requires_grad for t in ws.values()) and sink is None:
        raise RuntimeError("EPLB: a backward through expert replicas needs the exact gradient sum "
                           "(--grad_reduce=exact), which folds their gradients into their experts'")
    layout, have = r.layouts[moe.ep_layer], r.copies.get(moe)
    if have is None or have[0] != r.version:
        with torch.no_grad():
            slots = {n: _gather_slots(t, ep, layout).requires_grad_(t.requires_grad) for n, t in ws.items()}
        have = r.copies[moe] = (r.version, slots)
    return layout, have[1], keys and {n: (key, "slots") for n, key in keys.items()}


def _gather_slots(w: torch.Tensor, ep: ExpertParallel, layout: Placement) -> torch.Tensor:
    """w (E/N, ...) this rank's home rows (ep.placement's local order) -> (S/N, ...) the rows of its
    slots in `layout`, each an exact copy of its logical expert's home row: one all_to_all over the
    group, each rank sending every other the rows its slots need, in their slot order."""
    home, N, me = ep.placement, ep.size, ep.rank
    home_rank = [p // home.per_rank for p in home.table]                       # logical e -> its home rank
    send = [[home.table[e] % home.per_rank for e in layout.experts_of(q) if home_rank[e] == me] for q in range(N)]
    mine = layout.experts_of(me)
    rows = torch.tensor([i for part in send for i in part], dtype=torch.long, device=w.device)
    recv = [sum(home_rank[e] == r for e in mine) for r in range(N)]
    got = _all_to_all(w[rows], [len(part) for part in send], recv, ep.group)   # by source, slot order inside
    arrival = sorted(range(len(mine)), key=lambda j: (home_rank[mine[j]], j))  # got[i] is slot arrival[i]'s
    out = torch.empty_like(got)
    out[torch.tensor(arrival, dtype=torch.long, device=w.device)] = got
    return out


def fold_slots(t: torch.Tensor, layer: int, ep: ExpertParallel) -> torch.Tensor:
    """t (S/N, ...) int64, a value per slot of this rank in the layer's EPLB layout (a slot's gradient
    limbs) -> (E/N, ...): for each of this rank's home experts, the sum of t over that expert's slots on
    every rank. Integers add exactly in any order (index_add_ of int64, atomic or not), so a folded
    gradient sum is the one without replicas. A collective over the group."""
    home, layout, N, me = ep.placement, ep.eplb.layouts[layer], ep.size, ep.rank
    home_rank = [p // home.per_rank for p in home.table]
    mine = layout.experts_of(me)
    order = sorted(range(len(mine)), key=lambda j: (home_rank[mine[j]], j))    # grouped by home rank
    send = [sum(home_rank[e] == r for e in mine) for r in range(N)]
    theirs = [[e for e in layout.experts_of(r) if home_rank[e] == me] for r in range(N)]
    mine_first = torch.tensor(order, dtype=torch.long, device=t.device)
    got = _all_to_all(t[mine_first], send, [len(p) for p in theirs], ep.group)  # by source, its slot order inside
    rows = [home.table[e] % home.per_rank for part in theirs for e in part]      # each row's home expert
    return t.new_zeros(home.per_rank, *t.shape[1:]).index_add_(0, torch.tensor(rows, dtype=torch.long,
                                                                                device=t.device), got)


def slot_bytes(model: nn.Module) -> int:
    """EPLB: the bytes of one copy's slot weights (every MoE layer's (E+R)/N slots of each expert
    tensor); 0 off."""
    ep = of(model)
    if ep is None or ep.eplb is None:
        return 0
    return sum(w.nbytes // w.shape[0] * pl.per_rank for (_, m), pl in zip(_moe_layers(model), ep.eplb.layouts)
               for w in expert_tensors(m).values())


def weights_changed(model: nn.Module) -> None:
    """Some copy of the model's weights moved (an optimizer step, a sync of the sampler's copy): under
    EPLB every copy gathers its slots' weights again at its next forward. Called at the same point of
    the program on every rank, so the group gathers together."""
    ep = of(model)
    if ep is not None and ep.eplb is not None:
        ep.eplb.version += 1


def _rows(x, ws: dict, ids, weights, swiglu) -> torch.Tensor:
    """kernels.expert_rows over the expert tensors ws (EXPERT_TENSORS' names) and the layer's GLU."""
    return kernels.expert_rows(x, ws["w13"], ws["w2"], ids, weights, b13=ws.get("b13"), b2=ws.get("b2"), swiglu=swiglu)


def _owner_rows(x_in, ws: dict, local, w_in, recv: list[int], ep: ExpertParallel, keys, run) -> torch.Tensor:
    """The owner's expert rows, source by source. In a training forward under an exact gradient sum
    (keys: the sink's name of each expert tensor, _layout), each source rank's rows run through the
    experts (run: moe_experts') on their own and the gradients of the expert tensors (biases too) go to the sink apart: a
    source's rows are one micro-batch's, in EP=1's order, so each piece (and x's gradient, and the
    routing weights') has the bits EP=1 computes for that micro-batch; one call over every source's
    rows would sum the micro-batches' gradients in fp32 inside it. Every source is run, an empty one too: the backward's exchanges need every rank's
    graph to reach them."""
    if keys is None:
        return run(x_in, ws, local, w_in)
    sink = ep.grad_sink
    outs = [run(xs, {n: _Sink.apply(t, sink, keys[n]) for n, t in ws.items()}, ls, wts)
            for xs, ls, wts in zip(x_in.split(recv), local.split(recv), w_in.split(recv))]
    return torch.cat(outs)


class _Sink(torch.autograd.Function):
    """The identity on an expert weight whose backward hands its gradient to sink(key, grad) instead of
    accumulating it into .grad (_owner_rows)."""

    @staticmethod
    def forward(ctx, w, sink, key):
        ctx.sink, ctx.key = sink, key
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(ctx.key, grad)
        return None, None, None


def _moe_experts_fixed(x, ws, run, x_rows, w_rows, local, dest, slot_of_row, shape, ep):
    """The decode step's exchange: every rank sends ep.capacity rows to every rank (its rows for that
    owner, then padding), so no counts are exchanged and nothing is read back to the host. Padding rows
    run through expert 0 with weight 0 and are dropped; a real row's bits are those of the counted path
    (the expert kernel is row-invariant). ws: the expert tensors (_layout), run: their rows (moe_experts);
    x_rows, w_rows, local, dest: the slots grouped by owner."""
    M, k = shape
    S, C, N, D = x_rows.shape[0], ep.capacity, ep.size, x.shape[1]
    counts = torch.zeros(N, dtype=torch.long, device=x.device).scatter_add_(0, dest, torch.ones_like(dest))
    first = torch.cumsum(counts, 0) - counts                        # (N,) where each owner's rows start
    at = dest * C + torch.arange(S, device=x.device) - first[dest]  # (S,) each row's place in the buffer
    x_buf = x_rows.new_zeros(N * C, D).index_copy(0, at, x_rows)
    w_buf = w_rows.new_zeros(N * C).index_copy(0, at, w_rows)
    l_buf = local.new_zeros(N * C).index_copy(0, at, local)         # padding: expert 0
    even = [C] * N
    x_in = _all_to_all(x_buf, even, even, ep.group)                 # (N*C, D) C rows from each source
    w_in = _all_to_all(w_buf, even, even, ep.group)
    l_in = _all_to_all(l_buf, even, even, ep.group)
    y = run(x_in, ws, l_in, w_in)
    y_back = _all_to_all(y, even, even, ep.group)[at]              # (M*k, D) in by-owner order
    per_slot = y_back[torch.argsort(slot_of_row)]
    return kernels.combine_slots(per_slot.view(M, k, D), x.dtype)


# ---------------------------------------------------------------------------------------------------
# shards of a model's experts
# ---------------------------------------------------------------------------------------------------
def _moe_layers(model: nn.Module):
    """(name, module) of the MoE layers: the modules holding stacked experts w13 and w2."""
    return [(n, m) for n, m in model.named_modules() if isinstance(getattr(m, "w13", None), nn.Parameter)]


def keep_experts(model: nn.Module, experts: list[int]) -> None:
    """Keep only these experts' rows, in this order, of every MoE layer's expert tensors (in place)."""
    for _, m in _moe_layers(model):
        m.keep_experts(experts)


def shard_experts(model: nn.Module, ep: ExpertParallel, loaded: bool = False) -> nn.Module:
    """Keep only this rank's experts in every MoE layer (rows in the placement's local order) and route
    the layer through the exchange. loaded=True: the model holds those rows already, read so from the
    checkpoint (Transformer.from_pretrained(experts=...)). In place; returns the model."""
    mine = ep.placement.experts_of(ep.rank)
    want = len(mine) if loaded else ep.placement.n_experts
    for _, m in _moe_layers(model):
        for name, t in expert_tensors(m).items():
            if t.shape[0] != want:
                raise ValueError(f"shard_experts: a layer's {name} holds {t.shape[0]} experts, expected {want}"
                                 + ("" if loaded else " (already sharded?)"))
    if not loaded:
        keep_experts(model, mine)
    for j, (_, m) in enumerate(_moe_layers(model)):
        for t in expert_tensors(m).values():
            t.expert_shard = True                                    # what the optimizer's state knows them by
        m.ep, m.ep_layer = ep, j                                     # EPLB: the layer's layout is ep.eplb.layouts[j]
        m.experts_op = functools.partial(moe_experts, ep=ep, moe=m)  # its experts on their owners (model.MoE.experts)
    return model


def replica_mesh(ep: ExpertParallel, device_type: str):
    """The DeviceMesh of the ranks holding this rank's experts (r, r + N, r + 2N, ...), for FSDP2: a 2-D
    mesh (replica, ep) over every rank, consecutive ranks forming an EP group; collective, made once."""
    if ep.mesh is None:
        from torch.distributed.device_mesh import init_device_mesh
        ep.mesh = init_device_mesh(device_type, (ep.n_replicas, ep.size), mesh_dim_names=("replica", "ep"))["replica"]
    return ep.mesh


def gather_rows(shard: torch.Tensor, ep: ExpertParallel) -> torch.Tensor | None:
    """(E/N, ...) rows of this rank's experts -> on rank 0, (E, ...) in logical order in host memory;
    None on the other ranks. Every rank calls it (an FSDP2 shard is first made whole over its replicas);
    rank 0's EP group gathers, the other groups hold replicas of the same experts and send nothing. So
    no rank but rank 0 ever holds every expert, and rank 0 on the host, one tensor at a time."""
    shard = unsharded(shard).contiguous()
    if dist.get_rank() >= ep.size:
        return None
    parts = [torch.empty_like(shard) for _ in range(ep.size)] if dist.get_rank() == 0 else None
    dist.gather(shard, parts, dst=0, group=ep.group)
    if parts is None:
        return None
    pl = ep.placement
    whole = torch.empty(pl.n_experts, *shard.shape[1:], dtype=shard.dtype)
    for r, part in enumerate(parts):
        whole[torch.tensor(pl.experts_of(r))] = part.cpu()
    return whole


def shard_rows(whole: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """(E, ...) in logical order -> this rank's (E/N, ...) rows, in its local order."""
    return whole[torch.tensor(ep.placement.experts_of(ep.rank), device=whole.device)].clone()


def gather_experts(model: nn.Module, ep: ExpertParallel) -> dict[str, torch.Tensor] | None:
    """The model's state dict with whole experts (logical order), on rank 0 (host memory for the
    experts); None on the other ranks. A collective: every rank calls it."""
    state = {k: unsharded(v) for k, v in model.state_dict().items()}   # FSDP2: the replicated weights whole too
    for name, m in _moe_layers(model):
        for key, t in expert_tensors(m).items():
            state[f"{name}.{key}" if name else key] = gather_rows(t, ep)
    return state if dist.get_rank() == 0 else None


def whole_model(model: nn.Module) -> nn.Module | None:
    """model itself, or, with sharded experts, a copy holding whole ones on rank 0 (None elsewhere; a
    collective, every rank calls it). For writing checkpoints in the HF layout."""
    ep = of(model)
    if ep is None:
        return model
    state = gather_experts(model, ep)
    if state is None:
        return None
    with torch.device("meta"):
        out = type(model)(model.config)
    if set(state) != set(out.state_dict()):          # a plug-in's tensors (LoRA's adapters): its layers as they are
        out = _meta_copy(model, state)
    out.load_state_dict(state, assign=True)
    out.extra_tensors = model.extra_tensors                        # MTP weights, kept as loaded
    return out


def _meta_copy(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of model's modules (their classes, a plug-in's swapped ones too) whose tensors are meta
    tensors of state's shapes (whole experts where model holds a shard): nothing is allocated."""
    memo = {}
    for k, t in model.state_dict(keep_vars=True).items():
        empty = torch.empty(state[k].shape, dtype=state[k].dtype, device="meta")
        memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def _expert_state(opt_state: dict, names: dict, fn) -> dict:
    """opt_state with fn applied to the moment tensors of the expert parameters. names maps a state key
    (a parameter index, or an FQN for the FSDP2 full state dict) to whether it is an expert."""
    state = dict(opt_state["state"])
    for key, entry in state.items():
        if names.get(key):
            state[key] = {k: fn(v) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in entry.items()}
    return {**opt_state, "state": state}


def _shards(params: list[nn.Parameter], model: nn.Module) -> list[bool]:
    """Which of params are expert shards: marked by shard_experts (the masters of mixed precision are
    another copy's), or, once FSDP2 has replaced the parameters, known by their names in model."""
    by_name = {id(q) for n, q in model.named_parameters() if is_expert(n)}
    return [getattr(p, "expert_shard", False) or id(p) in by_name for p in params]


def expert_keys(opt: torch.optim.Optimizer, model: nn.Module, opt_state: dict) -> dict:
    """Which keys of opt_state['state'] are the experts': indices in the param groups' order, or FQNs."""
    params = [p for g in opt.param_groups for p in g["params"]]
    by_index = dict(enumerate(_shards(params, model)))
    return {k: (by_index.get(k, False) if isinstance(k, int) else is_expert(k)) for k in opt_state["state"]}


def gather_optimizer_state(opt, model, opt_state: dict) -> dict:
    """AdamW's state with whole experts' moments on rank 0, as a checkpoint stores it (the other ranks
    get opt_state back): a collective on every rank, each gathering from its own optimizer (FSDP2's
    full state dict is rank 0's alone)."""
    ep = of(model)
    if ep is None:
        return opt_state
    params = [p for g in opt.param_groups for p in g["params"]]
    names = {id(p): n for n, p in model.named_parameters()}
    whole = {}
    for i, (p, shard) in enumerate(zip(params, _shards(params, model))):
        if shard and p in opt.state:
            whole[i] = {k: gather_rows(v, ep) if torch.is_tensor(v) and v.dim() > 0 else v
                        for k, v in opt.state[p].items()}
    if dist.get_rank() != 0 or "state" not in opt_state:
        return opt_state
    state = dict(opt_state["state"])
    for i, entry in whole.items():
        fqn = next((k for k in state if isinstance(k, str) and names.get(id(params[i]), "").endswith(k)), None)
        state[i if i in state else fqn] = entry
    return {**opt_state, "state": state}


def shard_optimizer_state(opt, model, opt_state: dict) -> dict:
    """A checkpoint's AdamW state (whole experts) cut to this rank's experts."""
    ep = of(model)
    if ep is None:
        return opt_state
    return _expert_state(opt_state, expert_keys(opt, model, opt_state), lambda t: shard_rows(t, ep))


# ---------------------------------------------------------------------------------------------------
# the exact gradient sum of the shards (--grad_reduce=exact, support/exact_sum.py)
# ---------------------------------------------------------------------------------------------------
class ExpertSums(Reducer):
    """Reducer with expert shards: the owner's weight gradient of each source rank's rows is handed over
    through ep.grad_sink (this object's __call__), kept apart by (MoE module, tensor name) until finish."""

    def __init__(self, masters: nn.Module, d, *, trained: nn.Module, ep, master_of: dict | None = None,
                 experts: set | None = None):
        super().__init__(masters, d, trained=trained, master_of=master_of, experts=experts)
        self.ep, self.master_of = ep, master_of or {}
        self.moes = [m for m in trained.modules() if isinstance(getattr(m, "w13", None), nn.Parameter)]
        self.pieces: dict[tuple[int, str], Limbs] = {}               # (id(MoE module), 'w13' | ...) -> sum
        ep.grad_sink = self

    def key(self, w: torch.Tensor) -> tuple[int, str]:
        """The (MoE module, 'w13' | 'w2' | 'b13' | 'b2') whose expert tensor w is, at forward time (under
        FSDP2 w is the unsharded parameter, only the module knows whose it is)."""
        for m in self.moes:
            for name, t in expert_tensors(m).items():
                if t is w:
                    return id(m), name
        raise RuntimeError("exact gradient sum: an expert weight of no MoE layer of the trained model")

    def __call__(self, key: tuple[int, str], g: torch.Tensor) -> None:
        if key not in self.pieces:
            self.pieces[key] = Limbs(g.shape, self.home)
        self.pieces[key].add(g.to(self.home), own=True)   # autograd's, handed over

    def start(self) -> None:
        super().start()
        for s in self.pieces.values():
            s.zero_()

    def _finish_experts(self) -> list[torch.Tensor]:
        """The expert shards' sums: each owner's pieces over its replicas (_write_experts); -> their
        out-of-range flags."""
        if self.ep.eplb is not None:
            self._fold_slots()
        found = []
        for m in self.moes:
            for name, t in expert_tensors(m).items():
                p = self.master_of.get(id(t), t)                      # after backward: sharded
                if (id(m), name) not in self.pieces:                  # no token reached these experts here
                    self.pieces[(id(m), name)] = Limbs(p.shape, p.device)
                found.append((p, self.pieces[(id(m), name)]))
        self._write_experts(found)
        return [s.bad for _, s in found]

    def _write_experts(self, found: list[tuple[nn.Parameter, Limbs]]) -> None:
        """Each (expert shard, its sum) all-reduced over the shard's replicas, as its .grad (FSDP2 cuts the
        shards over their replicas: parallel/fsdp.ShardedExpertSums)."""
        if self.ep.n_replicas > 1:
            all_reduce_limbs([s for _, s in found], group=self.ep.replicas, device=self.d.device)
        for p, s in found:
            p.grad = s.value().to(p.dtype)

    def _fold_slots(self) -> None:
        """EPLB: the sums of this rank's expert slots (replicas included, _owner_rows' pieces under the
        keys expert_parallel._layout gives them) added into their logical experts' sums on the experts'
        home ranks: limbs sent as integers (expert_parallel.fold_slots), so the result is the sum without
        replicas, every piece EP=1's of its micro-batch. Every rank folds every layer (a collective)."""
        for j, m in enumerate(self.moes):
            for name, t in expert_tensors(m).items():
                p = self.master_of.get(id(t), t)
                home = self.pieces.setdefault((id(m), name), Limbs(p.shape, p.device))
                slots = self.pieces.get(((id(m), name), "slots"))
                if slots is None:                                     # no row reached this rank's slots
                    slots = Limbs((self.ep.eplb.layouts[j].per_rank, *p.shape[1:]), p.device)
                slots.carry()                                         # lo below 2^52: N of them add in int64
                hi, lo = fold_slots(slots.hi, j, self.ep), fold_slots(slots.lo, j, self.ep)
                home.add_limbs(hi, lo, terms=self.ep.size)            # at most N slots an expert
                home.bad |= slots.bad

    def reserve_bytes(self) -> int:
        """The base's, and under EPLB the (E+R)/N slots of each expert weight."""
        slots = 0
        if self.ep.eplb is not None:
            slots = sum(t.numel() // t.shape[0] * pl.per_rank
                        for m, pl in zip(self.moes, self.ep.eplb.layouts) for t in expert_tensors(m).values())
        return super().reserve_bytes() + 16 * slots
