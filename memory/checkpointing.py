"""Activation checkpointing (--activation_checkpointing=moe|full): the trainer's layers keep only their
inputs between the forward and the backward, and the backward runs each layer's forward again to get the
rest (torch.utils.checkpoint, non-reentrant).

The recompute is the same kernels on the same inputs, so it is the same bits: the gradients, and with
them the run, are those of the run without it (tests/test_memory.py: torch.equal, fp32 and bf16, packed
and padded; tests/world_check.py under FSDP2 and EP). What it costs is one more forward of each
checkpointed layer per backward (`python -m tooling.bench --only memory`).

How: setup gives each checkpointed layer of the trainer's modules a forward of its own (`recomputed`),
which goes through torch.utils.checkpoint when autograd records and runs the layer's class forward as is
otherwise (the sampler and the old policy's forwards: no grad, nothing changes for them, also where the
sampler runs the same modules). Under EP a null micro-batch (a rank with nothing to run while its group
steps) has gradients enabled too, so its layers recompute their exchanges in the backward as the others'
do. The layer's side outputs (the route detail, the router losses' logits: appended to lists the forward
is handed) are written by the forward only; the recompute appends to scratch ones.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from model import Block, KeptLogits, MoE
from support.hooks import Hooks


class ActivationCheckpointing(Hooks):
    """--activation_checkpointing: the trainer's blocks (full) or MoE layers (moe) recompute in the backward."""

    def __init__(self, kind: str):
        self.kind = kind

    def setup(self, run, resumed) -> None:
        p = run.policy
        for model in {id(m): m for m in (p.trainer, p.master, p.full)}.values():
            checkpoint_layers(model, self.kind)


def checkpoint_layers(model: torch.nn.Module, kind: str) -> int:
    """Give model's blocks (kind "full") or MoE layers ("moe") the recomputing forward -> how many."""
    layers = [m for m in model.modules() if isinstance(m, Block if kind == "full" else MoE)]
    for m in layers:
        m.forward = functools.partial(recomputed, m)     # a partial: a deepcopy of the model gets its own
    return len(layers)


def recomputed(module: torch.nn.Module, *args, **kw):
    """module's class forward; recorded by autograd only as its inputs, run again in the backward."""
    forward = type(module).forward
    if not torch.is_grad_enabled():
        return forward(module, *args, **kw)
    calls = [0]

    def run(*a, **k):
        calls[0] += 1
        if calls[0] > 1:                                  # the backward's recompute: side outputs to scratch
            a, k = tuple(_scratch(v) for v in a), {n: _scratch(v) for n, v in k.items()}
        return forward(module, *a, **k)
    # no RNG in a forward: nothing to preserve
    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False, **kw)


def _scratch(v):
    if isinstance(v, list):
        return []
    if isinstance(v, KeptLogits):
        return KeptLogits(v.n_experts)
    return v
