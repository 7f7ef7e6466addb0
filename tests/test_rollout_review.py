"""Review of the rollout engine (rollout.py): the bugs a review found, each pinned by a test, and a
randomized stress run of the engine against the contract and against a large-pool reference.

    python -m pytest -q tests/test_rollout_review.py

Everything runs on the CPU with the tiny model of tests/test_rollout.py (a 64-position context here,
so that requests reach it). The stress run draws requests around page boundaries, group sizes 1..4,
stop tokens, 1..8 batch rows, pools so small that sequences are preempted, pages of 16 and 32, padded
(bucketed) decode steps, greedy / top-p / top-k sampling, and a second request on the same Sampler.
"""
from __future__ import annotations

import functools

import pytest
import torch

from conftest import assert_contract
from rollout import Sampler
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
