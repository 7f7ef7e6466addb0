"""Review of the rollout engine (rollout.py): the bugs a review found, each pinned by a test, and a
randomized stress run of the engine against the contract and against a large-pool reference.

    python -m pytest -q tests/test_rollout_review.py

Everything runs on the CPU with the tiny model of tests/test_rollout.py (a 64-position context here,
so that requests reach it). The stress run draws requests around page boundaries, group sizes 1..4,
stop tokens, 1..8 batch rows, pools so small that sequences are preempted, pages of 16 and 32, padded
(bucketed) decode steps, greedy / top-p / top-k sampling, and a second request on the same Sampler.
The last test runs the fast path's grouped-GEMM MoE, a CUDA path of the sampler, on the CPU.
"""
from __future__ import annotations

import functools
import random

import pytest
import torch

import rollout
from conftest import assert_contract
from rollout import BlockManager, Sampler, Scheduler, Sequence
from test_rollout import make_model, make_prompts

MAX_POS = 64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def short_model():
    return make_model(seed=0, max_position_embeddings=MAX_POS)


def seq(seq_id: int, length: int) -> Sequence:
    return Sequence(seq_id, list(range(seq_id, seq_id + length)), max_len=10_000, num_tokens=length)


# ---------------------------------------------------------------------------------------------------
# finish_reason: a stop token wins over the length limit it also reaches
# ---------------------------------------------------------------------------------------------------
def test_stop_token_at_the_length_limit_finishes_as_stop():
    """A sequence whose last allowed token is a stop token ended on that stop token: "stop" (as vLLM,
    and as this sampler did before the engine rewrite). Checked where the prefill samples the last
    token, where a decode step does, and at the context limit; the control, without stop tokens, is
    "length"."""
    model, vocab = short_model(), short_model().config.vocab_size
    sampler = Sampler(model)
    prompts = make_prompts([5, 16, MAX_POS - 1], seed=3)
    everything = tuple(range(vocab))
    outs = sampler.generate(prompts, max_new_tokens=1, temperature=1.0, stop_token_ids=everything,
                            progress=False)
    assert [o.finish_reason for o in outs] == ["stop"] * 3
    control = sampler.generate(prompts, max_new_tokens=1, temperature=1.0, progress=False)
    assert [o.tokens for o in control] == [o.tokens for o in outs]
    assert [o.finish_reason for o in control] == ["length"] * 3
    # decode: greedy, the 4th token is the first stop token and the last one max_new_tokens allows
    for seed in range(20):
        prompt = make_prompts([9], seed=100 + seed)
        free = sampler.generate(prompt, max_new_tokens=4, temperature=0, progress=False)[0]
        if free.tokens[3] not in free.tokens[:3]:
            break
    else:
        pytest.fail("no prompt whose 4th greedy token differs from the first three")
    stop = tuple(t for t in everything if t not in free.tokens[:3])
    out = sampler.generate(prompt, max_new_tokens=4, temperature=0, stop_token_ids=stop, progress=False)[0]
    assert out.tokens == free.tokens and out.finish_reason == "stop"
    assert free.finish_reason == "length"
    assert_contract(model, outs + [out], 1.0)


# ---------------------------------------------------------------------------------------------------
# prefill admission
# ---------------------------------------------------------------------------------------------------
def test_prefill_admits_every_group_the_pool_holds():
    """Two 64-token prompts (4 pages each) and a 10-page pool: both fit, with a spare page each for the
    next decode step. Admission allocates the pages at once, so they must not also be subtracted a
    second time from the free count (that admitted one group per prefill step here)."""
    bm = BlockManager(10, 16)
    sched = Scheduler(bm, max_batch_size=8, max_num_batched_tokens=4096)
    a, b = [seq(0, 64)], [seq(1, 64)]
    sched.add(a)
    sched.add(b)
    batch, is_prefill = sched.schedule()
    assert is_prefill and batch == a + b
    assert bm.num_free == 2
    sched.postprocess(batch, True, [False, False])
    batch, is_prefill = sched.schedule()                   # position 64: a new page each, no preemption
    assert not is_prefill and batch == a + b and sched.num_preemptions == 0 and bm.num_free == 0


def test_prefill_budget_counts_the_padded_forward():
    """ModelRunner.prefill runs the leaders right-padded to the longest, so a prefill step costs
    leaders x longest tokens; max_num_batched_tokens must bound that, not the sum of the lengths
    (a 60-token prompt followed by four 1-token ones made a 5 x 60 = 300-token forward at budget 64)."""
    budget = 64
    bm = BlockManager(64, 16)
    sched = Scheduler(bm, max_batch_size=16, max_num_batched_tokens=budget)
    groups = [[seq(0, 60)]] + [[seq(i, 1)] for i in range(1, 11)]
    for g in groups:
        sched.add(g)
    steps = []
    while sched.waiting:
        batch, is_prefill = sched.schedule()
        assert is_prefill
        steps.append(batch)
        sched.postprocess(batch, True, [True] * len(batch))    # finish at once: only admission matters
    for batch in steps:
        leaders = [s for s in batch if s.parent is None]
        assert len(leaders) * max(s.num_tokens for s in leaders) <= budget or len(leaders) == 1
    assert [len(b) for b in steps] == [1, 10]                 # the short prompts share one step
    assert sorted(s.seq_id for b in steps for s in b) == list(range(11))
    assert bm.num_free == 64 and bm.ref_counts == [0] * 64


# ---------------------------------------------------------------------------------------------------
# randomized stress: contract, large-pool reference, bookkeeping
# ---------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def reference(request: tuple):
    """The same request on a pool and a batch large enough that nothing waits or is preempted."""
    kw = dict(request)
    kw["prompts"] = [list(p) for p in kw["prompts"]]
    return Sampler(short_model(), num_blocks=2000, max_batch_size=64).generate(**kw, progress=False)


def random_request(rng: random.Random, vocab: int) -> dict:
    """Prompt lengths at page boundaries and at the context limit, repeated prompts, random sampling."""
    edges = [1, 15, 16, 17, 31, 32, 33, 47, 48, 49, MAX_POS - 2, MAX_POS - 1]
    lengths = [min(MAX_POS - 1, max(1, rng.choice(edges) + rng.randint(-1, 1))) for _ in range(rng.randint(1, 5))]
    prompts = [tuple(rng.randrange(vocab) for _ in range(L)) for L in lengths]
    if len(prompts) > 1 and rng.random() < 0.4:
        prompts[-1] = prompts[0]                             # a prompt repeated at another index
    return dict(prompts=tuple(prompts), max_new_tokens=rng.choice([1, 2, 5, 17, 40]), n=rng.randint(1, 4),
                temperature=rng.choice([0.0, 1.0, 0.7]), top_p=rng.choice([1.0, 0.9, 0.3]),
                top_k=rng.choice([0, 0, 1, 5]), stop_token_ids=tuple(rng.sample(range(vocab), rng.choice([0, 1, 3]))),
                seed=rng.randrange(1 << 40))


def check_outputs(model, request: dict, outs) -> None:
    """The contract, equality with the large-pool reference, and the finish reasons."""
    assert_contract(model, outs, request["temperature"])
    ref = reference(tuple(request.items()))
    assert len(outs) == len(ref) == len(request["prompts"]) * request["n"]
    stop = request["stop_token_ids"]
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.tokens == r.tokens, i
        assert o.logprobs == r.logprobs and torch.equal(o.routes, r.routes), i
        assert not any(t in stop for t in o.tokens[:-1]), i
        limit = min(len(o.prompt) + request["max_new_tokens"], MAX_POS)
        if o.tokens[-1] in stop:
            assert o.finish_reason == "stop", i
        else:
            assert o.finish_reason == "length" and len(o.prompt) + len(o.tokens) == limit, i


def check_released(sched: Scheduler) -> None:
    """After a request: nothing waits or runs, every page is free exactly once, every row is free."""
    bm = sched.bm
    assert sched.is_finished() and not sched.offset and not any(sched.by_phase)
    assert bm.ref_counts == [0] * len(bm.ref_counts)
    assert sorted(bm.free_block_ids) == list(range(len(bm.ref_counts)))
    assert sorted(sched.free_rows) == list(range(sched.max_batch_size))


def test_random_requests_match_a_large_pool(monkeypatch):
    model = short_model()
    vocab = model.config.vocab_size
    scheds = []

    class Recorded(Scheduler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            scheds.append(self)
    monkeypatch.setattr(rollout, "Scheduler", Recorded)
    rng = random.Random(2024)
    preemptions = 0
    for trial in range(20):
        request = random_request(rng, vocab)
        bs = rng.choice([16, 32])
        longest = max(min(len(p) + request["max_new_tokens"], MAX_POS) for p in request["prompts"])
        sampler = Sampler(model, block_size=bs, num_blocks=-(-longest // bs) + rng.choice([0, 1, 3]),
                          max_batch_size=rng.randint(1, 8), max_num_batched_tokens=rng.choice([1, 40, 4096]))
        sampler.runner.pad_to_buckets = trial % 2 == 1
        for j in range(2):                                    # a second request on the same Sampler
            if j:
                request = dict(request, seed=request["seed"] + 1, temperature=rng.choice([0.0, 1.0, 0.7]),
                               prompts=tuple(p[:max(1, len(p) // 2)] for p in request["prompts"][::-1]))
            outs = sampler.generate(**{**request, "prompts": [list(p) for p in request["prompts"]]}, progress=False)
            check_outputs(model, request, outs)
            check_released(scheds[-1])
            preemptions += sampler.num_preemptions
    assert preemptions > 0                                    # the small pools did force recompute


def test_check_outputs_sees_one_ulp(monkeypatch):
    """Control: the stress test's check is bitwise; one ulp in one log-prob fails it."""
    request = dict(prompts=((1, 2, 3), (4,) * 17), max_new_tokens=5, n=2, temperature=1.0, top_p=1.0, top_k=0,
                   stop_token_ids=(), seed=7)
    outs = Sampler(short_model(), num_blocks=3).generate(**{**request, "prompts": [list(p) for p in request["prompts"]]},
                                                          progress=False)
    check_outputs(short_model(), request, outs)
    outs[1].logprobs[2] = torch.nextafter(torch.tensor(outs[1].logprobs[2]), torch.tensor(0.0)).item()
    with pytest.raises(AssertionError):
        check_outputs(short_model(), request, outs)


# ---------------------------------------------------------------------------------------------------
# the fast path's grouped-GEMM MoE (CUDA-only in the sampler; this torch runs torch._grouped_mm on CPU)
# ---------------------------------------------------------------------------------------------------
def test_grouped_mm_moe_matches_the_expert_loop():
    """kernels._grouped_mm_moe: slots sorted by expert, int32 cumulative group ends as offs, the weights
    as (E, K, N) transposed views, results scattered back to slot order and combined over k. Against
    the invariant MoE in fp32 on the same bf16 weights, within bf16 rounding; expert 3 gets no token."""
    import kernels
    from conftest import rel_err
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    g = torch.Generator().manual_seed(0)
    M, D, I, E, k = 37, 64, 32, 8, 2
    x = torch.randn(M, D, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, D, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(E, D, I, generator=g) * 0.1).bfloat16()
    logits = torch.randn(M, E, generator=g)
    logits[:, 3] = -1e9
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = torch.softmax(torch.randn(M, k, generator=g), dim=-1)
    try:
        out = kernels._grouped_mm_moe(x, w13, w2, ids, weights)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm does not run on this CPU build: {e}")
    ref = kernels.moe_experts(x.float(), w13.float(), w2.float(), ids, weights)
    assert out.shape == (M, D) and out.dtype == torch.bfloat16
    assert rel_err(out.float(), ref) < 2e-2
