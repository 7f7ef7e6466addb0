"""The window pool (scheduler.WindowPool, WindowBlockManager; rollout.Sampler): a model's sliding-window layers keep their
KV in a pool of their own, whose blocks are freed once they lie wholly below the window of every query a
sequence will still feed; full-attention layers and the routes keep every block.

    python -m pytest -q tests/test_window_pool.py

The sampler's bits do not depend on it: through preemption, small pools, chunked prefill, pages of 32,
speculative decoding, sessions and prefix-cache hits (across requests and within one), the outputs are the
no-pool run's (window_blocks=-1) and score's. It holds fewer blocks than the full pool, and the control
(blocks freed while a window still reaches them) changes the bits.
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_contract
from test_rollout import make_model, make_prompts, seq
from test_sessions import assert_episode_contract, assert_same, episodes, shared_prefix_prompts
from rollout import Sampler
from scheduler import Sequence, WindowBlockManager, WindowPool

LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
PROMPT_LENGTHS = [1, 15, 16, 17, 31, 40, 5, 33]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def windowed_model(window: int):
    """test_rollout's tiny model with layers 0 and 2 sliding (a window of `window` keys) and sinks."""
    return make_model(seed=3, layer_types=LAYERS, sliding_window=window, attention_sinks=True)


def sample(sampler: Sampler, **kw):
    kw = dict(dict(max_new_tokens=40, n=2, temperature=1.0, seed=7, progress=False), **kw)
    return sampler.generate(make_prompts(PROMPT_LENGTHS, seed=5), **kw)


def same_outputs(a, b) -> bool:
    return all(x.tokens == y.tokens and x.logprobs == y.logprobs and torch.equal(x.routes, y.routes)
               for x, y in zip(a, b))


CONFIGS = {
    "default": {},
    "small pool": dict(window_blocks=12, max_batch_size=6),
    "preempt": dict(num_blocks=14, max_batch_size=8),
    "block32": dict(block_size=32),
    "chunk7": dict(max_num_batched_tokens=7),
    "speculative": dict(speculative_tokens=3),
}


@pytest.mark.parametrize("window", [8, 20])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_window_pool_keeps_the_no_pool_bits_and_the_contract(window, config):
    """Windows of 8 (inside a block) and 20 (across two): the outputs are the no-pool run's bit for bit and
    score's; blocks were freed early; at the default size the pool held fewer blocks than the full one."""
    model = windowed_model(window)
    ref = sample(Sampler(model, window_blocks=-1))
    sampler = Sampler(model, **CONFIGS[config])
    assert sampler.window_blocks > 0 and sampler.block_manager.window_pool.window == window
    pages = [k.shape[0] for k, _ in sampler.caches]
    assert pages == [sampler.window_blocks + 1, sampler.num_blocks + 1, sampler.window_blocks + 1]
    outs = sample(sampler)
    assert same_outputs(ref, outs), config
    assert_contract(model, outs)
    bm = sampler.block_manager
    assert bm.window_pool.released > 0, "no window block was freed early"
    if config == "preempt":
        assert sampler.num_preemptions > 0
    if config == "default":
        assert 0 < bm.window_pool.peak_held < bm.peak_held, (bm.window_pool.peak_held, bm.peak_held)


@pytest.mark.parametrize("frontier", ["window", "block"])
def test_control_a_block_freed_inside_the_window_changes_the_bits(monkeypatch, frontier):
    """Freed blocks first in line to be handed out again: freeing below the window (the pool's rule) keeps
    the no-pool run's bits; freeing every block below the one a query sits in (its window ignored) lets
    another sequence take and overwrite keys that window still reads, and the bits change."""
    model = windowed_model(20)
    ref = sample(Sampler(model, window_blocks=-1))
    release = WindowPool.release

    def release_first_in_line(self, s, first_query):
        before = set(self.free)
        release(self, s, first_query)
        for w in set(self.free) - before:
            self.free.move_to_end(w, last=False)
    monkeypatch.setattr(WindowPool, "release", release_first_in_line)
    if frontier == "block":
        monkeypatch.setattr(WindowPool, "first_block", lambda self, position: position // self.block_size)
    outs = sample(Sampler(model, window_blocks=12, max_batch_size=6))
    assert same_outputs(ref, outs) == (frontier == "window")


@pytest.mark.parametrize("config", ["default", "preempt", "chunk7"])
def test_window_pool_sessions_and_prefix_hits(config):
    """Episodes (observations prefilled over KV whose early window blocks are gone), twice on one
    sampler: the second request's prefix-cache hits bring their window blocks; both are the no-pool
    run's bits and score's."""
    model = windowed_model(20)
    kw = {"default": {}, "preempt": dict(num_blocks=11, max_batch_size=10),
          "chunk7": dict(max_num_batched_tokens=7)}[config]
    ref = episodes(Sampler(model, window_blocks=-1, **kw))
    sampler = Sampler(model, **kw)
    for run in ("cold", "warm"):
        outs = episodes(sampler)
        assert_same(ref, outs, f"{config} {run}")
        if run == "warm":
            assert sampler.num_cached_tokens > 0
    assert_episode_contract(model, outs)


@pytest.mark.parametrize("window", [8, 20])
def test_window_pool_groups_sharing_a_prefix_in_one_request(window):
    """Groups whose prompts open with the same two blocks, in one request: the first computes them and frees
    the window blocks its window left behind (still kept for the cache); the others take both blocks as hits
    with the window blocks their prefill reads. The no-pool, no-cache run's bits and score's."""
    model = windowed_model(window)
    prompts, kw = shared_prefix_prompts(), dict(max_new_tokens=24, n=2, seed=4, progress=False)
    ref = Sampler(model, window_blocks=-1, prefix_cache=False).generate(prompts, **kw)
    sampler = Sampler(model)
    outs = sampler.generate(prompts, **kw)
    assert same_outputs(ref, outs)
    assert_contract(model, outs)
    assert sampler.num_cached_tokens == 3 * 32 and sampler.block_manager.window_pool.released > 0


def test_block_manager_frees_window_blocks_below_the_window_and_forks_alike():
    bm = WindowBlockManager(8, 16, window=20, window_blocks=6)
    pool = bm.window_pool
    a = seq(0, 40)
    bm.allocate(a, 40)
    assert len(a.block_table) == len(a.window_table) == 3 and bm.num_free == 3       # min(5 full, 3 window)
    bm.release_window(a, 40)              # a query at 40 sees keys 21..40: blocks 1 and 2
    assert a.window_table[0] == -1 and a.window_table[1:] == [1, 2] and a.window_start == 1
    assert len(pool.free) == 4 and bm.num_free == 4
    b = seq(1, 40)
    bm.fork(a, b, 40)                     # the full blocks shared, a fresh partial one in both pools
    assert b.block_table[:2] == a.block_table[:2] and b.window_table[:2] == [-1, 1] and b.window_start == 1
    assert pool.refs[1] == 2 and b.window_table[2] not in a.window_table
    bm.release_window(a, 60)              # keys 41..60: block 2 and on; a's block 1 still held by b
    assert pool.refs[1] == 1 and 1 not in pool.free
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 6 and len(bm.free_block_ids) == 8 and all(r == 0 for r in pool.refs)
    assert b.window_table == [] and b.window_start == 0


def test_block_manager_prefix_hits_need_the_window_blocks_of_their_last_window():
    """A registered block keeps its window block until either is evicted; a hit of h blocks needs those
    of the blocks its window reaches from position h * 16, and is shortened where they are gone."""
    bm = WindowBlockManager(8, 16, True, window=20, window_blocks=4)
    pool = bm.window_pool
    a = Sequence(0, list(range(64)), max_len=1000, num_tokens=64)
    bm.allocate(a, 64)
    bm.register(a, 64)
    bm.release_window(a, 64)              # keys 45.. : blocks 2 and 3 stay; 0 and 1 freed, still registered
    window = list(pool.of.values())
    bm.free(a)
    b = Sequence(1, list(range(64)) + [5], max_len=1000, num_tokens=65)
    hits, _ = bm.match(b)
    assert len(hits) == 4
    bm.allocate(b, 65, cached=hits)       # the hit's window blocks from block 2 on, shared
    assert b.window_table[:4] == [-1, -1, window[2], window[3]] and b.window_start == 2
    bm.free(b)
    c = seq(2, 16)
    bm.allocate(c, 16)                    # takes the least recently freed window block: block 0's
    assert len(bm.match(b)[0]) == 4       # (not needed by a hit of 4 blocks)
    bm.allocate(c, 48)                    # and block 1's, then block 3's
    assert bm.match(b)[0] == []           # each shorter hit needs one of those
    assert not pool.of.keys() - set(hits)
    bm.set_version(1)                     # new weights: no block, and no window block, is kept
    assert not pool.of and all(o is None for o in pool.owner)


def test_a_sequence_the_window_pool_cannot_hold_is_one_line():
    """A prefill takes a window block for each of its positions (a preempted sequence: all of them), so
    one sequence must fit the window pool alone; else generate says so before it starts."""
    sampler = Sampler(windowed_model(8), window_blocks=2)
    with pytest.raises(ValueError, match=r"50 tokens = 4 blocks, but the window pool has 2; raise window_blocks"):
        sampler.generate([[1] * 20], max_new_tokens=30, progress=False)
