"""The mismatch lab's deliberate faults: the rollout's copy of the weights made to differ on purpose.

    from lab.faults import rollout_copy
    sampler_model, refresh = rollout_copy(full, tcfg, rcfg, refresh)   # full itself when nothing differs

In the default (invariant) run the sampler reads the trainer's own compute weights and the mismatch is
exactly zero. The lab (`python -m tooling.bench --only lab`, README "The mismatch lab") makes the rollout side
differ in one way at a time, while the trainer stays invariant, to measure the mismatch and the fixes:
* precision: a bf16 / fp16 copy of the weights (--rollout_dtype=bfloat16), or matmul weights rounded
  to int8 / fp8_e4m3 per output channel and dequantized (--rollout_dtype=int8|fp8_e4m3,
  `fake_quantize`), the router kept exact with --rollout_quant_router=false;
* routing: the sampler's router wrong in one way (--rollout_router_fault, lab/options.py's ROUTER_FAULTS), by a
  subclass of model.MoE that overrides its `route` / `experts` seams on the copy's MoE layers;
* kernels: --rollout_mode=fast and --router_bf16 are lab/fast_ops.py's op set, swapped in by
  the sampler (rollout.Sampler), not a copy of the weights.
Every fault acts on a copy of its own, refreshed from the compute weights before each rollout, so the
trainer's model never carries one. The trainer-side source, --train_capacity_factor, is the model's
capacity limit (parallel/hooks.capacity_limit).
"""
from __future__ import annotations

import bisect
import copy

import torch

import kernels
from config import ConfigError, RolloutConfig, TrainConfig
from model import Transformer
from support.distributed import model_state
from support.hooks import Hooks


# ---------------------------------------------------------------------------------------------------
# the rollout's copy: which one, and how it is refreshed
# ---------------------------------------------------------------------------------------------------
def rollout_copy(full: Transformer, tcfg: TrainConfig, rcfg: RolloutConfig, refresh):
    """-> (the model the sampler runs, the refresh that brings it up to date before a rollout).
    full: the compute weights (the trainer's full copy), refresh: its own refresh (full <- masters)."""
    model = full
    if rcfg.quantized:                                               # the quantized copy
        model, refresh = quantized_copy(full, rcfg.rollout_dtype, refresh, rcfg.rollout_quant_router)
    elif rcfg.rollout_dtype and rcfg.rollout_dtype != tcfg.dtype:    # the lower-precision copy
        model, refresh = lower_precision_copy(full, getattr(torch, rcfg.rollout_dtype), refresh)
    if rcfg.rollout_router_fault != "none":
        model, refresh = router_fault_copy(model, full, rcfg.rollout_router_fault, refresh)
    if rcfg.rollout_linear_decode == "recurrent":
        model, refresh = recurrent_decode_copy(model, full, refresh)
    return model, refresh


def check_linear_decode(config, mode: str) -> None:
    if mode == "recurrent" and not config.linear_layers:
        raise ConfigError("--rollout_linear_decode=recurrent needs Gated DeltaNet layers (--init_from=tiny-hybrid "
                          "or a qwen3_5_moe / qwen3_next checkpoint)")


def recurrent_decode_copy(rollout_model: Transformer, full: Transformer, refresh):
    """The rollout's weights with their Gated DeltaNet layers decoding by the recurrent form (hybrids/family.
    EngineDecode: what inference engines run), on a copy of its own; the trainer keeps the grid."""
    check_linear_decode(full.config, "recurrent")
    from hybrids.family import EngineDecode, LinearAttention
    if rollout_model is full:
        rollout_model, refresh = lower_precision_copy(full, None, refresh)
    for layer in rollout_model.layers:
        if isinstance(getattr(layer, layer.mixer), LinearAttention):
            getattr(layer, layer.mixer).__class__ = EngineDecode
    return rollout_model, refresh


class Faults(Hooks):
    """The lab's faults through the step's seams (support/hooks.py): checked against the task and the model
    before anything is built, the sampler's model a copy of the compute weights (rollout_copy), the sampler
    wrapped (episode_fault). The trainer's side is never touched."""

    def __init__(self, tcfg: TrainConfig, rcfg: RolloutConfig):
        self.tcfg, self.rcfg = tcfg, rcfg

    def check_build(self, task, config) -> None:
        check_router_fault(config, self.rcfg.rollout_router_fault)
        check_episode_fault(task, self.rcfg.rollout_episode_fault)
        check_linear_decode(config, self.rcfg.rollout_linear_decode)

    def sampler_model(self, full, refresh):
        return rollout_copy(full, self.tcfg, self.rcfg, refresh)

    def wrap_sampler(self, sampler):
        return episode_fault(sampler, self.rcfg.rollout_episode_fault)


def lower_precision_copy(source: Transformer, dtype: torch.dtype | None, sync_source):
    """A copy of `source` in `dtype` (None: its own dtypes), refreshed before each rollout."""
    copy_ = copy.deepcopy(source).requires_grad_(False)
    if dtype is not None:
        copy_ = copy_.to(dtype)
    pairs = list(zip(model_state(source), model_state(copy_)))       # the router bias is rounded too

    @torch.no_grad()
    def sync():
        sync_source()
        for p, q in pairs:
            q.copy_(p)
    return copy_, sync


QUANT_MAX = {"int8": 127.0, "fp8_e4m3": 448.0}     # the largest magnitude of each format


def fake_quantize(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """w rounded to `fmt` with one absmax scale per output channel, dequantized back to w's dtype.

    w (..., out, in): the scale of row o is max|w[..., o, :]| / QUANT_MAX[fmt] (1 for an all-zero row);
    int8 rounds w / scale to the nearest integer in [-127, 127], fp8_e4m3 casts it to
    torch.float8_e4m3fn (round to nearest even). Computed in fp32.
    """
    w32 = w.float()
    absmax = w32.abs().amax(dim=-1, keepdim=True)                    # (..., out, 1)
    scale = torch.where(absmax > 0, absmax / QUANT_MAX[fmt], torch.ones_like(absmax))
    x = w32 / scale
    q = x.round().clamp(-127, 127) if fmt == "int8" else x.to(torch.float8_e4m3fn).float()
    return (q * scale).to(w.dtype)


def quantized_copy(source: Transformer, fmt: str, sync_source, quantize_router: bool = True):
    """A copy of `source` whose matmul weights (attention and MLP projections, the stacked experts, the
    router gate unless quantize_router is False) are fake_quantize'd, refreshed before each rollout;
    embeddings, the LM head, norms, biases and the router's score-correction bias stay as they are
    (weight-only quantization as engines serve it)."""
    copy_ = copy.deepcopy(source).requires_grad_(False)
    skip = {id(source.embed_tokens.weight), id(source.lm_weight())}
    skip |= {id(p) for n, p in source.named_parameters() if n.rsplit(".", 1)[-1] in ("b13", "b2")}  # (E, n) biases
    if not quantize_router:
        skip |= {id(layer.mlp.gate.weight) for layer in source.layers if layer.is_moe}
    pairs = [(p, q, p.dim() >= 2 and id(p) not in skip) for p, q in zip(model_state(source), model_state(copy_))]

    @torch.no_grad()
    def sync():
        sync_source()
        for p, q, quantize in pairs:
            q.copy_(fake_quantize(p, fmt) if quantize else p)
    return copy_, sync


# ---------------------------------------------------------------------------------------------------
# router faults: what a conversion bug or a second engine gets wrong about routing
# ---------------------------------------------------------------------------------------------------
def expert_map_fault(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The expert_map fault: ids read through a table that swaps the first and the last expert, as an
    engine whose placement table disagrees with where the weights are (across EP ranks at every
    contiguous placement) would compute them. ids (M, k) -> (M, k), the same ids otherwise."""
    first, last = ids == 0, ids == n_experts - 1
    return torch.where(first, n_experts - 1, torch.where(last, 0, ids))


def biased_weights(logits: torch.Tensor, ids: torch.Tensor, bias: torch.Tensor, norm_topk_prob: bool, *,
                   scoring: str, scaling: float, **_) -> torch.Tensor:
    """The bias_in_weights fault: kernels.route's combine weights, but of the biased scores.
    logits (M, E), ids (M, k) -> weights (M, k) fp32."""
    kind = kernels.ROUTER_SCORES[scoring]
    weights = kind.weigh((kind.scores(logits) + bias.float()).gather(-1, ids))
    if norm_topk_prob:
        total = weights[:, 0]
        for j in range(1, weights.shape[1]):                          # k ascending, as route
            total = total + weights[:, j]
        weights = weights / (total[:, None] + kind.eps)
    return weights * scaling if scaling != 1.0 else weights


class FaultyRouting:
    """Mixed into a MoE layer's class on the rollout's copy (set_router_fault): its router wrong in the
    one way `self.fault` names, through model.MoE's seams (router_inputs, route, experts)."""
    fault: str = "none"

    def router_inputs(self, dtype):
        bias, norm = super().router_inputs(dtype)
        if self.fault == "no_bias":                                   # the choice on the raw scores
            bias = None
        elif self.fault == "bias_sign":                               # the bias subtracted, not added
            bias = -bias
        elif self.fault == "no_renorm":                               # norm_topk_prob ignored
            norm = False
        return bias, norm

    def route(self, logits, forced, detail):
        ids, weights, chosen, *extra = super().route(logits, forced, detail)
        if self.fault == "bias_in_weights":                           # the combine weights of the biased scores
            bias, norm = self.router_inputs(logits.dtype)
            weights = biased_weights(logits, ids, bias, norm, **self.route_kw)
        if self.fault == "shared_in_topk":                            # the routed weights over 1 + their sum
            total = 1.0 + weights[:, 0]
            for j in range(1, weights.shape[1]):                      # k ascending, as route
                total = total + weights[:, j]
            weights, self.shared_share = weights / total[:, None], 1.0 / total[:, None]   # (M, k), (M, 1)
        return (ids, weights, chosen, *extra)

    def experts(self, x2, ids, weights):
        if self.fault == "expert_map":                                # the right ids reach the wrong experts
            ids = expert_map_fault(ids, self.n_experts)
        return super().experts(x2, ids, weights)

    def add_shared(self, out, x2):
        if self.fault != "shared_in_topk":
            return super().add_shared(out, x2)
        # the engine's fused top-k: the shared expert a (k+1)-th slot of score 1, the k+1 renormalised, so
        # the shared expert weighs 1 / (1 + sum of the routed weights) (route above divided those)
        return out + (self.shared_share * self.shared_experts(x2).float()).to(out.dtype)


_FAULTY: dict[type, type] = {}


def set_router_fault(model: Transformer, fault: str) -> None:
    """Give every MoE layer of `model` (a copy of its own) the router fault `fault` (ROUTER_FAULTS;
    "none" takes it off)."""
    for layer in model.layers:
        if layer.is_moe:
            set_layer_fault(layer.mlp, fault)


def set_layer_fault(moe, fault: str) -> None:
    """One MoE layer's router fault: its class swapped for the FaultyRouting subclass of it (or back).
    The layer keeps its parameters and buffers; only its routing changes."""
    base = type(moe).__bases__[1] if isinstance(moe, FaultyRouting) else type(moe)   # (FaultyRouting, base)
    if fault == "none":
        moe.__class__ = base
        return
    if base not in _FAULTY:
        _FAULTY[base] = type(f"Faulty{base.__name__}", (FaultyRouting, base), {})
    moe.__class__ = _FAULTY[base]
    moe.fault = fault


def router_fault_of(moe) -> str:
    return moe.fault if isinstance(moe, FaultyRouting) else "none"


def check_router_fault(config, fault: str) -> None:
    """The fault must be one this model can have (one line, before anything is built)."""
    if fault in ("no_bias", "bias_sign", "bias_in_weights") and not config.score_correction_bias:
        raise ConfigError(f"--rollout_router_fault={fault} needs a router with a score-correction bias "
                          "(--init_from=tiny-sigmoid or a glm4_moe checkpoint)")
    if fault == "shared_in_topk" and not config.n_shared_experts:
        raise ConfigError("--rollout_router_fault=shared_in_topk needs ungated shared experts (n_shared_experts: "
                          "--init_from=tiny-sigmoid or a glm4_moe / deepseek checkpoint)")
    if fault == "no_renorm" and not config.norm_topk_prob:
        raise ConfigError("--rollout_router_fault=no_renorm: this model does not renormalise its top-k weights")
    if fault != "none" and not config.moe_layers:
        raise ConfigError(f"--rollout_router_fault={fault}: the model has no MoE layer (no router)")


def router_fault_copy(rollout_model: Transformer, full: Transformer, fault: str, refresh):
    """The rollout's weights with their routers wrong in one way; a copy of its own (in the same dtype
    if the rollout had none), so the trainer's model never carries the fault."""
    check_router_fault(full.config, fault)
    if rollout_model is full:
        rollout_model, refresh = lower_precision_copy(full, None, refresh)
    set_router_fault(rollout_model, fault)
    return rollout_model, refresh



# ---------------------------------------------------------------------------------------------------
# episode faults: where shipped systems break a multi-turn episode's consistency
# ---------------------------------------------------------------------------------------------------
def check_episode_fault(task, fault: str) -> None:
    """An episode fault needs episodes; retokenize's toy merges need the built-in digit vocabulary."""
    if fault != "none" and not task.episodic:
        raise ConfigError(f"--rollout_episode_fault={fault} breaks multi-turn episodes: use a multi-turn task "
                          "(--task=lookup, --task=fix, or --env)")
    if fault == "retokenize" and not hasattr(task, "INSTRUCTION"):
        raise ConfigError("--rollout_episode_fault=retokenize re-encodes with a toy tokenizer of the built-in digits: "
                          "use --task=lookup or --task=fix")


def episode_fault(sampler, fault: str):
    """The sampler train.py rolls out with under --rollout_episode_fault (lab/options.py's EPISODE_FAULTS):
    stale_prefix_kv: the sampler is never told that the weights changed, so its prefix cache serves KV
        (and routes) computed by an older policy;
    dummy_last_route, retokenize: its outputs rewritten as such an engine would hand them over
        (EpisodeFaultSampler)."""
    if fault == "none":
        return sampler
    if fault == "stale_prefix_kv":
        sampler.track_weights = False                  # and nobody calls sampler.weights_updated()
        return sampler
    return EpisodeFaultSampler(sampler, fault)


class EpisodeFaultSampler:
    """A Sampler whose episodes come back with `fault` applied to every output; the rest is the sampler's."""

    def __init__(self, sampler, fault: str):
        self.sampler, self.fault = sampler, fault

    def __getattr__(self, name):
        return getattr(self.sampler, name)

    def generate(self, *args, **kwargs):
        outs = self.sampler.generate(*args, **kwargs)
        k = self.sampler.model.config.num_experts_per_tok
        return [dummy_last_routes(o, k) if self.fault == "dummy_last_route" else retokenize(o) for o in outs]


def dummy_last_routes(o, top_k: int):
    """Each turn's last token recorded with a dummy route (experts 0..k-1), as an engine that never feeds
    a turn's last token in its own request records it; the episode's last token has no route anyway."""
    P = len(o.prompt)
    for _, end in o.turns[:-1]:
        o.routes[P + end - 1] = torch.arange(top_k)
    return o


MERGED = 16      # retokenize's merged ids: "d d" (the same digit twice) re-encodes as MERGED + d (< 32, the
                 # tiny presets' vocabulary, past the digit tasks' 15 ids)


def retokenize(o):
    """The history decoded and re-encoded between turns, by a toy BPE that merges a repeated digit
    ("3 3") into one id (MERGED + 3), as a real tokenizer's merges re-encode what the policy sampled
    token by token: every turn but the last comes back re-encoded. A merged id keeps the first sampled
    token's log-prob and route, what follows keeps its own: the trainer scores ids the sampler never
    held, after a history the sampler never saw."""
    turn_of = [-1] * len(o.tokens)                                    # each id's policy turn (-1: observation)
    for t, (start, end) in enumerate(o.turns):
        turn_of[start:end] = [t] * (end - start)
    keep, ids, j = [], [], 0                                          # the kept ids' old positions, the new ids
    while j < len(o.tokens):
        t = turn_of[j]
        pair = (0 <= t < len(o.turns) - 1 and j + 1 < len(o.tokens) and turn_of[j + 1] == t
                and o.tokens[j] == o.tokens[j + 1] < 10)
        keep.append(j)
        ids.append(o.tokens[j] + MERGED * pair)
        j += 1 + pair
    P = len(o.prompt)
    o.routes = torch.cat([o.routes[:P], o.routes[[P + j for j in keep[:-1]]]])    # (P + len(ids) - 1, n_moe, k)
    o.turns = [(bisect.bisect_left(keep, s), bisect.bisect_left(keep, e)) for s, e in o.turns]
    o.tokens, o.logprobs, o.policy_mask = ids, [o.logprobs[j] for j in keep], [o.policy_mask[j] for j in keep]
    o.token_versions = [o.token_versions[j] for j in keep] if o.token_versions else []
    o.kv_versions = [o.kv_versions[j] for j in keep] if o.kv_versions else []
    return o
