"""support/hf.py and families/ (model families, config.json, weight keys, safetensors) and the router
semantics the families need: each family against transformers, the contract for every new op, and the
score-correction bias as state.

    python -m pytest -q tests/test_hf.py

Per family (every model_type of hf.FAMILIES; tiny random checkpoints that transformers makes here,
conftest.FAMILY_HF): logits within 1e-5 relative in fp32, gradients, save -> transformers reads back
the same bits, batch-invariant score (fp32, bf16), the sampler contract, greedy == transformers'
generate. For the new attention kinds (gpt-oss's sinks and windows, dots.llm1's windows, MLA): each
knob's control, the sampler contract through preemption and batch layouts, packing, MLA's latent cache,
and gpt-oss's MXFP4 checkpoints bitwise as transformers dequantizes them. Then: the router's new ops (sigmoid, bias, groups, scaling) against brute force
and for row invariance with their controls, R3 replay under sigmoid routing, DeepSeek-V3's MoE block
against transformers' DeepseekV3MoE, Qwen3-MoE unchanged (the old ops, bit for bit), the bias in
checkpoints, syncs and the balancing update, and a CUDA test of the router ops' row invariance. For
Qwen3-MoE: config.json in both transformers field-name generations, the per-expert, sharded, fused and
bf16 checkpoint formats, and every bad checkpoint refused by name.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import kernels
import train
from lab import faults as lab
from support import distributed
from conftest import (FAMILY_HF, assert_contract, assert_greedy_like_generate, assert_same_weights, hf_classes,
                      load_hf, load_hf_auto, make_hf_family, make_model, rel_err, tiny_config)
from config import MODEL_PRESETS, ConfigError, ModelConfig
from support.hf import CheckpointError, config_from_hf, config_to_hf, hf_to_state
from model import Transformer
from rollout import Sampler

transformers = pytest.importorskip("transformers")
FAMS = list(FAMILY_HF)
TOL = 1e-5
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tokens(B=3, T=24, seed=0):
    return torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(seed))


def hf_routes(hf, toks):
    """transformers' logits and, per MoE layer, its router's top-k ids (M, k) (a hook on mlp.gate)."""
    ids, handles = [], []
    for layer in hf.model.layers:
        if hasattr(layer.mlp, "experts"):                  # gpt-oss calls its gate the router
            gate = layer.mlp.router if hasattr(layer.mlp, "router") else layer.mlp.gate
            handles.append(gate.register_forward_hook(lambda m, i, out: ids.append(out[2])))
    try:
        with torch.no_grad():
            logits = hf(toks).logits
    finally:
        for h in handles:
            h.remove()
    return logits, ids


# ---------------------------------------------------------------------------------------------------
# each family against transformers
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mt", FAMS)
def test_logits_and_routes_match_transformers(family, mt):
    hf, _, model = family(mt)
    assert model.config.model_type == mt
    toks = tokens()
    ref, ref_ids = hf_routes(hf, toks)
    with torch.no_grad():
        logits = model(toks)
        _, routes = model.score(toks)
    err = rel_err(logits, ref)
    print(f"\n[rel-err vs transformers] {mt}: {err:.2e}")
    # Gated DeltaNet's fp32 state chain: transformers' own fp32 forward is 1-3e-5 from its fp64 here
    # (test_hybrids.py compares both against fp64)
    tol = 1e-4 if model.config.linear_num_value_heads else TOL
    assert err < tol, f"{mt}: logits differ from transformers by {err:.2e} relative"
    assert len(ref_ids) == model.n_moe_layers
    for j, r in enumerate(ref_ids):                        # the same experts (as sets) at every token
        assert torch.equal(routes[:, :, j].reshape(r.shape).sort(-1).values, r.sort(-1).values), (mt, j)


@pytest.mark.parametrize("mt", ["glm4_moe", "minimax_m2", "dots1"])
def test_glm_bias_is_used_for_the_choice(family, mt):
    """Control for the test above: zeroing our copy of the score-correction bias changes the routes."""
    hf, _, model = family(mt)
    model = copy.deepcopy(model)
    toks = tokens()
    _, ref_ids = hf_routes(hf, toks)
    for i in model.config.moe_layers:
        model.layers[i].mlp.gate.e_score_correction_bias.zero_()
    with torch.no_grad():
        _, routes = model.score(toks)
    assert any(not torch.equal(routes[:, :, j].reshape(r.shape).sort(-1).values, r.sort(-1).values)
               for j, r in enumerate(ref_ids))


def hf_state_as_ours(hf, model, grads=False):
    """transformers' in-memory state (fused experts) mapped through our loader; grads=True: the gradients."""
    params = dict(hf.named_parameters())
    src = {k: (params[k].grad if grads and k in params else v) for k, v in hf.state_dict().items()}
    return hf_to_state(src, model)


@pytest.mark.parametrize("mt", FAMS)
def test_gradients_match_transformers(family, mt):
    _, path, _ = family(mt)
    model = Transformer.from_pretrained(path)
    hf = load_hf_auto(path).double()                       # fp64 reference; ours runs in fp32
    toks = tokens(2, 20, seed=3)
    logp, _ = model.score(toks)
    logp.sum().backward()
    ref = torch.log_softmax(hf(toks).logits[:, :-1], -1).gather(-1, toks[:, 1:, None]).sum()
    ref.backward()
    ref_grads = hf_state_as_ours(hf, model, grads=True)
    worst = 0.0
    # the hybrids' GDN layers: transformers' own fp32 gradients are up to 1.7e-4 from its fp64 here
    tol = 5e-4 if model.config.linear_num_value_heads else 1e-4
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == ref_grads[name].shape, name
        err = rel_err(p.grad, ref_grads[name])
        worst = max(worst, err)
        assert err < tol, f"{mt} {name}: grad rel error {err:.2e}"
    print(f"\n[grad rel-err] {mt}: worst {worst:.2e}")


@pytest.mark.parametrize("mt", FAMS)
def test_save_then_transformers_reads_back(family, mt, tmp_path):
    from safetensors.torch import load_file
    hf, path, model = family(mt)
    model.save_pretrained(str(tmp_path))
    back = load_hf_auto(str(tmp_path))                     # the class config.json's model_type names
    assert back.config.model_type == mt and type(back) is type(hf)
    assert set(load_file(str(tmp_path / "model.safetensors"))) == set(load_file(os.path.join(path, "model.safetensors")))
    toks = tokens(2, 20, seed=4)
    with torch.no_grad():
        assert torch.equal(back(toks).logits, hf(toks).logits)   # the very same weights, bit for bit
    again = Transformer.from_pretrained(str(tmp_path))
    assert again.config == model.config
    for (k, a), b in zip(again.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k                        # including the router bias buffers


@pytest.mark.parametrize("mt", ["mixtral", "glm4_moe"])
def test_fused_expert_layout_loads(family, mt, tmp_path):
    """transformers 5's in-memory layout (mlp.experts.gate_up_proj / down_proj) written as is."""
    from safetensors.torch import save_file
    hf, path, model = family(mt)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    fused = Transformer.from_pretrained(str(tmp_path))
    for (k, a), b in zip(fused.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


def test_glm_mtp_layer_is_dropped_but_other_extras_are_errors(family, tmp_path):
    from safetensors.torch import load_file, save_file
    _, path, model = family("glm4_moe")
    t = load_file(os.path.join(path, "model.safetensors"))
    L = model.config.num_hidden_layers
    t[f"model.layers.{L}.eh_proj.weight"] = torch.zeros(4, 4)          # GLM-4.5 ships its MTP layer so
    save_file(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    Transformer.from_pretrained(str(tmp_path))
    t["model.layers.1.mlp.gate.extra"] = torch.zeros(3)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.1.mlp.gate.extra"):
        Transformer.from_pretrained(str(tmp_path))


# ---------------------------------------------------------------------------------------------------
# the contract: batch invariance of score, the sampler, greedy decoding
# ---------------------------------------------------------------------------------------------------
LENGTHS = [3, 17, 9, 30, 16]


def seqs_(seed=5, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (L,), generator=g) for L in lengths]


def invariance_failures(model, seqs) -> list[int]:
    """Sequences whose log-probs or routes, scored in a padded batch (two groupings), differ from alone."""
    bad, dev = set(), next(model.parameters()).device
    with torch.no_grad():
        alone = [model.score(s[None].to(dev)) for s in seqs]
        longest = max(len(q) for q in seqs)
        for order, T in ((range(len(seqs)), longest + 3), (reversed(range(len(seqs))), longest + 10)):
            order = list(order)
            batch = torch.randint(0, 50, (len(order), T), generator=torch.Generator().manual_seed(T))
            for row, i in enumerate(order):
                batch[row, :len(seqs[i])] = seqs[i]
            logp, routes = model.score(batch.to(dev))
            for row, i in enumerate(order):
                L = len(seqs[i])
                if not (torch.equal(logp[row, :L - 1], alone[i][0][0]) and torch.equal(routes[row, :L], alone[i][1][0])):
                    bad.add(i)
    return sorted(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mt", FAMS)
def test_score_is_batch_invariant(family, mt, dtype):
    model = copy.deepcopy(family(mt)[2]).to(dtype)
    assert invariance_failures(model, seqs_()) == []


def test_control_torch_sigmoid_breaks_batch_invariance(family, monkeypatch):
    """The control: with fp32 torch.sigmoid in GLM's router the forward is batch-variant on this CPU.
    Its vector tail rounds differently, so a row's bits depend on where the (M, 8) score tensor ends
    (M % 4 == 3 here): the differing rows are a sequence's last ones, whose routes score() mostly does
    not use, so the forward's logits at every position are compared. (Qwen2-MoE's (M, 1) gate sees a
    strided slice, which torch.sigmoid happened to compute row-invariantly; the op-level control is
    test_sigmoid_is_row_invariant_and_torch_sigmoid_is_not.)"""
    x = torch.randn(300, 8) * 3
    if all(torch.equal(torch.sigmoid(x[:m]), torch.sigmoid(x)[:m]) for m in range(1, 301)):
        pytest.skip("fp32 torch.sigmoid happens to be row-invariant on this CPU; nothing to control")
    monkeypatch.setattr(kernels, "sigmoid", lambda t: torch.sigmoid(t.float()))
    lengths = list(range(3, 32, 4)) * 2
    model, seqs = family("glm4_moe")[2], seqs_(lengths=lengths)
    with torch.no_grad():
        batch = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
        for i, q in enumerate(seqs):
            batch[i, :len(q)] = q
        full = model(batch)
        assert any(not torch.equal(model(q[None])[0], full[i, :len(q)]) for i, q in enumerate(seqs))


def test_one_column_linear_is_row_invariant():
    """Qwen2-MoE's shared-expert gate is a linear to ONE column. kernels.linear keeps it row-invariant
    (it runs two columns, one of zeros); control: the plain tiled bmm with one column gave a lone
    32-row tile other bits than the same rows inside a larger batch on this CPU."""
    x, w = torch.randn(200, 32), torch.randn(1, 32)
    for m in (1, 5, 31, 32, 33):
        assert torch.equal(kernels.linear(x[:m], w), kernels.linear(x, w)[:m]), m

    def naive(x_):                                          # the tiled bmm without the second column
        tiles = torch.cat([x_, x_.new_zeros((-len(x_)) % 32, 32)]).view(-1, 32, 32)
        return torch.bmm(tiles, w.t().expand(len(tiles), -1, -1)).view(-1, 1)[:len(x_)]
    if all(torch.equal(naive(x[:m]), naive(x)[:m]) for m in (1, 5, 31)):
        pytest.skip("a one-column bmm happens to be row-invariant on this CPU; nothing to control")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mt", ["glm4_moe", "qwen2_moe", "olmoe"])
def test_score_is_batch_invariant_on_cuda(family, mt, dtype):
    """The families' new ops (biases, full q/k norm, partial RoPE, the router, shared experts) through
    the default CUDA backend (Triton kernels + the torch router)."""
    model = copy.deepcopy(family(mt)[2]).to("cuda", dtype)
    assert invariance_failures(model, seqs_()) == []


@pytest.mark.parametrize("mt", FAMS)
def test_sampler_contract(family, mt):
    model = family(mt)[2]
    prompts = [s.tolist() for s in seqs_(seed=6)]
    outs = Sampler(model).generate(prompts, max_new_tokens=6, temperature=1.0, n=2, seed=3, progress=False)
    assert_contract(model, outs, 1.0)


@pytest.mark.parametrize("mt", FAMS)
def test_greedy_matches_transformers_generate(family, mt):
    hf, _, model = family(mt)
    assert_greedy_like_generate(hf, model, [s.tolist() for s in seqs_(seed=7)[:3]], 6)


# ---------------------------------------------------------------------------------------------------
# the router's new ops
# ---------------------------------------------------------------------------------------------------
def brute_force_route(logits, k, bias, n_group, topk_group, norm, scaling):
    """DeepSeek-V3's rule by enumeration, in fp64: the best topk_group groups (by the sum of each
    group's two best biased scores; lower group index first on ties), then the best k experts inside
    (lower index first on ties); weights = unbiased sigmoid scores, renormalised, scaled."""
    s = torch.sigmoid(logits.double())
    c = s + bias.double()
    E = s.shape[-1]
    size = E // n_group
    ids = []
    for row in c.tolist():
        gs = [sum(sorted(row[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: (-gs[g], g))[:topk_group]
        allowed = [e for e in range(E) if e // size in groups]
        ids.append(sorted(allowed, key=lambda e: (-row[e], e))[:k])
    ids = torch.tensor(ids)
    w = s.gather(-1, ids)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    return ids, w * scaling


@pytest.mark.parametrize("n_group, topk_group, k", [(1, 1, 3), (4, 2, 3), (2, 1, 2), (8, 3, 2)])
def test_grouped_sigmoid_route_matches_brute_force(n_group, topk_group, k):
    g = torch.Generator().manual_seed(n_group * 10 + topk_group)
    logits = torch.randn(200, 16, generator=g) * 2
    bias = torch.randn(16, generator=g) * 0.3
    ids, w, chosen = kernels.route(logits, k, True, scoring="sigmoid", bias=bias, n_group=n_group,
                                   topk_group=topk_group, scaling=2.5)
    ref_ids, ref_w = brute_force_route(logits, k, bias, n_group, topk_group, True, 2.5)
    assert torch.equal(ids, ref_ids) and torch.equal(chosen, ids)
    assert torch.allclose(w.double(), ref_w, rtol=1e-6, atol=0)
    # the bias moved the choice (the test is not vacuous) but not the weights' source
    free_ids, _, _ = kernels.route(logits, k, True, scoring="sigmoid", n_group=n_group, topk_group=topk_group)
    assert not torch.equal(free_ids, ids)


def test_route_ties_go_to_the_lowest_index():
    # sigmoid(0) = 0.5 everywhere: every expert and every group ties
    ids, w, _ = kernels.route(torch.zeros(2, 8), 3, False, scoring="sigmoid", n_group=4, topk_group=2)
    assert ids.tolist() == [[0, 1, 2]] * 2 and torch.equal(w, torch.full((2, 3), 0.5))
    # groups 1 and 3 tie at the top; group 1 wins; a bias breaks the expert tie inside it
    logits = torch.tensor([[0.0, 0.0, 3.0, 3.0, 0.0, 0.0, 3.0, 3.0]])
    ids, _, _ = kernels.route(logits, 2, True, scoring="sigmoid", n_group=4, topk_group=1)
    assert ids.tolist() == [[2, 3]]
    bias = torch.tensor([0.0, 0, 0, 0.1, 0, 0, 0, 0])
    ids, w, _ = kernels.route(logits, 1, False, scoring="sigmoid", bias=bias, n_group=4, topk_group=1)
    assert ids.tolist() == [[3]] and w.item() == kernels.sigmoid(torch.tensor(3.0)).item()   # unbiased weight


def test_sigmoid_is_row_invariant_and_torch_sigmoid_is_not():
    x = torch.randn(70, 40) * 3
    prefix_bad = lambda f: [m for m in range(1, 71) if not torch.equal(f(x[:m]), f(x)[:m])]  # noqa: E731
    naive = prefix_bad(torch.sigmoid)
    if not naive:
        pytest.skip("fp32 torch.sigmoid happens to be row-invariant on this CPU; nothing to control")
    assert prefix_bad(kernels.sigmoid) == []
    assert (kernels.sigmoid(x).double() - torch.sigmoid(x.double())).abs().max() < 1e-6
    # no nan gradient where exp(-x) overflows
    z = torch.tensor([-200.0, -88.0, 0.0, 90.0], requires_grad=True)
    kernels.sigmoid(z).sum().backward()
    assert torch.isfinite(z.grad).all()


ROUTER_CASES = [dict(scoring="sigmoid"), dict(scoring="sigmoid", n_group=4, topk_group=2, scaling=2.5),
                dict(scoring="softmax", n_group=2, topk_group=1), dict(scoring="sigmoid", n_group=4, topk_group=2)]


def router_prefix_failures(logits, bias, kw) -> list[int]:
    full = kernels.route(logits, 3, True, bias=bias, **kw)
    return [m for m in range(1, logits.shape[0] + 1)
            if not all(torch.equal(a, b[:m]) for a, b in zip(kernels.route(logits[:m], 3, True, bias=bias, **kw), full))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_ops_are_row_invariant(dtype):
    g = torch.Generator().manual_seed(0)
    logits, bias = (torch.randn(70, 16, generator=g) * 3).to(dtype), torch.randn(16, generator=g).to(dtype) * 0.2
    for kw in ROUTER_CASES:
        assert router_prefix_failures(logits, bias, kw) == [], kw


def test_default_router_takes_the_old_ops():
    """At their defaults the new knobs run exactly the ops route ran before them (restated here)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 8, generator=g) * 2
    logits[::7, 3] = logits[::7, 5]                                     # some exact ties
    forced = torch.randint(0, 8, (64, 2), generator=g)
    forced[forced[:, 0] == forced[:, 1], 1] = (forced[forced[:, 0] == forced[:, 1], 0] + 1) % 8
    forced[::5] = -1
    for norm, f in itertools.product((True, False), (None, forced)):
        probs = torch.softmax(logits.float(), dim=-1)
        ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :2]
        chosen = ids
        if f is not None:
            ids = torch.where((f < 0).all(-1, keepdim=True), ids, f)
        w = probs.gather(-1, ids)
        if norm:
            w = w / (w[:, 0] + w[:, 1])[:, None]
        for a, b in zip(kernels.route(logits, 2, norm, f), (ids, w, chosen)):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------
# Qwen3-MoE unchanged: the default model scores the bits of the old forward (restated with the old ops)
# ---------------------------------------------------------------------------------------------------
def old_score(model, toks):
    """The forward as it was before the family knobs: per-head q/k norm, full RoPE, no biases, softmax
    router, no shared experts, straight from kernels.py's ops."""
    c, B, T = model.config, *toks.shape
    H, KVH, D, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    cos_t, sin_t = kernels.rope_tables(c.head_dim, c.rope_theta, c.max_position_embeddings)
    pos = torch.arange(T).expand(B, T)
    cos, sin = cos_t[pos], sin_t[pos]
    x, routes = model.embed_tokens(toks), []
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        h = kernels.rms_norm(x, layer.input_layernorm.weight, eps)
        q = kernels.rms_norm(kernels.linear(h, a.q_proj.weight).view(B, T, H, D), a.q_norm.weight, eps)
        k = kernels.rms_norm(kernels.linear(h, a.k_proj.weight).view(B, T, KVH, D), a.k_norm.weight, eps)
        v = kernels.linear(h, a.v_proj.weight).view(B, T, KVH, D)
        q, k = kernels.apply_rope(q, cos, sin), kernels.apply_rope(k, cos, sin)
        pad = (-T) % kernels.KV_BLOCK
        kp = F.pad(k, (0, 0, 0, 0, 0, pad)).reshape(-1, kernels.KV_BLOCK, KVH, D)
        vp = F.pad(v, (0, 0, 0, 0, 0, pad)).reshape(-1, kernels.KV_BLOCK, KVH, D)
        o = kernels.paged_attention(q, kp, vp, torch.arange(kp.shape[0]).view(B, -1), pos, D ** -0.5)
        x = x + kernels.linear(o.reshape(B, T, H * D), a.o_proj.weight)
        h = kernels.rms_norm(x, layer.post_attention_layernorm.weight, eps)
        if layer.is_moe:
            h2 = h.reshape(B * T, -1)
            probs = torch.softmax(kernels.linear(h2, m.gate.weight).float(), dim=-1)
            ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :c.num_experts_per_tok]
            w = probs.gather(-1, ids)
            if c.norm_topk_prob:
                total = w[:, 0]
                for j in range(1, w.shape[1]):
                    total = total + w[:, j]
                w = w / total[:, None]
            x = x + kernels.moe_experts(h2, m.w13, m.w2, ids, w).view(B, T, -1)
            routes.append(ids.view(B, T, -1))
        else:
            x = x + m.down_proj(kernels.silu_mul(m.gate_proj(h), m.up_proj(h)))
    h = kernels.rms_norm(x, model.norm.weight, eps)
    logits = kernels.linear(h[:, :-1], model.lm_weight())
    return kernels.token_logprobs(logits, toks[:, 1:], 0.7), torch.stack(routes, dim=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_moe_default_is_unchanged_bit_for_bit(dtype):
    model = make_model(tiny_config(), seed=3).to(dtype)
    assert not list(model.buffers())                                    # no new state by default
    toks = tokens(3, 37, seed=8)
    with torch.no_grad():
        logp, routes = model.score(toks, temperature=0.7)
        old_logp, old_routes = old_score(model, toks)
    assert torch.equal(logp, old_logp) and torch.equal(routes, old_routes)


# ---------------------------------------------------------------------------------------------------
# R3 replay under sigmoid routing
# ---------------------------------------------------------------------------------------------------
def test_r3_replay_with_sigmoid_routing(family, monkeypatch):
    model = copy.deepcopy(family("glm4_moe")[2])
    toks = tokens(2, 30, seed=9)
    with torch.no_grad():
        logp, routes = model.score(toks)
        again, used = model.score(toks, routes=routes)
    assert torch.equal(again, logp) and torch.equal(used, routes)      # replaying one's own routes: identity
    E = model.config.num_experts
    forced = (routes + 1) % E                                           # other experts, still distinct
    seen = []
    real_route = kernels.route

    def spy(logits, *a, **kw):
        out = real_route(logits, *a, **kw)
        seen.append((logits.detach(), out))
        return out
    monkeypatch.setattr(kernels, "route", spy)
    logp_f, used_f = model.score(toks, routes=forced)
    assert torch.equal(used_f[:, :, 0], routes[:, :, 0])                # the router's own choice is reported
    assert not torch.equal(logp_f, logp)
    cfg = model.config
    for j, (logits, (ids, w, _)) in enumerate(seen):
        assert torch.equal(ids, forced[:, :, j].reshape(ids.shape))
        s = torch.sigmoid(logits.double()).gather(-1, ids)              # the model's own unbiased scores
        want = s / s.sum(-1, keepdim=True) * cfg.routed_scaling_factor
        assert torch.allclose(w.double(), want, rtol=1e-6, atol=0)
    logp_f.sum().backward()
    for i in cfg.moe_layers:
        assert model.layers[i].mlp.gate.weight.grad.abs().sum() > 0    # the router still learns


# ---------------------------------------------------------------------------------------------------
# gpt-oss: each knob is used, the contract through preemption and packing, MXFP4 checkpoints
# ---------------------------------------------------------------------------------------------------
def test_gpt_oss_each_knob_is_used(family):
    """The controls of test_logits_and_routes_match_transformers for gpt-oss: our model with one of its
    knobs switched off no longer matches transformers (each knob is on in the checkpoint and matters)."""
    hf, _, model = family("gpt_oss")
    toks = tokens()
    with torch.no_grad():
        ref = hf(toks).logits
    sliding = [i for i in range(3) if model.config.window(i)]

    def no_sinks(m):
        for layer in m.layers:
            layer.self_attn.sinks = None

    def no_window(m):
        for i in sliding:
            m.layers[i].self_attn.window = 0

    def no_yarn(m):
        m.config = dataclasses.replace(m.config, rope_type="default")
        m._rope.clear()

    def no_clamp(m):
        for layer in m.layers:
            layer.mlp.swiglu = (layer.mlp.swiglu[0], 1e4)

    def no_router_bias(m):
        for layer in m.layers:
            layer.mlp.gate.bias = None
    assert sliding == [0, 2] and max(len(q) for q in toks) > model.config.sliding_window
    for off in (no_sinks, no_window, no_yarn, no_clamp, no_router_bias):
        m = copy.deepcopy(model)
        off(m)
        with torch.no_grad():
            err = rel_err(m(toks), ref)
        assert err > 1e-3, f"{off.__name__}: still matches transformers ({err:.1e})"


GPT_OSS_CONFIGS = {"preempt": dict(num_blocks=4, max_batch_size=16), "batch2": dict(max_batch_size=2),
                   "block32": dict(block_size=32), "small_prefill": dict(max_num_batched_tokens=40)}


NEW_ATTENTION = ["gpt_oss", "dots1", "deepseek_v3", "deepseek_v2", "glm4_moe_lite"]   # dots1: a window, no sinks


@pytest.mark.parametrize("config", list(GPT_OSS_CONFIGS))
@pytest.mark.parametrize("mt", NEW_ATTENTION)
def test_sink_window_and_latent_sampler_contract(family, mt, config):
    """gpt-oss's sinks and a window (12) shorter than every prompt but one (decode steps skip the key
    tiles below it), MLA's latent cache: log-probs and routes bitwise score's, through preemption and
    every batch layout."""
    model = family(mt)[2]
    prompts = [s.tolist() for s in seqs_(seed=6, lengths=[3, 17, 29, 40, 16])]
    sampler = Sampler(model, **GPT_OSS_CONFIGS[config])
    outs = sampler.generate(prompts, max_new_tokens=12, temperature=1.0, n=2, seed=3, progress=False)
    assert (sampler.num_preemptions > 0) == (config == "preempt")
    assert_contract(model, outs, 1.0)


@pytest.mark.parametrize("mt", NEW_ATTENTION)
def test_sink_window_and_latent_prefix_hits_keep_the_bits(family, mt):
    """The same request twice on one sampler: the second is served by the prefix cache (the latent cache's
    blocks; a window's blocks from the window pool) and gives the first one's bits."""
    model = family(mt)[2]
    prompts = [s.tolist() for s in seqs_(seed=6, lengths=[3, 17, 29, 40, 16])]
    sampler = Sampler(model)
    cold, warm = (sampler.generate(prompts, max_new_tokens=12, n=2, seed=3, progress=False) for _ in range(2))
    assert sampler.num_cached_tokens > 0
    for a, b in zip(cold, warm):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs and torch.equal(a.routes, b.routes)


@pytest.mark.parametrize("mt", NEW_ATTENTION)
def test_sink_window_and_latent_packed_score_is_the_padded_bits(family, mt):
    """Packed sequences (each its own positions, sinks and window, or latent keys) get the padded bits."""
    from support.packing import Packing
    model = family(mt)[2]
    seqs = seqs_(seed=8, lengths=[30, 5, 19, 40])
    batch = torch.zeros(len(seqs), 40, dtype=torch.long)
    for i, q in enumerate(seqs):
        batch[i, :len(q)] = q
    packing = Packing.concat([len(q) for q in seqs])
    with torch.no_grad():
        logp, routes = model.score(batch)
        plogp, proutes = model.score(torch.cat(seqs)[None], packing=packing)
    plogp, proutes = packing.to_padded(plogp), packing.to_padded(proutes)
    for i, q in enumerate(seqs):
        assert torch.equal(plogp[i, :len(q) - 1], logp[i, :len(q) - 1]), i
        assert torch.equal(proutes[i, :len(q)], routes[i, :len(q)]), i


def test_mla_caches_the_latent_and_rope_key_only(family):
    """The sampler's pages of an MLA layer: one (pages, block, 1, kv_lora_rank + head_dim) tensor, both
    halves of the (k, v) pair, holding each token's normed latent and RoPE'd key; what tooling/plan.py counts."""
    model = family("deepseek_v3")[2]
    cfg = model.config
    sampler = Sampler(model, num_blocks=8)
    k, v = sampler.caches[0]
    assert k is v and k.shape == (9, 16, 1, cfg.kv_lora_rank + cfg.head_dim)
    assert cfg.kv_numbers_per_token == 16 + 8 < 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.head_dim)
    prompt = seqs_(seed=2, lengths=[20])[0]
    sampler.generate([prompt.tolist()], max_new_tokens=1, temperature=0, progress=False)
    attn = model.layers[1].self_attn
    with torch.no_grad():
        x = model.layers[1].input_layernorm(model.layers[0](model.embed_tokens(prompt[None]), *[
            t[torch.arange(20)][None] for t in model.rope("cpu")], torch.arange(20)[None], None)[0])
        ckv = attn.kv_a_proj_with_mqa(x)
    page = sampler.runner.block_tables[0, 0]
    latent = sampler.caches[1][0][page, :16, 0]                             # the first 16 positions
    assert torch.equal(latent[:, :16], attn.kv_a_layernorm(ckv[0, :16, :16]))


def test_dots1_window_is_used(family):
    """Control: dots.llm1's window (10, no sinks) matters for its prompts; without it transformers disagrees."""
    hf, _, model = family("dots1")
    toks = tokens()
    m = copy.deepcopy(model)
    for layer in m.layers:
        layer.self_attn.window = 0
    with torch.no_grad():
        assert rel_err(m(toks), hf(toks).logits) > 1e-3


def test_mla_each_knob_is_used(family):
    """Controls for MLA: interleaved RoPE pairs and YaRN's softmax scale matter (V3's checkpoint has both)."""
    hf, _, model = family("deepseek_v3")
    toks = tokens()
    with torch.no_grad():
        ref = hf(toks).logits

    def halves(m):
        for layer in m.layers:
            layer.self_attn.interleave = False

    def plain_scale(m):
        for layer in m.layers:
            layer.self_attn.scale = (layer.self_attn.nope_dim + layer.self_attn.rope_dim) ** -0.5
    for off in (halves, plain_scale):
        m = copy.deepcopy(model)
        off(m)
        with torch.no_grad():
            assert rel_err(m(toks), ref) > 1e-3, off.__name__


@pytest.mark.parametrize("mt", ["gpt_oss", "deepseek_v3"])
def test_fast_rollout_of_sinks_windows_and_mla(family, mt):
    """The mismatch lab's fast path (SDPA, or transformers' eager softmax with the sink as a last logit;
    einsum for MLA's projections) runs these models and lands near score's log-probs, not on them."""
    model = family(mt)[2]
    prompts = [s.tolist() for s in seqs_(seed=9, lengths=[17, 30])]
    outs = Sampler(model, rollout_mode="fast").generate(prompts, max_new_tokens=6, temperature=1.0, seed=1,
                                                        progress=False)
    for o in outs:
        logp, _ = model.score(torch.tensor([o.prompt + o.tokens]))
        assert (torch.tensor(o.logprobs) - logp[0, len(o.prompt) - 1:]).abs().max() < 1e-4


@pytest.mark.parametrize("mxfp4", [False, True])
def test_gpt_oss_expert_shard_reads_only_its_experts(tmp_path, monkeypatch, mxfp4):
    """gpt-oss under EP: a rank's load (from_pretrained(experts=...)) reads only its experts' rows of the
    fused gate_up_proj and down_proj, of their biases and (MXFP4) of their blocks and scales, and holds the
    whole load's rows, biases too. Control: the whole load reads every expert."""
    import safetensors
    from disk_reads import ReadLog, experts_read
    from parallel.expert_parallel import is_expert
    cfg = ModelConfig.preset("tiny-gpt-oss")
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():                            # biases start at zero: draw them, so a wrong row shows
        for layer in model.layers:
            layer.mlp.b13.normal_()
            layer.mlp.b2.normal_()
    ckpt = str(tmp_path / "ckpt")
    model.save_pretrained(ckpt)
    if mxfp4:
        _mxfp4_checkpoint(ckpt, str(tmp_path / "mx"))
        ckpt = str(tmp_path / "mx")
    whole = Transformer.from_pretrained(ckpt).state_dict()
    mine = [cfg.num_experts - 1, 2, 0]                # a permuted placement's order
    log = ReadLog(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", log)
    shard = Transformer.from_pretrained(ckpt, experts=mine)
    assert experts_read(log.read, cfg) == set(mine), sorted(experts_read(log.read, cfg))
    assert any(key.endswith("_blocks" if mxfp4 else "gate_up_proj_bias") for key, _ in log.read)
    for k, v in shard.state_dict().items():
        assert torch.equal(v, whole[k][mine] if is_expert(k) else whole[k]), k
    assert torch.equal(whole["layers.0.mlp.b2"], model.layers[0].mlp.b2.detach())
    log.read.clear()
    Transformer.from_pretrained(ckpt)
    assert experts_read(log.read, cfg) == set(range(cfg.num_experts))


def _mxfp4_checkpoint(src: str, dst: str, seed: int = 0) -> dict:
    """src's checkpoint with its experts replaced by random MXFP4 blocks and scales (the layout of
    gpt-oss's published checkpoints) and a quantization_config; returns the blocks and scales."""
    from safetensors.torch import load_file, save_file
    t, g, packed = load_file(os.path.join(src, "model.safetensors")), torch.Generator().manual_seed(seed), {}
    for key in [k for k in t if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, K, N = t.pop(key).shape                                        # x @ W: (E, in, out)
        packed[key + "_blocks"] = torch.randint(0, 256, (E, N, K // 32, 16), generator=g, dtype=torch.uint8)
        packed[key + "_scales"] = torch.randint(118, 132, (E, N, K // 32), generator=g, dtype=torch.uint8)
    os.makedirs(dst, exist_ok=True)
    save_file({**t, **packed}, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return packed


def test_mxfp4_dequantize_is_transformers_bits():
    """hf.mxfp4_dequantize against transformers' own dequantizer, every code and scales from the
    subnormal range to near overflow, in bf16 and fp32."""
    from support.hf import mxfp4_dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 253, (3, 40, 4), generator=g, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        ours = mxfp4_dequantize(blocks, scales, dtype)
        assert ours.shape == (3, 128, 40) and ours.dtype == dtype
        assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype)), dtype
    nibbles = torch.cat([blocks & 15, blocks >> 4]).unique()
    assert len(nibbles) == 16                                             # every E2M1 code was seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_checkpoint_loads_as_transformers_dequantizes_it(tmp_path, dtype):
    """A gpt-oss checkpoint with MXFP4 experts: our weights are bitwise those transformers dequantizes
    (Mxfp4Config(dequantize=True)), our save is the dequantized checkpoint that transformers reads back."""
    hf = make_hf_family("gpt_oss", seed=2, intermediate_size=32).to(dtype)   # MXFP4 groups: dims of 32
    hf.save_pretrained(str(tmp_path / "src"))
    _mxfp4_checkpoint(str(tmp_path / "src"), str(tmp_path / "mx"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "mx"), dtype=dtype, attn_implementation="eager", experts_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    ours = Transformer.from_pretrained(str(tmp_path / "mx"))
    assert ours.layers[0].mlp.w13.dtype == dtype
    want = hf_state_as_ours(ref, ours)
    for k, v in ours.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert not torch.equal(want["layers.0.mlp.w13"], hf_state_as_ours(hf, ours)["layers.0.mlp.w13"])   # dequantized
    ours.save_pretrained(str(tmp_path / "out"))
    assert "quantization_config" not in json.load(open(tmp_path / "out" / "config.json"))
    back = load_hf_auto(str(tmp_path / "out"), dtype)
    toks = tokens(2, 20, seed=4)
    with torch.no_grad():
        assert torch.equal(back(toks).logits, ref(toks).logits)


def test_mxfp4_errors(tmp_path, family):
    from support.hf import dequantize_mxfp4, mxfp4_dequantize
    with pytest.raises(CheckpointError, match="no .*_scales"):
        dequantize_mxfp4({"a_blocks": torch.zeros(1, 2, 1, 16, dtype=torch.uint8)})
    with pytest.raises(CheckpointError, match="do not match"):
        mxfp4_dequantize(torch.zeros(1, 2, 1, 16, dtype=torch.uint8), torch.zeros(1, 2, 2, dtype=torch.uint8), torch.float32)
    with pytest.raises(CheckpointError, match="non-finite"):               # 6 * 2^128 overflows
        dequantize_mxfp4({"a_blocks": torch.full((1, 1, 1, 16), 0x77, dtype=torch.uint8),
                          "a_scales": torch.full((1, 1, 1), 255, dtype=torch.uint8)})
    d = config_to_hf(family("gpt_oss")[2].config)
    with pytest.raises(ConfigError, match="quant_method='fp8'"):
        config_from_hf({**d, "quantization_config": {"quant_method": "fp8"}})
    d = config_to_hf(family("qwen3_moe")[2].config)
    with pytest.raises(ConfigError, match="load a dequantized checkpoint"):
        config_from_hf({**d, "quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(ConfigError, match="rope type 'yarn' is not supported for qwen3_moe"):
        config_from_hf({**d, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                                                 "original_max_position_embeddings": 64}})


# ---------------------------------------------------------------------------------------------------
# DeepSeek-V3's MoE block alone
# ---------------------------------------------------------------------------------------------------
def test_deepseek_v3_moe_block_matches_transformers():
    from model import MoE
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    hcfg = transformers.DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=16,
                                         num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
                                         routed_scaling_factor=2.5, norm_topk_prob=True, hidden_act="silu",
                                         experts_implementation="eager")
    ref = DeepseekV3MoE(hcfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        ref.gate.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.2)
    cfg = tiny_config(hidden_size=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16,
                      router_scoring="sigmoid", score_correction_bias=True, n_group=4, topk_group=2,
                      n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    ours = MoE(cfg)
    ours.load_state_dict({"gate.weight": ref.gate.weight,
                          "gate.e_score_correction_bias": ref.gate.e_score_correction_bias,
                          "w13": ref.experts.gate_up_proj, "w2": ref.experts.down_proj,
                          **{f"shared_experts.{k}": v for k, v in ref.shared_experts.state_dict().items()}})
    x = torch.randn(2, 40, 32, generator=g)
    with torch.no_grad():
        want = ref(x)
        got, _ = ours(x)
    assert rel_err(got, want) < TOL


# ---------------------------------------------------------------------------------------------------
# config translation
# ---------------------------------------------------------------------------------------------------
def test_family_config_fields():
    expect = {   # the knobs each family switches on (checked against the HF config dicts of FAMILY_HF)
        "qwen3_moe": dict(attention_bias=True, attention_out_bias=True, qk_norm="head", mlp_only_layers=[0]),
        "qwen3": dict(num_experts=0, attention_bias=True, attention_out_bias=True, moe_layers=[]),
        "qwen2_moe": dict(attention_bias=True, attention_out_bias=False, qk_norm="none",
                          shared_expert_intermediate_size=40, mlp_only_layers=[1]),
        "olmoe": dict(attention_bias=True, attention_out_bias=True, qk_norm="full", moe_intermediate_size=24,
                      head_dim=8, mlp_only_layers=[]),
        "mixtral": dict(norm_topk_prob=True, qk_norm="none", moe_intermediate_size=24, mlp_only_layers=[]),
        "glm4_moe": dict(router_scoring="sigmoid", score_correction_bias=True, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1,
                         attention_bias=True, attention_out_bias=False, qk_norm="head", partial_rotary_factor=0.5,
                         moe_layers=[1, 2], rotary_dim=8),
        "gpt_oss": dict(attention_sinks=True, sliding_window=12, rope_type="yarn", yarn_factor=4.0,
                        yarn_original_max_position_embeddings=64, yarn_truncate=False, router_bias=True,
                        router_scoring="topk_softmax", norm_topk_prob=True, expert_bias=True, moe_act="clamped_swiglu",
                        swiglu_alpha=1.702, swiglu_limit=1.0, attention_bias=True, attention_out_bias=True,
                        qk_norm="none", moe_intermediate_size=24, moe_layers=[0, 1, 2],
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        "dots1": dict(router_scoring="sigmoid", score_correction_bias=True, n_group=2, n_shared_experts=2,
                      first_k_dense_replace=1, attention_bias=True, attention_out_bias=True, qk_norm="head",
                      sliding_window=10, layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
        "minimax_m2": dict(router_scoring="sigmoid", score_correction_bias=True, norm_topk_prob=True, qk_norm="full",
                           partial_rotary_factor=0.5, rotary_dim=8, moe_intermediate_size=24, mlp_only_layers=[]),
        "deepseek_v3": dict(kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, head_dim=8, v_head_dim=12,
                            rope_interleave=True, rope_type="yarn", yarn_mscale_all_dim=1.0, router_scoring="sigmoid",
                            score_correction_bias=True, n_group=4, topk_group=2, first_k_dense_replace=1,
                            moe_layers=[1, 2], attention_bias=True, qk_norm="none", kv_numbers_per_token=24),
        "deepseek_v2": dict(kv_lora_rank=16, q_lora_rank=0, rope_interleave=True, router_scoring="softmax",
                            group_score="max", n_group=4, topk_group=2, norm_topk_prob=False, n_shared_experts=2,
                            routed_scaling_factor=1.5, yarn_mscale=0.707, moe_layers=[1, 2]),
        "glm4_moe_lite": dict(kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=12, v_head_dim=16, rope_type="default",
                              router_scoring="sigmoid", n_group=2, mlp_only_layers=[0], moe_layers=[1, 2]),
    }
    hybrid = dict(zero_centered_norm=True, qk_norm="head", partial_rotary_factor=0.25, rotary_dim=4,
                  shared_expert_intermediate_size=40, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention"] * 3 + ["gated_attention"])
    if "qwen3_next" in FAMILY_HF:                                    # hybrids/ (a plug-in: its tests go with it)
        expect["qwen3_5_moe_text"] = dict(hybrid, norm_topk_prob=True, moe_layers=[0, 1, 2, 3])
        expect["qwen3_next"] = dict(hybrid, norm_topk_prob=False, mlp_only_layers=[1], moe_layers=[0, 2, 3])
    assert set(expect) == set(FAMILY_HF)
    for mt, want in expect.items():
        cfg = config_from_hf(make_hf_family(mt).config.to_dict())
        for k, v in want.items():
            assert getattr(cfg, k) == v, (mt, k)
        assert config_from_hf(json.loads(json.dumps(config_to_hf(cfg)))) == cfg


def test_old_glm_config_keeps_partial_rotary_factor_at_the_top():
    d = make_hf_family("glm4_moe").config.to_dict()
    d.pop("rope_parameters")
    d.update(rope_theta=5e5, partial_rotary_factor=0.25)               # the GLM-4.5 config.json spelling
    cfg = config_from_hf(d)
    assert cfg.partial_rotary_factor == 0.25 and cfg.rope_theta == 5e5


@pytest.mark.parametrize("overrides, needle", [
    (dict(router_scoring="sigmoid"), "router_scoring"),
    (dict(score_correction_bias=True), "score_correction_bias"),
    (dict(n_shared_experts=1), "n_shared_experts"),
    (dict(qk_norm="full"), "qk_norm"),
])
def test_to_hf_refuses_what_the_family_cannot_express(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        config_to_hf(tiny_config(**overrides))                         # model_type qwen3_moe


@pytest.mark.parametrize("overrides, needle", [
    (dict(n_group=3), "n_group"), (dict(n_group=2, topk_group=3), "topk_group"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok"),
    (dict(router_scoring="relu"), "router_scoring"), (dict(qk_norm="layer"), "qk_norm"),
    (dict(partial_rotary_factor=0.1), "rotary"),
    (dict(n_shared_experts=1, shared_expert_intermediate_size=8), "not both"),
])
def test_validation_of_the_new_fields(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        tiny_config(**overrides)


def test_unknown_model_type_is_refused_where_config_json_is_read_or_written(tmp_path):
    """ModelConfig takes model_type as a plain name; support/hf.py refuses one it has no family for, naming the
    supported ones, before anything is written."""
    cfg = tiny_config(model_type="llama")
    for call in (lambda: config_to_hf(cfg), lambda: make_model(cfg).save_pretrained(str(tmp_path / "out"))):
        with pytest.raises(ConfigError, match=r"model_type 'llama' is not supported; supported: .*gpt_oss.*qwen3_moe"):
            call()
    assert not (tmp_path / "out").exists()
    assert config_to_hf(tiny_config())["model_type"] == "qwen3_moe"       # control: a known family writes


def test_every_preset_writes_a_config_json_that_reads_back():
    for name in MODEL_PRESETS:
        cfg = ModelConfig.preset(name)
        assert config_from_hf(json.loads(json.dumps(config_to_hf(cfg)))) == cfg, name


def test_tiny_sigmoid_preset():
    cfg = ModelConfig.preset("tiny-sigmoid")
    assert (cfg.router_scoring, cfg.score_correction_bias, cfg.n_group, cfg.n_shared_experts) == ("sigmoid", True, 2, 1)
    assert cfg.moe_layers == [1, 2, 3] and config_from_hf(config_to_hf(cfg)) == cfg


# ---------------------------------------------------------------------------------------------------
# config.json of Qwen3-MoE: both field-name generations, files, errors
# ---------------------------------------------------------------------------------------------------
def _hf_base():
    return dict(model_type="qwen3_moe", vocab_size=1000, hidden_size=64, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                moe_intermediate_size=32, num_experts_per_tok=3, norm_topk_prob=True,
                mlp_only_layers=[0], decoder_sparse_step=1, rms_norm_eps=1e-5,
                tie_word_embeddings=False, max_position_embeddings=512, hidden_act="silu")


def test_from_hf_old_and_new_field_names_agree(tmp_path):
    old = dict(_hf_base(), num_experts=12, rope_theta=123456.0, rope_scaling=None)
    new = dict(_hf_base(), num_local_experts=12,
               rope_parameters={"rope_type": "default", "rope_theta": 123456.0})
    a, b = config_from_hf(old), config_from_hf(new)
    assert a == b
    assert a.num_experts == 12 and a.rope_theta == 123456.0
    assert (a.num_experts_per_tok, a.moe_intermediate_size, a.rms_norm_eps) == (3, 32, 1e-5)
    # the same through a file and through a directory
    (tmp_path / "config.json").write_text(json.dumps(new))
    assert config_from_hf(str(tmp_path)) == b
    assert config_from_hf(str(tmp_path / "config.json")) == b


def test_from_hf_accepts_transformers_own_config():
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3MoeConfig(
        vocab_size=77, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        head_dim=8, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=40,
        mlp_only_layers=[2], rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    cfg = config_from_hf(hf.to_dict())
    assert (cfg.vocab_size, cfg.num_key_value_heads, cfg.head_dim, cfg.num_experts) == (77, 1, 8, 5)
    assert cfg.rope_theta == 5000.0 and cfg.mlp_only_layers == [2] and cfg.norm_topk_prob is False


def test_to_hf_from_hf_round_trip():
    for cfg in (tiny_config(), tiny_config(norm_topk_prob=False, tie_word_embeddings=True,
                                           decoder_sparse_step=2, mlp_only_layers=[], rope_theta=5e5),
                ModelConfig.preset("qwen3-30b-a3b")):
        d = config_to_hf(cfg)
        assert d["model_type"] == "qwen3_moe" and d["num_local_experts"] == cfg.num_experts
        assert d["rope_parameters"] == {"rope_type": "default", "rope_theta": cfg.rope_theta}
        back = config_from_hf(json.loads(json.dumps(d)))   # through JSON, as on disk
        assert back == cfg
        assert dataclasses.asdict(back) == dataclasses.asdict(cfg)


@pytest.mark.parametrize("bad, needle", [
    (dict(model_type="llama"), "model_type"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "yarn"),
    (dict(model_type="olmoe", clip_qkv=8.0), "clip_qkv"),    # qwen3_moe's attention_bias is supported now
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_from_hf_rejects_unsupported(bad, needle):
    with pytest.raises(ConfigError, match=needle):
        config_from_hf(dict(_hf_base(), num_experts=4, **bad))


def test_from_hf_missing_file(tmp_path):
    with pytest.raises(ConfigError):
        config_from_hf(str(tmp_path))


@pytest.mark.parametrize("drop", ["hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads"])
def test_from_hf_missing_required_field_names_it_and_the_file(tmp_path, drop):
    hf = _hf_base()
    del hf[drop]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError) as e:
        config_from_hf(str(tmp_path))
    assert f"lacks the required field(s) {drop}" in str(e.value) and str(tmp_path) in str(e.value)


def test_from_hf_invalid_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 10,')
    with pytest.raises(ConfigError, match=r"config.json: not valid JSON"):
        config_from_hf(str(tmp_path))


# ---------------------------------------------------------------------------------------------------
# Qwen3-MoE checkpoint formats: per-expert layout, shards, fused experts, bf16
# ---------------------------------------------------------------------------------------------------
def test_our_checkpoint_is_per_expert_layout(tmp_path):
    model = make_model()
    model.save_pretrained(str(tmp_path))
    from safetensors.torch import load_file
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    E = model.config.num_experts
    for i in model.config.moe_layers:
        for e in range(E):
            for p in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{i}.mlp.experts.{e}.{p}.weight" in keys
        assert f"model.layers.{i}.mlp.gate.weight" in keys
        assert f"model.layers.{i}.mlp.experts.gate_up_proj" not in keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys          # the dense layer
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]


def test_sharded_checkpoint(tmp_path):
    model = make_model()
    model.save_pretrained(str(tmp_path), max_shard_bytes=20_000)
    index_path = tmp_path / "model.safetensors.index.json"
    assert index_path.is_file()
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert all((tmp_path / s).is_file() for s in shards)
    loaded = Transformer.from_pretrained(str(tmp_path))
    assert_same_weights(loaded, model)
    tokens = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))


def test_sharded_checkpoint_readable_by_transformers(tmp_path):
    hf_classes()
    model = make_model(std=0.15)
    model.save_pretrained(str(tmp_path), max_shard_bytes=20_000)
    hf = load_hf(str(tmp_path))
    tokens = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        assert rel_err(model(tokens), hf(tokens).logits) < TOL


def test_fused_expert_layout_loads_qwen3_moe(tmp_path):
    model = make_model()
    model.save_pretrained(str(tmp_path / "per_expert"))
    fuse_experts(tmp_path / "per_expert", tmp_path / "fused", model.config)
    assert_same_weights(Transformer.from_pretrained(str(tmp_path / "fused")), model)


def fuse_experts(src, dst, cfg):
    """Rewrite a per-expert checkpoint in the fused layout (mlp.experts.gate_up_proj / down_proj)."""
    from safetensors.torch import load_file, save_file
    t = load_file(str(src / "model.safetensors"))
    for i in cfg.moe_layers:
        pre = f"model.layers.{i}.mlp.experts"
        gate = [t.pop(f"{pre}.{e}.gate_proj.weight") for e in range(cfg.num_experts)]
        up = [t.pop(f"{pre}.{e}.up_proj.weight") for e in range(cfg.num_experts)]
        down = [t.pop(f"{pre}.{e}.down_proj.weight") for e in range(cfg.num_experts)]
        t[f"{pre}.gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1).contiguous()  # (E, 2I, D)
        t[f"{pre}.down_proj"] = torch.stack(down).contiguous()                                          # (E, D, I)
    os.makedirs(dst)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())


@pytest.mark.parametrize("layout", ["per_expert", "sharded", "fused", "masters"])
def test_an_expert_shard_reads_only_its_experts(tmp_path, monkeypatch, layout):
    """An expert-parallel rank's load (Transformer.from_pretrained(experts=...), checkpoint.load_weights)
    reads its experts' rows, in its order, and not one byte of the others; the rest is the whole load's."""
    import safetensors
    from support.checkpoint import load_weights
    from disk_reads import ReadLog, experts_read
    from parallel.expert_parallel import keep_experts
    model = make_model()
    cfg, ckpt = model.config, tmp_path / "ckpt"
    model.save_pretrained(str(ckpt), **({"max_shard_bytes": 20_000} if layout == "sharded" else {}))
    if layout == "fused":
        fuse_experts(ckpt, tmp_path / "fused", cfg)
        ckpt = tmp_path / "fused"
    if layout == "masters":                          # a resume from the fp32 masters beside a rounded export
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt / "masters.safetensors"))
    mine = [cfg.num_experts - 1, 2, 0]                # a permuted placement's order
    log = ReadLog(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", log)
    if layout == "masters":
        with torch.device("meta"):
            shard = Transformer(cfg)
        keep_experts(shard, mine)
        shard.load_state_dict(load_weights(str(ckpt), shard, mine), assign=True)
    else:
        shard = Transformer.from_pretrained(str(ckpt), experts=mine)
    assert log.read and experts_read(log.read, cfg) == set(mine), sorted(experts_read(log.read, cfg))
    whole = model.state_dict()
    for k, v in shard.state_dict().items():
        want = whole[k][mine] if k.endswith((".mlp.w13", ".mlp.w2")) else whole[k]
        assert torch.equal(v, want), k
    log.read.clear()                                 # control: the whole load reads every expert
    Transformer.from_pretrained(str(ckpt))
    assert experts_read(log.read, cfg) == set(range(cfg.num_experts))


def test_bf16_checkpoint(tmp_path):
    model = make_model().to(torch.bfloat16)
    model.save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = Transformer.from_pretrained(str(tmp_path))
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert_same_weights(loaded, model)
    as32 = Transformer.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in as32.parameters())
    for (k, a), b in zip(as32.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b.float()), k
    tokens = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        assert loaded(tokens).dtype == torch.bfloat16
        assert as32(tokens).dtype == torch.float32


# ---------------------------------------------------------------------------------------------------
# bad checkpoints: each refused with a CheckpointError naming the tensor or the file
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def good_ckpt(tmp_path):
    """A valid checkpoint of the tiny model; returns (dir, tensors, config dict) to be edited and saved."""
    from safetensors.torch import load_file
    path = tmp_path / "good"
    make_model().save_pretrained(str(path))
    return path, load_file(str(path / "model.safetensors")), json.loads((path / "config.json").read_text())


def write_ckpt(path, tensors, cfg):
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def load_error(path) -> str:
    with pytest.raises(CheckpointError) as e:
        Transformer.from_pretrained(path)
    return str(e.value)


@pytest.mark.parametrize("key", ["model.layers.1.self_attn.k_norm.weight", "lm_head.weight",
                                 "model.layers.2.mlp.experts.5.up_proj.weight", "model.layers.1.mlp.gate.weight"])
def test_missing_tensor(good_ckpt, tmp_path, key):
    _, t, cfg = good_ckpt
    del t[key]
    assert key in load_error(write_ckpt(tmp_path / "bad", t, cfg))


@pytest.mark.parametrize("key", ["model.layers.0.mlp.experts.0.gate_proj.weight", "model.extra.weight"])
def test_unexpected_tensor(good_ckpt, tmp_path, key):
    _, t, cfg = good_ckpt
    t[key] = torch.zeros(3)
    assert key in load_error(write_ckpt(tmp_path / "bad", t, cfg))


def test_misshaped_tensor(good_ckpt, tmp_path):
    _, t, cfg = good_ckpt
    t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 33)
    assert "layers.0.self_attn.q_proj.weight" in load_error(write_ckpt(tmp_path / "bad", t, cfg))


def test_misshaped_single_expert(good_ckpt, tmp_path):
    """One expert's tensor of the wrong shape: a CheckpointError naming it, not a torch.stack error."""
    _, t, cfg = good_ckpt
    t["model.layers.1.mlp.experts.3.down_proj.weight"] = torch.zeros(32, 25)
    path = write_ckpt(tmp_path / "bad", t, cfg)
    with pytest.raises(CheckpointError) as e:
        Transformer.from_pretrained(path)
    msg = str(e.value)
    assert "layers.1.mlp" in msg and ("experts.3.down_proj" in msg or "w2" in msg)


@pytest.mark.parametrize("field, value, needle", [
    ("hidden_size", 48, "embed_tokens.weight"),
    ("moe_intermediate_size", 16, "layers.1.mlp.experts.0.gate_proj.weight"),
    ("vocab_size", 60, "embed_tokens.weight"),
    ("num_local_experts", 6, "layers.1.mlp.gate.weight"),   # the router has 8 rows, the config wants 6
    ("num_hidden_layers", 2, "layers.2"),              # layer 2 is left over
])
def test_config_does_not_match_weights(good_ckpt, tmp_path, field, value, needle):
    _, t, cfg = good_ckpt
    cfg = dict(cfg, **{field: value})
    if field == "num_local_experts":
        cfg["num_experts"] = value
    assert needle in load_error(write_ckpt(tmp_path / "bad", t, cfg))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_is_refused_by_key_and_file(good_ckpt, tmp_path, bad):
    _, t, cfg = good_ckpt
    t["model.layers.2.mlp.gate.weight"][1, 4] = bad
    msg = load_error(write_ckpt(tmp_path / "bad", t, cfg))
    assert "model.safetensors: tensor 'model.layers.2.mlp.gate.weight' holds 1 non-finite value(s)" in msg
    assert Transformer.from_pretrained(str(good_ckpt[0])) is not None      # control: the original loads


def test_truncated_safetensors_names_the_file(good_ckpt):
    path = good_ckpt[0] / "model.safetensors"
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    assert f"{path}: unreadable safetensors file" in load_error(str(good_ckpt[0]))


def test_sharded_index_naming_a_missing_shard(good_ckpt, tmp_path):
    _, t, cfg = good_ckpt
    path = write_ckpt(tmp_path / "bad", t, cfg)
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "model-00001-of-00002.safetensors"))
    index = {"weight_map": {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(t)}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    assert "model-00002-of-00002.safetensors: missing" in load_error(path)


def test_directory_without_safetensors(good_ckpt, tmp_path):
    _, _, cfg = good_ckpt
    empty = tmp_path / "empty"
    os.makedirs(empty)
    (empty / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError):
        Transformer.from_pretrained(str(empty))


# ---------------------------------------------------------------------------------------------------
# the bias is state: syncs, digests, the balancing update, and a 2-rank FSDP2 run
# ---------------------------------------------------------------------------------------------------
def sigmoid_model():
    """The tiny test model with tiny-sigmoid's routing (GLM spelling): MoE layers 1 and 2."""
    return make_model(tiny_config(model_type="glm4_moe", router_scoring="sigmoid", score_correction_bias=True,
                                  n_group=2, topk_group=1, n_shared_experts=1, mlp_only_layers=[],
                                  first_k_dense_replace=1), seed=4)


def test_lower_precision_copy_and_digest_carry_the_bias():
    model = sigmoid_model()
    rollout, sync = lab.lower_precision_copy(model, torch.bfloat16, lambda: None)
    bias = model.layers[1].mlp.gate.e_score_correction_bias
    with torch.no_grad():
        bias.copy_(torch.tensor([0.3001, -0.1, 0, 0, 0, 0, 0, 0.7]))
    d = train.Dist(0, 1, torch.device("cpu"))
    before = train.check_in_sync(model, d)
    sync()
    got = rollout.layers[1].mlp.gate.e_score_correction_bias
    assert got.dtype == torch.bfloat16 and torch.equal(got, bias.bfloat16())  # rounded, as the rollout sees it
    assert got.float()[0] != bias[0]                                    # the rounding is a mismatch source
    with torch.no_grad():
        bias[2] += 1e-3
    assert train.check_in_sync(model, d) != before                      # the digest covers the buffer


def test_expert_load_and_bias_update():
    routes = torch.tensor([[[[0, 1]], [[0, 2]], [[3, 0]], [[1, 2]]]])   # (B=1, T=4, n_moe=1, k=2)
    mask = torch.tensor([[1, 1, 0]])                                    # positions 0 and 1 score responses
    from replay import expert_load
    load = expert_load(routes[:, :-1][mask.bool()], 4)                 # the update's positions (train.update)
    assert load.tolist() == [[2, 1, 1, 0]]
    model = sigmoid_model()
    E = model.config.num_experts
    load = torch.zeros(len(model.config.moe_layers), E, dtype=torch.long)
    load[:, 0], load[:, 1], load[:, 2] = 10, 3, 1                      # mean 2: 0 and 1 busy, the rest idle
    from router_training.balance import update_expert_bias
    update_expert_bias(model, load, 0.01, distributed.Dist(0, 1, torch.device("cpu")))
    for i in model.config.moe_layers:
        b = model.layers[i].mlp.gate.e_score_correction_bias
        assert torch.equal(b, torch.tensor([-0.01, -0.01] + [0.01] * (E - 2)))   # one step of rate each


def test_expert_bias_update_rate_needs_a_bias_and_fp32(tmp_path):
    from config import RolloutConfig, TrainConfig, apply_overrides, parse_args
    t, r = TrainConfig(), RolloutConfig()
    apply_overrides(parse_args(["--init_from=tiny", f"--out_dir={tmp_path}", "--expert_bias_update_rate=0.05"]), t, r)
    with pytest.raises(ConfigError, match="score-correction bias"):
        train.train(t, r)
    apply_overrides({"dtype": "bfloat16"}, t)                           # bf16 compute: the bias has an fp32 master
    with pytest.raises(ConfigError, match="float32"):
        apply_overrides({"master_dtype": "bfloat16"}, t)                # bf16 storage would round its updates


def test_fsdp2_two_ranks_sync_the_bias(tmp_path):
    """The sampler reads FSDP2's full copy: after a bias update its routes still equal the trainer's."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not built")
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           "--device=cpu", "--init_from=tiny-sigmoid", "--parallel=fsdp", "--steps=3", "--save_every=3",
           "--task=copy", "--n_digits=2", "--prompts_per_step=4", "--group_size=4", "--minibatch_size=8",
           "--expert_bias_update_rate=0.05", "--progress=false", f"--out_dir={out}"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 3: weights identical on 2 ranks" in r.stdout          # the digest includes the buffers
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert all(row["train_rollout_kl"] == 0 and row["route_flip_frac"] == 0 for row in rows)
    with open(os.path.join(out, "latest")) as f:
        model = Transformer.from_pretrained(os.path.join(out, f.read().strip()))
    bias = model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().max() >= 0.1 - 1e-6                               # three updates of +-0.05 moved it


# ---------------------------------------------------------------------------------------------------
# CUDA: the router runs as torch ops there too; show their row invariance on the device
# ---------------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_ops_row_invariant_on_cuda(dtype, dev="cuda"):
    g = torch.Generator().manual_seed(0)
    for M, E in ((300, 16), (1000, 128)):
        logits = (torch.randn(M, E, generator=g) * 3).to(dev, dtype)
        bias = (torch.randn(E, generator=g) * 0.2).to(dev, dtype)
        for kw in ROUTER_CASES + [dict(scoring="sigmoid", n_group=8, topk_group=4, scaling=2.5)]:
            full = kernels.route(logits, 8 if E == 128 else 3, True, bias=bias, **kw)
            for m in (1, 2, 3, 7, 16, 33, 100, M - 1):
                part = kernels.route(logits[:m], 8 if E == 128 else 3, True, bias=bias, **kw)
                assert all(torch.equal(a, b[:m]) for a, b in zip(part, full)), (M, E, kw, m)
        x = (torch.randn(M, 1, generator=g) * 3).to(dev, dtype)         # Qwen2-MoE's shared-expert gate
        assert all(torch.equal(kernels.sigmoid(x[:m]), kernels.sigmoid(x)[:m]) for m in (1, 5, 64, M - 1))

