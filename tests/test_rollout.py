"""The rollout sampler (rollout.py): the same-bits contract, scheduling, stopping, errors, sampling.

    python -m pytest -q tests/test_rollout.py

The central property (DESIGN.md section 2): whatever the batch, the page size, the prefix sharing or
the preemptions, every generated token's log-prob is bitwise model.score's, every recorded route is
score's, and the sampled tokens depend only on (weights, prompt, seed, index in the request).
Everything runs on the CPU at tiny sizes; the helpers live here so this file stands alone. A
randomized stress run draws requests around page boundaries and the context limit (a 64-position
model), group sizes 1..4, stop tokens, 1..8 batch rows, pools so small that sequences are preempted,
pages of 16 and 32, padded (bucketed) decode steps, greedy / top-p / top-k sampling, and a second
request on the same Sampler, against the contract and against a large-pool reference.
"""
from __future__ import annotations

import functools
import os
import random
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import rollout  # noqa: E402
from conftest import assert_contract, assert_greedy_like_generate, rel_err  # noqa: E402
from config import ConfigError, ModelConfig, RolloutConfig  # noqa: E402
from kernels import sample_tokens  # noqa: E402
from model import Transformer      # noqa: E402
from rollout import Sampler, SamplingParams, draw_keys, kv_pool_blocks  # noqa
from scheduler import BlockManager, Scheduler, Sequence  # noqa: E402

# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
VOCAB = 48
MAX_POS = 128
MAX_NEW = 12
N = 3                                           # samples per prompt (a GRPO group)
LENGTHS = [1, 15, 16, 17, 31, 40, 5, 33]        # around the 16- and 32-position page boundaries


def tiny_config(**overrides) -> ModelConfig:
    """3 layers (1 dense + 2 MoE, 6 experts, top-2): big enough that routing is non-trivial."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
              moe_intermediate_size=32, intermediate_size=64, mlp_only_layers=[0],
              max_position_embeddings=MAX_POS, initializer_range=0.2)
    kw.update(overrides)
    return ModelConfig(**kw)


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    """Random N(0, 0.2) weights and norm weights in [0.5, 1.5] (so a missing norm would show)."""
    model = Transformer(tiny_config(**overrides))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * model.config.initializer_range)
    return model.to(dtype).eval()


def make_prompts(lengths, seed: int, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lengths]


def request_prompts() -> list[list[int]]:
    """Mixed lengths, plus two prompts repeated explicitly (at other indices) besides n=3."""
    prompts = make_prompts(LENGTHS, seed=1)
    return prompts + [prompts[2], prompts[5]]


def assert_complete(outs, prompts, n: int, max_new: int, stop=()) -> None:
    """No sequence was dropped: one output per (prompt, sample), prompt-major, each properly finished."""
    assert len(outs) == len(prompts) * n
    for i, o in enumerate(outs):
        assert o.prompt == prompts[i // n]
        assert o.finish_reason in ("stop", "length")
        assert not any(t in stop for t in o.tokens[:-1]), "generation ran past a stop token"
        if o.finish_reason == "stop":
            assert o.tokens[-1] in stop
        else:
            assert len(o.tokens) == min(max_new, MAX_POS - len(o.prompt))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: these shapes gain nothing from more, and on a shared 2-core machine OpenMP
    spin-waiting made a run 100x slower. (test_contract_with_two_threads covers the threaded path.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def fp32_model() -> Transformer:
    return make_model(seed=0)


SHORT_POS = 64                                  # a shorter context, so that random requests reach it


@functools.lru_cache(maxsize=None)
def short_model() -> Transformer:
    return make_model(seed=0, max_position_embeddings=SHORT_POS)


# sampling settings (temperature, top_p, top_k) and sampler configurations
SETTINGS = [(1.0, 1.0, 0), (1.0, 0.9, 0), (1.0, 1.0, 5), (0.7, 1.0, 0), (0.7, 0.8, 8), (0.0, 1.0, 0)]
CONFIGS = {
    "default": dict(),
    "batch1": dict(max_batch_size=1),
    "batch2": dict(max_batch_size=2),
    "preempt": dict(num_blocks=9, max_batch_size=16),      # 30 sequences of up to 4 pages each
    "block32": dict(block_size=32),
    "small_prefill": dict(max_num_batched_tokens=24),       # prefill one or two prompts at a time
}


@functools.lru_cache(maxsize=None)
def run(setting: tuple, config: str, seed: int = 1234):
    """Generate the standard request under a sampling setting and sampler config (cached per module)."""
    temperature, top_p, top_k = setting
    sampler = Sampler(fp32_model(), **CONFIGS[config])
    outs = sampler.generate(request_prompts(), max_new_tokens=MAX_NEW, temperature=temperature,
                            top_p=top_p, top_k=top_k, n=N, seed=seed, progress=False)
    return outs, sampler.num_preemptions


# ---------------------------------------------------------------------------------------------------
# the contract
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"T{s[0]}-p{s[1]}-k{s[2]}")
def test_contract_across_configs(setting):
    model, prompts = fp32_model(), request_prompts()
    ref, _ = run(setting, "default")
    assert_complete(ref, prompts, N, MAX_NEW)
    assert_contract(model, ref, setting[0])
    for name in CONFIGS:
        outs, preemptions = run(setting, name)
        if name == "preempt":
            assert preemptions > 0, "the small pool was meant to force preemption"
        else:
            assert preemptions == 0, f"config {name} has room for every running sequence"
        assert_complete(outs, prompts, N, MAX_NEW)
        # bitwise equal to the default config's outputs, hence to score's (checked above) as well
        for i, (a, b) in enumerate(zip(ref, outs)):
            assert a.tokens == b.tokens, f"config {name}, output {i}: tokens differ from the default config"
            assert a.logprobs == b.logprobs, f"config {name}, output {i}: logprobs differ"
            assert torch.equal(a.routes, b.routes), f"config {name}, output {i}: routes differ"


def test_contract_with_two_threads():
    """Intra-op threading must not change the bits either (a small request; threads restored after)."""
    model, prompts = fp32_model(), make_prompts([1, 17, 40, 9], seed=9)
    torch.set_num_threads(2)
    try:
        outs = {}
        for name in ("default", "batch2"):
            outs[name] = Sampler(model, **CONFIGS[name]).generate(
                prompts, max_new_tokens=8, temperature=1.0, n=2, seed=4, progress=False)
            assert_contract(model, outs[name], 1.0)
    finally:
        torch.set_num_threads(1)
    assert_contract(model, outs["default"], 1.0)                # one thread scores the same bits
    assert [o.tokens for o in outs["default"]] == [o.tokens for o in outs["batch2"]]


def test_samples_in_a_group_are_independent_draws():
    """n samples of one prompt (and explicit repeats) get their own seeds: they are not copies."""
    outs, _ = run((1.0, 1.0, 0), "default")
    k = len(LENGTHS)
    for i in range(len(outs) // N):
        group = [tuple(o.tokens) for o in outs[i * N:(i + 1) * N]]
        assert len(set(group)) > 1, f"prompt {i}: all {N} samples identical"
    # an explicitly repeated prompt is a different sequence index, hence different draws
    assert [o.tokens for o in outs[2 * N:3 * N]] != [o.tokens for o in outs[k * N:(k + 1) * N]]


def test_greedy_is_the_same_for_every_member():
    outs, _ = run((0.0, 1.0, 0), "default")
    for i in range(len(outs) // N):
        assert all(o.tokens == outs[i * N].tokens for o in outs[i * N:(i + 1) * N])


@pytest.mark.parametrize("setting", [(1.0, 1.0, 0), (0.7, 0.8, 8)], ids=["T1", "T0.7-p0.8-k8"])
def test_tokens_do_not_depend_on_neighbours(setting):
    """A prompt sampled alone (at the same request index) or among other prompts gets the same tokens."""
    temperature, top_p, top_k = setting
    prompts = request_prompts()
    ref, _ = run(setting, "default")
    sampler = Sampler(fp32_model())
    kw = dict(max_new_tokens=MAX_NEW, temperature=temperature, top_p=top_p, top_k=top_k, n=N,
              seed=1234, progress=False)
    for idx in (0, 3, 5):
        # different neighbours: other contents and lengths, the same count before idx, none or some after
        before = make_prompts([7 + 9 * j for j in range(idx)], seed=100 + idx)
        for after in ([], make_prompts([3, 45, 20], seed=200 + idx)):
            outs = sampler.generate(before + [prompts[idx]] + after, **kw)
            assert_contract(fp32_model(), outs, temperature)
            mine = outs[idx * N:(idx + 1) * N]
            for j in range(N):
                assert mine[j].tokens == ref[idx * N + j].tokens, (idx, len(after), j)
                assert mine[j].logprobs == ref[idx * N + j].logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_are_log_softmax_of_tempered_logits(temperature):
    """What is recorded: log softmax(logits / T)[token], T = 1 for greedy (checked against plain torch)."""
    model = fp32_model()
    outs, _ = run((temperature, 1.0, 0), "default")
    for o in outs[::5]:
        P = len(o.prompt)
        logits = model(torch.tensor([o.prompt + o.tokens]))[0, P - 1:-1].double()   # (G, V)
        ref = torch.log_softmax(logits / (temperature or 1.0), -1)
        ref = ref.gather(-1, torch.tensor(o.tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(o.logprobs).double(), ref, rtol=0, atol=1e-5)
        if temperature == 0:
            assert o.tokens == logits.argmax(-1).tolist()


def test_trainer_batch_scoring_matches_rollout():
    """The trainer scores many rollouts in one right-padded batch: still the rollout's bits."""
    model = fp32_model()
    outs, _ = run((1.0, 1.0, 0), "preempt")
    seqs = [o.prompt + o.tokens for o in outs]
    T = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = torch.tensor(s)
    logp, routes = model.score(tokens, temperature=1.0)
    for b, o in enumerate(outs):
        P, G = len(o.prompt), len(o.tokens)
        assert torch.equal(logp[b, P - 1:P - 1 + G], torch.tensor(o.logprobs))
        assert torch.equal(routes[b, :P + G - 1], o.routes)


@pytest.mark.parametrize("config", ["preempt", "batch2"])
def test_route_detail_matches_the_trainers(config):
    """With record_route_detail the sampler's combine weights and margins are score()'s bits (prefill,
    decode, preemption, group members), the routes' too; a sigmoid router with a bias and groups as well."""
    for model in (fp32_model(), make_model(seed=3, router_scoring="sigmoid", score_correction_bias=True,
                                           n_group=2, topk_group=1, norm_topk_prob=True)):
        if model.config.score_correction_bias:
            with torch.no_grad():
                for m in model.modules():
                    if hasattr(m, "e_score_correction_bias"):
                        m.e_score_correction_bias.copy_(torch.randn(6) * 0.05)
        outs = Sampler(model, record_route_detail=True, **CONFIGS[config]).generate(
            request_prompts(), max_new_tokens=MAX_NEW, temperature=1.0, n=N, seed=5, progress=False)
        T = max(len(o.prompt) + len(o.tokens) for o in outs)
        tokens = torch.zeros(len(outs), T, dtype=torch.long)
        for b, o in enumerate(outs):
            tokens[b, :len(o.prompt) + len(o.tokens)] = torch.tensor(o.prompt + o.tokens)
        _, routes, detail = model.score(tokens, route_detail=True)
        for b, o in enumerate(outs):
            n = o.routes.shape[0]
            assert torch.equal(routes[b, :n], o.routes)
            assert torch.equal(detail.weights[b, :n], o.route_weights), b
            assert torch.equal(detail.margin[b, :n], o.route_margins), b
        assert (detail.margin[detail.margin.isfinite()] >= 0).all() and detail.weights.std() > 0
    # control: a rollout whose router logits are rounded to bf16 records other weights and margins
    outs = Sampler(fp32_model(), record_route_detail=True, router_bf16=True).generate(
        request_prompts()[:2], max_new_tokens=4, temperature=1.0, seed=5, progress=False)
    _, _, detail = fp32_model().score(torch.tensor([outs[0].prompt + outs[0].tokens]), route_detail=True)
    n = outs[0].routes.shape[0]
    assert not torch.equal(detail.margin[0, :n], outs[0].route_margins)
    assert not torch.equal(detail.weights[0, :n], outs[0].route_weights)


def test_route_detail_is_off_by_default():
    outs = Sampler(fp32_model()).generate([[1, 2, 3]], max_new_tokens=3, progress=False)
    assert outs[0].route_weights is None and outs[0].route_margins is None


def test_bf16_contract():
    model = make_model(seed=0, dtype=torch.bfloat16)
    prompts = request_prompts()
    ref = None
    for config in ("default", "preempt", "batch2"):
        for temperature in (1.0, 0.7):
            sampler = Sampler(model, **CONFIGS[config])
            outs = sampler.generate(prompts, max_new_tokens=MAX_NEW, temperature=temperature, n=N,
                                    seed=7, progress=False)
            assert sampler.caches[0][0].dtype == torch.bfloat16
            assert_complete(outs, prompts, N, MAX_NEW)
            assert_contract(model, outs, temperature)
            if temperature == 1.0:
                if ref is None:
                    ref = outs
                assert [o.tokens for o in outs] == [o.tokens for o in ref], config


def test_padded_decode_steps_keep_the_contract():
    """The steps CUDA graphs replay run a bucket of rows, the extra ones padding (the pad row, writing
    only the scratch page): on the CPU too, padding must not change a real row's bits."""
    model, prompts = fp32_model(), request_prompts()
    ref, _ = run((1.0, 1.0, 0), "default")
    for config in ("default", "preempt", "batch2"):
        sampler = Sampler(model, **CONFIGS[config])
        sampler.runner.pad_to_buckets = True
        outs = sampler.generate(prompts, max_new_tokens=MAX_NEW, temperature=1.0, n=N, seed=1234, progress=False)
        assert sampler.runner.bucket(30) == min(32, sampler.config.max_batch_size)   # 30 sequences: 2 pad rows
        for a, b in zip(ref, outs):
            assert a.tokens == b.tokens and a.logprobs == b.logprobs and torch.equal(a.routes, b.routes)


def test_a_reused_sampler_keeps_the_contract():
    """One Sampler serves several requests (as in training): rows, graphs and buffers carry over, the
    bookkeeping of the previous request must not (sequences finishing at different steps each time)."""
    model, sampler = fp32_model(), Sampler(fp32_model(), max_batch_size=12)
    for i, lengths in enumerate(([4, 9, 6], [7, 3, 12, 5], [2])):
        outs = sampler.generate(make_prompts(lengths, seed=40 + i), max_new_tokens=9, temperature=1.0, n=4,
                                stop_token_ids=(3, 7, 11, 19), seed=i, progress=False)
        assert {o.finish_reason for o in outs} == {"stop", "length"}, i
        assert_contract(model, outs, 1.0)


def test_sampler_sees_weight_updates():
    """The sampler holds the model, not a copy: after an in-place update it samples from the new weights."""
    model = make_model(seed=3)
    sampler = Sampler(model)
    prompts = make_prompts([4, 9], seed=5)
    before = sampler.generate(prompts, max_new_tokens=8, temperature=0, progress=False)
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
    after = sampler.generate(prompts, max_new_tokens=8, temperature=0, progress=False)
    assert [o.tokens for o in before] != [o.tokens for o in after]
    assert_contract(model, after, 0.0)


# ---------------------------------------------------------------------------------------------------
# greedy against transformers
# ---------------------------------------------------------------------------------------------------
def test_greedy_matches_transformers_generate(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = make_model(seed=0)
    model.save_pretrained(str(tmp_path))
    hf, info = transformers.Qwen3MoeForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf.eval()
    outs = assert_greedy_like_generate(hf, model, make_prompts([1, 5, 15, 17, 30], seed=1), MAX_NEW)
    assert all(o.finish_reason == "length" for o in outs)


# ---------------------------------------------------------------------------------------------------
# stopping
# ---------------------------------------------------------------------------------------------------
def test_stop_on_first_generated_token():
    model = fp32_model()
    sampler = Sampler(model)
    prompts = make_prompts([6, 20, 33], seed=11)
    free = sampler.generate(prompts, max_new_tokens=MAX_NEW, temperature=0, progress=False)
    stop = free[1].tokens[0]                         # the greedy first token of prompt 1
    outs = sampler.generate(prompts, max_new_tokens=MAX_NEW, temperature=0, stop_token_ids=(stop,),
                            progress=False)
    assert outs[1].tokens == [stop] and outs[1].finish_reason == "stop"
    assert outs[1].routes.shape[0] == len(prompts[1]) and len(outs[1].logprobs) == 1
    assert_complete(outs, prompts, 1, MAX_NEW, stop=(stop,))
    assert_contract(model, outs, 0.0)
    for f, o in zip(free, outs):                     # the others are cut at their first stop token
        cut = f.tokens.index(stop) + 1 if stop in f.tokens else len(f.tokens)
        assert o.tokens == f.tokens[:cut]


def test_stop_tokens_truncate_the_same_samples():
    """Draws depend on (seed, index, position) only, so stopping just truncates the unstopped samples."""
    model = fp32_model()
    prompts = request_prompts()
    kw = dict(max_new_tokens=20, temperature=1.0, n=N, seed=5, progress=False)
    free = Sampler(model).generate(prompts, **kw)
    stop = (3, 17, 40)
    sampler = Sampler(model, num_blocks=10)
    outs = sampler.generate(prompts, stop_token_ids=stop, **kw)
    assert_complete(outs, prompts, N, 20, stop=stop)
    assert_contract(model, outs, 1.0)
    n_stopped = 0
    for f, o in zip(free, outs):
        hits = [j for j, t in enumerate(f.tokens) if t in stop]
        cut = hits[0] + 1 if hits else len(f.tokens)
        assert o.tokens == f.tokens[:cut]
        assert o.logprobs == f.logprobs[:cut]
        assert o.finish_reason == ("stop" if hits else "length")
        n_stopped += bool(hits)
    assert 0 < n_stopped < len(outs)


def test_stop_token_at_the_length_limit_finishes_as_stop():
    """A sequence whose last allowed token is a stop token ended on that stop token: "stop" (as vLLM).
    Checked where the prefill samples the last token, where a decode step does, and at the context
    limit; the control, without stop tokens, is "length"."""
    model, vocab = short_model(), short_model().config.vocab_size
    sampler = Sampler(model)
    prompts = make_prompts([5, 16, SHORT_POS - 1], seed=3)
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


def test_max_new_tokens_gives_length():
    outs = Sampler(fp32_model()).generate(make_prompts([2, 17], seed=4), max_new_tokens=5, temperature=1.0,
                                          n=2, progress=False)
    assert all(o.finish_reason == "length" and len(o.tokens) == 5 for o in outs)
    outs = Sampler(fp32_model()).generate(make_prompts([9], seed=4), max_new_tokens=1, temperature=1.0,
                                          progress=False)
    assert len(outs[0].tokens) == 1 and outs[0].finish_reason == "length"
    assert outs[0].routes.shape[0] == 9


def test_context_limit_gives_length():
    model = fp32_model()
    prompts = make_prompts([MAX_POS - 5, MAX_POS - 1, 30], seed=8)
    sampler = Sampler(model, max_batch_size=2)
    outs = sampler.generate(prompts, max_new_tokens=50, temperature=1.0, n=2, progress=False)
    assert [len(o.tokens) for o in outs] == [5, 5, 1, 1, 50, 50]
    assert all(o.finish_reason == "length" for o in outs)
    assert all(len(o.prompt) + len(o.tokens) <= MAX_POS for o in outs)
    assert_contract(model, outs, 1.0)


# ---------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompts, kwargs, match", [
    ([[]], {}, "empty"),
    ([[1, 2], []], {}, "prompt 1 is empty"),
    ([[1] * MAX_POS], {}, "max_position_embeddings"),
    ([[1] * (MAX_POS + 40)], {}, "max_position_embeddings"),
    ([[1, VOCAB]], {}, "vocab_size"),
    ([[-1, 2]], {}, "vocab_size"),
    ([[1, 2]], dict(temperature=-0.5), "temperature"),
    ([[1, 2]], dict(top_p=0.0), "top_p"),
    ([[1, 2]], dict(top_p=1.5), "top_p"),
    ([[1, 2]], dict(top_k=-1), "top_k"),
    ([[1, 2]], dict(max_new_tokens=0), "max_new_tokens"),
    ([[1, 2]], dict(n=0), "n=0"),
    ([[1, 2]], dict(temperature=float("nan")), "temperature"),
    ([[1, 2]], dict(temperature=float("inf")), "temperature"),
    ([[1, 2]], dict(max_new_tokens=1.5), "max_new_tokens"),
    ([[1, 2]], dict(max_new_tokens=True), "max_new_tokens"),
    ([[1, 2]], dict(top_k=2.0), "top_k"),
    ([[1, 2]], dict(seed=-1), "seed"),
    ([[True, 2]], {}, "integer token ids"),
    ([[1.0, 2]], {}, "integer token ids"),
    ([torch.tensor([1.0, 2.0])], {}, "integer"),
    ([[1, 2]], dict(stop_token_ids=(1.5,)), "stop_token_ids"),
    ([[1, 2]], dict(stop_token_ids=(VOCAB,)), "stop_token_ids"),
    ([[1, 2]], dict(index_offset=-1), "index_offset"),
    ([[1, 2]], dict(n=True), "n=True"),
])
def test_bad_requests_raise(prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampler(fp32_model()).generate(prompts, progress=False, **kwargs)


def test_pool_too_small_for_one_sequence():
    sampler = Sampler(fp32_model(), num_blocks=2)            # 32 positions
    with pytest.raises(ValueError, match="num_blocks"):
        sampler.generate([[1] * 30], max_new_tokens=10, progress=False)
    # a sequence that fits exactly is fine
    outs = sampler.generate([[1] * 30], max_new_tokens=2, progress=False)
    assert len(outs[0].tokens) == 2


def test_kv_pool_sizing():
    """The CUDA pool: a fraction of what is free after the reserve (the optimizer's state, allocated
    later), capped at what full-context sequences need, never zero (the scheduler preempts instead)."""
    assert kv_pool_blocks(100_000, 0.5, 20_000, 1000, 10**6) == 40
    assert kv_pool_blocks(100_000, 0.5, 0, 1000, 30) == 30
    assert kv_pool_blocks(10_000, 0.5, 20_000, 1000, 30) == 1
    # the fraction's range is RolloutConfig's rule, whichever way the sampler is built
    with pytest.raises(ConfigError, match="kv_memory_fraction"):
        Sampler(fp32_model(), kv_memory_fraction=0.0)
    with pytest.raises(ConfigError, match="kv_memory_fraction"):
        RolloutConfig(kv_memory_fraction=1.5)


def test_bad_block_size_raises():
    with pytest.raises(ValueError, match="KV_BLOCK"):
        Sampler(fp32_model(), block_size=24)
    with pytest.raises(ConfigError, match="block_size"):
        RolloutConfig(block_size=24)


@pytest.mark.parametrize("bad", [dict(temperature=-0.5), dict(temperature="1"), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(top_p="0.9"), dict(top_k=-1), dict(top_k=2.0), dict(top_k=True)])
def test_sampling_ranges_have_one_owner(bad):
    """The run's config (RolloutConfig, from the command line) and each request (SamplingParams, from
    generate()) reject the same sampling values in the same words: one rule, config.check_sampling."""
    with pytest.raises(ConfigError) as by_config:
        RolloutConfig(**bad)
    with pytest.raises(ConfigError) as by_request:
        SamplingParams(**bad)
    assert str(by_config.value) == str(by_request.value) and next(iter(bad)) in str(by_config.value)
    ok = dict(temperature=0.0, top_p=1.0, top_k=0)           # control: the edges of each range pass
    RolloutConfig(**ok), SamplingParams(**ok)


def test_a_new_sampling_filter_is_one_entry_of_sampling_filters(monkeypatch):
    """A fork's sampling rule (README, "A sampling rule"): one entry of kernels.SAMPLING_FILTERS, here min-p (keep
    the tokens of at least min_p times the row's top probability), then generate(min_p=...) (and a RolloutConfig
    field of its name, the command line's) draws with it under the contract. min_p=1 keeps only the most likely
    token: the draws are greedy's. Control: without it the same seed draws others. Its check says what is wrong."""
    import kernels
    monkeypatch.setitem(kernels.SAMPLING_FILTERS, "min_p", kernels.SamplingFilter(
        lambda p, m: p >= m * p[:, :1], 0.0, lambda v: isinstance(v, float) and 0 <= v <= 1, "must be in [0, 1]"))
    model, prompts = fp32_model(), [[1, 2, 3, 4], [5, 6, 7]]
    kept = Sampler(model, num_blocks=64).generate(prompts, max_new_tokens=8, n=3, seed=4, min_p=1.0)
    assert_contract(model, kept)
    greedy = Sampler(model, num_blocks=64).generate(prompts, max_new_tokens=8, n=3, temperature=0.0)
    free = Sampler(model, num_blocks=64).generate(prompts, max_new_tokens=8, n=3, seed=4)
    assert [o.tokens for o in kept] == [o.tokens for o in greedy] != [o.tokens for o in free]
    with pytest.raises(ConfigError, match=r"--min_p=1.5: must be in \[0, 1\]"):
        Sampler(model, num_blocks=64).generate(prompts, max_new_tokens=8, min_p=1.5)
    with pytest.raises(ConfigError, match="min_q=0.5: not a sampling filter"):
        Sampler(model, num_blocks=64).generate(prompts, max_new_tokens=8, min_q=0.5)


# ---------------------------------------------------------------------------------------------------
# BlockManager and Scheduler
# ---------------------------------------------------------------------------------------------------
def seq(seq_id: int, length: int) -> Sequence:
    return Sequence(seq_id, list(range(length)), max_len=10_000, num_tokens=length)


def test_block_manager_allocate_and_free():
    bm = BlockManager(8, 16)
    a, b = seq(0, 40), seq(1, 16)
    bm.allocate(a, 40)
    assert len(a.block_table) == 3 and bm.num_free == 5
    assert all(bm.ref_counts[x] == 1 for x in a.block_table)
    bm.allocate(a, 48)                                        # still inside the third page
    assert len(a.block_table) == 3
    bm.allocate(a, 49)
    assert len(a.block_table) == 4 and bm.num_free == 4
    bm.allocate(b, 16)
    assert len(b.block_table) == 1 and not set(a.block_table) & set(b.block_table)
    with pytest.raises(RuntimeError):
        bm.allocate(b, 16 * 5)                                # 4 more, 3 free
    assert len(b.block_table) == 1 and bm.num_free == 3      # a failed allocation takes nothing
    bm.free(a)
    assert a.block_table == [] and bm.num_free == 7
    bm.free(b)
    assert bm.num_free == 8 and sorted(bm.free_block_ids) == list(range(8))
    assert bm.ref_counts == [0] * 8


@pytest.mark.parametrize("order", ["parent_first", "children_first"])
def test_block_manager_fork_partial_block(order):
    bm = BlockManager(10, 16)
    parent = seq(0, 40)
    bm.allocate(parent, 40)                                   # 2 full pages + a partial one
    children = [seq(i, 40) for i in (1, 2)]
    copies = [bm.fork(parent, c, 40) for c in children]
    for c, cp in zip(children, copies):
        assert c.block_table[:2] == parent.block_table[:2]
        src, dst = cp
        assert src == parent.block_table[2] and dst == c.block_table[2]
        assert dst not in parent.block_table and bm.ref_counts[dst] == 1
    assert copies[0][1] != copies[1][1]
    assert [bm.ref_counts[x] for x in parent.block_table] == [3, 3, 1]
    assert bm.num_free == 10 - 3 - 2
    for s in ([parent] + children if order == "parent_first" else children + [parent]):
        bm.free(s)
    assert bm.num_free == 10 and sorted(bm.free_block_ids) == list(range(10))   # each freed exactly once
    assert bm.ref_counts == [0] * 10


def test_scheduler_lifecycle_and_block_growth():
    """add -> schedule (prefill) -> postprocess -> schedule (decode) ... -> finished: a new block exactly
    when a running sequence's next position starts one, found without visiting the other sequences."""
    bm = BlockManager(32, 16)
    sched = Scheduler(bm, max_batch_size=4, max_num_batched_tokens=1024)
    group, other = [seq(0, 15), seq(1, 15)], [seq(2, 16)]
    sched.add(group)
    sched.add(other)
    step = sched.schedule()
    assert step.is_prefill and step.batch == group + other and not step.new_blocks
    assert group[1].parent is group[0] and group[0].parent is None and other[0].parent is None
    assert len(group[0].block_table) == len(group[1].block_table) == 1   # 15 tokens: one page, copied
    assert group[0].block_table != group[1].block_table                  # (a partial page is not shared)
    assert sorted(s.row for s in step.batch) == [0, 1, 2]
    sched.postprocess(step, [False, False, False])
    assert [sched.length(s) for s in step.batch] == [16, 16, 17]
    for i in range(40):
        before = {id(s): len(s.block_table) for s in sched.running}
        step = sched.schedule()
        assert not step.is_prefill and step.batch is sched.running
        for s in step.batch:                                # position length - 1 is written this step
            assert len(s.block_table) == -(-sched.length(s) // 16), (i, s.seq_id)
            assert len(s.block_table) - before[id(s)] == int((sched.length(s) - 1) % 16 == 0)
        assert set(step.new_blocks) == {(s.row, len(s.block_table) - 1, s.block_table[-1])
                                        for s in step.batch if len(s.block_table) > before[id(s)]}
        # the runner rewrites its rows only when the running set changed: first decode, after a finish
        assert step.rows_changed == (i in (0, 11)), i
        sched.postprocess(step, [i == 10 and s.seq_id == 1 for s in step.batch])
    assert [s.seq_id for s in sched.running] == [0, 2] and group[1].num_tokens == 16 + 11
    assert sched.free_rows[-1] == group[1].row              # its row is handed out again
    done = sched.postprocess(sched.schedule(), [True, True])
    assert [s.seq_id for s in done] == [0, 2] and sched.is_finished()
    assert bm.num_free == 32 and bm.ref_counts == [0] * 32


def test_scheduler_preempts_newest_to_front_of_waiting():
    bm = BlockManager(4, 16)
    sched = Scheduler(bm, max_batch_size=8, max_num_batched_tokens=1024)
    running = [seq(i, 15) for i in range(3)]                  # each fills one page after its first token
    sched.add(running)
    sched.postprocess(sched.schedule(), [False] * 3)
    other = [seq(9, 5)]
    sched.add(other)
    step = sched.schedule()                                   # 1 block free: no admission; decode 16th
    assert not step.is_prefill and step.batch == running
    sched.postprocess(step, [False] * 3)
    step = sched.schedule()                                   # position 16: each needs a 2nd page
    assert not step.is_prefill and step.batch == running[:2]  # 1 free, and 1 more from preempting the newest
    assert step.rows_changed and len(step.new_blocks) == 2    # the preempted row leaves the batch
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [[running[2]], other]       # first in line for recompute
    assert running[2].block_table == [] and running[2].num_tokens == 17 and running[2].row >= 0
    assert all(len(s.block_table) == 2 for s in running[:2]) and bm.num_free == 0
    sched.postprocess(step, [True, True])                     # both finish: their pages come back
    step = sched.schedule()
    assert step.is_prefill and step.batch[0] is running[2]    # recompute of all 17 tokens
    assert len(running[2].block_table) == 2


def test_scheduler_splits_a_group_larger_than_the_batch():
    bm = BlockManager(32, 16)
    sched = Scheduler(bm, max_batch_size=2, max_num_batched_tokens=1024)
    group = [seq(i, 20) for i in range(5)]
    sched.add(group)
    step = sched.schedule()
    assert step.is_prefill and step.batch == group[:2]
    assert list(sched.waiting) == [group[2:]]


def test_block_manager_admission():
    """num_admissible: m members of a group of L-token sequences need the leader's ceil(L / 16) blocks,
    m - 1 copies of a partly filled last block, and, while others run, one spare block for each of the
    m and of the num_running others."""
    bm = BlockManager(10, 16)
    assert bm.num_admissible(64, 3, 0) == 3                  # 4 full blocks, all shared, no spares
    assert bm.num_admissible(160, 3, 0) == 3                 # exactly the 10 free blocks
    assert bm.num_admissible(161, 3, 0) == 0                 # 11 blocks: not even the leader
    assert bm.num_admissible(40, 9, 0) == 8                  # 3 blocks + 7 copies = 10
    assert bm.num_admissible(40, 9, 2) == 3                  # 10 - 2 spares: 3 + (m - 1) + m <= 8
    assert bm.num_admissible(64, 9, 2) == 4                  # 4 + m <= 8
    assert bm.num_admissible(64, 9, 9) == 0                  # the spares of the running take all but 1
    bm.allocate(seq(0, 80), 80)                              # 5 blocks taken
    assert bm.num_admissible(40, 9, 0) == 3 and bm.num_admissible(40, 2, 0) == 2


def test_prefill_admits_every_group_the_pool_holds():
    """Two 64-token prompts (4 pages each) and a 10-page pool: both fit, with a spare page each for the
    next decode step. Admission allocates the pages at once, so they must not also be subtracted a
    second time from the free count (that would admit one group per prefill step here)."""
    bm = BlockManager(10, 16)
    sched = Scheduler(bm, max_batch_size=8, max_num_batched_tokens=4096)
    a, b = [seq(0, 64)], [seq(1, 64)]
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert step.is_prefill and step.batch == a + b
    assert bm.num_free == 2
    sched.postprocess(step, [False, False])
    step = sched.schedule()                                # position 64: a new page each, no preemption
    assert not step.is_prefill and step.batch == a + b and sched.num_preemptions == 0 and bm.num_free == 0


def test_prefill_budget_counts_the_padded_forward():
    """ModelRunner.prefill runs the leaders right-padded to the longest, so a prefill step costs
    leaders x longest tokens; max_num_batched_tokens must bound that, not the sum of the lengths
    (which would let a 60-token prompt and four 1-token ones make a 5 x 60 = 300-token forward at
    budget 64)."""
    budget = 64
    bm = BlockManager(64, 16)
    sched = Scheduler(bm, max_batch_size=16, max_num_batched_tokens=budget)
    groups = [[seq(0, 60)]] + [[seq(i, 1)] for i in range(1, 11)]
    for g in groups:
        sched.add(g)
    steps = []
    while sched.waiting:
        step = sched.schedule()
        assert step.is_prefill
        steps.append(step.batch)
        sched.postprocess(step, [True] * len(step.batch))   # finish at once: only admission matters
    for batch in steps:
        leaders = [s for s in batch if s.parent is None]
        assert len(leaders) * max(s.num_tokens for s in leaders) <= budget or len(leaders) == 1
    assert [len(b) for b in steps] == [1, 10]                 # the short prompts share one step
    assert sorted(s.seq_id for b in steps for s in b) == list(range(11))
    assert bm.num_free == 64 and bm.ref_counts == [0] * 64


def test_preemption_end_to_end_never_drops_a_sequence():
    model = fp32_model()
    prompts = make_prompts([40, 33, 17, 1, 31, 16] * 2, seed=21)
    sampler = Sampler(model, num_blocks=5, max_batch_size=8)  # a 52-token sequence needs 4 of the 5
    outs = sampler.generate(prompts, max_new_tokens=MAX_NEW, temperature=1.0, n=2, seed=3, progress=False)
    assert sampler.num_preemptions > 0
    assert_complete(outs, prompts, 2, MAX_NEW)
    assert_contract(model, outs, 1.0)
    ref = Sampler(model).generate(prompts, max_new_tokens=MAX_NEW, temperature=1.0, n=2, seed=3, progress=False)
    assert [o.tokens for o in outs] == [o.tokens for o in ref]


def test_memory_pressure_75_percent_pool():
    """A KV pool of 75% of what the batch needs: generation completes through preemption and every
    sequence's tokens, log-probs and routes equal those of a run with a large pool."""
    model = fp32_model()
    prompts = make_prompts([9, 20, 33, 14, 27, 40], seed=31)
    n, max_new = 3, 24
    need = sum(-(-(len(p) + max_new) // 16) for p in prompts) * n
    kw = dict(max_new_tokens=max_new, temperature=1.0, n=n, seed=8, progress=False)
    ref = Sampler(model, num_blocks=4 * need).generate(prompts, **kw)
    small = Sampler(model, num_blocks=int(0.75 * need), max_batch_size=len(prompts) * n)
    outs = small.generate(prompts, **kw)
    assert small.num_preemptions > 0
    for a, b in zip(ref, outs):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        assert a.logprobs == b.logprobs and torch.equal(a.routes, b.routes)


@pytest.mark.parametrize("num_experts", [256, 300])
def test_routes_past_255_experts_come_back_exactly(num_experts):
    """The route buffers take the smallest integer type that holds every expert id: uint8 up to 256
    experts (ids 0..255), int16 past that. Ids past 255 are recorded (they would wrap in uint8)."""
    model = make_model(seed=5, num_experts=num_experts)
    sampler = Sampler(model)
    assert sampler.runner.route_dtype == (torch.uint8 if num_experts <= 256 else torch.int16)
    outs = sampler.generate(make_prompts([9, 30], seed=6), max_new_tokens=10, n=2, seed=1, progress=False)
    assert_contract(model, outs, 1.0)
    top = max(int(o.routes.max()) for o in outs)
    assert top >= 200, f"the largest recorded expert id is {top}: the test meant to reach the high ids"
    if num_experts > 256:
        assert top > 255, "no route past id 255: the int16 buffer was not exercised"


def test_sampler_takes_a_rollout_config():
    """Sampler(model, RolloutConfig) sizes its pool and rows from the config; keyword overrides replace
    fields of a copy (the caller's config is untouched) and pass the config's checks."""
    rcfg = RolloutConfig(block_size=32, num_blocks=40, max_batch_size=3)
    s = Sampler(fp32_model(), rcfg)
    assert (s.config.block_size, s.num_blocks, s.config.max_batch_size) == (32, 40, 3)
    assert s.caches[0][0].shape[:2] == (40 + 1, 32)                    # + the scratch page
    t = Sampler(fp32_model(), rcfg, max_batch_size=5)
    assert (t.config.block_size, t.config.max_batch_size, rcfg.max_batch_size) == (32, 5, 3)
    assert t.runner.max_batch_size == 5 and t.runner.pad_row == 5
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        Sampler(fp32_model(), rcfg, max_num_batched_tokens=0)
    with pytest.raises(TypeError, match="RolloutConfig"):
        Sampler(fp32_model(), 16)                                      # a page size is not a config


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
    edges = [1, 15, 16, 17, 31, 32, 33, 47, 48, 49, SHORT_POS - 2, SHORT_POS - 1]
    lengths = [min(SHORT_POS - 1, max(1, rng.choice(edges) + rng.randint(-1, 1))) for _ in range(rng.randint(1, 5))]
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
        limit = min(len(o.prompt) + request["max_new_tokens"], SHORT_POS)
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
        longest = max(min(len(p) + request["max_new_tokens"], SHORT_POS) for p in request["prompts"])
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


def test_check_outputs_sees_one_ulp():
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
# host work per decode step
# ---------------------------------------------------------------------------------------------------
def _ops_per_decode_step(n_seqs: int) -> int:
    """Top-level torch ops (what the host calls, not the ops those run inside) of one decode step."""
    from tooling.bench import decode_step_profile
    sampler = Sampler(fp32_model(), max_batch_size=n_seqs)
    return decode_step_profile(sampler, make_prompts([10] * n_seqs, seed=2), 8)[0]


def test_ops_per_decode_step_do_not_grow_with_the_batch():
    small, large = _ops_per_decode_step(16), _ops_per_decode_step(256)
    assert small == large, (small, large)


# ---------------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------------
def uniforms(seed: int, seq_ids, positions) -> torch.Tensor:
    s = torch.tensor([seed & 0xFFFFFFFF, seed >> 32])
    return draw_keys(s, torch.as_tensor(seq_ids), torch.as_tensor(positions))


def test_same_request_same_tokens_and_seed_matters():
    sampler = Sampler(fp32_model())
    prompts = make_prompts([3, 12], seed=30)
    kw = dict(max_new_tokens=40, temperature=1.0, n=2, progress=False)
    a = sampler.generate(prompts, seed=0, **kw)
    b = sampler.generate(prompts, seed=0, **kw)               # the same sampler, stale pages and all
    c = Sampler(fp32_model(), block_size=32).generate(prompts, seed=0, **kw)
    d = sampler.generate(prompts, seed=1, **kw)
    for x, y, z in zip(a, b, c):
        assert x.tokens == y.tokens == z.tokens
        assert x.logprobs == y.logprobs and x.logprobs == z.logprobs
    assert all(x.tokens != w.tokens for x, w in zip(a, d))


def test_top_k_1_and_tiny_top_p_are_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(100, VOCAB, generator=g) * 3
    best = logits.argmax(-1)
    u = uniforms(5, torch.arange(100), torch.full((100,), 7))
    assert torch.equal(sample_tokens(logits, 1.0, 1.0, 1, u), best)
    assert torch.equal(sample_tokens(logits, 0.7, 1e-6, 0, u), best)
    assert torch.equal(sample_tokens(logits, 1.3, 1e-6, 7, u), best)


def test_sample_distribution_and_truncation():
    p = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = torch.log(p).expand(4000, 4)
    u = uniforms(0, torch.zeros(4000, dtype=torch.long), torch.arange(4000))
    freq = torch.bincount(sample_tokens(logits, 1.0, 1.0, 0, u), minlength=4).float() / 4000
    assert torch.allclose(freq, p, atol=0.03), freq
    # temperature 0.5 squares the probabilities (then renormalises)
    u = uniforms(1, torch.zeros(4000, dtype=torch.long), torch.arange(4000))
    freq = torch.bincount(sample_tokens(logits, 0.5, 1.0, 0, u), minlength=4).float() / 4000
    assert torch.allclose(freq, p ** 2 / (p ** 2).sum(), atol=0.03), freq
    # top_k=2 keeps tokens 0 and 1; top_p=0.7 keeps the smallest prefix reaching 0.7: tokens 0 and 1
    u = uniforms(2, torch.zeros(300, dtype=torch.long), torch.arange(300))
    for top_p, top_k, want in ((1.0, 2, {0, 1}), (0.7, 0, {0, 1}), (0.74, 0, {0, 1}), (0.76, 0, {0, 1, 2})):
        assert set(sample_tokens(logits[:300], 1.0, top_p, top_k, u).tolist()) == want, (top_p, top_k)


def test_batched_draws_equal_draws_alone():
    """sample_tokens on a batch of rows (one call) gives each row the token it gets alone, in any order."""
    g = torch.Generator().manual_seed(7)
    for B, V in ((1, 5), (7, 50), (5, 3001)):
        logits = torch.randn(B, V, generator=g) * 3
        u = uniforms(11, torch.arange(B), torch.full((B,), V))
        for temperature, top_p, top_k in ((1.0, 1.0, 0), (0.7, 0.8, 8), (1.3, 0.95, 0)):
            batched = sample_tokens(logits, temperature, top_p, top_k, u)
            assert batched.shape == (B,) and batched.dtype == torch.long
            alone = [int(sample_tokens(logits[b:b + 1], temperature, top_p, top_k, u[b:b + 1])) for b in range(B)]
            assert batched.tolist() == alone
            perm = torch.randperm(B, generator=g)
            assert sample_tokens(logits[perm], temperature, top_p, top_k, u[perm]).tolist() == [alone[i] for i in perm]


def test_draws_depend_on_seed_index_and_position_only():
    u = uniforms(3, torch.arange(20).repeat_interleave(50), torch.arange(50).repeat(20))
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert u.unique().numel() == 1000
    assert torch.equal(u, uniforms(3, torch.arange(20).repeat_interleave(50), torch.arange(50).repeat(20)))
    assert not torch.equal(u, uniforms(4, torch.arange(20).repeat_interleave(50), torch.arange(50).repeat(20)))
    assert not torch.equal(uniforms(3 + (1 << 40), [0], [0]), uniforms(3, [0], [0]))   # high seed bits count
    assert abs(float(u.mean()) - 0.5) < 0.03 and abs(float(u.var()) - 1 / 12) < 0.01


def test_bench_gpu_section_runs_on_cpu(tmp_path):
    """`tooling/bench.py --only gpu` is only measured on a GPU (tools/gpu_check.sh); its code runs here at
    tiny sizes so that the call cannot fail on a stale path: the contract rows must read 0. It takes
    the sweep's tile configs (--tuning); a bad tuning file is one line of error, not a traceback."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    tuning = tmp_path / "tuning.json"
    tuning.write_text('{"attn_split_below": 1, "mm": {"float32": [[null, 32, 32, 32, 4, 3]]}}')
    r = subprocess.run([sys.executable, "-m", "tooling.bench", "--only", "gpu", "--cpu-smoke", "--tuning", str(tuning)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert f"tile configs from {tuning}: {{'attn_split_below': 1" in r.stdout
    contract = [line for line in r.stdout.splitlines() if "mismatching sequences" in line]
    assert contract and all(line.split()[-4] == "0.0" for line in contract), contract
    assert "one invariant eager decode step" in r.stdout and "one fast decode step" in r.stdout
    tuning.write_text('{"attn_split_below": 0}')
    r = subprocess.run([sys.executable, "-m", "tooling.bench", "--only", "gpu", "--tuning", str(tuning)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("bench.py: error: tuning file"), r.stderr


# ---------------------------------------------------------------------------------------------------
# the fast path's grouped-GEMM MoE (CUDA-only in the sampler; this torch runs torch._grouped_mm on CPU)
# ---------------------------------------------------------------------------------------------------
def test_grouped_mm_moe_matches_the_expert_loop():
    """The lab's fast MoE on torch._grouped_mm (lab/fast_ops.grouped_mm_moe): slots sorted by expert, int32 cumulative group ends as offs, the weights
    as (E, K, N) transposed views, results scattered back to slot order and combined over k. Against
    the invariant MoE in fp32 on the same bf16 weights, within bf16 rounding; expert 3 gets no token."""
    import kernels
    from lab import fast_ops
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
        out = fast_ops.grouped_mm_moe(x, w13, w2, ids, weights)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm does not run on this CPU build: {e}")
    ref = kernels.moe_experts(x.float(), w13.float(), w2.float(), ids, weights)
    assert out.shape == (M, D) and out.dtype == torch.bfloat16
    assert rel_err(out.float(), ref) < 2e-2


# ---------------------------------------------------------------------------------------------------
# CUDA: graphs replay the eager bits; draws do not depend on the batch (skipped without a GPU)
# ---------------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@functools.lru_cache(maxsize=None)
def cuda_model(dtype: torch.dtype = torch.bfloat16) -> Transformer:
    return make_model(seed=0, dtype=dtype).cuda()


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graphs_equal_eager_and_score(dtype):
    """Decode steps replayed as CUDA graphs (padded to a bucket: 3 of 4 rows, 30 of 32, ...) give the
    eager step's bits, which are score's bits; also through preemption and a small batch limit."""
    model, prompts = cuda_model(dtype), request_prompts()
    kw = dict(max_new_tokens=MAX_NEW, temperature=1.0, n=N, seed=3, progress=False)
    eager = Sampler(model, cuda_graphs=False).generate(prompts, **kw)
    assert_contract(model, eager, 1.0)
    for config in ("default", "preempt", "batch2", "small_prefill"):
        sampler = Sampler(model, cuda_graphs=True, **CONFIGS[config])
        for _ in range(2):                                 # the first use of a bucket runs eagerly
            outs = sampler.generate(prompts, **kw)
        assert sampler.runner.graphs, "no graph was captured"
        for a, b in zip(eager, outs):
            assert a.tokens == b.tokens, config
            assert a.logprobs == b.logprobs and torch.equal(a.routes, b.routes), config


@cuda
def test_cuda_top_p_draws_do_not_depend_on_the_batch():
    model, prompts = cuda_model(), request_prompts()
    kw = dict(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.9, top_k=20, n=N, seed=5, progress=False)
    ref = Sampler(model).generate(prompts, **kw)
    assert_contract(model, ref, 0.8)
    alone = [Sampler(model).generate([p], **{**kw, "n": 1}, index_offset=i * N + j)[0]
             for i, p in enumerate(prompts[:3]) for j in range(N)]
    assert [o.tokens for o in alone] == [o.tokens for o in ref[:3 * N]]


@cuda
def test_cuda_fast_mode_runs_with_graphs():
    """The fast path (cuBLAS, SDPA, torch._grouped_mm) runs as graphs in bf16 and deviates a little."""
    model, prompts = cuda_model(), request_prompts()
    sampler = Sampler(model, rollout_mode="fast")
    outs = [sampler.generate(prompts, max_new_tokens=MAX_NEW, temperature=1.0, n=N, seed=3, progress=False)
            for _ in range(2)]
    assert sampler.runner.cuda_graphs and sampler.runner.graphs
    assert [o.tokens for o in outs[0]] == [o.tokens for o in outs[1]]   # deterministic run to run
    assert_complete(outs[1], prompts, N, MAX_NEW)


def test_finish_time_is_each_sequences_latency_within_the_call():
    """SequenceOutput.finish_time: seconds from generate()'s start to when the host saw the sequence end,
    read where the step's finished flags come back anyway (no read of its own). In one decode batch a
    sequence that stopped after fewer tokens finished no later; every time lies inside the call.
    Control: a second call's times start again from its own start."""
    import time
    model = make_model(seed=4)
    sampler = Sampler(model, max_batch_size=64)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    t0 = time.perf_counter()
    outs = sampler.generate(prompts, max_new_tokens=12, n=8, temperature=1.0, seed=3, stop_token_ids=(3, 7, 11))
    wall = time.perf_counter() - t0
    assert all(0 < o.finish_time <= wall for o in outs)
    lengths = sorted({len(o.tokens) for o in outs})
    assert len(lengths) >= 3                                          # the stops spread the lengths
    by_len = {n: [o.finish_time for o in outs if len(o.tokens) == n] for n in lengths}
    assert all(max(by_len[a]) <= min(by_len[b]) for a, b in zip(lengths, lengths[1:]))
    time.sleep(0.05)
    again = sampler.generate(prompts[:1], max_new_tokens=2, temperature=0)
    assert again[0].finish_time < wall
