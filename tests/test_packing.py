"""Packed micro-batches (packing.Packing, packing.pack): a packed forward gives every sequence token the
padded forward's bits, and the sampler's; the packing rule is deterministic and keeps the budget.

    python -m pytest -q tests/test_packing.py

The Triton test runs under the interpreter (TRITON_INTERPRET=1) in a process of its own when
kernels_triton was imported without it (as tests/test_triton.py does).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernels
from conftest import ROOT, make_model, rel_err, tiny_config
from rollout import Sampler
from support.packing import Packing, deal, in_row_order, null_micro_batch, pack

LENGTHS = [5, 17, 33, 1, 20, 16]       # across tiles, a one-token sequence, one exactly a tile


def padded_batch(lengths, seed=0, vocab=50):
    """(S, max length) random tokens, right-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, vocab, (len(lengths), max(lengths)), generator=g)
    for i, n in enumerate(lengths):
        tok[i, n:] = 0
    return tok


def assert_same_tokens(packing, packed, padded, what=""):
    """Each sequence's own positions of a packed result (laid out per sequence) equal the padded
    forward's. Log-probs have one column fewer: a sequence owns the first length - 1 of them."""
    per_seq = packing.to_padded(packed, fill=0)
    own = 1 if packed.shape[1] == packing.shape[1] - 1 else 0
    for i, n in enumerate(packing.lengths):
        assert torch.equal(per_seq[i, :n - own], padded[i, :n - own]), f"{what}: sequence {i} (length {n})"


def score_both(model, lengths, routes=None, **kw):
    tok = padded_batch(lengths)
    pk = Packing.concat(lengths)
    ref = model.score(tok, routes=routes, **kw)
    got = model.score(pk.from_padded(tok), routes=None if routes is None else pk.from_padded(routes, -1),
                      packing=pk, **kw)
    return pk, ref, got


# ---------------------------------------------------------------------------------------------------
# packed forward == padded forward, bit for bit
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_packed_score_equals_padded_bitwise(dtype):
    model = make_model().to(dtype).eval()
    pk, (lp, routes), (plp, proutes) = score_both(model, LENGTHS)
    assert plp.shape == (1, sum(LENGTHS) - 1) and proutes.shape[:2] == (1, sum(LENGTHS))
    assert_same_tokens(pk, plp, lp, what="logp")
    assert_same_tokens(pk, proutes, routes, what="routes")


@torch.no_grad()
def test_packed_score_in_several_rows_with_padding_between():
    """Two rows, sequences at arbitrary starts, untouched gaps (padding) between and after them."""
    model = make_model().eval()
    tok = padded_batch(LENGTHS)
    pk = Packing(rows=(0, 1, 0, 1, 0, 1), starts=(3, 0, 9, 18, 43, 20), lengths=tuple(LENGTHS), shape=(2, 70))
    lp, routes = model.score(tok)
    noise = torch.randint(0, 50, pk.shape, generator=torch.Generator().manual_seed(9))   # in the gaps
    covered = pk.from_padded(torch.ones_like(tok), 0).bool()
    packed = torch.where(covered, pk.from_padded(tok), noise)
    plp, proutes = model.score(packed, packing=pk)
    assert_same_tokens(pk, plp, lp, what="logp")
    assert_same_tokens(pk, proutes, routes, what="routes")


@torch.no_grad()
def test_packed_replay_entropy_and_logits_chunk_are_bitwise():
    model = make_model().eval()
    tok = padded_batch(LENGTHS)
    _, routes = model.score(tok)
    forced = (routes + 1) % model.config.num_experts                          # not the free choice
    forced = torch.where(torch.arange(tok.shape[1])[None, :, None, None] < torch.tensor(LENGTHS)[:, None, None, None],
                         forced, -1)                                            # padding: -1
    pk, (lp, r, ent), (plp, pr, pent) = score_both(model, LENGTHS, routes=forced, with_entropy=True, logits_chunk=7)
    free_lp, _ = model.score(tok)
    assert not torch.equal(lp, free_lp)                                          # the replay took effect
    assert_same_tokens(pk, plp, lp, what="replayed logp")
    assert_same_tokens(pk, pr, r, what="router's own routes under replay")
    assert_same_tokens(pk, pent, ent, what="entropy")
    _, (lp_full, _), _ = score_both(model, LENGTHS)
    assert_same_tokens(pk, model.score(pk.from_padded(tok), logits_chunk=7, packing=pk)[0], lp_full, what="chunked")


def test_packed_gradients_match_padded():
    """The loss is the same sum of the same per-token values; the backward adds the parameters'
    contributions in another order (other matmul shapes), so the gradients agree within 1e-5 (fp32)."""
    model = make_model()
    tok = padded_batch(LENGTHS)
    pk = Packing.concat(LENGTHS)
    mask = torch.arange(tok.shape[1] - 1)[None] < torch.tensor(LENGTHS)[:, None] - 1          # (S, T-1)
    weight = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3))
    lp, _ = model.score(tok)
    (lp * weight * mask).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    plp, _ = model.score(pk.from_padded(tok), packing=pk)
    per_seq = pk.to_padded(plp)[:, :-1]                                                        # (S, T-1)
    (per_seq * weight * mask).sum().backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and rel_err(p.grad, ref[n]) < 1e-5, n


@torch.no_grad()
def test_control_naive_packing_changes_the_bits(monkeypatch):
    """The two ways a packed row goes wrong: one causal mask over the whole row (a sequence sees the
    ones before it), or positions that do not restart (RoPE at the row's positions)."""
    model = make_model().eval()
    tok = padded_batch(LENGTHS)
    pk = Packing.concat(LENGTHS)
    lp, _ = model.score(tok)
    packed = pk.from_padded(tok)
    right = pk.to_padded(model.score(packed, packing=pk)[0])
    assert torch.equal(right[1, :16], lp[1, :16])
    one_mask = pk.to_padded(model.score(packed)[0])                 # the row as one sequence
    assert not torch.equal(one_mask[1, :16], lp[1, :16])
    monkeypatch.setattr(Packing, "positions", lambda self, device=None: torch.arange(self.shape[1], device=device)[None])
    row_positions = pk.to_padded(model.score(packed, packing=pk)[0])   # own keys, the row's positions
    assert not torch.equal(row_positions[1, :16], lp[1, :16])


def test_packing_rejects_bad_layouts():
    with pytest.raises(ValueError, match="overlap"):
        Packing(rows=(0, 0), starts=(0, 3), lengths=(4, 2), shape=(1, 8))
    with pytest.raises(ValueError, match="does not fit"):
        Packing(rows=(0,), starts=(5,), lengths=(4,), shape=(1, 8))
    model = make_model()
    with pytest.raises(ValueError, match="packing is for tokens"):
        model.score(torch.zeros(1, 7, dtype=torch.long), packing=Packing.concat([3, 5]))


# ---------------------------------------------------------------------------------------------------
# the sampler records what the packed trainer forward computes
# ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_sampler_outputs_equal_packed_score():
    model = make_model().eval()
    prompts = [[3, 1, 4, 1, 5], list(range(2, 19)), [7, 7]]
    outs = Sampler(model, max_batch_size=4).generate(prompts, max_new_tokens=9, n=2, seed=1, progress=False)
    seqs = [o.prompt + o.tokens for o in outs]
    pk = Packing.concat([len(s) for s in seqs])
    lp, routes = model.score(torch.tensor([sum(seqs, [])]), packing=pk)
    lp, routes = pk.to_padded(lp), pk.to_padded(routes, -1)
    for i, o in enumerate(outs):
        P, G = len(o.prompt), len(o.tokens)
        assert torch.equal(torch.tensor(o.logprobs), lp[i, P - 1:P + G - 1]), i
        assert torch.equal(o.routes, routes[i, :P + G - 1]), i


# ---------------------------------------------------------------------------------------------------
# the Triton backend under the interpreter (tiny, fp32)
# ---------------------------------------------------------------------------------------------------
TRITON_CHECK = r"""
import sys, torch
sys.path[:0] = [{root!r}, {tests!r}]
import kernels
from conftest import make_model, rel_err, tiny_config
from support.packing import Packing
from test_packing import padded_batch
lengths = [5, 40, 1, 23]                        # 40: across the interpreter's 32-query tile (2 heads a KV head)
model = make_model(tiny_config(num_hidden_layers=2, mlp_only_layers=[])).eval()
tok = padded_batch(lengths)
pk = Packing.concat(lengths)
with torch.no_grad(), kernels.set_backend("triton"):
    lp, routes = model.score(tok)
    plp, proutes = model.score(pk.from_padded(tok), packing=pk)
    forced = (routes + 1) % 8
    rlp, _ = model.score(tok, routes=forced)
    prlp, _ = model.score(pk.from_padded(tok), routes=pk.from_padded(forced, -1), packing=pk, logits_chunk=16)
plp, proutes, prlp = pk.to_padded(plp), pk.to_padded(proutes, -1), pk.to_padded(prlp)
worst = 0.0
for i, n in enumerate(lengths):
    assert torch.equal(proutes[i, :n], routes[i, :n]), ("routes", i)
    for a, b in ((plp, lp), (prlp, rlp)):
        if n > 1:
            worst = max(worst, rel_err(a[i, :n - 1], b[i, :n - 1]))
# the interpreter's tl.dot (numpy BLAS) may round a row by its place in the matmul / MoE tile, and
# packing moves tokens to other rows of those tiles: agreement within the Triton tests' TOL (measured: 0)
assert worst < 1e-5, worst
print("ok", worst)
"""


def test_packed_score_under_the_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    code = TRITON_CHECK.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_gpu_packed_score_equals_padded_bitwise(dtype):
    """On CUDA the Triton path's claim is bitwise: packed == padded, 200-token sequences across tiles."""
    model = make_model(tiny_config(max_position_embeddings=512)).to("cuda", dtype).eval()
    lengths = [200, 3, 77, 64, 1, 130]
    tok = padded_batch(lengths).cuda()
    pk = Packing.concat(lengths)
    with kernels.set_backend("triton"):
        lp, routes = model.score(tok)
        plp, proutes = model.score(pk.from_padded(tok), packing=pk)
    assert_same_tokens(pk, plp, lp, what="logp")
    assert_same_tokens(pk, proutes, routes, what="routes")


# ---------------------------------------------------------------------------------------------------
# the packing rule
# ---------------------------------------------------------------------------------------------------
def lognormal_lengths(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [max(1, int(x)) for x in torch.exp(torch.randn(n, generator=g) * 1.0 + 4.0)]


def test_pack_is_deterministic_and_keeps_every_sequence_once():
    lengths = lognormal_lengths(64, seed=0)
    a, b = pack(lengths, 400), pack(list(lengths), 400)
    assert [(mb.rows.tolist(), mb.packing) for mb in a] == [(mb.rows.tolist(), mb.packing) for mb in b]
    assert sorted(i for mb in a for i in mb.rows.tolist()) == list(range(64))
    for mb in a:
        assert mb.rows.tolist() == sorted(mb.rows.tolist())
        assert mb.packing.lengths == tuple(lengths[i] for i in mb.rows.tolist()) and mb.packing.shape == (1, sum(mb.packing.lengths))


def test_pack_respects_the_budget_and_isolates_a_longer_sequence():
    lengths = [30, 500, 10, 90, 60, 40, 1]
    mbs = pack(lengths, 100)
    for mb in mbs:
        assert sum(mb.packing.lengths) <= 100 or mb.rows.tolist() == [1]     # 500 > budget: alone
    assert any(mb.rows.tolist() == [1] for mb in mbs)
    # by length 500, 90, 60, 40, 30, 10, 1: 500 alone; 90; 60 + 40; 30; 10 joins 90; 1 joins 30
    assert [mb.rows.tolist() for mb in mbs] == [[1], [2, 3], [4, 5], [0, 6]]


def test_pack_balances_and_ties_go_to_the_lower_index():
    lengths = lognormal_lengths(200, seed=1)
    budget = 1000
    mbs = pack(lengths, budget)
    fill = [sum(mb.packing.lengths) for mb in mbs]
    assert sum(f <= budget // 2 for f in fill) <= 1                  # first fit: at most one half-empty
    assert len(mbs) <= -(-sum(lengths) * 11 // (9 * budget)) + 1     # first fit decreasing: <= 11/9 OPT + 1
    assert pack([7, 7, 7], 14)[0].rows.tolist() == [0, 1] and pack([7, 7, 7], 14)[1].rows.tolist() == [2]
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack([3], 0)


# ---------------------------------------------------------------------------------------------------
# the trainer packed (packing.micro_batches, train.forward): the same loss math, the contract kept
# ---------------------------------------------------------------------------------------------------
TRAIN = ["--device=cpu", "--task=copy", "--n_digits=2", "--prompts_per_step=8", "--group_size=4",
         "--minibatch_size=32", "--progress=false", "--lr=1e-2", "--warmup_steps=1"]


def train_configs(*argv):
    from config import RolloutConfig, TrainConfig, apply_overrides, parse_args
    t, r = TrainConfig(), RolloutConfig()
    apply_overrides(parse_args([*TRAIN, *argv]), t, r)
    return t, r


def plan(rows, lengths, world=1, **kw):
    """train.trainer_micro_batches of rows under a config with kw, on `world` ranks, as comparable tuples."""
    from types import SimpleNamespace
    import train
    from config import TrainConfig
    run = SimpleNamespace(tcfg=TrainConfig(minibatch_size=32, **kw), d=train.Dist(0, world, torch.device("cpu")))
    return [(tuple(m.rows.tolist()), m.packing) for m in train.trainer_micro_batches(run, rows, lengths)]


def test_trainer_micro_batches_are_a_function_of_the_lengths_alone():
    lengths = torch.tensor(lognormal_lengths(48, seed=2))
    rows = torch.randperm(48, generator=torch.Generator().manual_seed(0))[:32]    # a minibatch, shuffled
    a = plan(rows, lengths, micro_batch_tokens=300)
    assert a == plan(rows.clone(), lengths.clone(), micro_batch_tokens=300)      # every run
    for world in (2, 4):                                                          # every rank count
        assert a == plan(rows, lengths, world=world, micro_batch_tokens=300)
    assert sorted(r for mb, _ in a for r in mb) == sorted(rows.tolist())          # every sequence once
    for mb, pk in a:
        assert pk.lengths == tuple(lengths[list(mb)].tolist())
        assert sum(pk.lengths) <= 300 or len(mb) == 1
    capped = plan(rows, lengths, micro_batch_tokens=300, micro_batch_size=3)      # --micro_batch_size caps it
    assert max(len(mb) for mb, _ in capped) == 3 and len(capped) > len(a)
    assert sorted(r for mb, _ in capped for r in mb) == sorted(rows.tolist())
    # padded micro-batches are slices of the global minibatch: the same at every rank count too
    assert plan(rows, lengths, micro_batch_tokens=0) == plan(rows, lengths, world=2, micro_batch_tokens=0)
    assert all(pk is None for _, pk in plan(rows, lengths, micro_batch_tokens=0))


@pytest.mark.parametrize("n, world", [(7, 1), (7, 2), (7, 4), (2, 4), (8, 4)])
def test_deal_runs_every_micro_batch_once_in_lockstep(n, world):
    """Round robin: micro-batch i on rank i % world at step i // world; every rank runs as many steps,
    None (a null micro-batch) where the list has run out."""
    dealt = [deal(n, world, r) for r in range(world)]
    assert len({len(d) for d in dealt}) == 1 and len(dealt[0]) == -(-n // world)
    assert sorted(i for d in dealt for i in d if i is not None) == list(range(n))
    for r, d in enumerate(dealt):
        assert all(i is None or (i % world == r and i // world == s) for s, i in enumerate(d))
    lengths = torch.tensor([9, 4, 7, 4])
    null = null_micro_batch(lengths, packed=True)
    assert null.rows.tolist() == [1] and null.packing.lengths == (4,)       # the shortest, the first of equals
    assert null_micro_batch(lengths, packed=False).packing is None


@pytest.fixture(scope="module")
def trainer_batch(tmp_path_factory):
    """One step's rollout batch of a small run (KL to a reference, the old log-probs recomputed), with
    random advantages so every sequence's loss terms count."""
    import train
    tcfg, rcfg = train_configs(f"--out_dir={tmp_path_factory.mktemp('packed')}", "--kl_coef=0.05",
                               "--recompute_old_logp=true", "--init_from=tiny-sigmoid")
    run = train.setup(tcfg, rcfg, train.Dist(0, 1, torch.device("cpu")))
    outs = train.rollout(run, 0, version=0).outs
    adv = torch.randn(len(outs), generator=torch.Generator().manual_seed(1))
    return run, train.make_batch(outs, adv)


def minibatch(run, batch, idx, **kw):
    """old_policy + minibatch_step under the config with kw: the result and the clipped gradients."""
    import train
    from conftest import with_options
    run = with_options(run, **kw)
    old = train.old_policy(run, batch)
    r = train.minibatch_step(run, batch, old, idx, 0, run.tcfg.replay)
    grads = {n: p.grad.clone() for n, p in run.policy.master.named_parameters()}
    return old, r, grads, train.trainer_micro_batches(run, idx, batch.lengths)


# A packed step sums the same per-token loss values, grouped in other micro-batches: the loss, clip
# fraction and entropy agree within fp32 rounding of those sums (1e-6 relative, 1e-7 absolute: the
# token-mean loss is a near-cancelling sum of O(1) terms); the gradients within 1e-5 (the backward's
# matmuls have other shapes, as test_packed_gradients_match_padded); log-probs and routes bitwise.
@pytest.mark.parametrize("loss, agg, extra", [
    ("grpo", "token_mean", {}),
    ("grpo", "seq_mean_token_sum", {"replay": "r3"}),
    ("grpo", "drgrpo", {"route_filter": "mask", "route_filter_threshold": 0.99}),    # on other routes: below
    ("gspo", "auto", {"logits_chunk": 16}),
])
def test_packed_training_step_equals_the_padded_one(trainer_batch, loss, agg, extra):
    import dataclasses
    run, batch = trainer_batch
    if "route_filter" in extra:                      # rollout routes the trainer does not take, on odd rows
        odd = (torch.arange(batch.tokens.shape[0]) % 2 == 1)[:, None, None, None] & (batch.routes >= 0)
        E = run.policy.full.config.num_experts
        batch = dataclasses.replace(batch, routes=torch.where(odd, (batch.routes + 1) % E, batch.routes))
    idx = torch.randperm(batch.tokens.shape[0], generator=torch.Generator().manual_seed(5))[:24]
    kw = dict(loss=loss, agg=agg, **extra)
    old_a, a, ga, micro_a = minibatch(run, batch, idx, micro_batch_tokens=0, micro_batch_size=8, **kw)
    old_b, b, gb, micro_b = minibatch(run, batch, idx, micro_batch_tokens=50, **kw)
    # not the same computation: other micro-batches, packed ones with no padding
    assert all(m.packing is not None for m in micro_b)
    assert {tuple(m.rows.tolist()) for m in micro_a} != {tuple(m.rows.tolist()) for m in micro_b}
    m = batch.mask.bool()
    assert torch.equal(old_a.logp[m], old_b.logp[m]) and torch.equal(old_b.logp[m], batch.rollout_logp[m])
    assert torch.equal(old_a.ref_logp[m], old_b.ref_logp[m])
    sa, sb = in_row_order(a.scored), in_row_order(b.scored)
    sm, rm = batch.mask[sa.rows].bool(), batch.route_mask[sa.rows]
    assert torch.equal(sa.rows, sb.rows) and torch.equal(sa.logp[sm], sb.logp[sm])
    assert torch.equal(sa.routes[rm], sb.routes[rm])
    assert b.loss == pytest.approx(a.loss, rel=1e-6, abs=1e-7) and a.loss != 0
    assert b.clip_frac == pytest.approx(a.clip_frac, rel=1e-6, abs=1e-9)
    assert b.entropy_sum == pytest.approx(a.entropy_sum, rel=1e-6)
    assert (b.tokens, b.filtered) == (a.tokens, a.filtered) and (a.filtered > 0) == ("route_filter" in extra)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
    for n in ga:
        assert rel_err(gb[n], ga[n]) < 1e-5, n


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_run_keeps_the_contract(tmp_path, dtype):
    """Packed micro-batches of at most 40 tokens in the old policy's forward and the updates, R3 replay,
    the route filter, logits chunks and the expert-bias update: the trainer's forward is the rollout's."""
    import train
    tcfg, rcfg = train_configs(f"--out_dir={tmp_path}", "--steps=2", f"--dtype={dtype}", "--micro_batch_tokens=40",
                               "--recompute_old_logp=true", "--replay=r3", "--route_filter=mask", "--logits_chunk=16",
                               "--init_from=tiny-sigmoid", "--expert_bias_update_rate=0.01", "--epochs=2")
    rows = train.train(tcfg, rcfg)
    for r in rows:
        assert r["train_rollout_kl"] == 0 and r["logp_max_abs_diff"] == 0 and r["route_flip_frac"] == 0, r
        assert r["grad_norm"] > 0


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize("parallel, dtype", [("ddp", "float32"), ("fsdp", "bfloat16")])
def test_two_ranks_packed_keep_the_contract(tmp_path, parallel, dtype):
    from test_distributed import metrics, run
    out = str(tmp_path / parallel)
    stdout = run(out, 2, "--steps=2", f"--parallel={parallel}", f"--dtype={dtype}", "--micro_batch_tokens=40",
                 "--recompute_old_logp=true", "--replay=r3")
    assert "step 2: weights identical on 2 ranks" in stdout
    for r in metrics(out):
        assert r["train_rollout_kl"] == 0 and r["logp_max_abs_diff"] == 0 and r["route_flip_frac"] == 0, r


@pytest.mark.parametrize("value, needle", [("-1", "--micro_batch_tokens=-1: must be >= 0"),
                                           ("lots", "--micro_batch_tokens expects int")])
def test_bad_micro_batch_tokens_is_one_line(tmp_path, value, needle):
    from conftest import cli_error
    line = cli_error([f"--out_dir={tmp_path}", f"--micro_batch_tokens={value}"])
    assert line.startswith("error: ") and needle in line
