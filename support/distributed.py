"""Distributed training: one process, or one rank of a torchrun job (RANK, WORLD_SIZE, LOCAL_RANK set).

    d = init_distributed("auto")                              # NCCL per GPU, gloo on CPU, or one process
    policy = Policy(model, tcfg, d)                           # the weights' copies, the optimizer, the step
    policy.refresh()                                          # before a rollout: policy.sampler is up to date

What train.py needs beyond one process: the parallel wrapper (DDP; a plug-in may shard the weights
instead: `sharding`, parallel/fsdp.py's FSDP2), the weight syncs (parameters and buffers: a router's
score-correction bias is state the rollout must see bit for bit), gradient-sync control, reductions of
metrics over ranks, and the check that every rank holds the same bits; mixed precision (MixedPrecision:
fp32 masters for the optimizer, one compute copy that the trainer and the sampler both read, fp32
gradients); and `Policy`, the one owner of the policy's copies and of the end of an optimizer step. Under
--grad_reduce=exact (the default) the gradient sum is exact_sum.Reducer's (no DDP wrapper), and the batch
and the metrics are global (global_batch, all_gather_rows, reduce_metrics): the same bits at every world
size.
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import functools
import hashlib
import math
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from config import ConfigError
from support import hf
from model import RouteDetail, Transformer, expert_group
from support import exact_sum
from support.checkpoint import RunError
from support.packing import Scored, deal

if TYPE_CHECKING:                     # a run's classes: config.configs_for
    from config import TrainConfig


@dataclasses.dataclass
class Dist:
    """This process's place: its rank and world among the ranks of its role (the default process group's),
    and with --rollout_ranks the role ("train" or "rollout") and the bridge to the other side."""
    rank: int
    world: int
    device: torch.device
    role: str = "train"              # train | rollout (disaggregated: the last --rollout_ranks ranks generate)
    bridge: object = None            # disaggregated: the process groups between the sides (asynchrony/ranks.py)

    @property
    def master(self) -> bool:
        return self.rank == 0

    def print0(self, *args):
        if self.master:
            print(*args, flush=True)


def check_device(device: str) -> None:
    """--device must name a device this torch build has (the syntax is checked by TrainConfig)."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device={device}: this machine has no usable CUDA GPU (torch {torch.__version__}, "
                              f"CUDA build: {torch.version.cuda or 'no'}); use --device=cpu or --device=auto")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(f"--device={device}: only {torch.cuda.device_count()} CUDA device(s) visible")


def init_distributed(device: str, split=None) -> Dist:
    """NCCL with one GPU per local rank (gloo beside it for host tensors), or gloo on CPU; a single process
    when not under torchrun.

    split: a plug-in's division of a torchrun job's ranks into sides (Hooks.split_ranks: asynchrony's
    rollout ranks), called as split(rank, world, device, backend, init_kw) -> this rank's Dist, each side
    its own default process group; split.single() is its one line when there is no torchrun job."""
    check_device(device)
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if "RANK" in os.environ:
        return join_torchrun(use_cuda, split)
    if split is not None:
        split.single()
    return Dist(0, 1, torch.device(("cuda" if use_cuda else "cpu") if device == "auto" else device))


def join_torchrun(use_cuda: bool, split=None) -> Dist:
    """This process's place in the torchrun job: its rank, its device, the process group(s)."""
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    kw = {"device_id": dev} if use_cuda else {}
    if use_cuda:
        torch.cuda.set_device(dev)
    # on a GPU, CUDA tensors reduce over NCCL and host ones over gloo: the optimizer's state on the host
    # (memory/offload.py) has its norms, checkpoint gathers and sums there
    backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    if split is not None:
        return split(rank, world, dev, backend, kw)
    dist.init_process_group(backend, **kw)
    return Dist(rank, world, dev)


class Scorer(nn.Module):
    """model.score as a module call: DDP and FSDP2 hook __call__, so training goes through this.

    The trainer's hot path: score runs unchecked (its checks read tensors back, a sync on a GPU); the
    trainer checks its batches where it builds them (train.make_batch, replay.pack_routes).
    """

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, tokens, *, temperature: float, routes=None, with_entropy: bool = False, logits_chunk: int = 0,
                packing=None, route_detail: bool = False, entropy_grad: bool = False, router_logits: bool = False):
        out = self.model.score(tokens, temperature=temperature, routes=routes, with_entropy=with_entropy,
                               logits_chunk=logits_chunk, packing=packing, check=False, route_detail=route_detail,
                               entropy_grad=entropy_grad, router_logits=router_logits)
        return (out[0].clone(), *out[1:])                             # FSDP2 wants no view outputs


def parallelize(model: Transformer, tcfg: TrainConfig, d: Dist):
    """-> (the scorer to train through, a full-weight model for the sampler and checkpoints, sync() refreshing
    it). One process: the model itself, nothing to refresh; several: across_ranks."""
    scorer = Scorer(model)
    return (scorer, model, lambda: None) if d.world == 1 else across_ranks(model, scorer, tcfg, d)


def across_ranks(model: Transformer, scorer: nn.Module, tcfg: TrainConfig, d: Dist):
    """parallelize over several ranks: every rank holds the full model and the sampler reads it directly
    (DDP; no wrapper under --grad_reduce=exact, whose reduction is exact_sum.Reducer's), or a sharding
    plug-in's layout (parallel/'s FSDP2: sharding). Sharded experts (expert_parallel.shard_experts): DDP
    leaves them out (each rank's own, reduced over its replicas by expert_parallel.reduce_expert_grads)."""
    if (shards := sharding(tcfg, d)) is not None:
        return shards.wrap(model, scorer, d)
    if tcfg.grad_reduce == "exact":
        return scorer, model, lambda: None
    if (ep := expert_group(model)) is not None:
        DDP._set_params_and_buffers_to_ignore_for_model(scorer, ep.expert_names(scorer))
    return DDP(scorer, device_ids=[d.device.index] if d.device.type == "cuda" else None), model, lambda: None


def sharding(tcfg: TrainConfig, d: Dist):
    """The plug-in that shards the trained weights over the ranks (an options module's `sharding(tcfg, d)`:
    parallel/'s FSDP2 under --parallel=fsdp), or None: every rank holds them whole (one process, DDP)."""
    found = (m.sharding(tcfg, d) for m in type(tcfg).plugins if hasattr(m, "sharding"))
    return next((s for s in found if s is not None), None)


def unsharded(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole on this rank: an FSDP2 DTensor all-gathered over its mesh (collective), else itself."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def is_fsdp(model: nn.Module) -> bool:
    """Whether FSDP2 shards this model's parameters (DTensors)."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def finish_exact_grads(trained: nn.Module, max_norm: float, d: Dist, reducer) -> float:
    """After a minibatch's backward under --grad_reduce=exact: the reducer's sums over ranks, clipped to
    max_norm -> the norm before clipping, the same at every layout (NaN if a gradient was out of the fixed
    point's range, exact_sum)."""
    reducer.finish()
    if reducer.bad:
        return math.nan
    ep = expert_group(trained)
    experts = {id(p) for p in ep.split_params(trained)[1]} if ep is not None else set()
    return exact_sum.clip_grad_norm(list(trained.parameters()), max_norm, d, expert_ids=experts, ep=ep)


def finish_grads(trained: nn.Module, mp, max_norm: float, d: Dist) -> float:
    """After a minibatch's backward (--grad_reduce=fast): reduce what the wrappers did not (mixed
    precision's fp32 master grads, sharded experts' grads over their replicas), clip to max_norm -> the
    norm before clipping."""
    if mp is not None:
        mp.reduce_grads()
    ep = expert_group(trained)
    if ep is not None:                                                # EP (parallel/): shards over their replicas
        return ep.finish_grads(trained, max_norm, d.world, fsdp=is_fsdp(trained), reduced=mp is not None)
    gn = torch.nn.utils.clip_grad_norm_(trained.parameters(), max_norm)
    return gn.full_tensor().item() if hasattr(gn, "full_tensor") else gn.item()


# ---------------------------------------------------------------------------------------------------
# mixed precision: fp32 masters, one compute copy (docs/design.md, "Mixed precision")
# ---------------------------------------------------------------------------------------------------
def router_dtype(tcfg: TrainConfig, model_type: str) -> torch.dtype:
    """--router_dtype resolved: auto is the family table's (float32 where transformers upcasts)."""
    name = tcfg.router_dtype
    if name == "auto":
        name = "float32" if hf.family(model_type).router_dtype == "float32" else tcfg.dtype
    return getattr(torch, name)


def routers(model: Transformer) -> list[nn.Module]:
    """The gates (Linear + its score-correction bias buffer) of the MoE layers."""
    return [layer.mlp.gate for layer in model.layers if layer.is_moe]


def cast_for_compute(model: Transformer, dtype: torch.dtype, router: torch.dtype, device=None) -> Transformer:
    """A copy of `model` in `dtype` (on `device`, else where model is), its routers (gate weight, bias) in
    `router`; a cast is elementwise, so the copy's bits are those of each master tensor rounded on its own.
    A frozen parameter already in `dtype` there (LoRA's base, lora/) is shared, not copied: one copy."""
    where = device or next(model.parameters()).device
    shared = {id(p): p for p in model.parameters() if not p.requires_grad and p.dtype == dtype and p.device == where}
    out = copy.deepcopy(model, memo=dict(shared)).to(dtype=dtype, device=device)
    with torch.no_grad():
        for src, dst in zip(routers(model), routers(out)):
            dst.to(router)
            for a, b in zip(model_state(src), model_state(dst)):     # from the masters, not re-rounded
                b.copy_(a)
    return out


def place_weights(model: Transformer, tcfg: TrainConfig, d: Dist, apart: bool = False):
    """-> (scorer, full_model, sync_full_weights, mp): parallelize's three, and the MixedPrecision
    object when --dtype computes on a copy of the --master_dtype weights, or the masters are kept apart
    from the compute weights (apart: on the host, memory/offload.py); None: one set of weights."""
    if tcfg.master_dtype == "bfloat16" and not tcfg.mixed_precision:
        d.print0("--master_dtype=bfloat16: the optimizer updates bf16 weights; an update smaller than half a bf16 "
                 "ulp of its weight (2e-3 to 4e-3 relative) is lost (float32 masters keep it)")
    store_routers(model, tcfg)                     # one dtype: the masters' gates as one set of weights keeps them
    if tcfg.mixed_precision or apart:
        mp = mixed_precision(model, tcfg, d, apart)
        return mp.scorer, mp.full_model, mp.sync_full_weights, mp
    return (*parallelize(model, tcfg, d), None)


def store_routers(model: Transformer, tcfg: TrainConfig) -> None:
    """One set of weights (no mixed precision): the gates stored in --router_dtype (in place). A resume
    calls it before loading, so an fp32 gate is read back at its saved bits, not through --dtype."""
    if tcfg.mixed_precision:
        return
    router = router_dtype(tcfg, model.config.model_type)
    for gate in routers(model):
        if gate.weight.dtype != router:
            gate.to(router)


def _accumulate_into(master: torch.Tensor, p: torch.Tensor) -> None:
    """After autograd accumulated p.grad (compute dtype): add it to the master's fp32 grad, free it."""
    g = p.grad.to(master.device, master.dtype)                        # an fp32 router's grad: itself
    if master.grad is None:
        master.grad = g
    else:
        master.grad.add_(g)
    p.grad = None


class MixedPrecision:
    """fp32 master weights (the optimizer's) and one compute copy in --dtype (the router in its own dtype).

    One process / DDP: `compute` is a full Transformer cast from the masters after every optimizer step
    (refresh); the trainer's forward and backward run on it and the sampler reads it, one copy. Each
    compute parameter's gradient is added in fp32 to its master's .grad as soon as autograd has
    accumulated it (a post-accumulate hook), so micro-batches accumulate in fp32; across ranks the fp32
    master grads are averaged by all-reduce (reduce_grads; no DDP wrapper, whose reduction would run in
    bf16). Under --grad_reduce=exact the hooks are exact_sum.Reducer's (master_of maps a compute
    parameter to its master). Sharded masters (FSDP2): parallel/fsdp.ShardedMixedPrecision.
    apart (offload): the masters, their gradients and AdamW's state stay where they were built (the host)
    and the compute copy is made on d.device, also in the masters' dtype.
    """

    def __init__(self, master: Transformer, tcfg: TrainConfig, d: Dist, apart: bool = False):
        self.master, self.d, self.apart = master, d, apart
        self.dtype = getattr(torch, tcfg.dtype)
        self.router = router_dtype(tcfg, master.config.model_type)
        self.full_model = cast_for_compute(master, self.dtype, self.router, d.device)
        self._attach(tcfg)

    def _attach(self, tcfg: TrainConfig) -> None:
        """The trainer runs on the compute copy; its gradients go to the masters' fp32 .grad."""
        master, d = self.master, self.d
        self.scorer, self.sync_full_weights = Scorer(self.full_model), lambda: None
        masters = dict(master.named_parameters())
        self.master_of = {id(p): masters[name] for name, p in self.full_model.named_parameters()}
        if tcfg.grad_reduce == "fast":                                # exact: exact_sum.Reducer's hooks instead
            for name, p in self.full_model.named_parameters():
                if p.requires_grad:                                   # LoRA: not the frozen base
                    p.register_post_accumulate_grad_hook(functools.partial(_accumulate_into, masters[name]))
        self._pairs = [(m, c) for m, c in zip(model_state(master), model_state(self.full_model)) if m is not c]
        if self.apart and d.device.type == "cuda":                   # pinned: the recast's copies run async
            for t in model_state(master):
                t.data = t.data.pin_memory()

    def parameters(self) -> list[nn.Parameter]:
        """What the optimizer updates and clipping measures: the trained masters."""
        return [p for p in self.master.parameters() if p.requires_grad]

    @torch.no_grad()
    def refresh(self) -> None:
        """After an optimizer step (and the bias update): the compute copy cast from the masters."""
        for m, c in self._pairs:
            c.copy_(m, non_blocking=True)                         # host to device: from pinned memory, queued

    @torch.no_grad()
    def reduce_grads(self, bucket_bytes: int = 64 << 20) -> None:
        """Average the fp32 master grads over ranks (one process: nothing to do), in buckets."""
        if self.d.world == 1:
            return
        params = self.parameters()
        ep = expert_group(self.master)
        if ep is not None:                                            # experts: over their replicas only
            params, experts = ep.split_params(self.master)
            ep.reduce_grads(experts, self.d.world, self.d.device)
            params = [p for p in params if p.requires_grad]                # LoRA: not the frozen base
        for p in params:
            if p.grad is None:                                        # every rank reduces the same tensors
                p.grad = torch.zeros_like(p)
        bucket, size = [], 0
        for i, p in enumerate(params):
            bucket.append(p.grad)
            size += p.grad.nbytes
            if size >= bucket_bytes or i == len(params) - 1:
                flat = torch.cat([g.reshape(-1) for g in bucket]).to(self.d.device)   # offload: from the host
                dist.all_reduce(flat)
                flat.div_(self.d.world)
                for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                    g.copy_(part.view_as(g))
                bucket, size = [], 0

    def master_state(self) -> dict[str, torch.Tensor]:
        """The full fp32 masters (state_dict keys, buffers included), whole experts; a collective under
        sharding and EP."""
        ep = expert_group(self.master)
        if ep is not None:
            return ep.gather_experts(self.master)
        return {k: unsharded(v) for k, v in self.master.state_dict().items()}

    def cast(self, model: Transformer) -> Transformer:
        """Another model (the frozen reference) in the compute dtypes."""
        return cast_for_compute(model, self.dtype, self.router, self.d.device).requires_grad_(False)

    def reserve_bytes(self, opt_has_state: bool) -> int:
        """Bytes still to come on the device after the sampler is built: fp32 master grads and AdamW's two
        moments (this rank's shard when sharded; none when they are apart, on the host) and the compute
        grads in flight (in_flight_bytes)."""
        local = 0 if self.apart else sum(getattr(p, "to_local", lambda: p)().nbytes for p in self.parameters())
        return (1 if opt_has_state else 3) * local + self.in_flight_bytes()

    def in_flight_bytes(self) -> int:
        """The compute gradients alive at once: the largest one (each goes to its master when accumulated)."""
        return max(p.nbytes for p in self.full_model.parameters())


def mixed_precision(master: Transformer, tcfg: TrainConfig, d: Dist, apart: bool = False) -> MixedPrecision:
    """MixedPrecision over these masters, or the sharding plug-in's (parallel/fsdp.ShardedMixedPrecision)."""
    shards = sharding(tcfg, d)
    if shards is None:
        return MixedPrecision(master, tcfg, d, apart)
    return shards.mixed_precision(master, tcfg, d, apart)


# ---------------------------------------------------------------------------------------------------
# the policy's weights and the end of an optimizer step: one owner
# ---------------------------------------------------------------------------------------------------
class Policy:
    """The policy's copies of the weights, which reads which, and the end of an optimizer step.

    master    the weights the optimizer steps: fp32 masters (under --dtype=bfloat16 too), sharded
              under FSDP2, this rank's E/N experts under EP
    trainer   the module the training forward and backward run through: score as a module (Scorer),
              wrapped by DDP / FSDP2, over the masters or (mixed precision) their compute copy
    full      whole compute weights: the old policy's and the probe's forwards, checkpoints (the masters
              themselves with one dtype and no FSDP2)
    sampler   what the rollout runs: `full`, or the mismatch lab's copy of it (lab.rollout_copy)
    mp        MixedPrecision when the compute weights are a copy of the masters, else None
    sharding  the plug-in that shards the masters over the ranks (parallel/'s FSDP2), or None
    optimizer AdamW over the masters (build_optimizer)
    refresh() brings full and sampler up to date before anything reads them (a rollout, a checkpoint);
    step() is the end of an optimizer step: the step, the router bias update, the compute copy recast.
    """

    def __init__(self, model: Transformer, tcfg: TrainConfig, d: Dist, sampler_copy=None, apart: bool = False,
                 hooks=()):
        """sampler_copy(full, refresh) -> (sampler model, its refresh): the lab's rollout copy, or None;
        apart: the model (the masters) stays where it is, the compute weights are a copy on d.device;
        hooks: the plug-ins' (an optimizer of their own: support/hooks.py)."""
        self.master, self.tcfg, self.d, self.sharding = model, tcfg, d, sharding(tcfg, d)
        self.trainer, self.full, self._refresh, self.mp = place_weights(model, tcfg, d, apart)
        self.sampler = self.full
        if sampler_copy is not None:
            self.sampler, self._refresh = sampler_copy(self.full, self._refresh)
        self.optimizer = build_optimizer(model, tcfg, hooks)
        self.reducer = exact_reducer(self) if tcfg.grad_reduce == "exact" else None

    def refresh(self) -> None:
        self._refresh()
        if (ep := expert_group(self.master)) is not None:
            ep.weights_changed(self.master)                           # EPLB: the slots' weights, gathered again

    def compute_copy(self, model: Transformer) -> Transformer:
        """Another model (the frozen reference) in the trainer's compute dtypes."""
        return model if self.mp is None else self.mp.cast(model)

    def start_minibatch(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        if self.reducer is not None:
            self.reducer.start()

    @property
    def loss_scale(self) -> float:
        """What a micro-batch's loss is multiplied by before its backward: the world size under fast (DDP
        and FSDP2 average over ranks, the loss normalisers are global); 1 under exact (a sum)."""
        return 1.0 if self.reducer is not None else float(self.d.world)

    def grad_sync(self, last: bool):
        """The context of one micro-batch step's backward. fast: the wrappers reduce on the last step
        only; exact: every step's gradients go into the sums (FSDP2 reduce-scatters each step, told
        whether this is the one that writes the sum into .grad)."""
        if self.reducer is None:
            return grad_sync(self.trainer, enabled=last)
        self.reducer.last = last
        return grad_sync(self.trainer, enabled=True)

    def finish_grads(self) -> float:
        """After a minibatch's backward: the gradients reduced and clipped -> their norm before clipping."""
        if self.reducer is not None:
            return finish_exact_grads(self.master, self.tcfg.grad_clip, self.d, self.reducer)
        return finish_grads(self.master, self.mp, self.tcfg.grad_clip, self.d)

    def step(self, after=None) -> None:
        """The optimizer step; then after() (the hooks' after_update: router_training/'s bias balancing);
        then the compute copy recast from the masters."""
        self.optimizer.step()
        if after is not None:
            after()
        if self.mp is not None:
            self.mp.refresh()
        if (ep := expert_group(self.master)) is not None:
            ep.weights_changed(self.master)

    def reserve_bytes(self) -> int:
        """What the optimizer will still allocate once the sampler has sized its KV pool: the gradients
        (first backward) and AdamW's two moments (first step; already there on resume), this rank's
        shard under FSDP2; EPLB: the experts' slots, in each copy that runs forwards."""
        has_state = bool(self.optimizer.state)
        sums = 0 if self.reducer is None else self.reducer.reserve_bytes()
        if (ep := expert_group(self.full)) is not None:               # EPLB's slots
            sums += ep.slot_bytes(self.full) * (1 + (self.sampler is not self.full) + (self.sharding is not None))
        if self.mp is not None:
            return self.mp.reserve_bytes(has_state) + sums
        param_bytes = sum(getattr(p, "to_local", lambda: p)().nbytes for p in self.trainer.parameters())
        return (1 if has_state else 3) * param_bytes + sums


def exact_reducer(policy: Policy) -> exact_sum.Reducer:
    """--grad_reduce=exact: the Reducer of the policy's gradients, hooked where the backward produces them:
    the compute copy's parameters (mixed precision), the masters themselves, or the policy's sharding
    plug-in's (parallel/'s FSDP2: its groups' reduce-scatters)."""
    model, mp, d = policy.master, policy.mp, policy.d
    if policy.sharding is not None:
        return policy.sharding.reducer(model, policy.trainer, d)
    trained, master_of = (model, None) if mp is None else (mp.full_model, mp.master_of)
    ep = expert_group(model)
    if ep is not None:                                                # EP (parallel/): its shards' sums too
        return ep.exact_reducer(model, d, trained=trained, master_of=master_of)
    return exact_sum.Reducer(model, d, trained=trained, master_of=master_of)


def build_optimizer(model: Transformer, tcfg: TrainConfig, hooks=()) -> torch.optim.Optimizer:
    """AdamW over the model's trained parameters, one param group; or a hook's optimizer (router_training/:
    the gates in a group of their own)."""
    kw = dict(lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]     # LoRA: the adapters (the base is frozen)
    found = next((o for o in (h.optimizer(model, params, kw) for h in hooks) if o is not None), None)
    return torch.optim.AdamW(params, **kw) if found is None else found


def lr_at(step: int, cfg: TrainConfig, hooks=()) -> float:
    """The learning rate of optimizer step `step` (0-based): warmup, then a plug-in's schedule (a hook's
    `lr`: lr_halving/), else --lr_schedule's (docs/design.md, "The learning-rate horizon")."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if (planned := next((lr for lr in (h.lr(step, cfg) for h in hooks) if lr is not None), None)) is not None:
        return planned                                               # a plug-in's schedule
    if cfg.lr_schedule == "constant":
        return cfg.lr
    horizon = cfg.lr_decay_steps or cfg.steps                        # past it, lr stays at its minimum
    progress = 1.0 if step >= horizon else (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def update_is_finite(step: int, loss: float, grad_norm: float, skipped: int, tcfg: TrainConfig, d: Dist) -> bool:
    """Before an optimizer step: True if the loss and the gradient norm (both global: the same on every
    rank) are finite.

    Otherwise the step is skipped (False) while fewer than --skip_nonfinite_steps were, else RunError:
    a NaN never reaches the weights, so nothing non-finite is ever saved.
    """
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return True
    return skip_or_stop(step, loss, grad_norm, skipped, tcfg, d)


def skip_or_stop(step: int, loss: float, grad_norm: float, skipped: int, tcfg: TrainConfig, d: Dist) -> bool:
    """A non-finite loss or gradient norm: False (the step skipped) while --skip_nonfinite_steps allows."""
    bad = [f"{name} is {v}" for name, v in (("loss", loss), ("gradient norm", grad_norm)) if not math.isfinite(v)]
    if skipped < tcfg.skip_nonfinite_steps:
        d.print0(f"step {step}: {' and '.join(bad)}; skipping this optimizer step "
                 f"({skipped + 1} of --skip_nonfinite_steps={tcfg.skip_nonfinite_steps})")
        return False
    raise RunError(f"step {step}: the {' and the '.join(bad)} before the optimizer step; stopped before it reached "
                   "the weights (the last checkpoint is good). Lower --lr or check the rewards, then --resume; "
                   f"--skip_nonfinite_steps=N skips up to N such steps ({skipped} skipped so far)")


def model_state(model: nn.Module) -> list[torch.Tensor]:
    """Everything a weight sync must carry: the parameters, then the buffers (the routers'
    score-correction biases); DDP broadcasts buffers from rank 0 at each forward on its own."""
    return list(model.parameters()) + list(model.buffers())


def grad_sync(scorer, enabled: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of an optimizer step."""
    if isinstance(scorer, DDP) and not enabled:
        return scorer.no_sync()
    if hasattr(scorer, "set_requires_gradient_sync"):                # FSDP2
        scorer.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def all_cat(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world == 1:
        return t
    parts = [torch.empty_like(t, device=d.device) for _ in range(d.world)]
    dist.all_gather(parts, t.to(d.device))
    return torch.cat(parts).cpu()


def all_owned(table: torch.Tensor, d: Dist) -> torch.Tensor:
    """A table whose every entry one rank filled (the others hold 0), complete on every rank: an fp64
    all-reduce sum, exact because each entry adds its owner's value to zeros."""
    if d.world == 1:
        return table
    t = table.to(d.device, torch.float64)
    dist.all_reduce(t)
    return t.cpu()


def all_gather_rows(t: torch.Tensor, d: Dist) -> list[torch.Tensor]:
    """Every rank's t (n_r, ...) (n_r may differ; the trailing shape and dtype may not), by rank, on
    the host: padded to the largest n_r for the all-gather, then cut back."""
    if d.world == 1:
        return [t]
    counts = all_cat(torch.tensor([t.shape[0]]), d).tolist()
    pad = t.new_zeros(max(counts) - t.shape[0], *t.shape[1:])
    parts = [torch.empty(max(counts), *t.shape[1:], dtype=t.dtype, device=d.device) for _ in range(d.world)]
    dist.all_gather(parts, torch.cat([t, pad]).to(d.device))
    return [p[:n].cpu() for p, n in zip(parts, counts)]


def all_gather_dealt(fields: dict[str, torch.Tensor], sizes: list[int], d: Dist) -> dict[str, torch.Tensor]:
    """Results of micro-batches dealt by packing.deal, in the micro-batches' order on every rank: each
    field holds this rank's micro-batches' rows back to back (in its dealt order); sizes: every
    micro-batch's rows. The same tensors at every world size (one process: the fields themselves)."""
    got = {k: torch.cat(all_gather_rows(v, d)) for k, v in fields.items()}   # rank by rank
    at, spans = 0, {}
    for r in range(d.world):                                          # where micro-batch i's rows landed
        for i in deal(len(sizes), d.world, r):
            if i is not None:
                spans[i], at = (at, sizes[i]), at + sizes[i]
    pick = torch.cat([torch.arange(a, a + n) for a, n in (spans[i] for i in range(len(sizes)))])
    return {k: v[pick] for k, v in got.items()}


def on_host(parts: list[Scored]) -> Scored:
    """Forwards of consecutive row sets as one, on the host: logp in fp32, detached (entropy dropped)."""
    detail = None
    if all(p.detail is not None for p in parts):
        detail = RouteDetail(*(torch.cat([getattr(p.detail, f).cpu() for p in parts]) for f in RouteDetail.FIELDS))
    return Scored(torch.cat([p.logp.detach().float().cpu() for p in parts]), torch.cat([p.routes.cpu() for p in parts]),
                  None, torch.cat([p.rows for p in parts]), detail)


def gather_scored(parts: dict, sizes: list[int], d: Dist) -> Scored:
    """Forwards of a list of micro-batches (sizes: their rows), each run by the rank packing.deal gave it
    (parts: this rank's by index, None: a null one's, for the shapes), as one Scored on the host in the
    micro-batches' order: the same tensors at every world size."""
    real = sorted(i for i in parts if i is not None)
    mine = on_host([parts[i] for i in real] or [parts[None]])
    n = sum(len(parts[i].rows) for i in real)
    fields = {k: getattr(mine, k)[:n] for k in ("logp", "routes", "rows")}
    detail = RouteDetail.FIELDS
    fields.update({k: getattr(mine.detail, k)[:n] for k in detail} if mine.detail is not None else {})
    got = fields if d.world == 1 else all_gather_dealt(fields, sizes, d)       # one process: all of them
    return Scored(got["logp"], got["routes"], None, got["rows"],
                  RouteDetail(*(got[k] for k in detail)) if mine.detail is not None else None)


def global_batch(batch, d: Dist):
    """The rollout batch of every rank, in rank order (rank r sampled the global sequences r * B ...):
    each rank's batch widened to the longest sequence anywhere (packing.Batch.widen), then each field
    all-gathered; the bits make_batch gives for all the sequences at once, at every world size. These
    tensors (tokens, masks, log-probs, routes, advantages) are small next to the model's."""
    if d.world == 1:
        return batch
    T = int(all_cat(torch.tensor([batch.tokens.shape[1]]), d).max())
    wide = batch.widen(T)
    return type(batch)(**{f.name: all_cat(getattr(wide, f.name), d) for f in dataclasses.fields(wide)})


# The keys that describe the layout, not the run: what each rank measured, combined over the ranks. Every
# other key of a metrics row is computed from global tensors (the global batch, the forwards gathered in
# the micro-batches' order, sums of counts), the same value on every rank and at every world size.
PER_RANK = {"rollout_tokens_per_s": "sum", "preemptions": "sum", "prefix_cached_tokens": "sum", "prefilled_tokens": "sum",
            "spec_drafted_tokens": "sum", "spec_accepted_tokens": "sum",
            "step_time": "max", "trainer_idle_s": "max", "rollout_idle_s": "max"}


def reduce_metrics(row: dict, d: Dist) -> dict:
    """row with its PER_RANK keys combined over the ranks (a sum, or the slowest rank's time); every other
    key is global already."""
    keys = [k for k in PER_RANK if k in row]
    if not keys:
        return row
    out = dict(row)
    for how in ("sum", "max"):
        mine = [k for k in keys if PER_RANK[k] == how]
        if mine:
            t = torch.tensor([float(row[k]) for k in mine], dtype=torch.float64, device=d.device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM if how == "sum" else dist.ReduceOp.MAX)
            out.update({k: type(row[k])(v) for k, v in zip(mine, t.tolist())})
    out.update(sampler_rates(out))
    return out


SAMPLER_RATES = ("prefix_hit_rate", "spec_accept_rate")


def sampler_rates(row: dict) -> dict:
    """The sampler's rates of a row's summed counts (a rate of the sums, never a mean of rates): the
    share of prefilled positions the prefix cache served, the share of drafted tokens verify steps kept."""
    out = {}
    if "prefix_cached_tokens" in row:
        served, fed = row["prefix_cached_tokens"], row["prefilled_tokens"]
        out["prefix_hit_rate"] = served / (served + fed) if served + fed else 0.0
    if "spec_drafted_tokens" in row:
        drafted = row["spec_drafted_tokens"]
        out["spec_accept_rate"] = row["spec_accepted_tokens"] / drafted if drafted else 0.0
    return out


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for p in tensors:
        t = p.detach().cpu().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.nbytes))            # the raw bytes; needs no numpy
    return h.hexdigest()


def check_in_sync(model: Transformer, d: Dist) -> str:
    """Raise unless every rank holds bit-identical weights (and buffers); returns their digest. With
    sharded experts: the replicated state on every rank, each expert shard on the ranks holding it."""
    ep = expert_group(model)
    names = ep.expert_names(model) if ep is not None else []
    state = dict(model.named_parameters())
    dense = [p for n, p in state.items() if n not in names] + list(model.buffers())
    mine = (_digest(dense), _digest([state[n] for n in names]), ep.rank if ep else 0)
    rows = [None] * d.world
    if d.world > 1:
        dist.all_gather_object(rows, mine)
    else:
        rows = [mine]
    shards = {}
    for _, shard, r in rows:
        shards.setdefault(r, set()).add(shard)
    if len({row[0] for row in rows}) != 1 or any(len(v) != 1 for v in shards.values()):
        raise RuntimeError(f"ranks hold different weights: {rows}")
    if ep is None:
        return rows[0][0]
    return hashlib.sha256("".join([rows[0][0]] + [next(iter(shards[r])) for r in sorted(shards)]).encode()).hexdigest()
