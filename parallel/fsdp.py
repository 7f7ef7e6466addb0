"""FSDP2 (--parallel=fsdp over several ranks): the trained weights sharded over the ranks, each block a group.

    shards = Fsdp()                                   # what options.sharding hands the core (support/distributed)
    scorer, full, sync = shards.wrap(model, scorer, d)   # one dtype: the sampler reads `full`, sync() gathers it
    mp = shards.mixed_precision(master, tcfg, d)         # fp32 masters sharded, FSDP2 casts as it gathers
    reducer = shards.reducer(model, trainer, d)           # --grad_reduce=exact: its reduce-scatters, exact

The core holds the weights whole on every rank (DDP) and asks support/distributed.sharding whether a plug-in
shards them instead; this module is that plug-in's code, imported only under --parallel=fsdp. The bits:
a cast is elementwise, so FSDP2's shard-then-cast-then-gather gives the cast of the whole tensor; the
exact sums' reduce-scatter adds integers (support/exact_sum.py), so a sharded sum is the whole one's.
"""
from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from model import Transformer, expert_group
from parallel.expert_parallel import ExpertSums, split_params
from support.distributed import Dist, MixedPrecision, Scorer
from support.exact_sum import Limbs, Reducer, from_limbs, to_limbs


class Fsdp:
    """The sharding the core's seam asks for (support/distributed.sharding): FSDP2's wrappers, its mixed
    precision, its exact reduction, its optimizer state; `name`, what the run's first line calls the layout."""
    name = "fsdp"

    def wrap(self, model: Transformer, scorer: nn.Module, d: Dist):
        """-> (the scorer to train through, a full copy for the sampler, sync() refreshing it): FSDP2 shards
        each block and the rest; the copy is all-gathered before each rollout (the trainer's bits)."""
        full_copy = copy.deepcopy(model).requires_grad_(False)
        router_apart = any(layer.is_moe and layer.mlp.gate.weight.dtype != layer.input_layernorm.weight.dtype
                           for layer in model.layers)                 # an fp32 router: one dtype per FSDP group
        shard(model, scorer, d, router_apart=router_apart)
        full_params = dict(full_copy.named_parameters())
        full_buffers = dict(full_copy.named_buffers())

        @torch.no_grad()
        def sync():
            for name, p in model.named_parameters():
                full_params[name].copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)   # an expert shard: itself
            for name, b in model.named_buffers():                     # FSDP2 leaves buffers whole on each rank
                full_buffers[name].copy_(b)
        return scorer, full_copy, sync

    def mixed_precision(self, master: Transformer, tcfg, d: Dist, apart: bool = False) -> MixedPrecision:
        return ShardedMixedPrecision(master, tcfg, d, apart)

    def reducer(self, model: Transformer, trainer: nn.Module, d: Dist) -> Reducer:
        """--grad_reduce=exact over FSDP2's groups (with expert shards: their sums too)."""
        ep = expert_group(model)
        if ep is None:
            return ShardedSums(model, d, trained=trainer)
        return ShardedExpertSums(model, d, trained=trainer, ep=ep, experts={id(p) for p in split_params(model)[1]})

    def optimizer_state(self, scorer: nn.Module, opt) -> dict:
        """AdamW's state whole (a collective), as one process would save it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        return get_optimizer_state_dict(scorer, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, scorer: nn.Module, opt, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(scorer, opt, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


def shard(model: Transformer, scorer: nn.Module, d: Dist, policy=None, router_policy=None,
               router_apart: bool = False, offload: bool = False) -> None:
    """FSDP2 over every rank: each block, then the rest (scorer); policy: a MixedPrecisionPolicy;
    offload: the shards, their gradients and so AdamW's state on the host (CPUOffloadPolicy, pinned
    when the device is a GPU), each copied to the device before its all-gather.

    The router gets a group of its own when its dtype differs (router_policy, one dtype per group) and
    under EP. Sharded experts (expert_parallel.shard_experts) are sharded over their replicas, the ranks
    holding the same E/N experts (torchtitan's dp-mod-ep mesh): each MoE layer's expert tensors form a group
    on that mesh, the shared experts a group on every rank. FSDP2 averages their gradient over the
    replicas; expert_parallel's finish_grads divides it by N too, DDP's mean over the world (each owner's
    gradient already sums its EP group's tokens). A custom divide factor would need PREMUL_SUM, which gloo
    lacks.
    """
    # FSDP2 warns when a wrapped module returns a view: an in-place op on it would skip the module's
    # pre-backward all-gather. The router and the MoE layer return reshaped views, and every caller
    # uses them out of place (x = x + mlp(...)); tests/ep_train_check.py holds these gradients against
    # EP=1 and DDP. So the warning is silenced for exactly these modules.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \((FSDP)?(Router|MoE)\) returned a view tensor",
                            category=UserWarning)
    ep = expert_group(model)
    kw = {} if policy is None else {"mp_policy": policy}
    router_kw = kw if router_policy is None else {"mp_policy": router_policy}
    if offload:
        kw = {**kw, "offload_policy": CPUOffloadPolicy(pin_memory=d.device.type == "cuda")}
        router_kw = {**router_kw, "offload_policy": kw["offload_policy"]}
    for layer in model.layers:
        if layer.is_moe:
            mlp = layer.mlp
            if router_apart or ep is not None:          # its own group (Router casts inside its forward)
                fully_shard(mlp.gate, **router_kw)
            if ep is not None:
                for shared in (mlp.shared_experts, mlp.shared_expert, mlp.shared_expert_gate):
                    if shared is not None:
                        fully_shard(shared, **kw)
                fully_shard(mlp, mesh=ep.replica_mesh(d.device.type), **kw)   # w13, w2 (b13, b2)
        fully_shard(layer, **kw)
    fully_shard(scorer, **kw)


class ShardedMixedPrecision(MixedPrecision):
    """MixedPrecision with the masters sharded: MixedPrecisionPolicy(param_dtype=--dtype, reduce_dtype=fp32)
    (routers: param_dtype = the router's), so FSDP2 casts each shard and all-gathers the compute dtype for
    the forward; the sampler's full copy is the same cast shards all-gathered. apart (offload): FSDP2 keeps
    the shards on the host (CPUOffloadPolicy) and copies each to the device before its all-gather."""

    def _attach(self, tcfg) -> None:
        f32 = torch.float32
        # cast_forward_inputs off: the fp32 RoPE tables enter every block as they do in the full copy
        policy = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=f32, cast_forward_inputs=False)
        router = MixedPrecisionPolicy(param_dtype=self.router, reduce_dtype=f32, cast_forward_inputs=False)
        self.scorer = Scorer(self.master)
        shard(self.master, self.scorer, self.d, policy, router, router_apart=self.router != self.dtype,
              offload=self.apart)
        self.full_model.requires_grad_(False)
        self._full = dict(self.full_model.named_parameters())
        self._full_buffers = dict(self.full_model.named_buffers())
        self.sync_full_weights = self._gather

    def parameters(self) -> list[nn.Parameter]:
        """The trained masters, sharded."""
        return [p for p in self.scorer.parameters() if p.requires_grad]

    @torch.no_grad()
    def _gather(self) -> None:
        """The sampler's copy: each fp32 shard cast to its compute dtype, then all-gathered (half the
        bytes of gathering fp32; the same bits, a cast being elementwise)."""
        for name, p in self.master.named_parameters():
            full = self._full[name]
            full.copy_(p.to(full.device, full.dtype).full_tensor())
        for name, b in self.master.named_buffers():                  # whole on every rank (the router bias)
            self._full_buffers[name].copy_(b)

    def refresh(self) -> None:
        """FSDP2 casts at each all-gather and the full copy is gathered before a rollout: nothing to do."""

    def reduce_grads(self, bucket_bytes: int = 0) -> None:
        """FSDP2 reduce-scattered the fp32 gradients: nothing to do."""

    def in_flight_bytes(self) -> int:
        """A block's unsharded fp32 gradients, kept while micro-batches accumulate: bounded by the full model."""
        return sum(p.numel() for p in self.full_model.parameters()) * 4


# ---------------------------------------------------------------------------------------------------
# --grad_reduce=exact: FSDP2's reduce-scatter replaced by an exact one
# ---------------------------------------------------------------------------------------------------
class ShardedSums(Reducer):
    """exact_sum.Reducer under FSDP2: every group's reduce-scatter becomes an ExactReduceScatter (every
    micro-batch step an int64 reduce-scatter of the step's unsharded gradients into a sharded sum; the
    last step writes the sum into .grad), so there are no hooks and no dense all-reduce at the finish."""

    def _attach(self, trained: nn.Module, master_of: dict) -> None:
        self.comms: list[ExactReduceScatter] = []
        for m in trained.modules():
            if isinstance(m, FSDPModule):
                comm = ExactReduceScatter(self)
                m.set_custom_reduce_scatter(comm)
                m.set_force_sum_reduction_for_comms(True)        # a sum: no pre- or post-division
                m.set_gradient_divide_factor(1.0)
                self.comms.append(comm)

    def accumulators(self) -> list[Limbs]:
        return [*super().accumulators(), *(c.sum for c in self.comms if c.sum is not None)]

    def _finish_dense(self, dense: list[nn.Parameter]) -> None:
        """The reduce-scatters wrote these sums at the minibatch's last step."""


class ShardedExpertSums(ShardedSums, ExpertSums):
    """EP under FSDP2: the expert shards' sums reduce-scattered over their replicas (FSDP2 cuts each shard
    over them), the rest as ShardedSums."""

    def _write_experts(self, found: list[tuple[nn.Parameter, Limbs]]) -> None:
        for p, s in found:
            _reduce_scatter_into(p, s, self.d.device)


def _reduce_scatter_into(p: nn.Parameter, s: Limbs, device) -> None:
    """An FSDP2 expert shard's sum: reduce-scatter the (E/N, ...) limbs over its mesh (sent from device),
    rows in torch.chunk's pieces as FSDP2 shards them (dim 0, the last piece short), into p.grad."""
    s.carry()                                                         # lo below 2^52 on every rank
    mesh, local = p.device_mesh, p.to_local()
    n, R = mesh.size(), s.hi.shape[0]
    chunk = -(-R // n)
    limbs = []
    for t in (s.hi.to(device), s.lo.to(device)):
        padded = torch.cat([t, t.new_zeros(chunk * n - R, *t.shape[1:])]) if chunk * n > R else t
        out = t.new_empty(chunk, *t.shape[1:])
        dist.reduce_scatter_single(out, padded.contiguous(), group=mesh.get_group())
        limbs.append(out[:local.shape[0]].to(local.device))
    value = from_limbs(*limbs).to(local.dtype)
    p.grad = DTensor.from_local(value, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


class ExactReduceScatter:
    """FSDP2's reduce-scatter of one parameter group (FSDPModule.set_custom_reduce_scatter), exact.

    FSDP2 hands over the step's unsharded fp32 gradients, flat and laid out by rank; they are converted
    elementwise (the grid is the same for every element, so the layout does not matter), reduce-
    scattered as int64 limbs and added to this group's sharded sum, CHUNK elements of each rank's piece
    at a time (so the limbs in flight are 16 x ranks x CHUNK bytes, not 16 a gradient of the whole
    block; integers add the same in pieces). FSDP2 accumulates what is written into `output` onto the
    sharded .grad: zeros until the minibatch's last step, then the sum (0 + x is exact)."""
    CHUNK = 1 << 20

    def __init__(self, reducer: ShardedSums):
        self.reducer, self.sum = reducer, None

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        n, shard, home = group.size(), output_tensor.numel(), self.reducer.home
        if self.sum is None:
            self.sum = Limbs(output_tensor.shape, home)
        by_rank = input_tensor.view(n, shard)                         # (ranks, shard): rank r's piece in row r
        for at in range(0, shard, self.CHUNK):
            hi, lo, bad = to_limbs(by_rank[:, at:at + self.CHUNK])    # (ranks, c), contiguous
            out_hi, out_lo = hi.new_empty(hi.shape[1]), lo.new_empty(lo.shape[1])
            dist.reduce_scatter_single(out_hi, hi.reshape(-1), group=group)
            dist.reduce_scatter_single(out_lo, lo.reshape(-1), group=group)
            last = at + self.CHUNK >= shard
            self.sum.add_limbs(out_hi.to(home), out_lo.to(home), terms=n if last else 0, at=at)
            self.sum.bad |= bad.to(home)
        if self.reducer.last:
            output_tensor.copy_(self.sum.value())
        else:
            output_tensor.zero_()
        return None
