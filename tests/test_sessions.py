"""Multi-turn sessions, the prefix cache and chunked prefill in the sampler (rollout.py), on the contract.

    python -m pytest -q tests/test_sessions.py

The property (DESIGN.md, "Episodes"): an episode is one growing token sequence; the environment's ids
are appended to the live sequence and prefilled into its KV. For every policy token the recorded
log-prob, and for every position the recorded route, is bitwise model.score's over the whole
trajectory, whatever the batch, the block size, the chunk budget, the state of the prefix cache or
preemption. Each bitwise test has a control that shows the naive way fails: re-encoding the decoded
history changes the ids, a dummy route for a turn's last token is not score's, a prefix cache kept
across a weight update serves stale log-probs, batch-variant kernels do not give chunks whole bits.
"""
from __future__ import annotations

import random

import pytest
import torch

from conftest import assert_contract
from test_rollout import cuda, cuda_model, fp32_model, make_model, make_prompts, seq
import rollout
from rollout import OBSERVATION_LOGPROB, Sampler
from scheduler import BlockManager, Scheduler, Sequence

VOCAB = 48                      # test_rollout's tiny model
MAX_NEW = 6                     # per turn
PROMPT_LENGTHS = [1, 15, 17, 33, 40]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ToyEnv:
    """A deterministic environment: after each of an episode's first `turns - 1` turns it answers with
    0..max_obs ids drawn from (seed, the sequence, the turn number, the policy's last id), so the
    answer depends on what the policy wrote; then it ends the episode (None)."""

    def __init__(self, turns: int = 3, max_obs: int = 20, seed: int = 0):
        self.turns, self.max_obs, self.seed, self.calls = turns, max_obs, seed, {}

    def __call__(self, index: int, turn: list[int]) -> list[int] | None:
        k = self.calls[index] = self.calls.get(index, 0) + 1
        if k >= self.turns:
            return None
        r = random.Random(f"{self.seed}-{index}-{k}-{turn[-1]}")
        return [r.randrange(VOCAB) for _ in range(r.randint(0, self.max_obs))]


def episodes(sampler: Sampler, prompts=None, env_seed: int = 0, **kw):
    prompts = prompts or make_prompts(PROMPT_LENGTHS, seed=11)
    kw = dict(dict(max_new_tokens=MAX_NEW, n=2, seed=5, stop_token_ids=(3,), max_episode_tokens=40), **kw)
    return sampler.generate(prompts, on_turn_end=ToyEnv(seed=env_seed), **kw)


def assert_episode_contract(model, outs, temperature: float = 1.0) -> None:
    """Every policy token's log-prob and every position's route are score's over prompt + tokens;
    observation ids carry the filler log-prob; the mask is the turns'."""
    score_t, dev = temperature or 1.0, next(model.parameters()).device
    for i, o in enumerate(outs):
        P, n = len(o.prompt), len(o.prompt) + len(o.tokens)
        mask = [0] * len(o.tokens)
        for a, b in o.turns:
            assert 0 <= a < b <= len(o.tokens), (i, o.turns)
            mask[a:b] = [1] * (b - a)
        assert o.policy_mask == mask and o.num_turns == len(o.turns) and o.turns[0][0] == 0, i
        assert len(o.logprobs) == len(o.tokens) and o.routes.shape[0] == n - 1, i
        logp, routes = model.score(torch.tensor([o.prompt + o.tokens], device=dev), temperature=score_t)
        lp, policy = torch.tensor(o.logprobs), torch.tensor(mask, dtype=torch.bool)
        assert torch.equal(lp[policy], logp[0, P - 1:].cpu()[policy]), f"output {i}: policy log-probs differ from score"
        assert (lp[~policy] == OBSERVATION_LOGPROB).all(), i
        assert torch.equal(o.routes, routes[0, :n - 1].cpu()), f"output {i}: routes differ from score"


def assert_same(ref, outs, what: str) -> None:
    assert len(ref) == len(outs), what
    for i, (a, b) in enumerate(zip(ref, outs)):
        assert a.tokens == b.tokens and a.policy_mask == b.policy_mask and a.turns == b.turns, (what, i)
        assert a.logprobs == b.logprobs and a.finish_reason == b.finish_reason, (what, i)
        assert torch.equal(a.routes, b.routes), (what, i)


# ---------------------------------------------------------------------------------------------------
# the contract on episodes
# ---------------------------------------------------------------------------------------------------
CONFIGS = {
    "batch1": dict(max_batch_size=1),
    "batch3": dict(max_batch_size=3),
    "block32": dict(block_size=32),
    "chunk7": dict(max_num_batched_tokens=7),
    "chunk20_block32": dict(max_num_batched_tokens=20, block_size=32),
    "no_cache": dict(prefix_cache=False),
    "preempt": dict(num_blocks=11, max_batch_size=10),
    "preempt_chunk5": dict(num_blocks=11, max_batch_size=10, max_num_batched_tokens=5),
}


@pytest.fixture(scope="module")
def reference():
    outs = episodes(Sampler(fp32_model()))
    assert_episode_contract(fp32_model(), outs)
    return outs


def test_episodes_have_turns_observations_and_both_endings(reference):
    assert all(o.num_turns >= 2 for o in reference), "the toy environment was meant to answer every episode"
    assert any(0 in o.policy_mask for o in reference), "no observation ids were appended"
    assert {o.finish_reason for o in reference} == {"stop", "length"}
    for o in reference:
        assert o.policy_mask[-1] == 1                      # an episode ends on a policy token
        assert len(o.tokens) <= 40 and o.weights_version == 0


@pytest.mark.parametrize("config", list(CONFIGS))
def test_episodes_are_bitwise_across_configs(reference, config):
    """Every configuration gives the reference's bits (hence score's); twice on one Sampler, the second
    run served by the prefix cache (warm) gives them too."""
    sampler = Sampler(fp32_model(), **CONFIGS[config])
    for run in ("cold", "warm"):
        assert_same(reference, episodes(sampler), f"{config}, {run}")
        if run == "warm" and sampler.config.prefix_cache:
            assert sampler.num_cached_tokens > 0 and 0 < sampler.prefix_hit_rate < 1
    if config.startswith("preempt"):
        assert sampler.num_preemptions > 0, "the small pool was meant to preempt sessions"


def test_greedy_and_top_p_episodes_match_score():
    for kw in (dict(temperature=0.0), dict(temperature=0.7, top_p=0.8, top_k=8)):
        outs = episodes(Sampler(fp32_model(), max_num_batched_tokens=9), **kw)
        assert_episode_contract(fp32_model(), outs, kw["temperature"])


def test_route_detail_of_episodes_matches_score():
    """Route weights and margins live per KV slot as the routes do: chunks, sessions and cache hits
    record score's bits."""
    model = fp32_model()
    sampler = Sampler(model, record_route_detail=True, max_num_batched_tokens=7)
    episodes(sampler)
    outs = episodes(sampler)                                   # warm
    assert sampler.num_cached_tokens > 0
    for o in outs:
        n = o.routes.shape[0]
        _, routes, detail = model.score(torch.tensor([o.prompt + o.tokens]), route_detail=True)
        assert torch.equal(routes[0, :n], o.routes)
        assert torch.equal(detail.weights[0, :n], o.route_weights)
        assert torch.equal(detail.margin[0, :n], o.route_margins)


def test_control_a_dummy_route_for_a_turns_last_token_is_not_scores(reference):
    """The last token of a turn gets its route from the forward that prefills the observation after it;
    an engine that never feeds it would have to make one up, and a made-up route is not score's."""
    model, differ, ends = fp32_model(), 0, 0
    for o in reference:
        P = len(o.prompt)
        _, routes = model.score(torch.tensor([o.prompt + o.tokens]))
        for _, end in o.turns[:-1]:                            # a turn followed by an observation
            pos = P + end - 1
            assert torch.equal(o.routes[pos], routes[0, pos])
            dummy = torch.arange(o.routes.shape[-1]).expand_as(o.routes[pos])   # experts 0..k-1 in every layer
            differ += not torch.equal(dummy, routes[0, pos])
            ends += 1
    assert ends > 5 and differ > ends // 2


TOY_CHARS = "abcdefghijklmnopqrstuvwx"


class ToyTokenizer:
    """Ids 0..23 are one character each, ids 24..47 the pieces of two neighbours ("ab", "bc", ...),
    encoded greedily, a piece first: decode then encode is not the identity on ids (two single ids that
    spell a piece merge into it; "a" + "bc" comes back as "ab" + "c")."""
    CHARS = TOY_CHARS
    PIECES = {24 + j: TOY_CHARS[j] + TOY_CHARS[(j + 1) % 24] for j in range(24)}

    def decode(self, ids: list[int]) -> str:
        return "".join(self.PIECES.get(t) or self.CHARS[t] for t in ids)

    def encode(self, text: str) -> list[int]:
        merged = {v: k for k, v in self.PIECES.items()}
        ids, i = [], 0
        while i < len(text):
            if text[i:i + 2] in merged:
                ids.append(merged[text[i:i + 2]])
                i += 2
            else:
                ids.append(self.CHARS.index(text[i]))
                i += 1
        return ids


def test_control_re_encoding_the_history_changes_the_ids(reference):
    """The sampler hands the trainer the ids it fed (score over them is the rollout's bits, above); a
    loop that decodes the history and encodes it again between turns would feed and train on others."""
    tok = ToyTokenizer()
    changed = [o for o in reference if tok.encode(tok.decode(o.prompt + o.tokens)) != o.prompt + o.tokens]
    assert changed, "no trajectory spelled a merge: the control shows nothing"


# ---------------------------------------------------------------------------------------------------
# chunked prefill
# ---------------------------------------------------------------------------------------------------
LONG = [100, 70, 9, 41, 64]                     # prompts longer than most budgets below


@pytest.mark.parametrize("block_size", [16, 32])
def test_chunked_prefill_is_a_whole_prefill(block_size):
    model = fp32_model()
    prompts = make_prompts(LONG, seed=4)
    kw = dict(max_new_tokens=8, n=2, seed=2)
    whole = Sampler(model, block_size=block_size).generate(prompts, **kw)
    assert_contract(model, whole, 1.0)
    for budget in (1, 5, 16, 33):
        sampler = Sampler(model, block_size=block_size, max_num_batched_tokens=budget, max_batch_size=3)
        outs = sampler.generate(prompts, **kw)
        assert_same(whole, outs, f"budget {budget}")


def test_control_batch_variant_chunks_are_not_whole():
    """The same comparison on the lab's batch-variant kernels (rollout_mode=fast) fails: chunking keeps
    a whole prefill's bits only because every op is row-invariant."""
    model = fp32_model()
    prompts = make_prompts(LONG, seed=4)
    whole = Sampler(model, rollout_mode="fast").generate(prompts, max_new_tokens=4, seed=2)
    chunked = Sampler(model, rollout_mode="fast", max_num_batched_tokens=5).generate(prompts, max_new_tokens=4, seed=2)
    assert any(a.logprobs != b.logprobs or not torch.equal(a.routes, b.routes) for a, b in zip(whole, chunked))


def test_chunks_alternate_with_decode_steps():
    """A long prompt is prefilled in chunks of the budget; the running sequences decode between two
    chunks; the group's members join the last chunk; only then does the group sample."""
    bm = BlockManager(32, 16)
    sched = Scheduler(bm, max_batch_size=4, max_num_batched_tokens=16)
    short = [seq(0, 5)]
    sched.add(short)
    sched.postprocess(sched.schedule(), [False])
    group = [seq(1, 40), seq(2, 40)]
    sched.add(group)
    steps = []
    for _ in range(6):
        step = sched.schedule()
        steps.append((step.is_prefill, [s.seq_id for s in step.batch], step.prefill_ends))
        sched.postprocess(step, [False] * len(step.batch))
    assert steps == [(True, [1], [16]), (False, [0], []), (True, [1], [32]), (False, [0], []),
                     (True, [1, 2], [40, 40]), (False, [0, 1, 2], [])]
    assert group[0].block_table[:2] == group[1].block_table[:2] and bm.num_free == 32 - 1 - 3 - 1


def test_a_session_goes_on_while_others_decode():
    """Scheduler-level: a turn's end queues the observation's prefill (with the turn's last token) over
    the sequence's own KV; the other sequences keep decoding; the blocks come back exactly once."""
    bm = BlockManager(16, 16)
    answers = {0: [[7, 8, 9], None], 1: [None]}
    ended = []

    def end_turn(s):
        ended.append((s.seq_id, s.turns[-1]))
        s.token_ids += [0] * (s.num_tokens - len(s.token_ids))     # (the Sampler reads the turn's ids here)
        return answers[s.seq_id].pop(0)
    sched = Scheduler(bm, max_batch_size=4, max_num_batched_tokens=64, end_turn=end_turn)
    a, b = seq(0, 10), seq(1, 12)
    a.max_new_tokens = b.max_new_tokens = 4
    sched.add([a])
    sched.add([b])
    sched.postprocess(sched.schedule(), [False, False])          # both sampled their first token
    sched.postprocess(sched.schedule(), [True, False])           # a's turn ends at 12 tokens
    assert ended == [(0, (10, 12))] and list(sched.prefilling) == [[a]] and a.num_computed == 11
    step = sched.schedule()
    assert step.is_prefill and step.batch == [a] and step.prefill_ends == [15]   # its last token + 3 ids
    assert a.max_len == 15 + 4 and a.turn_start == 15
    sched.postprocess(step, [False])
    step = sched.schedule()
    assert not step.is_prefill and step.batch == [b, a]          # b decoded on; a is back
    sched.postprocess(step, [True, True])
    assert a.turns == [(10, 12), (15, 17)] and sched.is_finished()
    assert bm.ref_counts == [0] * 16 and sorted(bm.free_block_ids) == list(range(16))


# ---------------------------------------------------------------------------------------------------
# the prefix cache
# ---------------------------------------------------------------------------------------------------
def test_block_manager_prefix_cache():
    """Full computed blocks are registered under their token prefix; freed, they stay matchable until
    allocation evicts them, least recently freed first; a new version forgets them."""
    bm = BlockManager(4, 16, prefix_cache=True)
    bm.set_version(0)
    a = seq(0, 40)
    bm.allocate(a, 40)
    bm.register(a, 40)                                          # 2 full blocks; the third is partial
    blocks = list(a.block_table)
    b = seq(1, 40)
    assert bm.match(b)[0] == blocks[:2]
    assert bm.match(seq(2, 33))[0] == blocks[:2] and bm.match(seq(3, 32))[0] == blocks[:1]   # never the last token
    other = seq(4, 40)
    other.token_ids = [1] + other.token_ids[1:]
    assert bm.match(other)[0] == []                             # a block is keyed by the whole prefix
    bm.free(a)
    assert bm.num_free == 4 and bm.match(b)[0] == blocks[:2]     # free, still cached
    bm.allocate(b, 40, cached=blocks[:2])
    assert b.block_table[:2] == blocks[:2] and bm.num_free == 1 and bm.ref_counts[blocks[0]] == 1
    bm.free(b)
    c = seq(5, 48)
    c.token_ids = [9] * 48
    bm.allocate(c, 48)                                          # 3 fresh blocks: evicts the least recently freed
    assert bm.match(seq(6, 40))[0] == blocks[:1]                # block 1, freed before block 0, was evicted
    assert bm.key_of[blocks[1]] is None and bm.key_of[blocks[0]] is not None
    bm.free(c)
    bm.set_version(1)
    assert bm.match(seq(7, 40))[0] == [] and not bm.cached


def test_only_groups_that_share_a_block_wait_for_its_prefill():
    """Groups queued together: B opens with A's two first blocks and waits one prefill for them, then
    takes both as hits; C shares nothing and D less than a block, so they go in A's prefill."""
    opening = list(range(100, 132))

    def group(i: int, prompt: list[int], n: int = 1) -> list[Sequence]:
        return [Sequence(10 * i + j, prompt, max_len=len(prompt) + 8, num_tokens=len(prompt)) for j in range(n)]
    a, b = group(0, opening + [1, 2, 3], n=2), group(1, opening + [4, 5], n=2)
    c, d = group(2, list(range(40))), group(3, opening[:10] + [7] * 20)
    sched = Scheduler(BlockManager(32, 16, prefix_cache=True), max_batch_size=8, max_num_batched_tokens=256)
    for g in (a, b, c, d):
        sched.add(g)
    step = sched.schedule()
    assert step.is_prefill and [s.seq_id for s in step.batch] == [0, 1, 20, 30] and sched.num_cached_tokens == 0
    sched.postprocess(step, [False] * len(step.batch))
    step = sched.schedule()
    assert step.is_prefill and [s.seq_id for s in step.batch] == [10, 11] and step.prefill_ends == [34, 34]
    assert b[0].num_computed == 32 and b[0].block_table[:2] == a[0].block_table[:2] and sched.num_cached_tokens == 32


@pytest.mark.parametrize("block_size", [16, 32])
def test_prefix_cache_hits_give_cold_bits(block_size, monkeypatch):
    """A second request whose prompts extend the first's outputs (their generated ids included),
    repeat its prompts, or are new: served from the cache on a small pool (preemption and eviction), it
    gives the bits of a cold Sampler without a cache, and score's."""
    model = fp32_model()
    first = make_prompts([20, 35, 50, 64, 9], seed=8)
    kw = dict(max_new_tokens=10, n=2, seed=3)
    evictions = []
    take = BlockManager._take_free

    def counted(bm):
        evictions.append(bm.key_of[next(iter(bm.free_block_ids))] is not None)
        return take(bm)
    monkeypatch.setattr(BlockManager, "_take_free", counted)
    warm = Sampler(model, block_size=block_size, num_blocks=7 if block_size == 16 else 4, max_batch_size=8)
    outs = warm.generate(first, **kw)
    second = ([o.prompt + o.tokens + [5, 6] for o in outs[::2]] + first[:2]
              + make_prompts([30], seed=9))
    got = warm.generate(second, **kw)
    cold = Sampler(model, block_size=block_size, prefix_cache=False).generate(second, **kw)
    assert_same(cold, got, "warm vs cold")
    assert_contract(model, got, 1.0)
    assert warm.num_cached_tokens > 0 and warm.num_preemptions > 0 and any(evictions)


def test_prefix_cache_never_survives_a_weight_update():
    """In-place updates (an optimizer step, copy_) bump the version by themselves, weights_updated() any
    other write: the next request misses and gives the cold bits. Control: a cache kept across the
    update (track_weights off, no bump: the stale_prefix_kv fault) serves stale KV and routes."""
    model = make_model(seed=7)
    prompts = make_prompts([40, 50, 33], seed=12)
    kw = dict(max_new_tokens=6, seed=1)
    auto, manual, stale = Sampler(model), Sampler(model), Sampler(model)
    stale.track_weights = False
    for s in (auto, manual, stale):
        s.generate(prompts, **kw)
        assert s.generate(prompts, **kw)[0].weights_version == 0 and s.num_cached_tokens > 0
    with torch.no_grad():
        for p in model.parameters():
            p.data.add_(torch.randn_like(p) * 0.02)             # through .data: no version counter moves
    manual.weights_updated()
    assert auto.generate(prompts, **kw) and auto.num_cached_tokens > 0, "a .data write is invisible to the counters"
    cold = Sampler(model, prefix_cache=False).generate(prompts, **kw)
    got = manual.generate(prompts, **kw)
    assert manual.num_cached_tokens == 0 and got[0].weights_version == 1
    assert_same(cold, got, "after weights_updated")
    with torch.no_grad():
        model.layers[0].self_attn.k_proj.weight.mul_(1.01)      # in place: seen
    cold = Sampler(model, prefix_cache=False).generate(prompts, **kw)
    got = auto.generate(prompts, **kw)
    assert auto.num_cached_tokens == 0 and auto.weights_version == 1
    assert_same(cold, got, "after an in-place update")
    bad = stale.generate(prompts, **kw)                          # control: the cache kept across both updates
    assert stale.num_cached_tokens > 0
    assert any(a.logprobs != b.logprobs for a, b in zip(cold, bad)), "stale KV went unnoticed"


def shared_prefix_prompts() -> list[list[int]]:
    """Four prompts that open with the same 40 ids (two full blocks of 16, as an agent's system prompt),
    each with its own tail, and one prompt that shares nothing."""
    opening = make_prompts([40], seed=21)[0]
    return [opening + tail for tail in make_prompts([3, 9, 20, 1], seed=22)] + make_prompts([30], seed=23)


SHARED_CONFIGS = {
    "default": {},
    "chunk7": dict(max_num_batched_tokens=7),
    "preempt": dict(num_blocks=10, max_batch_size=10),
    "speculative": dict(speculative_tokens=3),
}


@pytest.mark.parametrize("config", list(SHARED_CONFIGS))
def test_groups_sharing_a_prefix_hit_it_within_one_request(config):
    """One request, every group admitted at once: the first group whose prompt opens with the shared
    blocks computes them; the other three wait for them and take both as hits (32 tokens each); the
    outputs are the bits of the same request without a cache, and score's."""
    model, prompts = fp32_model(), shared_prefix_prompts()
    kw = dict(max_new_tokens=24, n=2, seed=4)
    cold = Sampler(model, prefix_cache=False, **SHARED_CONFIGS[config]).generate(prompts, **kw)
    sampler = Sampler(model, **SHARED_CONFIGS[config])
    outs = sampler.generate(prompts, **kw)
    assert_same(cold, outs, f"{config}: shared prefix vs no cache")
    assert_contract(model, outs, 1.0)
    if config == "preempt":                 # recomputed sequences hit their own blocks too
        assert sampler.num_preemptions > 0 and sampler.num_cached_tokens > 3 * 32
    else:
        assert sampler.num_cached_tokens == 3 * 32 and sampler.num_preemptions == 0


def test_control_a_shared_prefix_served_out_of_order_changes_the_bits(monkeypatch):
    """The hits above are read, not recomputed: the same request with each hit's two blocks handed out
    in the wrong order (each block computed right, at the other's positions) changes the bits of the
    groups that hit them."""
    model, prompts = fp32_model(), shared_prefix_prompts()
    kw = dict(max_new_tokens=24, n=2, seed=4)
    cold = Sampler(model, prefix_cache=False).generate(prompts, **kw)
    match = BlockManager.match

    def swapped(bm, seq):
        hits, node = match(bm, seq)
        return hits[1::-1] + hits[2:], node
    monkeypatch.setattr(BlockManager, "match", swapped)
    sampler = Sampler(model)
    outs = sampler.generate(prompts, **kw)
    assert sampler.num_cached_tokens == 3 * 32
    differ = [a.logprobs != b.logprobs or not torch.equal(a.routes, b.routes) for a, b in zip(cold, outs)]
    assert differ == [False, False] + [True] * 6 + [False, False], differ


# ---------------------------------------------------------------------------------------------------
# the edges: budgets and what the environment returns
# ---------------------------------------------------------------------------------------------------
def test_episode_budget_and_context_end_as_length():
    """max_episode_tokens counts the policy's and the environment's ids after the prompt; an observation
    after which not one policy token fits is dropped; the environment's None ends an episode as "stop"."""
    model = fp32_model()
    prompts = make_prompts([4, 110], seed=13)
    always = lambda i, turn: [1, 2, 3, 4, 5]                    # noqa: E731
    outs = Sampler(model).generate(prompts, max_new_tokens=4, on_turn_end=always, max_episode_tokens=20)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert len(outs[0].tokens) == 20 and outs[0].turns == [(0, 4), (9, 13), (18, 20)]   # the budget, mid-turn
    assert outs[1].turns == [(0, 4), (9, 13)] and len(outs[1].tokens) == 13   # 123 + 5 ids would fill the context
    assert_episode_contract(model, outs)
    ended = Sampler(model).generate(prompts, max_new_tokens=4, on_turn_end=lambda i, turn: None)
    assert [(o.finish_reason, o.num_turns, len(o.tokens)) for o in ended] == [("stop", 1, 4)] * 2


@pytest.mark.parametrize("answer, match", [
    ("12", "sequence 2 returned a str"), (torch.tensor([1]), "sequence 2 returned a Tensor"),
    ([1, 2.0], "sequence 2: item 1 of the observation is 2.0"),
    ([1, True], "sequence 2: item 1 of the observation is True"),
    ([0, VOCAB], "sequence 2: item 1 of the observation, id 48, is outside"),
    ([-1], "sequence 2: item 0 of the observation, id -1, is outside")])
def test_a_bad_observation_names_the_sequence(answer, match):
    """Checked where it enters; the failed request leaves the sampler usable (no block held)."""
    sampler = Sampler(fp32_model())
    prompts = make_prompts([3, 20, 5], seed=14)
    env = lambda i, turn: answer if i == 2 else [1, 2]            # noqa: E731
    with pytest.raises(ValueError, match=match):
        sampler.generate(prompts, max_new_tokens=3, on_turn_end=env, max_episode_tokens=30)
    bm = sampler.block_manager
    assert bm.ref_counts == [0] * len(bm.ref_counts) and bm.num_free == sampler.num_blocks
    outs = sampler.generate(prompts, max_new_tokens=3, on_turn_end=lambda i, turn: None)
    assert_episode_contract(fp32_model(), outs)


def test_bad_session_arguments_raise():
    sampler = Sampler(fp32_model())
    with pytest.raises(TypeError, match="on_turn_end"):
        sampler.generate([[1]], on_turn_end=[1, 2])
    with pytest.raises(ValueError, match="max_episode_tokens"):
        sampler.generate([[1]], on_turn_end=lambda i, t: None, max_episode_tokens=0)


def test_single_turn_outputs_have_one_turn_and_a_full_mask():
    outs = Sampler(fp32_model()).generate(make_prompts([5, 17], seed=15), max_new_tokens=7, n=2)
    for o in outs:
        assert o.turns == [(0, len(o.tokens))] and o.policy_mask == [1] * len(o.tokens) and o.num_turns == 1


def test_released_after_sessions(monkeypatch):
    """After a request of episodes on a small pool: nothing waits, prefills or runs; every block is free
    exactly once; every row is free."""
    scheds = []

    class Recorded(Scheduler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            scheds.append(self)
    monkeypatch.setattr(rollout, "Scheduler", Recorded)
    sampler = Sampler(fp32_model(), num_blocks=11, max_batch_size=10, max_num_batched_tokens=9)
    episodes(sampler)
    sched, bm = scheds[-1], sampler.block_manager
    assert sched.is_finished() and not sched.offset and not any(sched.by_phase)
    assert bm.ref_counts == [0] * len(bm.ref_counts) and sorted(bm.free_block_ids) == list(range(len(bm.ref_counts)))
    assert sorted(sched.free_rows) == list(range(sched.max_batch_size))


# ---------------------------------------------------------------------------------------------------
# CUDA: the same contract with the Triton kernels and CUDA graphs (skipped without a GPU)
# ---------------------------------------------------------------------------------------------------
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_episodes_chunks_and_cache_hits_match_score(dtype):
    """Episodes, chunks of a prefill at an offset (the attention kernel's queries start past 0) and
    prefix-cache hits, decode steps replayed as graphs: score's bits on the GPU too."""
    model = cuda_model(dtype)
    for config in ("chunk7", "preempt_chunk5", "block32"):
        sampler = Sampler(model, **CONFIGS[config])
        for _ in range(2):                                   # cold; warm: cache hits, the graphs captured
            assert_episode_contract(model, episodes(sampler))
        assert sampler.num_cached_tokens > 0
