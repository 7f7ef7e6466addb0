"""kernels.py (torch backend): each op against a plain reference, and each op's batch invariance.

Bitwise claims use torch.equal. The control for the matmul (plain x @ w.T is NOT row-invariant on this
CPU) lives in test_model.py next to the model's batch-invariance tests; the SiLU control is here.
"""
import pytest
import torch
import torch.nn.functional as F

import kernels
from config import ConfigError
from kernels import KV_BLOCK, ROW_CHUNK

DTYPES = [torch.float32, torch.bfloat16]
ROW_COUNTS = sorted({1, 2, 3, 7, ROW_CHUNK - 1, ROW_CHUNK, ROW_CHUNK + 1, 2 * ROW_CHUNK + 5, 100})


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max())


# ---------------------------------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------------------------------
def test_linear_matches_matmul():
    x, w = torch.randn(2, 37, 64), torch.randn(48, 64)
    y = kernels.linear(x, w)
    assert y.shape == (2, 37, 48) and y.dtype == torch.float32
    ref = (x.double() @ w.double().T)
    assert rel(y, ref) < 1e-5


def test_linear_bf16_accumulates_in_fp32():
    x, w = torch.randn(40, 256).bfloat16(), torch.randn(24, 256).bfloat16()
    y = kernels.linear(x, w)
    assert y.dtype == torch.bfloat16
    ref = (x.double() @ w.double().T)
    # fp32 accumulation then one rounding to bf16: error is a bf16 rounding (2^-8), not 256 of them
    assert torch.allclose(y.double(), ref, rtol=2 ** -8, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_row_count_invariant(dtype):
    x, w = torch.randn(max(ROW_COUNTS), 96).to(dtype), torch.randn(80, 96).to(dtype)
    full = kernels.linear(x, w)
    for m in ROW_COUNTS:
        assert torch.equal(kernels.linear(x[:m], w), full[:m]), m
        # any window of rows, not only a prefix: the row's position inside a tile must not matter
        assert torch.equal(kernels.linear(x[m - 1:m + 40], w), full[m - 1:m + 40]), m
    # leading dims are flattened: (B, T, K) gives the same rows as (B*T, K)
    assert torch.equal(kernels.linear(x[:60].view(4, 15, 96), w).view(60, 80), full[:60])


# ---------------------------------------------------------------------------------------------------
# elementwise and row reductions
# ---------------------------------------------------------------------------------------------------
def test_rms_norm_matches_formula():
    x, w = torch.randn(5, 9, 64) * 3, torch.rand(64) + 0.5
    ref = w.double() * x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6)
    y = kernels.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.float32
    assert torch.allclose(y.double(), ref, rtol=1e-6, atol=1e-6)
    # eps matters: all-zero rows give zeros, not NaN
    z = kernels.rms_norm(torch.zeros(2, 64), w, 1e-6)
    assert torch.equal(z, torch.zeros(2, 64))


def test_rms_norm_bf16_follows_transformers_rounding():
    x, w = (torch.randn(8, 64) * 3).bfloat16(), (torch.rand(64) + 0.5).bfloat16()
    y = kernels.rms_norm(x, w, 1e-6)
    assert y.dtype == torch.bfloat16
    xf = x.float()
    normed = (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert torch.equal(y, w * normed)


def test_silu_mul_matches_reference():
    g, u = torch.randn(7, 33, 40) * 4, torch.randn(7, 33, 40)
    y = kernels.silu_mul(g, u)
    ref = F.silu(g.double()) * u.double()
    assert torch.allclose(y.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(y, F.silu(g) * u, rtol=1e-6, atol=1e-6)
    # large |g| must not overflow into NaN
    big = kernels.silu_mul(torch.tensor([-200.0, 200.0]), torch.ones(2))
    assert torch.equal(big, torch.tensor([0.0, 200.0]))


def _row_prefixes_equal(f, x):
    full = f(x)
    return [m for m in range(1, x.shape[0] + 1) if not torch.equal(f(x[:m]), full[:m])]


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_and_norms_row_invariant(dtype):
    x = (torch.randn(70, 40) * 3).to(dtype)
    u = torch.randn(70, 40).to(dtype)
    w = (torch.rand(40) + 0.5).to(dtype)
    assert _row_prefixes_equal(lambda t: kernels.rms_norm(t, w, 1e-6), x) == []
    assert _row_prefixes_equal(lambda t: kernels.silu_mul(t, u[:t.shape[0]]), x) == []
    assert _row_prefixes_equal(lambda t: kernels.token_logprobs(t, torch.arange(t.shape[0]) % 40, 0.7), x) == []
    assert _row_prefixes_equal(lambda t: kernels.route(t, 3, True)[1], x) == []


def test_control_naive_silu():
    """On AVX-512 CPUs fp32 F.silu rounds differently in its vector tail; silu_mul must not."""
    x = torch.randn(70, 40) * 3
    if not _row_prefixes_equal(F.silu, x):
        pytest.skip("fp32 F.silu happens to be row-invariant on this CPU; nothing to control")
    assert _row_prefixes_equal(lambda t: kernels.silu_mul(t, torch.ones_like(t)), x) == []


def test_rope_matches_transformers_formula():
    D, theta = 16, 10000.0
    cos, sin = kernels.rope_tables(D, theta, 64)
    assert cos.shape == (64, D // 2) and cos.dtype == torch.float32
    x = torch.randn(2, 10, 3, D)
    pos = torch.tensor([list(range(10)), list(range(30, 40))])
    y = kernels.apply_rope(x, cos[pos], sin[pos])
    # reference: HF rotate_half with cat((freqs, freqs)) tables, in fp64
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    f = pos.double()[..., None] * inv
    c, s = torch.cat([f.cos(), f.cos()], -1)[:, :, None], torch.cat([f.sin(), f.sin()], -1)[:, :, None]
    xd = x.double()
    rot = torch.cat([-xd[..., D // 2:], xd[..., :D // 2]], -1)
    ref = xd * c + rot * s
    assert torch.allclose(y.double(), ref, atol=1e-5)
    # position 0 is the identity
    assert torch.equal(kernels.apply_rope(x[:, :1], cos[:1].expand(2, 1, -1), sin[:1].expand(2, 1, -1)), x[:, :1])


# ---------------------------------------------------------------------------------------------------
# paged attention
# ---------------------------------------------------------------------------------------------------
def naive_attention(q, k, v, scale):
    """q (B, T, H, D), k/v (B, S, KVH, D), causal with query t at position t. fp64."""
    B, T, H, D = q.shape
    G = H // k.shape[2]
    k = k.double().repeat_interleave(G, dim=2)
    v = v.double().repeat_interleave(G, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q.double(), k) * scale
    mask = torch.ones(T, k.shape[1], dtype=torch.bool).tril()
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", s.softmax(-1), v)


def lay_out(k, page_size, num_pages, perm_seed):
    """Write k (B, S, KVH, D) into a cache of random garbage pages in a shuffled page order.
    Returns cache (num_pages, page_size, KVH, D) and block_table (B, n_blocks)."""
    B, S, KVH, D = k.shape
    n_blocks = -(-S // page_size)
    g = torch.Generator().manual_seed(perm_seed)
    cache = torch.randn(num_pages, page_size, KVH, D, generator=g) * 7   # garbage, finite
    pages = torch.randperm(num_pages, generator=g)[:B * n_blocks].view(B, n_blocks)
    for b in range(B):
        for i in range(n_blocks):
            chunk = k[b, i * page_size:(i + 1) * page_size]
            cache[pages[b, i], :chunk.shape[0]] = chunk
    return cache, pages


@pytest.mark.parametrize("page_size", [KV_BLOCK, 2 * KV_BLOCK])
@pytest.mark.parametrize("H, KVH", [(4, 4), (4, 2), (8, 2)])
def test_paged_attention(page_size, H, KVH):
    B, T, D = 2, 45, 16
    scale = D ** -0.5
    q = torch.randn(B, T, H, D) * 2
    k, v = torch.randn(B, T, KVH, D) * 2, torch.randn(B, T, KVH, D)
    pos = torch.arange(T).expand(B, T)
    kc, bt = lay_out(k, page_size, 12, perm_seed=1)
    vc, bt_v = lay_out(v, page_size, 12, perm_seed=1)
    assert torch.equal(bt, bt_v)
    out = kernels.paged_attention(q, kc, vc, bt, pos, scale)
    assert out.shape == (B, T, H, D) and out.dtype == torch.float32
    ref = naive_attention(q, k, v, scale)
    assert rel(out, ref) < 1e-5

    # the same keys in another page order (and other garbage): bitwise the same result
    kc2, bt2 = lay_out(k, page_size, 20, perm_seed=2)
    vc2, _ = lay_out(v, page_size, 20, perm_seed=2)
    assert not torch.equal(bt, bt2)
    assert torch.equal(kernels.paged_attention(q, kc2, vc2, bt2, pos, scale), out)

    # decode: the query at position p alone (T = 1) gives prefill row p bitwise
    for p in [0, 1, KV_BLOCK - 1, KV_BLOCK, KV_BLOCK + 1, 31, 32, T - 1]:
        one = kernels.paged_attention(q[:, p:p + 1], kc, vc, bt, torch.full((B, 1), p), scale)
        assert torch.equal(one, out[:, p:p + 1]), p

    # a prefix of the queries (fewer tiles visited) gives the same rows
    assert torch.equal(kernels.paged_attention(q[:, :17], kc, vc, bt, pos[:, :17], scale), out[:, :17])

    # batch composition: sequence 1 alone gives the same bits as inside the batch of 2
    alone = kernels.paged_attention(q[1:], kc, vc, bt[1:], pos[1:], scale)
    assert torch.equal(alone, out[1:])


@pytest.mark.parametrize("H, KVH", [(4, 4), (8, 2)])
def test_fast_paged_attention_matches_reference(H, KVH):
    """The lab's fast attention (lab/fast_ops.paged_attention: SDPA over gathered pages, the GQA
    heads folded into query rows) against fp64 attention: prefill, a decode step at mixed positions,
    and garbage in the block table's columns past a sequence's end."""
    B, T, D = 2, 45, 16
    q = torch.randn(B, T, H, D) * 2
    k, v = torch.randn(B, T, KVH, D) * 2, torch.randn(B, T, KVH, D)
    kc, bt = lay_out(k, KV_BLOCK, 12, perm_seed=1)
    vc, _ = lay_out(v, KV_BLOCK, 12, perm_seed=1)
    ref = naive_attention(q, k, v, D ** -0.5)
    from lab import fast_ops
    with kernels.op_set(fast_ops.op_set(batch_variant=True, router_bf16=False)):
        out = kernels.paged_attention(q, kc, vc, bt, torch.arange(T).expand(B, T), D ** -0.5)
        steps = torch.tensor([[3], [T - 1]])                     # one query per sequence, different lengths
        one = kernels.paged_attention(q[torch.arange(B), steps[:, 0]][:, None], kc, vc, bt, steps, D ** -0.5)
    assert out.shape == (B, T, H, D) and rel(out, ref) < 1e-5
    assert rel(one[:, 0], ref[torch.arange(B), steps[:, 0]]) < 1e-5


def test_paged_attention_bf16():
    B, T, H, KVH, D = 1, 40, 4, 2, 16
    q, k, v = (torch.randn(B, T, H, D).bfloat16(), torch.randn(B, T, KVH, D).bfloat16(),
               torch.randn(B, T, KVH, D).bfloat16())
    kc, bt = lay_out(k.float(), 16, 4, 0)
    vc, _ = lay_out(v.float(), 16, 4, 0)
    kc, vc = kc.bfloat16(), vc.bfloat16()
    pos = torch.arange(T)[None]
    out = kernels.paged_attention(q, kc, vc, bt, pos, D ** -0.5)
    assert out.dtype == torch.bfloat16
    assert (out.double() - naive_attention(q, k, v, D ** -0.5)).abs().max() < 2e-2
    for p in [0, 15, 16, 39]:
        one = kernels.paged_attention(q[:, p:p + 1], kc, vc, bt, torch.tensor([[p]]), D ** -0.5)
        assert torch.equal(one, out[:, p:p + 1]), p


# ---------------------------------------------------------------------------------------------------
# attention sinks and sliding windows (gpt-oss)
# ---------------------------------------------------------------------------------------------------
def naive_sink_window_attention(q, k, v, scale, sinks=None, window=0):
    """fp64, as transformers' eager gpt-oss attention: keys past the causal edge or before the window
    masked, the head's sink one more logit of each softmax, then dropped."""
    B, T, H, D = q.shape
    G = H // k.shape[2]
    k, v = k.double().repeat_interleave(G, dim=2), v.double().repeat_interleave(G, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q.double(), k) * scale
    i, j = torch.arange(T)[:, None], torch.arange(k.shape[1])[None, :]
    s = s.masked_fill(~((j <= i) & ((j > i - window) if window else True)), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, H, 1, 1).expand(B, H, T, 1)], -1)
    return torch.einsum("bhts,bshd->bthd", s.softmax(-1)[..., :k.shape[1]], v)


def _sink_window_inputs(B, T, H, KVH, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g) * 2
    k, v = torch.randn(B, T, KVH, D, generator=g) * 2, torch.randn(B, T, KVH, D, generator=g)
    return q, k, v, torch.randn(H, generator=g) * 2


@pytest.mark.parametrize("with_sinks, window", [(True, 0), (False, 20), (True, 20), (True, 5)])
@pytest.mark.parametrize("H, KVH", [(4, 2), (8, 2)])
def test_paged_attention_sinks_and_window(with_sinks, window, H, KVH):
    """Against transformers' formula in fp64; then the contract: page order, decode (which skips the
    tiles below its window: a decode at 69 with a window of 20 starts at tile 3) bitwise the prefill's
    rows, a batch of rows starting at different tiles, a prefix, a row alone."""
    B, T, D = 2, 70, 16
    q, k, v, sinks = _sink_window_inputs(B, T, H, KVH, D)
    sinks = sinks if with_sinks else None
    attn = dict(sinks=sinks, window=window)
    kc, bt = lay_out(k, KV_BLOCK, 12, perm_seed=1)
    vc, _ = lay_out(v, KV_BLOCK, 12, perm_seed=1)
    pos = torch.arange(T).expand(B, T)
    out = kernels.paged_attention(q, kc, vc, bt, pos, D ** -0.5, **attn)
    assert rel(out, naive_sink_window_attention(q, k, v, D ** -0.5, sinks, window)) < 1e-5
    kc2, bt2 = lay_out(k, KV_BLOCK, 20, perm_seed=2)
    vc2, _ = lay_out(v, KV_BLOCK, 20, perm_seed=2)
    assert torch.equal(kernels.paged_attention(q, kc2, vc2, bt2, pos, D ** -0.5, **attn), out)
    for p in [0, 4, 5, 15, 16, 19, 20, 31, 47, 52, T - 1]:
        one = kernels.paged_attention(q[:, p:p + 1], kc, vc, bt, torch.full((B, 1), p), D ** -0.5, **attn)
        assert torch.equal(one, out[:, p:p + 1]), p
    steps = torch.tensor([[69], [6]])                              # rows at different first tiles, one batch
    mixed = kernels.paged_attention(q[torch.arange(B), steps[:, 0]][:, None], kc, vc, bt, steps, D ** -0.5, **attn)
    assert torch.equal(mixed[0], out[0, 69:70]) and torch.equal(mixed[1], out[1, 6:7])
    assert torch.equal(kernels.paged_attention(q[:, 30:45], kc, vc, bt, pos[:, 30:45], D ** -0.5, **attn), out[:, 30:45])
    assert torch.equal(kernels.paged_attention(q[1:], kc, vc, bt[1:], pos[1:], D ** -0.5, **attn), out[1:])


def test_paged_attention_sinks_and_window_gradients():
    B, T, H, KVH, D = 2, 40, 4, 2, 16
    q, k, v, sinks = _sink_window_inputs(B, T, H, KVH, D, seed=3)
    kc, bt = lay_out(k, KV_BLOCK, 6, perm_seed=1)
    vc, _ = lay_out(v, KV_BLOCK, 6, perm_seed=1)
    ours = [t.clone().requires_grad_(True) for t in (q, kc, vc, sinks)]
    out = kernels.paged_attention(ours[0], ours[1], ours[2], bt, torch.arange(T).expand(B, T), D ** -0.5,
                                  sinks=ours[3], window=9)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    (out * w).sum().backward()
    ref = [t.clone().double().requires_grad_(True) for t in (q, k, v, sinks)]
    (naive_sink_window_attention(ref[0], ref[1], ref[2], D ** -0.5, ref[3], 9) * w.double()).sum().backward()
    assert rel(ours[0].grad, ref[0].grad) < 1e-5 and rel(ours[3].grad, ref[3].grad) < 1e-5
    dk = torch.stack([ours[1].grad[bt[b]].reshape(-1, KVH, D)[:T] for b in range(B)])   # the pages, in order
    assert rel(dk, ref[1].grad) < 1e-5


def test_control_window_tiles_must_stay_absolute():
    """Why a window keeps the tiles at absolute positions: the same keys walked in tiles that start at
    the window's first key (what a kernel gathering just the window would do) give other bits than the
    prefill. (The exact skip of whole tiles below the window is test_paged_attention_sinks_and_window.)"""
    B, T, H, KVH, D, W = 1, 70, 4, 2, 16, 20
    q, k, v, sinks = _sink_window_inputs(B, T, H, KVH, D, seed=5)
    kc, bt = lay_out(k, KV_BLOCK, 6, perm_seed=1)
    vc, _ = lay_out(v, KV_BLOCK, 6, perm_seed=1)
    out = kernels.paged_attention(q, kc, vc, bt, torch.arange(T)[None], D ** -0.5, sinks=sinks, window=W)
    differ = 0
    for p in range(W + 3, T):
        lo = p - W + 1                                               # the window's keys from position 0
        kw, btw = lay_out(k[:, lo:p + 1], KV_BLOCK, 4, perm_seed=2)
        vw, _ = lay_out(v[:, lo:p + 1], KV_BLOCK, 4, perm_seed=2)
        cut = kernels.paged_attention(q[:, p:p + 1], kw, vw, btw, torch.tensor([[W - 1]]), D ** -0.5, sinks=sinks)
        assert rel(cut, out[:, p:p + 1]) < 1e-5
        differ += not torch.equal(cut, out[:, p:p + 1])
    if differ == 0:
        pytest.skip("relative tiles happened to round like absolute ones here; nothing to control")


def test_clamped_swiglu_and_expert_biases():
    """gpt-oss's experts (biases, clamped SwiGLU at a limit the activations reach) against an fp64 loop,
    row-invariant (permutations, neighbours, alone), gradients against fp64 autograd."""
    x, w13, w2, ids, weights = _moe_inputs(70, k=3)
    g = torch.Generator().manual_seed(8)
    b13, b2 = torch.randn(6, 48, generator=g) * 0.5, torch.randn(6, 32, generator=g) * 0.5
    extras = dict(b13=b13, b2=b2, swiglu=(1.702, 1.0))
    I = 24

    def naive(x, w13, w2, b13, b2, weights):
        rows = []
        for t in range(x.shape[0]):
            acc = 0
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                h = w13[e] @ x[t] + b13[e]
                gate, up = h[:I].clamp(max=1.0), h[I:].clamp(-1.0, 1.0)
                acc = acc + weights[t, j] * (w2[e] @ ((up + 1) * gate * torch.sigmoid(1.702 * gate)) + b2[e])
            rows.append(acc)
        return torch.stack(rows)
    y = kernels.moe_experts(x, w13, w2, ids, weights, **extras)
    ref = naive(*(t.double() for t in (x, w13, w2, b13, b2, weights)))
    assert rel(y, ref) < 1e-5 and rel(y, naive_moe(x, w13, w2, ids, weights)) > 1e-2   # the extras matter
    assert ((x @ w13[0].T + b13[0]).abs() > 1.0).any(), "the clamp is not reached"
    perm = torch.randperm(70, generator=g)
    assert torch.equal(kernels.moe_experts(x[perm], w13, w2, ids[perm], weights[perm], **extras), y[perm])
    for t in [0, 33, 69]:
        assert torch.equal(kernels.moe_experts(x[t:t + 1], w13, w2, ids[t:t + 1], weights[t:t + 1], **extras), y[t:t + 1])
    params = [t.clone().requires_grad_(True) for t in (x[:12], w13, w2, b13, b2, weights[:12])]
    ids = ids[:12]
    kernels.moe_experts(params[0], params[1], params[2], ids, params[5], b13=params[3], b2=params[4],
                        swiglu=(1.702, 1.0)).pow(2).sum().backward()
    refs = [p.detach().double().requires_grad_(True) for p in params]
    naive(*refs).pow(2).sum().backward()
    for p, r in zip(params, refs):
        assert rel(p.grad, r.grad) < 1e-5


def test_a_new_router_is_one_entry_of_router_scores(monkeypatch):
    """A fork's router scores (README, "A router"): one entry of kernels.ROUTER_SCORES. ModelConfig accepts its
    name, the sampler and the trainer's score run it, and the contract holds: the sampler's log-probs and routes
    are score()'s bits. Control: the entry is what routes (the same weights under softmax choose other experts)."""
    from conftest import assert_contract, make_model, tiny_config
    from rollout import Sampler
    with pytest.raises(ConfigError, match="router_scoring='abs_softmax': softmax, sigmoid, topk_softmax"):
        tiny_config(router_scoring="abs_softmax")
    monkeypatch.setitem(kernels.ROUTER_SCORES, "abs_softmax",
                        kernels.RouterScores(lambda z: torch.softmax(z.float().abs(), dim=-1)))
    model = make_model(tiny_config(router_scoring="abs_softmax"), seed=3)
    outs = Sampler(model, num_blocks=64).generate([[1, 2, 3, 4], [5, 6, 7]], max_new_tokens=6, n=2, seed=1)
    assert_contract(model, outs)
    plain = make_model(tiny_config(), seed=3)
    plain.load_state_dict(model.state_dict())
    tokens = torch.tensor([outs[0].prompt + outs[0].tokens])
    assert not torch.equal(model.score(tokens)[1], plain.score(tokens)[1])


def test_topk_softmax_route():
    """gpt-oss's router: the top-k of the logits (lowest index on ties), weighted by a softmax over those
    k; row-invariant; replay (R3) weights the replayed experts by the same softmax over theirs."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(90, 8, generator=g) * 2
    logits[::9, 5] = logits[::9, 2]                                  # ties
    ids, w, chosen = kernels.route(logits, 3, True, scoring="topk_softmax")
    ref_ids = torch.tensor([sorted(range(8), key=lambda e: (-row[e], e))[:3] for row in logits.tolist()])
    assert torch.equal(ids, ref_ids) and torch.equal(chosen, ids)
    assert rel(w, torch.softmax(logits.double().gather(-1, ids), -1)) < 1e-6
    full = kernels.route(logits, 3, True, scoring="topk_softmax", detail=True)
    for m in (1, 7, 31, 32, 33, 89):
        part = kernels.route(logits[:m], 3, True, scoring="topk_softmax", detail=True)
        assert all(torch.equal(a, b[:m]) for a, b in zip(part, full)), m
    assert torch.equal(full[3], torch.sort(logits, -1, descending=True).values[:, 2] - torch.sort(logits, -1, descending=True).values[:, 3])
    forced = (ids + 1) % 8
    f_ids, f_w, f_chosen = kernels.route(logits, 3, True, forced, scoring="topk_softmax")
    assert torch.equal(f_ids, forced) and torch.equal(f_chosen, ids)
    assert rel(f_w, torch.softmax(logits.double().gather(-1, forced), -1)) < 1e-6
    again = kernels.route(logits, 3, True, ids, scoring="topk_softmax")
    assert torch.equal(again[1], w)                                  # replaying one's own routes: the same bits


def test_yarn_rope_tables_are_transformers_bits():
    """kernels.rope_tables with YaRN against transformers' own rotary embedding (gpt-oss's settings, and
    DeepSeek's mscale pair): the same cos and sin bits."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
    cases = [dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
             dict(factor=40.0, beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707,
                  original_max_position_embeddings=4096)]
    for rope in cases:
        cfg = GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=32, num_hidden_layers=2,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **rope})
        cos_ref, sin_ref = GptOssRotaryEmbedding(cfg)(torch.zeros(1), torch.arange(300)[None])
        yarn = dict(factor=rope["factor"], original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                    truncate=rope.get("truncate", True), mscale=rope.get("mscale", 0.0),
                    mscale_all_dim=rope.get("mscale_all_dim", 0.0), attention_factor=0.0)
        cos, sin = kernels.rope_tables(32, 150000.0, 300, yarn=yarn)
        plain, _ = kernels.rope_tables(32, 150000.0, 300)
        assert torch.equal(cos, cos_ref[0]) and torch.equal(sin, sin_ref[0]), rope
        assert not torch.equal(cos, plain)


def test_linear_heads_is_row_invariant_and_einsum_is_not():
    """MLA's per-head projections (kernels.linear_heads) against fp64, the same bits for every row count;
    control: the plain per-head einsum picks its blocking from the row count on this CPU."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(100, 4, 24, generator=g), torch.randn(4, 20, 24, generator=g)
    y = kernels.linear_heads(x, w)
    assert y.shape == (100, 4, 20) and rel(y, torch.einsum("mhk,hnk->mhn", x.double(), w.double())) < 1e-6
    for m in ROW_COUNTS:
        assert torch.equal(kernels.linear_heads(x[:m], w), y[:m]), m
    assert torch.equal(kernels.linear_heads(x.view(10, 10, 4, 24), w), y.view(10, 10, 4, 20))
    naive = torch.einsum("mhk,hnk->mhn", x, w)
    if all(torch.equal(torch.einsum("mhk,hnk->mhn", x[:m], w), naive[:m]) for m in ROW_COUNTS):
        pytest.skip("the per-head einsum happens to be row-invariant on this CPU; nothing to control")


# ---------------------------------------------------------------------------------------------------
# router
# ---------------------------------------------------------------------------------------------------
def test_route_tie_break_lowest_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0],
                           [2.0, 2.0, 2.0, 2.0, 2.0],
                           [0.0, 0.0, 5.0, 1.0, 5.0]])
    ids, w, _ = kernels.route(logits, 2, norm_topk_prob=False)
    assert ids.tolist() == [[1, 2], [0, 1], [2, 4]]
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    ids3, _, _ = kernels.route(logits, 3, norm_topk_prob=False)
    assert ids3.tolist() == [[1, 2, 3], [0, 1, 2], [2, 4, 3]]


def test_route_weights():
    logits = torch.randn(50, 8) * 3
    probs = torch.softmax(logits.double(), -1)
    ids, w, _ = kernels.route(logits, 3, norm_topk_prob=False)
    top = probs.topk(3, dim=-1)
    assert torch.equal(ids, top.indices)                       # no ties in random data
    assert torch.allclose(w.double(), top.values, atol=1e-7)
    assert (w[:, :-1] >= w[:, 1:]).all()                       # descending
    ids_n, w_n, _ = kernels.route(logits, 3, norm_topk_prob=True)
    assert torch.equal(ids_n, ids)
    assert torch.allclose(w_n.sum(-1), torch.ones(50), atol=1e-6)
    assert torch.allclose(w_n.double(), top.values / top.values.sum(-1, keepdim=True), atol=1e-7)
    # bf16 logits: softmax is done in fp32
    ids_b, w_b, _ = kernels.route(logits.bfloat16(), 3, True)
    assert w_b.dtype == torch.float32
    assert torch.allclose(w_b.sum(-1), torch.ones(50), atol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_route_forced_ids(norm):
    logits = torch.randn(6, 8, requires_grad=True)
    forced = torch.tensor([[7, 0], [3, 5], [-1, -1], [1, 2], [-1, -1], [6, 4]])
    ids, w, _ = kernels.route(logits, 2, norm, forced_ids=forced)
    free_ids, free_w, _ = kernels.route(logits, 2, norm)
    set_rows = torch.tensor([0, 1, 3, 5])
    assert torch.equal(ids[set_rows], forced[set_rows])        # honoured, in the given order
    assert torch.equal(ids[[2, 4]], free_ids[[2, 4]])          # all -1 rows are routed freely
    assert torch.equal(w[[2, 4]], free_w[[2, 4]])
    probs = torch.softmax(logits.detach().double(), -1)
    want = probs[set_rows].gather(-1, forced[set_rows])
    if norm:
        want = want / want.sum(-1, keepdim=True)
        assert torch.allclose(w.sum(-1), torch.ones(6), atol=1e-6)
    assert torch.allclose(w[set_rows].double(), want, atol=1e-7)
    # the forced weights still carry the router's gradient
    (w * torch.tensor([1.0, 2.0])).sum().backward()
    assert logits.grad is not None and logits.grad[set_rows].abs().sum() > 0


def test_route_margin_and_entropy_by_hand():
    """A 4-expert router, top-2. Softmax row: probs (0.5, 0.3, 0.15, 0.05) -> margin 0.3 - 0.15, entropy
    -sum p ln p. A tie (two equal logits at the boundary) -> margin 0. Sigmoid with a bias: every
    sigmoid is 0.5, the bias (0, .1, .2, .3) decides -> margin on the biased scores 0.7 - 0.6, the
    entropy of the (uniform) unbiased scores ln 4. top_k = E leaves no (k+1)-th: margin inf."""
    import math
    p = [0.5, 0.3, 0.15, 0.05]
    logits = torch.tensor([[math.log(v) for v in p], [2.0, 1.0, 1.0, 0.0]])
    ids, w, chosen, margin, entropy = kernels.route(logits, 2, norm_topk_prob=False, detail=True)
    assert ids.tolist() == [[0, 1], [0, 1]]
    assert abs(margin[0].item() - 0.15) < 1e-6 and margin[1].item() == 0.0
    assert abs(entropy[0].item() - -sum(v * math.log(v) for v in p)) < 1e-6
    q = [math.exp(v) for v in (2.0, 1.0, 1.0, 0.0)]
    q = [v / sum(q) for v in q]
    assert abs(entropy[1].item() - -sum(v * math.log(v) for v in q)) < 1e-6
    plain = kernels.route(logits, 2, norm_topk_prob=False)
    assert all(torch.equal(a, b) for a, b in zip(plain, (ids, w, chosen)))   # detail changes no bits
    bias = torch.tensor([0.0, 0.1, 0.2, 0.3])
    ids, _, _, margin, entropy = kernels.route(torch.zeros(1, 4), 2, True, scoring="sigmoid", bias=bias, detail=True)
    assert ids.tolist() == [[3, 2]]
    assert abs(margin.item() - 0.1) < 1e-6 and abs(entropy.item() - math.log(4)) < 1e-6
    *_, margin, _ = kernels.route(logits, 4, norm_topk_prob=False, detail=True)
    assert margin.isinf().all()


# ---------------------------------------------------------------------------------------------------
# MoE experts
# ---------------------------------------------------------------------------------------------------
def naive_moe(x, w13, w2, ids, weights):
    I = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            a = F.silu(h[:I]) * h[I:]
            out[t] += weights[t, j].double() * (w2[e].double() @ a)
    return out


def _moe_inputs(M, E=6, D=32, I=24, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) * 0.2, torch.randn(E, D, I, generator=g) * 0.2
    ids, weights, _ = kernels.route(torch.randn(M, E, generator=g) * 2, k, True)
    return x, w13, w2, ids, weights


def test_moe_experts_matches_naive_loop():
    x, w13, w2, ids, weights = _moe_inputs(77, k=3)
    y = kernels.moe_experts(x, w13, w2, ids, weights)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel(y, naive_moe(x, w13, w2, ids, weights)) < 1e-5


def test_moe_experts_unused_experts_and_single_token():
    x, w13, w2, _, _ = _moe_inputs(1)
    ids, weights = torch.tensor([[4, 1]]), torch.tensor([[0.7, 0.3]])
    y = kernels.moe_experts(x, w13, w2, ids, weights)
    assert rel(y, naive_moe(x, w13, w2, ids, weights)) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_experts_invariant_to_permutation_and_neighbours(dtype):
    x, w13, w2, ids, weights = _moe_inputs(70)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    y = kernels.moe_experts(x, w13, w2, ids, weights)
    perm = torch.randperm(70, generator=torch.Generator().manual_seed(3))
    y_perm = kernels.moe_experts(x[perm], w13, w2, ids[perm], weights[perm])
    assert torch.equal(y_perm, y[perm])
    # extra random rows (other tokens in the batch), in front and behind
    xe, _, _, ide, we = _moe_inputs(45, seed=9)
    xe = xe.to(dtype)
    y_more = kernels.moe_experts(torch.cat([xe[:20], x, xe[20:]]), w13, w2,
                                 torch.cat([ide[:20], ids, ide[20:]]), torch.cat([we[:20], weights, we[20:]]))
    assert torch.equal(y_more[20:90], y)
    # every token alone
    for t in [0, 1, 33, 69]:
        assert torch.equal(kernels.moe_experts(x[t:t + 1], w13, w2, ids[t:t + 1], weights[t:t + 1]), y[t:t + 1])


def test_moe_experts_gradients_match_naive():
    x, w13, w2, ids, weights = _moe_inputs(20)
    params = [t.clone().requires_grad_(True) for t in (x, w13, w2, weights)]
    kernels.moe_experts(params[0], params[1], params[2], ids, params[3]).pow(2).sum().backward()
    ref = [t.clone().double().requires_grad_(True) for t in (x, w13, w2, weights)]
    naive_moe_d = naive_moe_autograd(ref[0], ref[1], ref[2], ids, ref[3])
    naive_moe_d.pow(2).sum().backward()
    for p, r in zip(params, ref):
        assert rel(p.grad, r.grad) < 1e-5


def naive_moe_autograd(x, w13, w2, ids, weights):
    I = w2.shape[2]
    rows = []
    for t in range(x.shape[0]):
        acc = 0
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            acc = acc + weights[t, j] * (w2[e] @ (F.silu(h[:I]) * h[I:]))
        rows.append(acc)
    return torch.stack(rows)


# ---------------------------------------------------------------------------------------------------
# token log-probs
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_token_logprobs(temperature):
    logits = torch.randn(3, 11, 50) * 4
    targets = torch.randint(0, 50, (3, 11))
    lp = kernels.token_logprobs(logits, targets, temperature)
    assert lp.shape == (3, 11) and lp.dtype == torch.float32
    t = 1.0 if temperature == 0.0 else temperature
    ref = torch.log_softmax(logits.double() / t, -1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(lp.double(), ref, rtol=1e-6, atol=1e-6)
    assert (lp <= 0).all()
    # bf16 logits are scored in fp32
    lpb = kernels.token_logprobs(logits.bfloat16(), targets, temperature)
    assert lpb.dtype == torch.float32
    refb = torch.log_softmax(logits.bfloat16().double() / t, -1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(lpb.double(), refb, rtol=1e-6, atol=1e-6)


def test_token_logprobs_temperature_changes_result():
    logits, targets = torch.randn(4, 50) * 4, torch.randint(0, 50, (4,))
    assert not torch.allclose(kernels.token_logprobs(logits, targets, 0.7),
                              kernels.token_logprobs(logits, targets, 1.0))
    # greedy (temperature 0) scores under the unscaled distribution
    assert torch.equal(kernels.token_logprobs(logits, targets, 0.0), kernels.token_logprobs(logits, targets, 1.0))


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_token_logprobs_entropy(temperature):
    """with_entropy: the entropy of softmax(logits / T) (T = 0 scores at T = 1) within 1e-5 of float64,
    logp bitwise as without it, no gradient through the entropy; a -inf logit (p = 0) adds nothing."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 40, generator=g) * 3
    logits[0, 0, 5] = float("-inf")
    targets = torch.randint(0, 40, (4, 6), generator=g)
    za = logits.clone().requires_grad_()
    lp, ent = kernels.token_logprobs(za, targets, temperature, with_entropy=True)
    assert torch.equal(lp, kernels.token_logprobs(logits, targets, temperature))
    assert ent.shape == (4, 6) and ent.dtype == torch.float32 and not ent.requires_grad
    logp64 = torch.log_softmax(logits.double() / (temperature or 1.0), -1)
    ref = -torch.where(logp64.isfinite(), logp64.exp() * logp64, 0.0).sum(-1)
    assert (ent.double() - ref).abs().max() < 1e-5
    lp.sum().backward()
    assert za.grad.abs().sum() > 0
