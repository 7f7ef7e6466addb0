"""model.py: agreement with transformers' Qwen3MoeForCausalLM, batch invariance of score(), routing replay
(R3), and gradients. Checkpoint formats and bad checkpoints: tests/test_hf.py.

Bitwise claims use torch.equal. transformers is the reference and a test-only dependency: the tests that
need it call pytest.importorskip through conftest.hf_classes().
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import kernels
from conftest import assert_same_weights, load_hf, make_model, rel_err, tiny_config
from model import Transformer

# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
# Tiny configs that cover the Qwen3-MoE variants (GQA ratio = num_attention_heads / num_key_value_heads).
HF_CONFIGS = {
    "base_norm_topk_gqa2": dict(),                                     # layer 0 dense, 1-2 MoE
    "no_norm_topk_gqa1": dict(norm_topk_prob=False, num_key_value_heads=4, mlp_only_layers=[]),
    "sparse_step2_gqa4": dict(decoder_sparse_step=2, num_key_value_heads=1, mlp_only_layers=[]),
    "dense_middle_8heads_gqa4": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                     mlp_only_layers=[1], num_experts_per_tok=3),
    "tied_embeddings": dict(tie_word_embeddings=True, norm_topk_prob=False),
}
TOL = 1e-5


def hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(tokens).logits


def hf_router_probs(hf, tokens):
    """Per MoE layer (in layer order): router softmax probabilities (M, E) fp32, from a hook on mlp.gate."""
    probs, handles = [], []
    for layer in hf.model.layers:
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
            handles.append(layer.mlp.gate.register_forward_hook(
                lambda mod, inp, out: probs.append(torch.softmax(out[0].float(), dim=-1))))
    try:
        logits = hf_logits(hf, tokens)
    finally:
        for h in handles:
            h.remove()
    return logits, probs


def check_routes_match_hf(routes, probs, k, min_clear=0.8):
    """Our top-k ids equal transformers' (as sets) wherever the k-th and (k+1)-th probs are not tied."""
    assert routes.shape[2] == len(probs)
    E = probs[0].shape[-1]
    n_clear = n_total = 0
    for j, p in enumerate(probs):
        ours = routes[:, :, j].reshape(-1, k).sort(-1).values
        top = p.topk(min(k + 1, E), dim=-1)
        ref = top.indices[:, :k].sort(-1).values
        if k < E:
            clear = (top.values[:, k - 1] - top.values[:, k]) > 1e-5
        else:
            clear = torch.ones(p.shape[0], dtype=torch.bool)
        assert torch.equal(ours[clear], ref[clear]), f"moe layer {j}: top-k experts differ from transformers"
        n_clear += int(clear.sum())
        n_total += clear.numel()
    assert n_clear >= min_clear * n_total, "too many near-ties for the route check to mean anything"


def ref_logp(logits, tokens, temperature=1.0):
    z = logits[:, :-1].double() / temperature
    return torch.log_softmax(z, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


# ---------------------------------------------------------------------------------------------------
# a. agreement with transformers
# ---------------------------------------------------------------------------------------------------
def check_logits_match(model, hf, tokens, what: str) -> torch.Tensor:
    """Our logits equal transformers' within TOL (max relative error); returns transformers' logits."""
    ref = hf_logits(hf, tokens)
    with torch.no_grad():
        logits = model(tokens)
    err = rel_err(logits, ref)
    print(f"\n[rel-err {what}]: {err:.3e}")
    assert logits.shape == ref.shape == (*tokens.shape, model.config.vocab_size)
    assert err < TOL, f"{what}: max rel error {err:.2e} vs transformers"
    return ref


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_matches_transformers_hf_to_ours(name, hf_checkpoint):
    overrides = HF_CONFIGS[name]
    hf, path = hf_checkpoint(seed=1, **overrides)
    model = Transformer.from_pretrained(path)
    assert model.config == tiny_config(**overrides)
    assert next(model.parameters()).dtype == torch.float32
    tokens = torch.randint(0, 50, (3, 40))
    ref = check_logits_match(model, hf, tokens, f"hf->ours {name}")

    # score(): log-probs of the next tokens and the routes
    _, probs = hf_router_probs(hf, tokens)
    with torch.no_grad():
        logp, routes = model.score(tokens)
        logp_t, routes_t = model.score(tokens, temperature=0.7)
    assert logp.shape == (3, 39) and logp.dtype == torch.float32
    cfg = model.config
    assert routes.shape == (3, 40, len(cfg.moe_layers), cfg.num_experts_per_tok)
    assert not routes.dtype.is_floating_point
    assert (logp.double() - ref_logp(ref, tokens)).abs().max() < 1e-5
    assert (logp_t.double() - ref_logp(ref, tokens, 0.7)).abs().max() < 1e-5
    assert torch.equal(routes_t, routes)
    check_routes_match_hf(routes, probs, cfg.num_experts_per_tok)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_matches_transformers_ours_to_hf(name, tmp_path):
    overrides = HF_CONFIGS[name]
    model = make_model(tiny_config(**overrides), seed=2, std=0.15)
    model.save_pretrained(str(tmp_path))
    hf = load_hf(str(tmp_path))
    assert hf.config.num_experts == model.config.num_experts
    assert hf.config.tie_word_embeddings == model.config.tie_word_embeddings
    tokens = torch.randint(0, 50, (2, 33))
    check_logits_match(model, hf, tokens, f"ours->hf {name}")


# ---------------------------------------------------------------------------------------------------
# b, c. batch invariance of score() and forward, and the control
# ---------------------------------------------------------------------------------------------------
LENGTHS = [1, 2, 15, 16, 17, 32, 70]     # multiples of 16 and 16 +- 1 (KV_BLOCK), and ROW_CHUNK


INV_CONFIGS = {
    "tiny": dict(),
    # odd widths everywhere, so elementwise ops see vector tails of every length
    "odd_widths": dict(hidden_size=40, head_dim=10, moe_intermediate_size=20, intermediate_size=36,
                       num_experts=6, num_experts_per_tok=3),
}


@pytest.fixture(scope="module", params=list(INV_CONFIGS))
def inv_model(request):
    cfg = tiny_config(initializer_range=0.2, **INV_CONFIGS[request.param])   # std 0.2: routing far from uniform
    return make_model(cfg, seed=11)


def make_seqs(seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (n,), generator=g) for n in LENGTHS]


def pad_batch(seqs, T, pad="random", seed=0):
    g = torch.Generator().manual_seed(seed)
    if pad == "random":
        out = torch.randint(0, 50, (len(seqs), T), generator=g)
    else:
        out = torch.full((len(seqs), T), int(pad))
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
    return out


def score_each(model, seqs, T, pad="random", seed=0):
    """Score seqs as one right-padded batch of length T; per sequence (logp at real positions, routes)."""
    with torch.no_grad():
        logp, routes = model.score(pad_batch(seqs, T, pad, seed))
    return [(logp[i, :len(s) - 1], routes[i, :len(s)]) for i, s in enumerate(seqs)]


def groupings(seqs, seed=0):
    """(name, list of (batch of sequence indices or random neighbours, T, pad)) covering many batch shapes."""
    n, L = len(seqs), max(len(s) for s in seqs)
    g = torch.Generator().manual_seed(seed)
    out = []
    for T in (L, L + 1, 80, 97, 150):                       # 150: padding far beyond the longest
        out.append((f"all_T{T}", [(list(range(n)), T, "random")]))
    out.append(("all_pad0", [(list(range(n)), L, 0)]))
    out.append(("reversed", [(list(range(n))[::-1], L + 3, "random")]))
    out.append(("pairs", [([i, i + 1], None, "random") for i in range(0, n - 1, 2)] + [([n - 1], None, 0)]))
    out.append(("pairs_shifted", [([i, (i + 3) % n], 72, "random") for i in range(n)]))
    out.append(("triples_odd", [([i, (i + 1) % n, (i + 5) % n], None, "random") for i in range(n)]))
    # each sequence among random-token neighbours of random lengths, at a random row
    nb = []
    for i in range(n):
        others = [torch.randint(0, 50, (int(torch.randint(1, 100, (1,), generator=g)),), generator=g)
                  for _ in range(3)]
        pos = int(torch.randint(0, 4, (1,), generator=g))
        nb.append((others[:pos] + [i] + others[pos:], None, "random"))
    out.append(("neighbours", nb))
    return out


def run_grouping(model, seqs, batches):
    """Results for every real sequence index seen in the grouping: {index: (logp, routes)}."""
    got = {}
    for bi, (members, T, pad) in enumerate(batches):
        batch = [seqs[m] if isinstance(m, int) else m for m in members]
        T = T or max(len(s) for s in batch)
        res = score_each(model, batch, T, pad, seed=bi)
        for m, r in zip(members, res):
            if isinstance(m, int):
                got[m] = r
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_is_batch_invariant(inv_model, dtype):
    model = copy.deepcopy(inv_model).to(dtype)
    seqs = make_seqs()
    alone = [score_each(model, [s], len(s))[0] for s in seqs]
    # routing is non-trivial: many experts used, tokens disagree
    k, E = model.config.num_experts_per_tok, model.config.num_experts
    all_routes = torch.cat([r for _, r in alone]).reshape(-1, model.n_moe_layers, k)
    for j in range(model.n_moe_layers):
        assert len(torch.unique(all_routes[:, j])) == E
    for name, batches in groupings(seqs):
        got = run_grouping(model, seqs, batches)
        assert sorted(got) == list(range(len(seqs)))
        for i, (lp, rt) in got.items():
            assert lp.dtype == torch.float32
            assert torch.equal(lp, alone[i][0]), f"{dtype} {name}: logp of sequence {i} (len {len(seqs[i])})"
            assert torch.equal(rt, alone[i][1]), f"{dtype} {name}: routes of sequence {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_logits_batch_invariant(inv_model, dtype):
    model = copy.deepcopy(inv_model).to(dtype)
    seqs = make_seqs(seed=6)
    batch = pad_batch(seqs, 90)
    with torch.no_grad():
        full = model(batch)
        assert full.dtype == dtype
        for i, s in enumerate(seqs):
            assert torch.equal(model(s[None])[0], full[i, :len(s)]), i
        # one sequence split across micro-batches of different sizes
        assert torch.equal(model(batch[2:5]), full[2:5])


def test_score_prefix_consistency(inv_model):
    """Causality: scoring a prefix gives the prefix's bits (what the sampler sees at decode time)."""
    s = make_seqs()[-1]
    with torch.no_grad():
        lp, rt = inv_model.score(s[None])
        for n in (1, 2, 16, 17, 33, 69):
            lpn, rtn = inv_model.score(s[None, :n])
            assert torch.equal(lpn[0], lp[0, :n - 1]) and torch.equal(rtn[0], rt[0, :n]), n


# The control. Found on this CPU (AMD EPYC, AVX-512, torch 2.13): x[:m] @ w.T differs from
# (x @ w.T)[:m] for m in 1..11 except 4 and 8, at every K/N tried; asserting it keeps the
# invariance tests honest (if this ever passes vacuously, search for shapes where it does not).
CONTROL_SHAPE = (300, 256, 512)
CONTROL_ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 16, 31, 32, 33, 64, 100, 299]


def test_control_naive_matmul_is_not_row_invariant_but_linear_is():
    M, K, N = CONTROL_SHAPE
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    naive_full, ours_full = x @ w.T, kernels.linear(x, w)
    naive_differs = [m for m in CONTROL_ROWS if not torch.equal(x[:m] @ w.T, naive_full[:m])]
    ours_differs = [m for m in CONTROL_ROWS if not torch.equal(kernels.linear(x[:m], w), ours_full[:m])]
    assert naive_differs, "plain x @ w.T was row-count invariant on this machine: the control is vacuous"
    assert ours_differs == []


def test_control_model_with_naive_matmul_is_not_batch_invariant(inv_model, monkeypatch):
    """The model-level control: with kernels.linear swapped for x @ w.T and kernels.silu_mul for
    F.silu(gate) * up (the ops a plain model would run), the invariance test fails. Which of the two
    shows it depends on the CPU: on an AVX-512 EPYC the matmul did at every width; on an AVX-512 Xeon
    a K=40 matmul differs only for one row (a matrix-vector path), and there F.silu's vector tail does."""
    monkeypatch.setattr(kernels, "linear", lambda x, w: x @ w.t())
    monkeypatch.setattr(kernels, "silu_mul", lambda gate, up: F.silu(gate) * up)
    seqs = make_seqs()
    alone = [score_each(inv_model, [s], len(s))[0] for s in seqs]

    def differs(batches):
        got = run_grouping(inv_model, seqs, batches)
        return any(not torch.equal(got[i][0], alone[i][0]) for i in got)
    # the groupings test_score_is_batch_invariant asserts over: at least one of them must fail
    assert any(differs(batches) for _, batches in groupings(seqs))


# ---------------------------------------------------------------------------------------------------
# d. routing replay (R3)
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def replay_setup():
    model = make_model(tiny_config(initializer_range=0.2), seed=12)
    tokens = torch.randint(0, 50, (2, 37), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logp, routes = model.score(tokens)
    return model, tokens, logp, routes


def rolled(routes, E, shift=1):
    r = (routes + shift) % E
    assert (r.sort(-1).values.diff(dim=-1) != 0).all()      # still distinct within each token
    return r


def test_replay_own_routes_is_identity(replay_setup):
    model, tokens, logp, routes = replay_setup
    with torch.no_grad():
        lp2, r2 = model.score(tokens, routes=routes)
        lp3, r3 = model.score(tokens, routes=routes.int())     # any integer dtype
    assert torch.equal(lp2, logp) and torch.equal(r2, routes)
    assert torch.equal(lp3, logp) and torch.equal(r3, routes)


def spy_expert_ids(monkeypatch):
    """Record the expert ids every MoE layer actually computes with (what kernels.moe_experts gets)."""
    seen = []
    real = kernels.moe_experts

    def spy(x, w13, w2, ids, weights):
        seen.append(ids.clone())
        return real(x, w13, w2, ids, weights)
    monkeypatch.setattr(kernels, "moe_experts", spy)
    return seen


def test_replay_forced_routes_obeyed_and_router_gets_gradient(replay_setup, monkeypatch):
    model, tokens, logp, routes = replay_setup
    forced = rolled(routes, model.config.num_experts)
    model.zero_grad(set_to_none=True)
    seen = spy_expert_ids(monkeypatch)
    lp, r = model.score(tokens, routes=forced)
    used = torch.stack([ids.view(tokens.shape[0], tokens.shape[1], -1) for ids in seen], dim=2)
    assert torch.equal(used, forced)                           # the experts computed are the forced ones
    # score reports the router's own choice: at the first MoE layer its inputs are the free run's
    assert torch.equal(r[:, :, 0], routes[:, :, 0]) and not torch.equal(r, forced)
    assert not torch.equal(lp.detach(), logp)
    assert (lp.detach() - logp).abs().max() > 1e-3
    lp.sum().backward()
    for i in model.config.moe_layers:
        g = model.layers[i].mlp.gate.weight.grad
        assert g is not None and g.abs().sum() > 0, f"layer {i}: router got no gradient under replay"
    model.zero_grad(set_to_none=True)


def test_replay_with_no_recorded_route_is_an_error(replay_setup):
    model, tokens, logp, routes = replay_setup
    with pytest.raises(ValueError, match="all -1"):
        model.score(tokens, routes=torch.full_like(routes, -1))


def test_replay_one_unrecorded_token_is_routed_freely(replay_setup, monkeypatch):
    """Token t has all -1 rows; earlier tokens replay their own routes, later ones forced other routes.
    Then token t routes exactly as in the free run (its inputs are the free run's), the log-probs up to
    it are the free run's, and later tokens follow the forced routes."""
    model, tokens, logp, routes = replay_setup
    t = 20
    forced = rolled(routes, model.config.num_experts)
    forced[:, :t] = routes[:, :t]
    forced[:, t] = -1
    seen = spy_expert_ids(monkeypatch)
    with torch.no_grad():
        lp, r = model.score(tokens, routes=forced)
    used = torch.stack([ids.view(tokens.shape[0], tokens.shape[1], -1) for ids in seen], dim=2)
    assert torch.equal(used[:, t], routes[:, t])               # free routing at t = the free run's
    assert torch.equal(used[:, t + 1:], forced[:, t + 1:])
    assert torch.equal(used[:, :t], routes[:, :t])
    assert torch.equal(r[:, :t + 1], routes[:, :t + 1])        # the router's own choice, reported
    assert torch.equal(lp[:, :t + 1], logp[:, :t + 1])         # logp[i] is read off hidden state i
    assert not torch.equal(lp[:, t + 1:], logp[:, t + 1:])


def test_replay_across_batches_with_unrecorded_padding(inv_model):
    """R3 as the trainer uses it: routes recorded one sequence at a time, replayed in a padded batch
    whose padding positions carry -1 routes; the real positions match the recording bitwise."""
    seqs = make_seqs()[2:6]
    rec = [score_each(inv_model, [s], len(s))[0] for s in seqs]
    T = 75
    tokens = pad_batch(seqs, T)
    k, L = inv_model.config.num_experts_per_tok, inv_model.n_moe_layers
    routes = torch.full((len(seqs), T, L, k), -1, dtype=torch.long)
    for i, (s, (_, r)) in enumerate(zip(seqs, rec)):
        routes[i, :len(s)] = r
    with torch.no_grad():
        lp, r = inv_model.score(tokens, routes=routes)
    for i, s in enumerate(seqs):
        assert torch.equal(lp[i, :len(s) - 1], rec[i][0]) and torch.equal(r[i, :len(s)], rec[i][1])


def _bad_routes(routes, E):
    B, T, L, k = routes.shape
    bad = {
        "short_T": routes[:, :-1],
        "long_T": torch.cat([routes, routes[:, :1]], 1),
        "wrong_B": routes[:1],
        "fewer_layers": routes[:, :, :-1],
        "extra_layer": torch.cat([routes, routes[:, :, :1]], 2),
        "wrong_k": routes[..., :1],
        "float": routes.float(),
        "bool": routes > 0,
        "minus2": torch.full_like(routes, -2),
    }
    r = routes.clone(); r[0, 3, 0, 1] = E; bad["id_ge_E"] = r
    r = routes.clone(); r[1, 5, 1, 0] = -1; bad["partial_minus1"] = r
    r = routes.clone(); r[0, 7, 0, 1] = r[0, 7, 0, 0]; bad["duplicate"] = r
    return bad


@pytest.mark.parametrize("case", ["short_T", "long_T", "wrong_B", "fewer_layers", "extra_layer", "wrong_k",
                                  "float", "bool", "minus2", "id_ge_E", "partial_minus1", "duplicate"])
def test_replay_rejects_bad_routes(replay_setup, case):
    model, tokens, _, routes = replay_setup
    bad = _bad_routes(routes, model.config.num_experts)[case]
    with pytest.raises(ValueError) as e:
        with torch.no_grad():
            model.score(tokens, routes=bad)
    if case == "minus2":                                              # not "all -1": say what is there
        assert "negative id -2" in str(e.value) and "all -1" not in str(e.value)


# ---------------------------------------------------------------------------------------------------
# e. gradients
# ---------------------------------------------------------------------------------------------------
def hf_param_name(name: str) -> str:
    if name.endswith(".mlp.w13"):
        return "model." + name[:-len("w13")] + "experts.gate_up_proj"
    if name.endswith(".mlp.w2"):
        return "model." + name[:-len("w2")] + "experts.down_proj"
    return name if name.startswith("lm_head") else "model." + name


@pytest.mark.parametrize("name", ["base_norm_topk_gqa2", "no_norm_topk_gqa1", "tied_embeddings"])
def test_gradients_match_transformers(hf_checkpoint, name):
    hf, path = hf_checkpoint(seed=4, **HF_CONFIGS[name])
    model = Transformer.from_pretrained(path)
    hf = hf.double()                                  # fp64 reference; ours runs in fp32
    tokens = torch.randint(0, 50, (2, 24))

    logits_ref, probs = hf_router_probs(hf, tokens)  # the routes must agree for the grads to agree
    logp, routes = model.score(tokens)
    check_routes_match_hf(routes, probs, model.config.num_experts_per_tok, min_clear=1.0)
    logp.sum().backward()

    ref = torch.log_softmax(hf(tokens).logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).sum()
    ref.backward()
    hf_params = dict(hf.named_parameters())
    worst = 0.0
    for pname, p in model.named_parameters():
        g_ref = hf_params[hf_param_name(pname)].grad
        assert p.grad is not None and g_ref is not None, pname
        assert p.grad.shape == g_ref.shape, pname
        err = rel_err(p.grad, g_ref)
        worst = max(worst, err)
        assert err < 1e-4, f"{pname}: grad rel error {err:.2e}"
    print(f"\n[grad rel-err] {name}: worst over params {worst:.3e}")
    for i in model.config.moe_layers:
        assert model.layers[i].mlp.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_is_deterministic(dtype):
    model = make_model(tiny_config(), seed=13).to(dtype)
    tokens = pad_batch(make_seqs(), 72)

    def grads():
        model.zero_grad(set_to_none=True)
        logp, _ = model.score(tokens, temperature=0.7)
        (logp * torch.linspace(-1, 1, logp.shape[1])).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    a, b = grads(), grads()
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert all(g.abs().sum() > 0 for n, g in a.items() if n != "embed_tokens.weight")


# ---------------------------------------------------------------------------------------------------
# misc API
# ---------------------------------------------------------------------------------------------------
def test_positions_past_max_raise():
    model = make_model(tiny_config(max_position_embeddings=32))
    model(torch.zeros(1, 32, dtype=torch.long))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("tokens, error, needle", [
    (torch.tensor([1, 2, 3]), ValueError, "shape (B, T), got (3,); add the batch dimension: tokens[None]"),
    (torch.ones(1, 3, 2, dtype=torch.long), ValueError, "shape (B, T)"),
    (torch.tensor([[1.0, 2.0]]), TypeError, "integer token ids (torch.long), got torch.float32"),
    (torch.tensor([[True, False]]), TypeError, "got torch.bool"),
    (torch.zeros(1, 0, dtype=torch.long), ValueError, "hold no tokens"),
    (torch.zeros(0, 4, dtype=torch.long), ValueError, "hold no tokens"),
    (torch.tensor([[1, 50]]), ValueError, "in [0, vocab_size=50), got 50"),
    (torch.tensor([[1, -1]]), ValueError, "got -1"),
    ([[1, 2]], TypeError, "torch.Tensor"),
])
def test_score_and_forward_reject_bad_tokens(tokens, error, needle):
    model = make_model()
    for call in (model.score, model.forward):
        with pytest.raises(error) as e:
            call(tokens)
        assert needle in str(e.value)
    model.score(torch.tensor([[1, 2]]))                               # control: the same call with good tokens
    assert model.score(torch.tensor([[7]]))[0].shape == (1, 0)        # one token: nothing to score, no error


def test_dense_only_model_scores():
    model = make_model(tiny_config(num_experts=0, mlp_only_layers=[]))
    logp, routes = model.score(torch.randint(0, 50, (2, 9)))
    assert logp.shape == (2, 8) and routes.shape == (2, 9, 0, 2)
    assert all(not layer.is_moe for layer in model.layers)


def test_reset_parameters_is_seeded():
    a, b = Transformer(tiny_config()), Transformer(tiny_config())
    a.reset_parameters(seed=3)
    b.reset_parameters(seed=3)
    assert_same_weights(a, b)
    b.reset_parameters(seed=4)
    assert not torch.equal(a.layers[1].mlp.w13, b.layers[1].mlp.w13)
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    std = a.layers[1].mlp.w13.std().item()
    assert abs(std - a.config.initializer_range) < 0.2 * a.config.initializer_range


def test_score_with_entropy_keeps_logp_bits():
    """score(with_entropy=True): logp bitwise unchanged, entropy of softmax(logits / T) vs float64."""
    model = make_model()
    tokens = torch.randint(0, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    for T in (1.0, 0.7):
        logp, routes = model.score(tokens, T)
        logp2, routes2, ent = model.score(tokens, T, with_entropy=True)
        assert torch.equal(logp, logp2) and torch.equal(routes, routes2)
        z = torch.log_softmax(model(tokens)[:, :-1].double() / T, -1)
        ref = -(z.exp() * z).sum(-1)
        assert ent.shape == logp.shape and not ent.requires_grad
        assert torch.allclose(ent.double(), ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# score in logit chunks (long responses: the (B, T-1, V) logits need not exist at once)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_score_in_logit_chunks(tied):
    """logits_chunk=16 over 3 x 39 positions (8 chunks, the last partial): the same log-probs, entropy
    and routes bit for bit, gradients within 1e-5 of the unchunked ones and the same run to run, and
    no saved (..., V) tensor larger than a chunk's logits (the unchunked score saves all: the control)."""
    model = make_model(tiny_config(tie_word_embeddings=tied), seed=5)
    tokens = torch.randint(0, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    g = torch.randn(3, 39, generator=torch.Generator().manual_seed(1))
    results = []
    for chunk in (0, 16, 16):
        model.zero_grad()
        largest = [0]

        def pack(t):                                                # the largest saved (..., V) tensor
            if t.shape and t.shape[-1] == model.config.vocab_size:
                largest[0] = max(largest[0], t.numel())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, routes, entropy = model.score(tokens, 0.7, with_entropy=True, logits_chunk=chunk)
        (logp * g).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logp, routes, entropy, grads, largest[0]))
    (lp0, r0, e0, g0, big0), (lp1, r1, e1, g1, big1), (lp2, _, _, g2, _) = results
    assert torch.equal(lp1, lp0) and torch.equal(r1, r0) and torch.equal(e1, e0) and torch.equal(lp2, lp0)
    assert g1.keys() == g0.keys() and "lm_head.weight" in g1 or tied
    for name in g0:
        assert rel_err(g1[name], g0[name]) < 1e-5, name
        assert torch.equal(g1[name], g2[name]), name                    # deterministic
    V = model.config.vocab_size
    assert big0 >= 3 * 39 * V and big1 == 0, (big0, big1)        # chunked: logits live inside the Function


def test_multi_head_attention_scores_packed_and_padded():
    """As many KV heads as query heads (OLMoE's layout): a query block of 16 positions is a whole tile of
    attention rows, so the torch kernel's scaled queries are a strided view; the packed and the padded
    forwards (16 and 32 tokens: whole tiles) run and give the same bits. It raised before."""
    from support.packing import Packing
    model = make_model(tiny_config(num_attention_heads=2, num_key_value_heads=2), seed=5)
    tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    logp, routes = model.score(tokens)
    packed = model.score(tokens.reshape(1, 64), packing=Packing.concat([32, 32]))
    assert torch.equal(Packing.concat([32, 32]).to_padded(packed[0])[:, :31], logp)
    assert torch.equal(model.score(tokens[:, :16])[0], logp[:, :15])
