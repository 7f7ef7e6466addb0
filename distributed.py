"""Distributed training: one process, or one rank of a torchrun job (RANK, WORLD_SIZE, LOCAL_RANK set).

    d = init_distributed("auto")                              # NCCL per GPU, gloo on CPU, or one process
    scorer, full_model, sync = parallelize(model, tcfg, d)    # DDP or FSDP2; the sampler's full weights

What train.py needs beyond one process: the parallel wrappers (DDP, FSDP2 with a full copy of the
weights for the sampler), the weight syncs (parameters and buffers: a router's score-correction bias
is state the rollout must see bit for bit), gradient-sync control, reductions of metrics over ranks,
and the check that every rank holds the same bits.
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import hashlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from config import TrainConfig
from model import Transformer


@dataclasses.dataclass
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def master(self) -> bool:
        return self.rank == 0

    def print0(self, *args):
        if self.master:
            print(*args, flush=True)


def init_distributed(device: str) -> Dist:
    """NCCL with one GPU per local rank, or gloo on CPU; a single process when not under torchrun."""
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ:
        return Dist(0, 1, torch.device(("cuda" if use_cuda else "cpu") if device == "auto" else device))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if use_cuda:
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    return Dist(rank, world, dev)


class Scorer(nn.Module):
    """model.score as a module call: DDP and FSDP2 hook __call__, so training goes through this.

    The trainer's hot path: score runs unchecked (its checks read tensors back, a sync on a GPU); the
    trainer checks its batches where it builds them (train.make_batch, audit.pack_routes).
    """

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, tokens, *, temperature: float, routes=None, with_entropy: bool = False, logits_chunk: int = 0):
        out = self.model.score(tokens, temperature=temperature, routes=routes, with_entropy=with_entropy,
                               logits_chunk=logits_chunk, check=False)
        return (out[0].clone(), *out[1:])                             # FSDP2 wants no view outputs


def parallelize(model: Transformer, tcfg: TrainConfig, d: Dist):
    """-> (the scorer to train through, a full-weight model for the sampler and checkpoints, sync() refreshing it).

    ddp: every rank holds the full model; the sampler reads it directly.
    fsdp: FSDP2 shards each block and the rest; the sampler reads a full copy, refreshed by an
    all-gather before each rollout (bit-identical to the weights the trainer computes with).
    """
    scorer = Scorer(model)
    if d.world == 1:
        return scorer, model, lambda: None
    if tcfg.parallel == "ddp":
        return DDP(scorer, device_ids=[d.device.index] if d.device.type == "cuda" else None), model, lambda: None
    from torch.distributed.fsdp import fully_shard
    full_copy = copy.deepcopy(model).requires_grad_(False)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(scorer)
    full_params = dict(full_copy.named_parameters())
    full_buffers = dict(full_copy.named_buffers())

    @torch.no_grad()
    def sync():
        for name, p in model.named_parameters():
            full_params[name].copy_(p.full_tensor())
        for name, b in model.named_buffers():                         # FSDP2 leaves buffers whole on each rank
            full_buffers[name].copy_(b)
    return scorer, full_copy, sync


def lower_precision_copy(source: Transformer, dtype: torch.dtype, sync_source):
    """The mismatch lab's rollout weights: a copy of `source` in `dtype`, refreshed before each rollout."""
    copy_ = copy.deepcopy(source).to(dtype).requires_grad_(False)
    pairs = list(zip(model_state(source), model_state(copy_)))       # the router bias is rounded too

    @torch.no_grad()
    def sync():
        sync_source()
        for p, q in pairs:
            q.copy_(p)
    return copy_, sync


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


def all_sum(x: float, d: Dist) -> float:
    if d.world == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=d.device)
    dist.all_reduce(t)
    return t.item()


def all_cat(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world == 1:
        return t
    parts = [torch.empty_like(t, device=d.device) for _ in range(d.world)]
    dist.all_gather(parts, t.to(d.device))
    return torch.cat(parts).cpu()


SUMMED = ("loss", "clip_frac", "rollout_tokens_per_s", "preemptions")
SHARED = ("step", "lr", "skipped_steps")


def reduce_metrics(row: dict, d: Dist) -> dict:
    """Combine per-rank metrics: sums for SUMMED, max/min for *max*/*min*, the mean otherwise (ranks
    hold equal numbers of sequences, so a mean of rank means; token-level means are approximate)."""
    if d.world == 1:
        return row
    rows = [None] * d.world
    dist.all_gather_object(rows, row)
    out = {}
    for k, v in row.items():
        vals = [r[k] for r in rows]
        if k in SHARED:
            out[k] = v
        elif isinstance(v, list):
            out[k] = [sum(x) / d.world for x in zip(*vals)]
        elif k in SUMMED:
            out[k] = sum(vals)
        elif "max" in k:
            out[k] = max(vals)
        elif "min" in k:
            out[k] = min(vals)
        else:
            out[k] = sum(vals) / d.world
    return out


def check_in_sync(model: Transformer, d: Dist) -> str:
    """Raise unless every rank holds bit-identical weights (and buffers); returns their digest."""
    h = hashlib.sha256()
    for p in model_state(model):
        t = p.detach().cpu().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.nbytes))            # the raw bytes; needs no numpy
    digests = [None] * d.world
    if d.world > 1:
        dist.all_gather_object(digests, h.hexdigest())
    else:
        digests = [h.hexdigest()]
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks hold different weights: {digests}")
    return digests[0]
