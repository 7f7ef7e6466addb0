"""The Triton backend (kernels_triton/ops.py): agreement with the torch backend, and the invariance contract.

    python -m pytest -q tests/test_triton.py

Without CUDA the kernels run on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1): fp32
only (the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest even), tiny shapes, few
launches per test (the interpreter's cost is per launch and per tile). With CUDA the same tests run
on the GPU, plus the `gpu` tests (bf16 and fp32, larger shapes), which are skipped
without CUDA. Bitwise claims use torch.equal; agreement with the torch backend is within
TOL = 1e-5 (max |a - b| / max |b|, fp32; measured 1e-7 to 6e-7 under the interpreter).

Where the bitwise claims hold: the interpreter runs tl.dot through numpy's BLAS, and some BLAS
kernels (OPENBLAS_CORETYPE=Haswell) round a row by its place inside the block. So under the
interpreter a row is compared bitwise only where it sits at the same place of the same tile (the
kernel's own property); elsewhere `same_bits` checks it within TOL. On CUDA every claim is bitwise,
and the torch backend proves the same claims bitwise on the CPU (tests/test_kernels.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")      # before kernels_triton applies @triton.jit
pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels_triton import ops as kt  # noqa: E402
from kernels_triton.tuning import load_tuning  # noqa: E402
from kernels_triton import moe as ktm  # noqa: E402
from kernels_triton import vocab as ktv  # noqa: E402
from conftest import assert_contract, make_model, tiny_config  # noqa: E402
from rollout import Sampler  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEV = "cuda" if CUDA else "cpu"
TOL = 1e-5
# kernels_triton was imported (its kernels decorated) without the interpreter by an earlier module of
# this process: the CPU checks cannot run here, test_rerun_in_subprocess runs this file afresh instead.
STALE = not CUDA and not kt.INTERPRET
runnable = pytest.mark.skipif(STALE, reason="kernels_triton imported without TRITON_INTERPRET; see subprocess test")
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def _auto_backend():
    """References run on CPU tensors with the torch backend; tests pick "triton" where they mean it."""
    with kernels.set_backend("auto"):
        yield


def rel(a, b):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()        # one device: the reference may be CPU
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def same_bits(a, b) -> bool:
    """The contract's bitwise claim for rows that may sit at another place of their tile: torch.equal
    on CUDA; under the interpreter within TOL (numpy's BLAS may round a row by its place, see above)."""
    return torch.equal(a, b) if CUDA else a.shape == b.shape and rel(a, b) < TOL


def randn(*shape, scale=1.0, seed=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return (torch.randn(*shape, generator=g) * scale).to(device=DEV, dtype=dtype)


@pytest.mark.skipif(not STALE, reason="kernels_triton runs under the interpreter in this process")
def test_rerun_in_subprocess():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------
# backend selection
# ---------------------------------------------------------------------------------------------------
def test_backend_selection():
    x = torch.zeros(2, 3)
    assert kernels.get_backend() in kernels.BACKENDS
    with kernels.set_backend("torch"):
        assert kernels.triton_for(x) is None
        with kernels.set_backend("triton"):
            assert kernels.triton_for(x) is kt
        assert kernels.get_backend() == "torch"               # the context manager restores
    with kernels.set_backend("auto"):
        assert kernels.triton_for(x) is None                 # CPU tensors stay on torch in auto mode
    with pytest.raises(ValueError, match="choose one of"):
        kernels.set_backend("cuda")


def test_import_kernels_does_not_import_triton():
    code = ("import importlib, os, sys, torch, kernels; assert 'triton' not in sys.modules; "
            "kernels.linear(torch.ones(2, 3), torch.ones(4, 3)); assert 'triton' not in sys.modules\n"
            "os.environ['KERNELS_BACKEND'] = 'fast'\n"
            "try:\n    importlib.reload(kernels)\nexcept ValueError as e:\n    assert 'KERNELS_BACKEND' in str(e)\n"
            "else:\n    raise SystemExit('an unknown KERNELS_BACKEND was accepted')")
    env = {k: v for k, v in os.environ.items() if k != "KERNELS_BACKEND"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_load_tuning_replaces_the_tables_and_rejects_a_bad_file_whole(tmp_path, tables):
    """kernels_triton.tuning.load_tuning: a sweep's file replaces each table it names (bf16 also serves fp16); a
    malformed one raises one ValueError naming the entry, and changes no table (not even the valid
    entries before the bad one)."""
    good = {"mm": {"bfloat16": [[8, 16, 16, 64, 2, 4], [None, 64, 128, 64, 4, 3]]},
            "moe": {"float32": [16, 16, 16, 2, 2]}, "attn": {"bwd_dq": [128, 8, 2]},
            "attn_keys": 128, "attn_split_below": 7}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(good))
    before = (dict(kt.MM_TABLE), dict(kt.ATTN_TABLE), dict(ktm.MOE_TILES))
    assert load_tuning(str(path)) == good
    assert kt.mm_config(8, torch.bfloat16) == [16, 16, 64, 2, 4] and kt.mm_config(9, torch.float16) == [64, 128, 64, 4, 3]
    assert kt.MM_TABLE[torch.float32] == before[0][torch.float32]
    assert ktm.MOE_TILES[torch.float32] == (16, 16, 16, 2, 2) and ktm.MOE_TILES[torch.bfloat16] == before[2][torch.bfloat16]
    assert kt.ATTN_TABLE["bwd_dq"] == (128, 8, 2) and kt.ATTN_TABLE["fwd"] == before[1]["fwd"]
    assert (kt.ATTN_KEYS, kt.ATTN_SPLIT_BELOW) == (128, 7)
    applied = (dict(kt.MM_TABLE), dict(kt.ATTN_TABLE), dict(ktm.MOE_TILES), kt.ATTN_KEYS, kt.ATTN_SPLIT_BELOW)
    bad = [({"mm": {"bfloat16": [[None, 64, 128, 64, 4, 0]]}}, "mm bfloat16 row 0"),
           ({"mm": {"bfloat16": [[None, 64, 128, 64, 4]]}}, "rows of 6"),
           ({"mm": {"bfloat16": [[64, 16, 16, 64, 2, 4], [8, 16, 16, 64, 2, 4], [None, 64, 128, 64, 4, 3]]}}, "increasing"),
           ({"mm": {"bfloat16": [[16, 16, 16, 64, 2, 4]]}}, "null"),
           ({"mm": {"int8": [[None, 64, 128, 64, 4, 3]]}}, "int8"),
           ({"attn_keys": 96, "attn": {"fwd": [64, 4, 0]}}, "attn fwd"),
           ({"attn": {"bwd": [64, 4, 2]}}, "'bwd'"),
           ({"mm": {"float32": [[None, 32, 32, 32, 4, 3]]}, "moe": {"bfloat16": [64, 64, 64, 4, 3.0]}}, "moe bfloat16"),
           ({"attn_split_below": -1}, "attn_split_below"), ({"attn_keys": 96}, "attn_keys = 96, need a positive integer, a power of two"),
           ({"mm": {"float32": [[None, 24, 32, 32, 4, 3]]}}, "powers of two"), ({"attn": {"fwd": [64, 6, 2]}}, "attn fwd"),
           ({"moe": {"bfloat16": [64, 64, 48, 4, 3]}}, "moe bfloat16"),
           ({"MM": {}}, "entries"), ([1, 2], "entries")]
    for tuning, says in bad:
        path.write_text(json.dumps(tuning))
        with pytest.raises(ValueError, match="tuning file") as e:
            load_tuning(str(path))
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert (dict(kt.MM_TABLE), dict(kt.ATTN_TABLE), dict(ktm.MOE_TILES), kt.ATTN_KEYS, kt.ATTN_SPLIT_BELOW) == applied
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read it as JSON"):
        load_tuning(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        load_tuning(str(tmp_path / "missing.json"))


# ---------------------------------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------------------------------
@runnable
def test_linear_matches_torch_and_is_row_invariant():
    x, w = randn(100, 96, seed=0), randn(80, 96, seed=1)
    y = kt.linear(x, w)
    assert y.shape == (100, 80) and y.dtype == torch.float32
    assert rel(y, kernels.linear(x.cpu(), w.cpu())) < TOL
    BM = kt.mm_config(100, torch.float32)[0]
    aligned = torch.cat([x[BM:BM + 7], randn(30, 96, seed=4)])   # rows BM.. at the same place of a same-config tile
    assert kt.mm_config(37, torch.float32) == kt.mm_config(100, torch.float32)
    assert torch.equal(kt.linear(aligned, w)[:7], y[BM:BM + 7])
    for lo, hi in [(5, 6), (3, 40), (64, 100)]:          # alone, and at other places inside a tile
        assert same_bits(kt.linear(x[lo:hi], w), y[lo:hi]), (lo, hi)
    assert same_bits(kt.linear(x[:60].view(4, 15, 96), w).view(60, 80), y[:60])   # leading dims flattened


def _configs(dtype):
    return [tuple(cfg) for _, *cfg in kt.MM_TABLE[dtype]]


@runnable
def test_linear_every_tile_config_agrees():
    """Each M bucket's config: within TOL of the reference, and a row alone (at the same place of its
    tile) has the bits of the full call in that config. tests below prove the configs equal on CUDA."""
    x, w = randn(40, 96, seed=0), randn(48, 96, seed=1)
    ref = kernels.linear(x.cpu(), w.cpu())
    for cfg in _configs(torch.float32):
        y = kt._mm(x, w, torch.float32, config=cfg)
        assert rel(y, ref) < TOL, cfg
        assert torch.equal(kt._mm(x[:1], w, torch.float32, config=cfg), y[:1]), cfg
        assert same_bits(kt._mm(x[5:6], w, torch.float32, config=cfg), y[5:6]), cfg


@runnable
def test_control_split_k_changes_bits():
    """The one thing the tile configs never do is split K: summing the two halves of K separately (what
    a split-K GEMM, or cuBLAS at small M, does) changes the bits, here and on CUDA."""
    x, w = randn(16, 512, seed=2), randn(32, 512, seed=3)
    y = kt._mm(x, w, torch.float32)
    split = kt._mm(x[:, :256], w[:, :256], torch.float32) + kt._mm(x[:, 256:], w[:, 256:], torch.float32)
    assert rel(split, y) < TOL and not torch.equal(split, y)


@runnable
def test_linear_gradients():
    x, w = randn(2, 37, 64, seed=0), randn(48, 64, seed=1)
    g = randn(2, 37, 48, seed=2)
    grads = []
    for f in (kt.linear, kernels.linear):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        (f(xa, wa) * g).sum().backward()
        grads.append((xa.grad, wa.grad))
    assert rel(grads[0][0], grads[1][0]) < TOL and rel(grads[0][1], grads[1][1]) < TOL


# ---------------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------------
@runnable
def test_rms_norm_forward_backward_and_invariance():
    x, w = randn(5, 9, 40, scale=3, seed=0), (torch.rand(40) + 0.5).to(DEV)
    g = randn(5, 9, 40, seed=1)
    outs, grads = [], []
    for f in (kt.rms_norm, kernels.rms_norm):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = f(xa, wa, 1e-6)
        (y * g).sum().backward()
        outs.append(y)
        grads.append((xa.grad, wa.grad))
    assert outs[0].dtype == torch.float32 and rel(outs[0], outs[1]) < TOL
    assert rel(grads[0][0], grads[1][0]) < TOL and rel(grads[0][1], grads[1][1]) < TOL
    rows = x.view(45, 40)
    assert torch.equal(kt.rms_norm(rows[7:8], w, 1e-6), outs[0].view(45, 40)[7:8].detach())
    assert torch.equal(kt.rms_norm(torch.zeros(2, 40, device=DEV), w, 1e-6), torch.zeros(2, 40, device=DEV))


# ---------------------------------------------------------------------------------------------------
# token log-probs
# ---------------------------------------------------------------------------------------------------
def mask_chunks(z, tg):
    """-inf over whole chunks of a (3, 5, 50) logits tensor with 32-entry segments of 16-entry chunks
    (banned tokens): a segment's first chunk, a row's first chunk, a whole segment; targets elsewhere."""
    z[1, 2, 32:48], z[2, 1, :16], z[0, 3, :32] = float("-inf"), float("-inf"), float("-inf")
    tg[1, 2], tg[2, 1], tg[0, 3] = 49, 20, 40


@runnable
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_chunked(monkeypatch, temperature):
    monkeypatch.setattr(ktv, "VOCAB_SEGMENT", 32)             # V = 50: two segments, the last partial,
    monkeypatch.setattr(ktv, "VOCAB_CHUNK", 16)               # two chunks in each
    z, tg = randn(3, 5, 50, scale=4, seed=0), torch.randint(0, 50, (3, 5)).to(DEV)
    mask_chunks(z, tg)
    g = randn(3, 5, seed=1)
    outs, grads = [], []
    for f in (ktv.token_logprobs, kernels.token_logprobs):
        za = z.clone().requires_grad_()
        lp = f(za, tg, temperature)
        (lp * g).sum().backward()
        outs.append(lp)
        grads.append(za.grad)
    assert outs[0].shape == (3, 5) and outs[0].dtype == torch.float32
    assert rel(outs[0], outs[1]) < TOL and rel(grads[0], grads[1]) < TOL
    assert torch.equal(ktv.token_logprobs(z[1, 2], tg[1, 2], temperature), outs[0][1, 2].detach())   # alone


@runnable
def test_token_logprobs_large_vocab_and_greedy():
    z, tg = randn(2, 5000, scale=4, seed=0), torch.tensor([7, 4999], device=DEV)
    lp = ktv.token_logprobs(z, tg, 0.0)
    assert rel(lp, kernels.token_logprobs(z.cpu(), tg.cpu(), 0.0)) < TOL
    assert torch.equal(lp, ktv.token_logprobs(z, tg, 1.0))    # greedy scores at temperature 1


@runnable
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_token_logprobs_entropy(monkeypatch, temperature):
    """with_entropy: the entropy of softmax(z / T) from the same pass, against float64; logp's bits
    unchanged by it; no gradient through the entropy."""
    monkeypatch.setattr(ktv, "VOCAB_SEGMENT", 32)             # V = 50: two segments, the last partial,
    monkeypatch.setattr(ktv, "VOCAB_CHUNK", 16)               # two chunks in each
    z, tg = randn(3, 5, 50, scale=4, seed=0), torch.randint(0, 50, (3, 5)).to(DEV)
    z[0, 0, 20] = float("-inf")                              # p = 0: adds nothing (no NaN)
    mask_chunks(z, tg)
    za = z.clone().requires_grad_()
    lp, ent = ktv.token_logprobs(za, tg, temperature, with_entropy=True)
    assert torch.equal(lp, ktv.token_logprobs(z, tg, temperature)) and not ent.requires_grad
    t = temperature if temperature else 1.0
    logp64 = torch.log_softmax(z.double() / t, -1)
    assert (ent.double() - -torch.where(logp64.isfinite(), logp64.exp() * logp64, 0.0).sum(-1)).abs().max() < 1e-5
    lp.sum().backward()                                      # the log-prob still has its gradient
    assert za.grad is not None and za.grad.abs().sum() > 0


@runnable
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sample_tokens_matches_torch_and_rows_alone(monkeypatch, temperature):
    """ktv.sample_tokens (no top-k / top-p) is the torch backend's inverse CDF computed by vocabulary
    segments: the same token for every row (here u * total never falls within rounding of a token's
    boundary), in a batch or alone. Rows: -inf logits inside a segment, a whole -inf segment, mass
    only in the last (partial) segment; u = 1 takes the last token of positive probability."""
    from rollout import draw_keys
    monkeypatch.setattr(ktv, "VOCAB_SEGMENT", 64)             # V = 200: four segments, the last partial,
    monkeypatch.setattr(ktv, "VOCAB_CHUNK", 16)               # four chunks in each
    B, V = 40, 200
    logits = randn(B, V, scale=4, seed=0).cpu()
    logits[1, :64] = float("-inf")
    logits[2, :-5] = float("-inf")
    logits[3, 10:150] = float("-inf")
    u = draw_keys(torch.tensor([7, 0]), torch.arange(B), torch.full((B,), 12))
    u[2] = 1.0
    tri = ktv.sample_tokens(logits.to(DEV), temperature, u.to(DEV))
    with kernels.set_backend("torch"):
        ref = kernels.sample_tokens(logits, temperature, 1.0, 0, u)
    assert tri.dtype == torch.long and torch.equal(tri.cpu(), ref)
    assert int(tri[2]) == V - 1 and int(tri[1]) >= 64 and not 10 <= int(tri[3]) < 150
    for b in (0, 2, 17):
        assert int(ktv.sample_tokens(logits[b:b + 1].to(DEV), temperature, u[b:b + 1].to(DEV))) == int(tri[b])
    assert torch.equal(ktv.sample_tokens(logits.flip(0).to(DEV), temperature, u.flip(0).to(DEV)), tri.flip(0))


@runnable
def test_sample_tokens_dispatch(monkeypatch):
    """The Triton backend draws with ktv.sample_tokens when nothing truncates the distribution, with the
    torch ops (a per-row sort) under top-k or top-p; the torch backend never calls the kernels."""
    calls = []
    monkeypatch.setattr(ktv, "sample_tokens", lambda *a: calls.append(a) or torch.zeros(2, dtype=torch.long))
    logits, u = randn(2, 30, seed=0), torch.full((2,), 0.5, dtype=torch.float64, device=DEV)
    with kernels.set_backend("triton"):
        kernels.sample_tokens(logits, 0.8, 1.0, 0, u)
        assert len(calls) == 1
        kernels.sample_tokens(logits, 0.8, 0.9, 0, u)
        kernels.sample_tokens(logits, 0.8, 1.0, 5, u)
        assert len(calls) == 1
    with kernels.set_backend("torch"):
        kernels.sample_tokens(logits, 0.8, 1.0, 0, u)
    assert len(calls) == 1


def test_triton_modules_do_not_import_kernels_or_each_other():
    """The dependencies run one way: kernels.py -> kernels_triton/{ops,moe,vocab}.py -> kernels_triton/base.py."""
    import ast
    imported = {}
    backend = ("kernels_triton.ops", "kernels_triton.moe", "kernels_triton.vocab")
    for name in backend + ("kernels_triton.base",):
        tree = ast.parse(open(os.path.join(ROOT, name.replace(".", "/") + ".py")).read())
        imported[name] = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
                         {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert all("kernels" not in deps for deps in imported.values()), imported
    for name in backend:                                     # each imports the base and nothing of the backend
        assert "kernels_triton.base" in imported[name] and not set(backend) & imported[name], (name, imported[name])
    assert not {m for m in imported["kernels_triton.base"] if m.startswith("kernels")}


# ---------------------------------------------------------------------------------------------------
# paged attention
# ---------------------------------------------------------------------------------------------------
def lay_out(k, page_size, num_pages, seed):
    """k (B, S, KVH, D) into a cache of finite garbage pages in shuffled order -> cache, block_table."""
    B, S, KVH, D = k.shape
    n_blocks = -(-S // page_size)
    g = torch.Generator().manual_seed(seed)
    cache = (torch.randn(num_pages, page_size, KVH, D, generator=g) * 7).to(k.device, k.dtype)
    pages = torch.randperm(num_pages, generator=g)[:B * n_blocks].view(B, n_blocks).to(k.device)
    for b in range(B):
        for i in range(n_blocks):
            chunk = k[b, i * page_size:(i + 1) * page_size]
            cache[pages[b, i], :chunk.shape[0]] = chunk
    return cache, pages


@runnable
@pytest.mark.parametrize("page_size, H, KVH", [(16, 4, 2), (32, 8, 2), (48, 4, 2)])   # 48: pages across tiles
def test_paged_attention_forward_and_invariance(page_size, H, KVH):
    B, T, D = 2, 140, 16                                   # 140 keys: three 64-key tiles, the last partial
    q, k, v = randn(B, T, H, D, scale=2, seed=0), randn(B, T, KVH, D, scale=2, seed=1), randn(B, T, KVH, D, seed=2)
    pos = torch.arange(T, device=DEV).expand(B, T)
    n_pages = 2 * -(-T // page_size)
    kc, bt = lay_out(k, page_size, n_pages + 2, seed=1)
    vc, _ = lay_out(v, page_size, n_pages + 2, seed=1)
    out = kt.paged_attention(q, kc, vc, bt, pos, D ** -0.5)
    assert out.shape == (B, T, H, D) and out.dtype == torch.float32
    assert rel(out, kernels.paged_attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), pos.cpu(), D ** -0.5)) < TOL
    # another page order and other garbage: the same bits
    kc2, bt2 = lay_out(k, page_size, n_pages + 5, seed=5)
    vc2, _ = lay_out(v, page_size, n_pages + 5, seed=5)
    assert torch.equal(kt.paged_attention(q, kc2, vc2, bt2, pos, D ** -0.5), out)

    def decode(p):                                         # one query per sequence, at position p
        return kt.paged_attention(q[:, p:p + 1], kc, vc, bt, torch.full((B, 1), p, device=DEV), D ** -0.5)
    # decode equals prefill. A query at a multiple of BT (queries per program) sits in the first rows
    # of its program in prefill as in decode: bitwise everywhere; elsewhere bitwise on CUDA (same_bits)
    BT = kt.ATTN_TABLE["fwd"][0] // triton_next_pow2(H // KVH)
    for p in (0, BT, 2 * BT):
        assert torch.equal(decode(p), out[:, p:p + 1]), p
    for p in (15, 17, 63, 64, 127, 139):                   # across the tile edges
        assert same_bits(decode(p), out[:, p:p + 1]), p
    # the masked/unmasked split follows the program's smallest position: a query at 70 next to one at
    # 5 sees tile 0 masked, alone it sees it unmasked; the same bits (both in the first rows)
    two = kt.paged_attention(q[:, [70, 5]], kc, vc, bt, torch.tensor([[70, 5]] * B, device=DEV), D ** -0.5)
    assert torch.equal(two[:, :1], decode(70))
    # batch composition: sequence 1 alone, its first 17 queries only
    assert torch.equal(kt.paged_attention(q[1:, :17], kc, vc, bt[1:], pos[1:, :17], D ** -0.5), out[1:, :17])


@runnable
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if CUDA else []))
def test_paged_attention_splits_in_parallel_give_the_same_bits(monkeypatch, dtype):
    """Keys in splits of one 64-key tile (three splits over 140 keys): the forward run as one program
    per query block walking the splits, or as one program per split plus a merge kernel (what a
    decode step of a few long sequences takes), gives the same bits; decode by splits equals prefill;
    both agree with the torch backend, and the backward through either is the same."""
    monkeypatch.setattr(kt, "ATTN_SPLIT", 1)
    B, T, H, KVH, D = 2, 140, 4, 2, 16
    q, k, v = (randn(B, T, H, D, scale=2, seed=0, dtype=dtype), randn(B, T, KVH, D, scale=2, seed=1, dtype=dtype),
               randn(B, T, KVH, D, seed=2, dtype=dtype))
    pos = torch.arange(T, device=DEV).expand(B, T)
    kc, bt = lay_out(k, 16, 24, seed=3)
    vc, _ = lay_out(v, 16, 24, seed=3)
    tol = TOL if dtype == torch.float32 else 2e-2

    def run(parallel, *args):
        monkeypatch.setattr(kt, "ATTN_SPLIT_BELOW", 10**9 if parallel else 0)
        return kt.paged_attention(*args, D ** -0.5)
    one = run(False, q, kc, vc, bt, pos)
    assert torch.equal(run(True, q, kc, vc, bt, pos), one)
    if dtype == torch.float32:   # control (fp32: a bf16 output may round the difference away): splitting
        monkeypatch.setattr(kt, "ATTN_SPLIT", 1000)   # is part of the arithmetic, a plain walk over the same
        assert not torch.equal(run(False, q, kc, vc, bt, pos), one)   # keys rounds otherwise, so prefill
        monkeypatch.setattr(kt, "ATTN_SPLIT", 1)      # must split exactly as a parallel decode does
    ref = kernels.paged_attention(*(t.cpu().float() if t.is_floating_point() else t.cpu() for t in (q, kc, vc, bt, pos)),
                                  D ** -0.5)
    assert rel(one, ref) < tol
    BT = kt.ATTN_TABLE["fwd"][0] // triton_next_pow2(H // KVH)
    for p in (0, BT, 4 * BT - 1 - (4 * BT - 1) % BT):      # first rows of their programs: bitwise anywhere
        dec = run(True, q[:, p:p + 1], kc, vc, bt, torch.full((B, 1), p, device=DEV))
        assert torch.equal(dec, one[:, p:p + 1]), p
    for p in (70, 139):
        assert same_bits(run(True, q[:, p:p + 1], kc, vc, bt, torch.full((B, 1), p, device=DEV)), one[:, p:p + 1])
    grads = []
    for parallel in (False, True):
        monkeypatch.setattr(kt, "ATTN_SPLIT_BELOW", 10**9 if parallel else 0)
        a = [t.clone().requires_grad_() for t in (q, k, v)]
        (_trainer_attention(kt.paged_attention, *a) * pos[..., None, None].float()).sum().backward()
        grads.append([t.grad for t in a])
    assert all(torch.equal(x, y) for x, y in zip(*grads))


def triton_next_pow2(n):
    return 1 << (n - 1).bit_length()


def _trainer_attention(att, q, k, v):
    """model.Attention's trainer path: the call's own k, v laid out as KV_BLOCK pages (autograd flows)."""
    B, T, KVH, D = k.shape
    pad = (-T) % kernels.KV_BLOCK
    kp = F.pad(k, (0, 0, 0, 0, 0, pad)).reshape(-1, kernels.KV_BLOCK, KVH, D)
    vp = F.pad(v, (0, 0, 0, 0, 0, pad)).reshape(-1, kernels.KV_BLOCK, KVH, D)
    bt = torch.arange(kp.shape[0], device=k.device).view(B, -1)
    return att(q, kp, vp, bt, torch.arange(T, device=k.device).expand(B, T), D ** -0.5)


@runnable
def test_paged_attention_gradients_deterministic():
    B, T, H, KVH, D = 2, 20, 4, 2, 16
    ins = [randn(B, T, H, D, seed=0), randn(B, T, KVH, D, seed=1), randn(B, T, KVH, D, seed=2)]
    g = randn(B, T, H, D, seed=3)
    grads = []
    for f in (kt.paged_attention, kt.paged_attention, kernels.paged_attention):
        a = [t.clone().requires_grad_() for t in ins]
        (_trainer_attention(f, *a) * g).sum().backward()
        grads.append([t.grad for t in a])
    for tri, tri2, ref in zip(*grads):
        assert rel(tri, ref) < TOL
        assert torch.equal(tri, tri2)                        # run to run


@runnable
def test_paged_attention_gradients_shared_pages():
    """Two sequences share their first page (a GRPO prompt prefix): its dK/dV sums both, in order.
    The table's last column lies past both sequences (a sampler's table is wider than its sequences):
    its entries name page 1, used by nobody, and page 0, used by sequence 0; they add nothing."""
    H, KVH, D, P = 4, 2, 16, 16
    q = randn(2, 24, H, D, seed=0)
    kc, vc = randn(4, P, KVH, D, seed=1), randn(4, P, KVH, D, seed=2)
    bt = torch.tensor([[2, 0, 1], [2, 3, 0]], device=DEV)
    pos = torch.arange(24, device=DEV).expand(2, 24)
    g = randn(2, 24, H, D, seed=3)
    grads = []
    for f in (kt.paged_attention, kernels.paged_attention):
        a = [t.clone().requires_grad_() for t in (q, kc, vc)]
        (f(a[0], a[1], a[2], bt, pos, D ** -0.5) * g).sum().backward()
        grads.append([t.grad for t in a])
    for tri, ref in zip(*grads):
        assert rel(tri, ref) < TOL
    assert torch.equal(grads[0][1][1], torch.zeros_like(grads[0][1][1]))   # page 1 unused


@runnable
@pytest.mark.parametrize("with_sinks, window", [(True, 0), (False, 40), (True, 40)])
def test_paged_attention_sinks_and_window(monkeypatch, with_sinks, window):
    """gpt-oss's sinks and sliding window in the Triton kernel: the torch backend's values; decode (which
    starts at the first key tile its window reaches: tile 1 for a query at 139 with a window of 40) the
    prefill's bits, also through splits of one tile run in parallel (the splits below a window are
    skipped in both); gradients of q, k, v and the sinks against the torch backend, run to run equal."""
    monkeypatch.setattr(kt, "ATTN_SPLIT", 1)
    B, T, H, KVH, D = 2, 140, 4, 2, 16
    q, k, v = randn(B, T, H, D, scale=2, seed=0), randn(B, T, KVH, D, scale=2, seed=1), randn(B, T, KVH, D, seed=2)
    sinks = randn(H, scale=2, seed=4) if with_sinks else None
    attn = dict(sinks=sinks, window=window)
    pos = torch.arange(T, device=DEV).expand(B, T)
    kc, bt = lay_out(k, 16, 24, seed=3)
    vc, _ = lay_out(v, 16, 24, seed=3)

    def run(parallel, q, pos):
        monkeypatch.setattr(kt, "ATTN_SPLIT_BELOW", 10**9 if parallel else 0)
        return kt.paged_attention(q, kc, vc, bt, pos, D ** -0.5, **attn)
    out = run(False, q, pos)
    ref = kernels.paged_attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), pos.cpu(), D ** -0.5,
                                  sinks=None if sinks is None else sinks.cpu(), window=window)
    assert rel(out, ref) < TOL
    assert torch.equal(run(True, q, pos), out)
    BT = kt.ATTN_TABLE["fwd"][0] // triton_next_pow2(H // KVH)
    for p in (0, BT, 2 * BT, 4 * BT - 1 - (4 * BT - 1) % BT):      # first rows of their programs: bitwise
        for parallel in (False, True):
            assert torch.equal(run(parallel, q[:, p:p + 1], torch.full((B, 1), p, device=DEV)), out[:, p:p + 1]), p
    for p in (39, 40, 70, 139):
        assert same_bits(run(True, q[:, p:p + 1], torch.full((B, 1), p, device=DEV)), out[:, p:p + 1]), p
    grads = []
    for f in (kt.paged_attention, kt.paged_attention, kernels.paged_attention):
        a = [t.clone().requires_grad_() for t in (q, k, v) + ((sinks,) if with_sinks else ())]
        s_ = a[3] if with_sinks else None
        o = _trainer_attention(lambda *x: f(*x, sinks=s_, window=window), *a[:3])
        (o * pos[..., None, None].float()).sum().backward()
        grads.append([t.grad for t in a])
    for tri, tri2, cpu in zip(*grads):
        assert rel(tri, cpu) < TOL and torch.equal(tri, tri2)


def test_head_split_pads_less_than_a_power_of_two():
    assert kt.head_split(576) == (512, 64)                 # MLA's absorbed head: not 1024
    assert kt.head_split(48) == (32, 16) and kt.head_split(80) == (64, 16) and kt.head_split(96) == (64, 32)
    assert kt.head_split(128) == (128, 0) and kt.head_split(64) == (64, 0)
    assert kt.head_split(24) == (32, 0) and kt.head_split(20) == (32, 0)   # parts under 16 wide: one part
    assert kt.attn_layout("fwd", 576) == (*kt.ATTN_WIDE["fwd"], kt.ATTN_WIDE["keys"])
    assert kt.attn_layout("bwd_dkv", 128) == (*kt.ATTN_TABLE["bwd_dkv"], kt.ATTN_KEYS)


@runnable
@pytest.mark.parametrize("wide", [False, True])
def test_paged_attention_head_split(monkeypatch, wide):
    """Heads of 48 dims run as 32 + a 16-dim tail (MLA's 576 as 512 + 64), in the table's layout and in the
    wide heads' one (16 rows, 16-key tiles): the torch backend's values and gradients, decode the
    prefill's bits also through splits run in parallel, gradients run to run equal. Control: the padded
    single part (64 dims) rounds otherwise, so trainer and sampler must split alike."""
    monkeypatch.setattr(kt, "ATTN_SPLIT", 1)
    if wide:
        monkeypatch.setattr(kt, "ATTN_WIDE_DIMS", 48)
    B, T, H, KVH, D = 2, 40 if wide else 70, 4, 1, 48          # more than one key tile in either layout
    q, k, v = randn(B, T, H, D, scale=2, seed=0), randn(B, T, KVH, D, scale=2, seed=1), randn(B, T, KVH, D, seed=2)
    pos = torch.arange(T, device=DEV).expand(B, T)
    kc, bt = lay_out(k, 16, 12, seed=3)
    vc, _ = lay_out(v, 16, 12, seed=3)

    def run(parallel, q, pos):
        monkeypatch.setattr(kt, "ATTN_SPLIT_BELOW", 10**9 if parallel else 0)
        return kt.paged_attention(q, kc, vc, bt, pos, D ** -0.5)
    out = run(False, q, pos)
    assert rel(out, kernels.paged_attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), pos.cpu(), D ** -0.5)) < TOL
    assert torch.equal(run(True, q, pos), out)
    BT = kt.attn_layout("fwd", D)[0] // triton_next_pow2(H // KVH)
    for p in (0, BT, 2 * BT):
        for parallel in (False, True):
            assert torch.equal(run(parallel, q[:, p:p + 1], torch.full((B, 1), p, device=DEV)), out[:, p:p + 1]), p
    grads = []
    for f in (kt.paged_attention, kt.paged_attention, kernels.paged_attention):
        a = [t.clone().requires_grad_() for t in (q, k, v)]
        (_trainer_attention(f, *a) * pos[..., None, None].float()).sum().backward()
        grads.append([t.grad for t in a])
    for tri, tri2, cpu in zip(*grads):
        assert rel(tri, cpu) < TOL and torch.equal(tri, tri2)
    monkeypatch.setattr(kt, "head_split", lambda D: (64, 0))
    padded = run(False, q, pos)
    assert rel(padded, out) < TOL and not torch.equal(padded, out)


@runnable
@torch.no_grad()
def test_mla_model_score_and_sampler_with_triton():
    """MLA (DeepSeek-V3's absorbed form) on the Triton backend: the attention kernel over one latent KV
    head (values = keys) and the per-head projections through the matmul kernel; the torch backend's
    values, and the sampler's log-probs the score's. The latent (32) and the RoPE key (16) make a 48-dim
    head: the kernels' split head (32 + a 16-dim tail, kernels_triton.head_split)."""
    model = _model(model_type="deepseek_v3", kv_lora_rank=32, q_lora_rank=12, qk_nope_head_dim=8, head_dim=16,
                   v_head_dim=12, rope_interleave=True, qk_norm="none", router_scoring="sigmoid",
                   score_correction_bias=True)
    tokens = torch.randint(0, 32, (2, 19), generator=torch.Generator().manual_seed(1)).to(DEV)
    ref, ref_routes = model.to("cpu").score(tokens.cpu())
    model.to(DEV)
    with kernels.set_backend("triton"):
        lp, routes = model.score(tokens)
        assert rel(lp, ref) < TOL and torch.equal(routes.cpu(), ref_routes)
        outs = Sampler(model, max_batch_size=4).generate([[3, 1, 4, 1, 5], list(range(2, 19))], max_new_tokens=3,
                                                         progress=False)
        for o in outs:
            P = len(o.prompt)
            lp, routes = model.score(torch.tensor([o.prompt + o.tokens], device=DEV))
            assert same_bits(torch.tensor(o.logprobs, device=lp.device), lp[0, P - 1:])
            assert torch.equal(o.routes, routes[0, :P + len(o.tokens) - 1].cpu())


# ---------------------------------------------------------------------------------------------------
# MoE experts
# ---------------------------------------------------------------------------------------------------
def _moe_inputs(M, E=4, D=32, I=24, k=2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) * 0.2, torch.randn(E, D, I, generator=g) * 0.2
    ids, weights, _ = kernels.route(torch.randn(M, E, generator=g) * 2, k, True)
    return (x.to(DEV, dtype), w13.to(DEV, dtype), w2.to(DEV, dtype), ids.to(DEV), weights.to(DEV))


@runnable
def test_moe_forward_and_invariance():
    x, w13, w2, ids, wt = _moe_inputs(40, k=3)
    y = ktm.moe_experts(x, w13, w2, ids, wt)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel(y, kernels.moe_experts(*(t.cpu() for t in (x, w13, w2, ids, wt)))) < TOL
    xe, _, _, ide, we = _moe_inputs(30, k=3, seed=9)                # other tokens after them: each row
    y_after = ktm.moe_experts(torch.cat([x, xe]), w13, w2, torch.cat([ids, ide]), torch.cat([wt, we]))
    assert torch.equal(y_after[:40], y)                             # keeps its place in its expert's tiles
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(3)).to(DEV)
    assert same_bits(ktm.moe_experts(x[perm], w13, w2, ids[perm], wt[perm]), y[perm])
    y_more = ktm.moe_experts(torch.cat([xe[:10], x, xe[10:]]), w13, w2, torch.cat([ide[:10], ids, ide[10:]]),
                             torch.cat([we[:10], wt, we[10:]]))     # other tokens around them
    assert same_bits(y_more[10:50], y)
    assert same_bits(ktm.moe_experts(x[7:8], w13, w2, ids[7:8], wt[7:8]), y[7:8])   # alone


@runnable
def test_moe_gradients_deterministic():
    """The Triton backward (grouped GEMMs, per-expert weight-gradient loops) against autograd of the
    torch backend, run to run bitwise; 70 tokens x top-2 over 3 used experts puts several 32-row tiles
    on one expert, and expert 3 gets no token (its weight gradients must be exactly zero)."""
    x, w13, w2, _, _ = _moe_inputs(70)
    logits = randn(70, 4, scale=2, seed=5)
    logits[:, 3] = -100.0
    ids, wt, _ = kernels.route(logits, 2, True)
    g = randn(70, 32, seed=4)
    grads = []
    for f in (ktm.moe_experts, ktm.moe_experts, kernels.moe_experts):
        a = [t.clone().requires_grad_() for t in (x, w13, w2, wt)]
        (f(a[0], a[1], a[2], ids, a[3]) * g).sum().backward()
        grads.append([t.grad for t in a])
    for tri, tri2, ref in zip(*grads):
        assert rel(tri, ref) < TOL
        assert torch.equal(tri, tri2)
    assert not grads[0][1][3].any() and not grads[0][2][3].any() and grads[0][1][2].abs().min() > 0


@runnable
def test_moe_expert_rows_are_its_slots():
    """expert_rows (an expert-parallel owner's rows, one slot each) gives every slot the fp32 term that
    moe_experts sums over k; the gradients against autograd of the torch backend's expert_rows."""
    x, w13, w2, ids, wt = _moe_inputs(40, k=3)
    M, k = ids.shape
    rows = ktm.expert_rows(x.repeat_interleave(k, 0), w13, w2, ids.reshape(-1), wt.reshape(-1))   # (M*k, D) fp32
    assert rows.dtype == torch.float32 and rows.shape == (M * k, x.shape[1])
    assert same_bits(kernels.combine_slots(rows.view(M, k, -1), x.dtype), ktm.moe_experts(x, w13, w2, ids, wt))
    perm = torch.randperm(M * k, generator=torch.Generator().manual_seed(3)).to(DEV)   # rows in any order
    xs = x.repeat_interleave(k, 0)[perm]
    assert same_bits(ktm.expert_rows(xs, w13, w2, ids.reshape(-1)[perm], wt.reshape(-1)[perm]), rows[perm])
    g = randn(M * k, x.shape[1], seed=4)
    grads = []
    for f in (ktm.expert_rows, kernels.expert_rows):
        a = [t.clone().requires_grad_() for t in (xs, w13, w2, wt.reshape(-1)[perm])]
        (f(a[0], a[1], a[2], ids.reshape(-1)[perm], a[3]) * g).sum().backward()
        grads.append([t.grad for t in a])
    for tri, ref in zip(*grads):
        assert rel(tri, ref) < TOL


BAD_IDS = """
import sys, torch
sys.path.insert(0, {root!r})
import kernels
from kernels_triton import moe as ktm
g = torch.Generator().manual_seed(0)
x, w13, w2 = torch.randn(6, 32, generator=g), torch.randn(4, 48, 32, generator=g), torch.randn(4, 32, 24, generator=g)
ids, wt, _ = kernels.route(torch.randn(6, 4, generator=g), 2, True)
ids[2, 1] = {bad}
y = ktm.moe_experts(*(t.to({dev!r}) for t in (x, w13, w2, ids, wt)))
if {dev!r} == "cuda":
    torch.cuda.synchronize()
print("no error")
"""


@runnable
@pytest.mark.parametrize("bad", [4, -1])                   # E = 4: ids must be in [0, 4)
def test_moe_bad_ids_raise(bad):
    """An expert id outside [0, E) fails (on the device, no host sync): on the CPU with the message;
    on CUDA as a device-side assert, which poisons the process's CUDA context, so it runs in a
    subprocess of its own."""
    code = BAD_IDS.format(root=ROOT, bad=bad, dev=DEV)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TRITON_INTERPRET="0" if CUDA else "1"))
    assert r.returncode != 0 and "no error" not in r.stdout
    assert ("device-side assert" if CUDA else "expert ids outside") in r.stderr, r.stderr[-2000:]


@runnable
def test_moe_frozen_experts():
    x, w13, w2, ids, wt = _moe_inputs(6)
    xa, xr = x.clone().requires_grad_(), x.clone().requires_grad_()   # experts frozen: dx only
    ktm.moe_experts(xa, w13, w2, ids, wt).sum().backward()
    kernels.moe_experts(xr, w13, w2, ids, wt).sum().backward()
    assert rel(xa.grad, xr.grad) < TOL


@runnable
def test_moe_gpt_oss_experts():
    """gpt-oss's experts in the fused MoE: biases after each matmul and the clamped SwiGLU at a limit the
    activations reach; the torch backend's values, a row's bits kept with other tokens after it, and the
    gradients of x, the weights, the biases and the router weights against the torch backend (run to run
    equal)."""
    x, w13, w2, ids, wt = _moe_inputs(40, k=3)
    g = torch.Generator().manual_seed(7)
    b13, b2 = (torch.randn(4, 48, generator=g) * 0.5).to(DEV), (torch.randn(4, 32, generator=g) * 0.5).to(DEV)
    extras = dict(b13=b13, b2=b2, swiglu=(1.702, 1.0))
    y = ktm.moe_experts(x, w13, w2, ids, wt, **extras)
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in extras.items()}
    assert rel(y, kernels.moe_experts(*(t.cpu() for t in (x, w13, w2, ids, wt)), **cpu)) < TOL
    assert rel(y, ktm.moe_experts(x, w13, w2, ids, wt)) > 1e-2                  # the extras matter
    xe, _, _, ide, we = _moe_inputs(30, k=3, seed=9)
    y_after = ktm.moe_experts(torch.cat([x, xe]), w13, w2, torch.cat([ids, ide]), torch.cat([wt, we]), **extras)
    assert torch.equal(y_after[:40], y)
    grads = []
    for f in (ktm.moe_experts, ktm.moe_experts, kernels.moe_experts):
        dev = DEV if f is ktm.moe_experts else "cpu"
        a = [t.detach().to(dev).clone().requires_grad_() for t in (x, w13, w2, b13, b2, wt)]
        out = f(a[0], a[1], a[2], ids.to(dev), a[5], b13=a[3], b2=a[4], swiglu=(1.702, 1.0))
        (out * torch.arange(32.0, device=dev)).sum().backward()
        grads.append([t.grad for t in a])
    for tri, tri2, cpu_grad in zip(*grads):
        assert rel(tri, cpu_grad) < TOL and torch.equal(tri, tri2)


@runnable
def test_moe_gpt_oss_expert_rows_are_its_slots():
    """expert_rows with gpt-oss's extras (an expert-parallel owner of biased, clamped-SwiGLU experts):
    each slot's fp32 term as moe_experts sums it, other values without the biases (the control), and
    the gradients, biases' too, against the torch backend's expert_rows."""
    x, w13, w2, ids, wt = _moe_inputs(40, k=3)
    g = torch.Generator().manual_seed(7)
    b13, b2 = (torch.randn(4, 48, generator=g) * 0.5).to(DEV), (torch.randn(4, 32, generator=g) * 0.5).to(DEV)
    swiglu = (1.702, 1.0)
    M, k = ids.shape
    xs, flat, wflat = x.repeat_interleave(k, 0), ids.reshape(-1), wt.reshape(-1)
    rows = ktm.expert_rows(xs, w13, w2, flat, wflat, b13, b2, swiglu)
    assert same_bits(kernels.combine_slots(rows.view(M, k, -1), x.dtype),
                     ktm.moe_experts(x, w13, w2, ids, wt, b13=b13, b2=b2, swiglu=swiglu))
    assert rel(rows, ktm.expert_rows(xs, w13, w2, flat, wflat, None, None, swiglu)) > 1e-2
    grads = []
    for f in (ktm.expert_rows, kernels.expert_rows):
        dev = DEV if f is ktm.expert_rows else "cpu"
        a = [t.detach().to(dev).clone().requires_grad_() for t in (xs, w13, w2, b13, b2, wflat)]
        out = f(a[0], a[1], a[2], flat.to(dev), a[5], b13=a[3], b2=a[4], swiglu=swiglu)
        (out * torch.arange(32.0, device=dev)).sum().backward()
        grads.append([t.grad for t in a])
    for tri, cpu_grad in zip(*grads):
        assert rel(tri, cpu_grad) < TOL


@runnable
@torch.no_grad()
def test_gpt_oss_model_score_and_sampler_with_triton():
    """A gpt-oss model (sinks, a window of 12 on alternate layers, YaRN, biased router and experts) on the
    Triton backend: the torch backend's log-probs and routes; the sampler's log-probs the score's."""
    layer_types = ["sliding_attention", "full_attention"]
    model = _model(model_type="gpt_oss", attention_sinks=True, sliding_window=12, layer_types=layer_types,
                   rope_type="yarn", yarn_factor=4.0, yarn_original_max_position_embeddings=16, router_bias=True,
                   router_scoring="topk_softmax", expert_bias=True, moe_act="clamped_swiglu", swiglu_limit=1.0,
                   attention_bias=True, attention_out_bias=True, qk_norm="none", mlp_only_layers=[])
    tokens = torch.randint(0, 32, (2, 30), generator=torch.Generator().manual_seed(1)).to(DEV)
    ref, ref_routes = model.to("cpu").score(tokens.cpu())
    model.to(DEV)
    with kernels.set_backend("triton"):
        lp, routes = model.score(tokens)
        assert rel(lp, ref) < TOL and torch.equal(routes.cpu(), ref_routes)
        outs = Sampler(model, max_batch_size=4).generate([list(range(3, 28)), [5, 1, 7]], max_new_tokens=4,
                                                         progress=False)
        for o in outs:
            P = len(o.prompt)
            lp, routes = model.score(torch.tensor([o.prompt + o.tokens], device=DEV))
            assert same_bits(torch.tensor(o.logprobs, device=lp.device), lp[0, P - 1:])
            assert torch.equal(o.routes, routes[0, :P + len(o.tokens) - 1].cpu())


# ---------------------------------------------------------------------------------------------------
# the whole model: score() and the sampler, bitwise, with the Triton backend
# ---------------------------------------------------------------------------------------------------
def _model(dtype=torch.float32, **kw):
    cfg = dict(vocab_size=32, num_hidden_layers=2, num_experts=4, max_position_embeddings=64)
    cfg.update(kw)
    return make_model(tiny_config(**cfg)).to(DEV, dtype).eval()


@runnable
@torch.no_grad()
def test_model_score_bitwise_with_triton():
    model = _model()
    tokens = torch.randint(0, 32, (3, 19), generator=torch.Generator().manual_seed(1)).to(DEV)
    ref, ref_routes = model.to("cpu").score(tokens.cpu())
    model.to(DEV)
    with kernels.set_backend("triton"):
        lp, routes = model.score(tokens)
        assert rel(lp, ref) < TOL and torch.equal(routes.cpu(), ref_routes)
        one, r1 = model.score(tokens[1:2, :13])                     # alone, shorter (fewer tiles)
        assert same_bits(one, lp[1:2, :12]) and torch.equal(r1, routes[1:2, :13])
        padded = tokens.clone()
        padded[0, 9:] = 0                                           # right padding next to it
        two, r2 = model.score(padded[:2])
        assert same_bits(two[1], lp[1]) and same_bits(two[0, :8], lp[0, :8])
        assert torch.equal(r2[1], routes[1])
        assert same_bits(model.score(tokens, logits_chunk=10)[0], lp)   # 54 positions in logit chunks of 10


@runnable
@torch.no_grad()
def test_sampler_records_score_bits_with_triton():
    model = _model()
    prompts = [[3, 1, 4, 1, 5], list(range(2, 19))]                # 5 and 17 tokens: across a tile
    with kernels.set_backend("triton"):
        outs = Sampler(model, max_batch_size=4).generate(prompts, max_new_tokens=3, n=2, progress=False)
        if CUDA:
            assert_contract(model, outs)
        else:                   # decode rows sit elsewhere in their tiles than in score: see same_bits
            for o in outs:
                P, G = len(o.prompt), len(o.tokens)
                lp, routes = model.score(torch.tensor([o.prompt + o.tokens]))
                assert rel(torch.tensor(o.logprobs, device=lp.device), lp[0, P - 1:]) < TOL and torch.equal(o.routes, routes[0, :P + G - 1])


# ---------------------------------------------------------------------------------------------------
# GPU only: bf16 and fp32 at larger shapes (skipped, not faked, without CUDA)
# ---------------------------------------------------------------------------------------------------
GPU_DTYPES = [torch.float32, torch.bfloat16]
GTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_linear(dtype):
    x, w = randn(1000, 1024, seed=0, dtype=dtype), randn(768, 1024, seed=1, dtype=dtype)
    y = kt.linear(x, w)
    assert rel(y, x.double() @ w.double().T) < GTOL[dtype]
    for lo, hi in [(0, 1), (1, 2), (5, 300), (129, 1000), (999, 1000)]:
        assert torch.equal(kt.linear(x[lo:hi], w), y[lo:hi]), (lo, hi)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    g = randn(1000, 768, seed=2, dtype=dtype)
    (kt.linear(xa, wa) * g).sum().backward()
    assert rel(xa.grad, g.double() @ w.double()) < GTOL[dtype]
    assert rel(wa.grad, g.double().T @ x.double()) < GTOL[dtype]


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_every_matmul_config_gives_the_same_bits(dtype):
    """MM_TABLE picks the tile config by M; that keeps the contract only if every config gives a row
    the same bits. Here, on this GPU: each config at M = 1 (row 0, and row 7 alone) and inside M = 4096,
    against the large-M config; the split-K control above shows a change of K order is caught."""
    x, w = randn(4096, 2048, seed=0, dtype=dtype), randn(1024, 2048, seed=1, dtype=dtype)
    ref = kt._mm(x, w, dtype, config=_configs(dtype)[-1])
    for cfg in _configs(dtype):
        assert torch.equal(kt._mm(x, w, dtype, config=cfg), ref), cfg
        assert torch.equal(kt._mm(x[:1], w, dtype, config=cfg), ref[:1]), cfg
        assert torch.equal(kt._mm(x[7:8], w, dtype, config=cfg), ref[7:8]), cfg
        assert torch.equal(kt._mm(x[100:116], w, dtype, config=cfg), ref[100:116]), cfg
    assert torch.equal(kt.linear(x[7:8], w), kt.linear(x, w)[7:8])           # the table, end to end


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_rows_ops(dtype):
    x, w = randn(300, 2048, scale=3, seed=0, dtype=dtype), (torch.rand(2048) + 0.5).to(DEV, dtype)
    y = kt.rms_norm(x, w, 1e-6)
    assert rel(y, kernels.rms_norm(x.cpu(), w.cpu(), 1e-6)) < GTOL[dtype]
    assert torch.equal(kt.rms_norm(x[17:18], w, 1e-6), y[17:18])
    z, tg = randn(64, 50000, scale=4, seed=1, dtype=dtype), torch.randint(0, 50000, (64,), device=DEV)
    lp = ktv.token_logprobs(z, tg, 0.7)
    assert rel(lp, kernels.token_logprobs(z.cpu(), tg.cpu(), 0.7)) < 1e-5
    assert torch.equal(ktv.token_logprobs(z[5:6], tg[5:6], 0.7), lp[5:6])
    lp2, ent = ktv.token_logprobs(z, tg, 0.7, with_entropy=True)
    assert torch.equal(lp2, lp)
    logp64 = torch.log_softmax(z.double() / 0.7, -1)
    assert (ent.double() - -(logp64.exp() * logp64).sum(-1)).abs().max() < 1e-4
    # the ops left to torch on CUDA (router softmax + top-k, RoPE, SiLU*up) are row-invariant too
    logits = randn(300, 64, scale=3, seed=2, dtype=dtype)
    ids, wts, _ = kernels.route(logits, 8, True)
    ids1, wts1, _ = kernels.route(logits[17:18], 8, True)
    assert torch.equal(ids1, ids[17:18]) and torch.equal(wts1, wts[17:18])
    u = randn(300, 2048, seed=3, dtype=dtype)
    assert torch.equal(kernels.silu_mul(x[17:18], u[17:18]), kernels.silu_mul(x, u)[17:18])


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_paged_attention(dtype):
    B, T, H, KVH, D = 3, 300, 8, 2, 64
    q, k, v = randn(B, T, H, D, seed=0, dtype=dtype), randn(B, T, KVH, D, seed=1, dtype=dtype), \
        randn(B, T, KVH, D, seed=2, dtype=dtype)
    pos = torch.arange(T, device=DEV).expand(B, T)
    kc, bt = lay_out(k, 32, 40, seed=1)
    vc, _ = lay_out(v, 32, 40, seed=1)
    out = kt.paged_attention(q, kc, vc, bt, pos, D ** -0.5)
    ref = F.scaled_dot_product_attention(q.double().transpose(1, 2), k.double().transpose(1, 2).repeat_interleave(4, 1),
                                         v.double().transpose(1, 2).repeat_interleave(4, 1), is_causal=True)
    assert rel(out, ref.transpose(1, 2)) < GTOL[dtype]
    for p in [0, 15, 16, 63, 100, 127, 299]:               # 63, 127: the masked/unmasked split differs
        one = kt.paged_attention(q[:, p:p + 1], kc, vc, bt, torch.full((B, 1), p, device=DEV), D ** -0.5)
        assert torch.equal(one, out[:, p:p + 1]), p
    assert torch.equal(kt.paged_attention(q[2:, :77], kc, vc, bt[2:], pos[2:, :77], D ** -0.5), out[2:, :77])
    a = [t.clone().requires_grad_() for t in (q, k, v)]
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    g = randn(B, T, H, D, seed=3, dtype=dtype)
    (_trainer_attention(kt.paged_attention, *a) * g).sum().backward()
    (_trainer_attention(kernels.paged_attention, *[t.cpu() for t in r]) * g.cpu().double()).sum().backward()
    for x, y in zip(a, r):
        assert rel(x.grad, y.grad) < 5 * GTOL[dtype]


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_mla_attention(dtype):
    """MLA's absorbed attention at Moonlight's sizes: 16 heads over one 576-dim latent head whose values are
    its keys (one cache), split 512 + 64 in the wide heads' layout. Decode (its key splits in parallel)
    has the prefill's bits at every position tried; values and gradients near a float64 reference."""
    B, T, H, D, scale = 2, 300, 16, 576, 192 ** -0.5
    q, k = randn(B, T, H, D, seed=0, dtype=dtype), randn(B, T, 1, D, seed=1, dtype=dtype)
    pos = torch.arange(T, device=DEV).expand(B, T)
    kc, bt = lay_out(k, 16, 48, seed=1)
    out = kt.paged_attention(q, kc, kc, bt, pos, scale)
    kd = k.double().transpose(1, 2).expand(B, H, T, D)
    ref = F.scaled_dot_product_attention(q.double().transpose(1, 2), kd, kd, is_causal=True, scale=scale)
    assert rel(out, ref.transpose(1, 2)) < GTOL[dtype]
    for p in [0, 15, 16, 100, 255, 256, 299]:
        one = kt.paged_attention(q[:, p:p + 1], kc, kc, bt, torch.full((B, 1), p, device=DEV), scale)
        assert torch.equal(one, out[:, p:p + 1]), p
    assert torch.equal(kt.paged_attention(q[1:, :77], kc, kc, bt[1:], pos[1:, :77], scale), out[1:, :77])

    def trainer(att, q, k):                                # model.MLA's trainer path: one page tensor for both
        kp = F.pad(k, (0, 0, 0, 0, 0, (-T) % kernels.KV_BLOCK)).reshape(-1, kernels.KV_BLOCK, 1, D)
        return att(q, kp, kp, torch.arange(kp.shape[0], device=k.device).view(B, -1),
                   torch.arange(T, device=k.device).expand(B, T), scale)
    a = [t.clone().requires_grad_() for t in (q, k)]
    r = [t.detach().cpu().double().requires_grad_() for t in (q, k)]
    g = randn(B, T, H, D, seed=3, dtype=dtype)
    (trainer(kt.paged_attention, *a) * g).sum().backward()
    (trainer(kernels.paged_attention, *r) * g.cpu().double()).sum().backward()
    for x, y in zip(a, r):
        assert rel(x.grad, y.grad) < 5 * GTOL[dtype]


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_moe(dtype):
    x, w13, w2, ids, wt = _moe_inputs(500, E=16, D=256, I=128, k=4, dtype=dtype)
    y = ktm.moe_experts(x, w13, w2, ids, wt)
    assert rel(y, kernels.moe_experts(*(t.cpu() for t in (x, w13, w2, ids, wt)))) < GTOL[dtype]
    perm = torch.randperm(500, device=DEV)
    assert torch.equal(ktm.moe_experts(x[perm], w13, w2, ids[perm], wt[perm]), y[perm])
    assert torch.equal(ktm.moe_experts(x[3:4], w13, w2, ids[3:4], wt[3:4]), y[3:4])
    rows = ktm.expert_rows(x[perm].repeat_interleave(4, 0), w13, w2, ids[perm].reshape(-1),
                           wt[perm].reshape(-1))                # an expert-parallel owner's rows, in another order
    assert torch.equal(kernels.combine_slots(rows.view(500, 4, -1), dtype), y[perm])
    g = randn(500, 256, seed=4, dtype=dtype)
    grads = []
    for f, args in [(ktm.moe_experts, (x, w13, w2, wt))] * 2 + [(kernels.moe_experts, (x, w13, w2, wt))]:
        if f is kernels.moe_experts:       # the reference: torch backend, fp32, on the CPU
            args, ids, g = [t.detach().cpu().float() for t in args], ids.cpu(), g.cpu().float()
        a = [t.clone().requires_grad_() for t in args]
        (f(a[0], a[1], a[2], ids, a[3]) * g).sum().backward()
        grads.append([t.grad.to(DEV) for t in a])
    assert all(torch.equal(p, q) for p, q in zip(grads[0], grads[1]))
    for tri, ref in zip(grads[0], grads[2]):      # bf16: dh and dL/dy are rounded to bf16 for the dots
        assert rel(tri, ref) < 5 * GTOL[dtype]


@gpu
def test_gpu_training_kernels_never_sync_the_host():
    """Attention and the fused MoE, forward and backward, queue their work without waiting for the GPU
    (no .item(), no bool-mask indexing, no size read back): a training step's layers overlap the host.
    Control: the same detector raises on a read-back."""
    B, T, H, KVH, D = 2, 200, 8, 2, 64
    q, k, v = (randn(*s, seed=i, dtype=torch.bfloat16).requires_grad_() for i, s in
               enumerate([(B, T, H, D), (B, T, KVH, D), (B, T, KVH, D)]))
    x, w13, w2, ids, wt = _moe_inputs(300, E=16, D=256, I=128, k=4, dtype=torch.bfloat16)
    moe_params = [t.clone().requires_grad_() for t in (x, w13, w2, wt)]
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        _trainer_attention(kt.paged_attention, q, k, v).sum().backward()
        a = moe_params
        ktm.moe_experts(a[0], a[1], a[2], ids, a[3]).float().sum().backward()
        with pytest.raises(RuntimeError):
            q.grad.sum().item()                                  # control: a read-back is caught
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(t.grad is not None for t in (q, k, v, *moe_params))


@gpu
def test_gpu_sampling_rows_do_not_depend_on_the_batch():
    """The sampler's draws on CUDA (the Triton kernels without top-k / top-p; softmax, sort, cumsum
    with them; the counter-based uniforms): each row of a batch gets the token it gets alone, at a
    Qwen-sized vocabulary. Without truncation the token is the inverse CDF at u of the float64 softmax,
    within 1e-5 of the total mass (the GPU's exp is not the CPU's: a boundary may move by rounding)."""
    from rollout import draw_keys
    logits = randn(16, 151936, scale=4, seed=7, dtype=torch.bfloat16)
    u = draw_keys(torch.tensor([1234, 0], device=DEV), torch.arange(16, device=DEV), torch.full((16,), 40, device=DEV))
    for temperature, top_p, top_k in ((1.0, 1.0, 0), (0.7, 1.0, 0), (0.7, 0.9, 0), (1.0, 0.95, 50)):
        batched = kernels.sample_tokens(logits, temperature, top_p, top_k, u)
        alone = torch.cat([kernels.sample_tokens(logits[b:b + 1], temperature, top_p, top_k, u[b:b + 1])
                           for b in range(16)])
        assert torch.equal(batched, alone), (temperature, top_p, top_k)
        if top_p == 1.0 and top_k == 0:
            cum = torch.softmax(logits.double() / temperature, -1).cumsum(-1)               # (16, V)
            below = torch.where(batched > 0, cum.gather(1, (batched - 1).clamp(min=0)[:, None])[:, 0], 0.0)
            at = cum.gather(1, batched[:, None])[:, 0]
            assert bool(((below <= u + 1e-5) & (at >= u - 1e-5)).all()), temperature


@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@torch.no_grad()
def test_gpu_model_contract(dtype):
    """Auto backend on CUDA: score() in any batch and the sampler's recorded log-probs/routes, bitwise."""
    model = _model(dtype, vocab_size=512, hidden_size=128, num_experts=16, num_experts_per_tok=4,
                   max_position_embeddings=256)
    tokens = torch.randint(0, 512, (4, 150), generator=torch.Generator().manual_seed(1)).to(DEV)
    lp, routes = model.score(tokens)
    one, r1 = model.score(tokens[2:3, :90])
    assert torch.equal(one, lp[2:3, :89]) and torch.equal(r1, routes[2:3, :90])
    prompts = [tokens[0, :30].tolist(), tokens[1, :17].tolist(), tokens[2, :64].tolist()]
    outs = Sampler(model, max_batch_size=8).generate(prompts, max_new_tokens=20, n=2, progress=False)
    assert_contract(model, outs)
