"""LoRA adapters, unmerged: y = x W + s (x A) B with s = alpha / r, W frozen, A and B trained.

Each adapted layer keeps its weight where it was (the same state_dict key, requires_grad off) and gains
`lora_A` (r, in) and `lora_B` (out, r), PEFT's layout; the routed experts gain them stacked by expert
(`lora_A13` (E, r, D), `lora_B13` (E, 2I, r), `lora_A2` (E, r, I), `lora_B2` (E, D, r); with
--lora_expert_factors=shared_outer the hidden side's factors, A13 and B2, have one expert row shared by all).
Both products run through kernels.linear, the row-invariant matmul (Triton's on a GPU), in the sampler and
the trainer alike: the adapter adds no op that depends on the batch, so the contract holds as it does
without it. Merging the adapter into bf16 weights (what engines' refits do) rounds W + s B A once more; the
lab's `lora_merged` fault measures what that costs (lab/faults.py).

The base is frozen in its compute dtype: under mixed precision (bf16 over fp32 masters) the frozen weights
are cast to bf16 in the masters' model and shared with the compute copy (one copy, no fp32 master, no
gradient, no AdamW state); the adapters keep fp32 masters like any trained weight. B starts at zero, so
step 0's policy is the base's, bit for bit.
"""
from __future__ import annotations

import functools
import math
import os

import torch
from torch import nn

import kernels
from config import ConfigError
from model import MLP, MoE, Linear, Router, Transformer

EXPERT_FACTORS = ("lora_A13", "lora_B13", "lora_A2", "lora_B2")
GATES = ("shared_expert_gate", "in_proj_a", "in_proj_b")   # per-token scalars (per head), never adapted


class Adapted:
    """Mixed into a Linear (or the Router) by adapt(): the layer's own forward, plus s (x A) B."""
    scale: float

    def forward(self, x):
        y = super().forward(x)
        x = x.to(self.lora_A.dtype)                          # the router runs in its own dtype, as its weight
        return y + (kernels.linear(kernels.linear(x, self.lora_A), self.lora_B) * self.scale).to(y.dtype)


class AdaptedExperts:
    """Mixed into a MoE layer by adapt(): its routed experts with per-expert adapters (lora_experts); a
    sharded layer (expert parallelism, parallel/) sends its adapters' rows with the experts' and runs each
    row on its owner by lora_rows."""
    scale: float

    def experts(self, x2, ids, weights):
        if getattr(self, "ep", None) is not None:                    # sharded: experts_op is the exchange's
            factors = {n: getattr(self, n) for n in EXPERT_FACTORS}
            return self.experts_op(x2, self.w13, self.w2, ids, weights, **self.expert_extras(), extra=factors,
                                   rows=functools.partial(lora_rows, scale=self.scale))
        factors = [getattr(self, n) for n in EXPERT_FACTORS]
        return lora_experts(x2, self.w13, self.w2, ids, weights, factors, self.scale, **self.expert_extras())

    @torch.no_grad()
    def keep_experts(self, experts: list[int]) -> None:
        super().keep_experts(experts)
        ids = torch.tensor(experts, device=self.w13.device)
        for n in EXPERT_FACTORS:
            t = getattr(self, n)
            setattr(self, n, nn.Parameter(t[ids].clone(), requires_grad=t.requires_grad))


_CLASSES: dict[type, type] = {}


def _adapted_class(cls: type, mixin: type) -> type:
    """cls with the mixin's forward (one class per base class, so copies and pickles see one type)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Lora{cls.__name__}", (mixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def lora_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 factors: list[torch.Tensor], scale: float, b13=None, b2=None, swiglu=None) -> torch.Tensor:
    """kernels.moe_experts with each expert's adapters: gate/up = x W13[e] + s (x A13[e]) B13[e], down
    likewise. x (M, D); ids (M, k); weights (M, k) fp32; factors: A13 (E or 1, r, D), B13 (E, 2I, r),
    A2 (E, r, I), B2 (E or 1, D, r) -> (M, D) in x.dtype. The steps are kernels.moe_experts' torch path
    (sort, per expert the row-chunked linear, the fixed-order combine), so a row's bits depend on no other row."""
    M, k = ids.shape
    order, counts = kernels.sort_slots(ids, w13.shape[0])
    ws = dict(zip(EXPERT_FACTORS, factors), w13=w13, w2=w2, b13=b13, b2=b2)
    per_slot = _slots(x, k, order, counts, ws, weights.reshape(-1), scale, swiglu)   # (M*k, D) fp32
    return kernels.combine_slots(per_slot.view(M, k, x.shape[1]), x.dtype)


def lora_rows(x: torch.Tensor, ws: dict, ids: torch.Tensor, weights: torch.Tensor, swiglu=None, *,
              scale: float) -> torch.Tensor:
    """An expert-parallel owner's rows (parallel/expert_parallel.moe_experts' `rows`): each row through
    expert ids[r] with its adapters, weighted, fp32: x (R, D); ws: the expert tensors by name (this rank's
    shard, adapters included); ids, weights (R,) -> (R, D), a row's bits those of its slot in lora_experts."""
    order, counts = kernels.sort_slots(ids.reshape(-1, 1), ws["w13"].shape[0])
    return _slots(x, 1, order, counts, ws, weights.reshape(-1), scale, swiglu)


def _slots(x, k: int, order, counts: list[int], ws: dict, weights, scale: float, swiglu) -> torch.Tensor:
    """kernels.grouped_experts with the adapters: (R*k, D) fp32 in slot order, slot s reading row s // k."""
    w13, w2, b13, b2 = ws["w13"], ws["w2"], ws.get("b13"), ws.get("b2")
    A13, B13, A2, B2 = (ws[n] for n in EXPERT_FACTORS)
    I = w2.shape[2]
    outs, start = [], 0
    for e, n in enumerate(counts):                                   # empty experts too: the same ops
        slots = order[start:start + n]
        start += n
        h = _adapted(x[slots // k], w13[e], A13[e % len(A13)], B13[e], scale)   # (n, 2I)
        if b13 is not None:
            h = h + b13[e]
        a = kernels.silu_mul(h[:, :I], h[:, I:]) if swiglu is None else kernels.clamped_swiglu(h[:, :I], h[:, I:], *swiglu)
        y = _adapted(a, w2[e], A2[e], B2[e % len(B2)], scale)       # (n, D)
        if b2 is not None:
            y = y + b2[e]
        outs.append(y.float() * weights[slots, None])
    return torch.cat(outs)[torch.argsort(order)]


def _adapted(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """x w.T + s (x a.T) b.T, each product the row-invariant linear: x (n, in), w (out, in), a (r, in), b (out, r)."""
    return kernels.linear(x, w) + kernels.linear(kernels.linear(x, a), b) * scale


# ---------------------------------------------------------------------------------------------------
# which layers, and adding the adapters
# ---------------------------------------------------------------------------------------------------
def targets(model: Transformer, words: set[str]) -> list[tuple[str, nn.Module]]:
    """(name, module) of the layers --lora_targets names: Linears (attention, mlp: dense MLPs and shared
    experts, not the shared expert's 1-wide gate), Routers (router), MoE layers (experts). A hybrid's Gated
    DeltaNet is attention here: its in_proj_qkv, in_proj_z and out_proj, not in_proj_a / in_proj_b (one
    number per value head, the decay's and the write strength's gates: a rank above their width is no
    low-rank adapter)."""
    found = []
    for i, block in enumerate(model.layers):
        groups = {"attention": [(f"layers.{i}.{block.mixer}", getattr(block, block.mixer))]}
        mlp, pre = block.mlp, f"layers.{i}.mlp"
        if isinstance(mlp, MLP):
            groups["mlp"] = [(pre, mlp)]
        else:
            groups["mlp"] = [(f"{pre}.{n}", getattr(mlp, n)) for n in ("shared_experts", "shared_expert")
                             if getattr(mlp, n) is not None]
            groups["router"] = [(f"{pre}.gate", mlp.gate)]
            groups["experts"] = [(pre, mlp)]
        for word in sorted(words & set(groups)):
            for pre, m in groups[word]:
                if word in ("experts", "router"):
                    found.append((pre, m))
                    continue
                found += [(f"{pre}.{n}", sub) for n, sub in m.named_modules()
                          if type(sub) is Linear and n and not n.endswith(GATES)]
    return found


def check_targets(model: Transformer, words: set[str], rank: int) -> None:
    """One line for targets that match nothing and for a rank above a targeted weight's dimensions."""
    found = targets(model, words)
    if not found:
        raise ConfigError(f"--lora_targets={','.join(sorted(words))}: no layer of this model matches; "
                          "try attention")
    dims = [(name, min(m.w13.shape[1:] + m.w2.shape[1:]) if isinstance(m, MoE) else min(m.weight.shape))
            for name, m in found]
    name, small = min(dims, key=lambda t: t[1])
    if rank > small:
        raise ConfigError(f"--lora_rank={rank} is above {name}'s smaller dimension ({small}): a rank-{rank} "
                          f"adapter there is not low-rank; use --lora_rank <= {small} or drop its target")


def adapt(model: Transformer, rank: int, alpha: float, words: set[str], shared_outer: bool, seed: int,
          frozen_dtype: torch.dtype, router_dtype: torch.dtype, experts: list[int] | None = None) -> list[str]:
    """Freeze every weight, cast the frozen ones to their compute dtype (routers: router_dtype), add the
    adapters (A: PEFT's kaiming-uniform init from `seed`, the same on every rank; B: zeros) in the
    masters' dtype -> the adapted layers' names. experts: the logical experts the model holds (an EP
    rank's shard), whose rows of the per-expert factors it keeps: every expert's are drawn, so a shard
    holds EP=1's values."""
    master = next(model.parameters()).dtype
    found = targets(model, words)
    model.requires_grad_(False)
    gates = {id(p) for b in model.layers if b.is_moe for p in b.mlp.gate.parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(router_dtype if id(p) in gates else frozen_dtype)
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device

    def new(shape, fan_in, zero=False):
        if device.type == "meta":                                    # a plan's or an export's build: no values
            return nn.Parameter(torch.empty(shape, device=device, dtype=master))
        t = torch.zeros(shape) if zero else (torch.rand(shape, generator=g) * 2 - 1) / math.sqrt(fan_in)
        return nn.Parameter(t.to(device=device, dtype=master))       # kaiming_uniform(a=sqrt(5)): bound 1/sqrt(fan_in)

    for _, m in found:
        m.scale = alpha / rank
        if isinstance(m, MoE):
            (_, I2, D), I, E = m.w13.shape, m.w2.shape[2], model.config.num_experts
            outer = 1 if shared_outer else E
            m.lora_A13, m.lora_B13 = new((outer, rank, D), D), new((E, I2, rank), rank, zero=True)
            m.lora_A2, m.lora_B2 = new((E, rank, I), I), new((outer, D, rank), rank, zero=True)
            m.__class__ = _adapted_class(type(m), AdaptedExperts)
            if experts is not None:                                  # the shard's rows (per_expert factors)
                for n in EXPERT_FACTORS:
                    setattr(m, n, nn.Parameter(getattr(m, n)[experts].clone()))
        else:
            out, inp = m.weight.shape
            m.lora_A, m.lora_B = new((rank, inp), inp), new((out, rank), rank, zero=True)
            if isinstance(m, Router):                              # the gate's adapters in its dtype
                m.lora_A.data, m.lora_B.data = m.lora_A.data.to(router_dtype), m.lora_B.data.to(router_dtype)
            m.__class__ = _adapted_class(type(m), Adapted)
    return [name for name, _ in found]


def adapted_shapes(cfg, tcfg) -> tuple[list[tuple[str, tuple[int, ...]]], list[tuple[str, tuple[int, ...]]]]:
    """(trained, frozen): (name, shape) of the adapters and of the base weights of a --lora_rank run, from a
    meta-device build (no memory; tooling/plan.py's)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    adapt(model, tcfg.lora_rank, tcfg.lora_alpha, tcfg.lora_target_set(),
          tcfg.lora_expert_factors == "shared_outer", 0, torch.float32, torch.float32)
    named = [(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]
    return [(n, s) for n, s, g in named if g], [(n, s) for n, s, g in named if not g]


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("lora_")


# ---------------------------------------------------------------------------------------------------
# merging: the adapter folded into the weights (the export; the lab's fault)
# ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def merged_state(model: nn.Module, device=None) -> dict[str, torch.Tensor]:
    """The weights with each adapter folded in, W + s B A computed in fp32 on W's device and rounded once to
    W's dtype; the adapters' own keys dropped: a plain model's state_dict. device: where every tensor of it
    goes (None: where it is), each merged weight as soon as it is made, so that a GPU holds one weight's fp32
    terms at a time, never a second base."""
    to = (lambda t: t) if device is None else (lambda t: t.to(device))         # noqa: E731
    folded = {}
    for name, m in model.named_modules():
        if isinstance(m, Adapted):
            w = m.weight
            folded[f"{name}.weight"] = to((w.float() + m.scale * (m.lora_B.float() @ m.lora_A.float())).to(w.dtype))
        elif isinstance(m, AdaptedExperts):
            A13, B13, A2, B2 = (getattr(m, n).float() for n in EXPERT_FACTORS)
            folded[f"{name}.w13"] = to((m.w13.float() + m.scale * (B13 @ A13)).to(m.w13.dtype))   # (E, 2I, D)
            folded[f"{name}.w2"] = to((m.w2.float() + m.scale * (B2 @ A2)).to(m.w2.dtype))       # (E, D, I)
    return {k: folded[k] if k in folded else to(v) for k, v in model.state_dict().items() if not is_adapter(k)}


def merged(model: Transformer, device=None) -> Transformer:
    """A plain Transformer with the adapter merged into its weights (merged_state), in the weights' dtypes, on
    `device` (None: the model's); the checkpoint tensors it keeps unused (MTP's) go with it."""
    state = merged_state(model, device)
    with torch.device("meta"):
        out = Transformer(model.config)
    out.load_state_dict(state, assign=True)
    out.extra_tensors = {k: v if device is None else v.to(device) for k, v in model.extra_tensors.items()}   # MTP's
    return out.requires_grad_(False)


# ---------------------------------------------------------------------------------------------------
# starting from a LoRA run's checkpoint
# ---------------------------------------------------------------------------------------------------
def is_lora_checkpoint(path: str) -> bool:
    """Whether path is a checkpoint folder whose masters file holds adapters (a --lora_rank run's)."""
    from safetensors import safe_open
    from support.checkpoint import MASTERS
    file = os.path.join(path, MASTERS) if os.path.isdir(path) else ""
    if not os.path.isfile(file):
        return False
    with safe_open(file, "pt") as f:
        return any(is_adapter(k) for k in f.keys())


@torch.no_grad()
def continue_from(model: Transformer, ckpt: str, tcfg, experts: list[int] | None = None) -> None:
    """The base and the adapters of a LoRA run's checkpoint into the adapted model, at their saved bits
    (its HF export, which from_pretrained read, is the merged weights); experts: an EP rank's, read alone."""
    from support.checkpoint import load_trainer_state, load_weights
    saved = load_trainer_state(ckpt)["train_config"]
    for key in ("lora_rank", "lora_targets", "lora_expert_factors"):
        if saved.get(key) != getattr(tcfg, key):
            raise ConfigError(f"--init_from={ckpt} holds adapters of --{key}={saved.get(key)!r}, this run asks for "
                              f"{getattr(tcfg, key)!r}: pass the checkpoint's to continue them (or init from its "
                              "merged weights without --lora_rank)")
    state = load_weights(ckpt, model, experts)
    for k, t in model.state_dict().items():
        t.copy_(state[k])
