"""Speculative decoding (sampling/speculative.py, rollout.ModelRunner._verify_step): nothing changes but speed.

    python -m pytest -q tests/test_speculative.py

The property: with speculative_tokens = k > 0 every output (tokens, log-probs, routes, finish reason,
turns) is bitwise plain decoding's, hence model.score's, whatever the batch, the page size, preemption,
chunked prefill, padded steps, the sampling settings, GRPO groups, the prefix cache, stop tokens inside
an accepted run, max_new_tokens reached mid-run, or multi-turn episodes; a 2-step train.py run logs the
same metrics. The test model's embeddings and LM head are scaled up so that its text repeats itself
(the drafts are often right, and often wrong), and half the prompts are periodic. Each bitwise test has
a control: accepting drafts unchecked, ignoring a stop token among the accepted, drafting past the
turn's end, or verifying on the batch-variant fast kernels gives other outputs.
"""
from __future__ import annotations

import functools
import json
import random

import pytest
import torch

import train
from config import ConfigError, ModelConfig, RolloutConfig, TrainConfig, apply_overrides
from sampling import speculative
from support import runlog
from conftest import assert_contract
from model import Transformer
from rollout import Sampler
from scheduler import BlockManager, Scheduler, Sequence
from support.distributed import sampler_rates
from test_rollout import cuda, make_model
from test_sessions import ToyEnv, assert_episode_contract

VOCAB = 48                      # test_rollout's tiny model
K = 4
MAX_NEW = 16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def repeater(device: str = "cpu") -> torch.nn.Module:
    """test_rollout's tiny MoE with its token embeddings x20 and LM head x3: the next token leans on
    the current one, so the text falls into loops that the drafts find (at T=1 as well)."""
    model = make_model(seed=0)
    with torch.no_grad():
        model.embed_tokens.weight.mul_(20)
        model.lm_head.weight.mul_(3)
    return model.to(device)


def prompts() -> list[list[int]]:
    """Lengths around the 16- and 32-position pages; periodic prompts (drafts from the prompt) and random ones."""
    r = random.Random(0)
    out = []
    for length, period in [(1, 1), (15, 3), (16, 0), (17, 4), (31, 5), (33, 0), (40, 2), (5, 0)]:
        base = [r.randrange(VOCAB) for _ in range(period or length)]
        out.append((base * length)[:length])
    return out


def generate(sampler: Sampler, setting=(1.0, 1.0, 0), **kw) -> list:
    temperature, top_p, top_k = setting
    kw = dict(dict(max_new_tokens=MAX_NEW, n=3, seed=7), **kw)
    return sampler.generate(prompts(), temperature=temperature, top_p=top_p, top_k=top_k, **kw)


def same(a, b) -> bool:
    return (a.tokens == b.tokens and a.logprobs == b.logprobs and torch.equal(a.routes, b.routes)
            and a.finish_reason == b.finish_reason and a.turns == b.turns and a.policy_mask == b.policy_mask)


def assert_same(ref, outs, what: str) -> None:
    assert len(ref) == len(outs), what
    for i, (a, b) in enumerate(zip(ref, outs)):
        assert same(a, b), f"{what}, output {i}: differs from plain decoding"


@functools.lru_cache(maxsize=None)
def plain(setting) -> list:
    outs = generate(Sampler(repeater()), setting)
    assert_contract(repeater(), outs, setting[0])
    return outs


# ---------------------------------------------------------------------------------------------------
# the pieces: drafts and their check
# ---------------------------------------------------------------------------------------------------
def test_propose_takes_the_longest_ngram_at_its_most_recent_full_place():
    def one(ids, room=8, k=4, ngram=3, width=12):
        row = torch.tensor(ids + [0] * (width - len(ids)))[None]
        drafts, n = speculative.propose(row, torch.tensor([len(ids)]), torch.tensor([room]), k, ngram)
        return drafts[0, :int(n)].tolist()
    assert one([1, 2, 3, 4, 2, 3]) == [4, 2, 3]                 # [4 2 3] is new, [2 3] follows 1; 3 ids follow it
    assert one([5, 1, 7, 5, 1, 8, 5, 1], k=2) == [8, 5]         # [5 1] twice: the most recent place ...
    assert one([5, 1, 7, 5, 1, 8, 5, 1], k=4) == [7, 5, 1, 8]   # ... that k ids follow
    assert one([7, 2, 9, 1, 3, 9, 7, 2, 9], k=2) == [1, 3]      # [7 2 9] beats [9]'s more recent place
    assert one([7, 2, 9, 1, 3, 9, 7, 2, 9], k=2, ngram=1) == [7, 2]
    assert one([1, 2, 3, 4]) == [] and one([6]) == []           # no earlier place
    assert one([3, 3]) == [3] and one([3, 3, 3, 3, 3]) == [3, 3]   # overlapping the suffix; the earliest place
    assert one([1, 2, 3, 4, 2, 3], room=1) == [4] and one([1, 2, 3, 4, 2, 3], room=0) == []
    # ids past a row's length are never read: a buffer that would match there changes nothing
    row = torch.tensor([[4, 5, 6, 9, 4, 5, 6, 1, 2]])
    drafts, n = speculative.propose(row, torch.tensor([5]), torch.tensor([8]), 4, 3)
    assert drafts[0, :int(n)].tolist() == [5, 6, 9, 4]
    # a batch of rows: each row's drafts are its own
    rows = torch.tensor([[1, 2, 3, 4, 2, 3, 0, 0], [5, 1, 7, 5, 1, 8, 5, 1], [1, 2, 3, 4, 0, 0, 0, 0]])
    drafts, n = speculative.propose(rows, torch.tensor([6, 8, 4]), torch.tensor([8, 2, 8]), 4, 3)
    assert n.tolist() == [3, 2, 0] and drafts[0, :3].tolist() == [4, 2, 3] and drafts[1, :2].tolist() == [7, 5]


def test_accept_keeps_drafts_to_the_first_mismatch_and_cuts_at_a_stop():
    stop = torch.tensor([9, -1])

    def kept(drafts, n_draft, sampled):
        k, s = speculative.accept(torch.tensor([drafts]), torch.tensor([n_draft]), torch.tensor([sampled]), stop)
        return int(k), bool(s)
    assert kept([1, 2, 3], 3, [1, 2, 5, 7]) == (3, False)      # two drafts hold, the bonus token 5
    assert kept([1, 2, 3], 3, [1, 2, 3, 7]) == (4, False)      # all hold, and the token after them
    assert kept([1, 2, 3], 3, [4, 2, 3, 7]) == (1, False)      # the first one fails: plain decoding's step
    assert kept([1, 2, 3], 1, [1, 2, 3, 7]) == (2, False)      # only n_draft of them count
    assert kept([1, 9, 3], 3, [1, 9, 3, 7]) == (2, True)       # a stop token among the accepted ends the turn
    assert kept([1, 2, 3], 3, [1, 2, 9, 7]) == (3, True)       # ... or as the bonus token
    assert kept([1, 2, 3], 3, [1, 2, 3, 9]) == (4, True)
    assert kept([1, 2, 3], 3, [1, 5, 3, 9]) == (2, False)      # a stop past the first mismatch is not kept


# ---------------------------------------------------------------------------------------------------
# the contract: plain decoding's bits
# ---------------------------------------------------------------------------------------------------
SETTINGS = [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 0.9, 5)]    # greedy, plain sampling, top-p and top-k
CONFIGS = {
    "default": dict(),
    "batch1": dict(max_batch_size=1),
    "batch2": dict(max_batch_size=2),
    "block32": dict(block_size=32),
    "preempt": dict(num_blocks=5, max_batch_size=16),          # 24 sequences of up to 4 pages
    "small_prefill": dict(max_num_batched_tokens=24),
    "k1_ngram1": dict(speculative_tokens=1, speculative_ngram=1),
    "k7_ngram5": dict(speculative_tokens=7, speculative_ngram=5),
}


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"T{s[0]}-p{s[1]}-k{s[2]}")
def test_speculative_outputs_are_plain_decodings_bits(setting):
    """Every config against plain decoding (whose outputs are score's, see plain()); the drafts were
    both accepted and rejected; preemption (recompute) happened where the pool is small; and a
    request padded to the decode buckets (the padding rows draft nothing) is the same too."""
    ref = plain(setting)
    for name, config in CONFIGS.items():
        sampler = Sampler(repeater(), **{"speculative_tokens": K, **config})
        outs = generate(sampler, setting)
        assert_same(ref, outs, name)
        assert 0 < sampler.num_accepted_tokens < sampler.num_drafted_tokens, (name, sampler.num_drafted_tokens)
        assert (sampler.num_preemptions > 0) == (name == "preempt"), name
    padded = Sampler(repeater(), speculative_tokens=K, max_batch_size=30)
    padded.runner.pad_to_buckets = True                       # 24 sequences run as 24 rows, then 16, 8, ...
    assert_same(ref, generate(padded, setting), "padded")
    assert_contract(repeater(), outs, setting[0])             # directly against score as well


def unchecked(drafts, n_draft, sampled, stop_ids):
    """speculative.accept as a check that always passes: every draft and the token after them."""
    return n_draft + 1, torch.zeros_like(n_draft, dtype=torch.bool)


def test_control_accepting_drafts_unchecked_changes_the_tokens(monkeypatch):
    """The check is what keeps plain decoding's tokens: keep every draft and the outputs differ."""
    ref = plain((1.0, 1.0, 0))
    monkeypatch.setattr(speculative, "accept", unchecked)
    outs = generate(Sampler(repeater(), speculative_tokens=K))
    assert not all(same(a, b) for a, b in zip(ref, outs))


def test_control_fast_kernels_give_a_verify_step_other_bits():
    """On the batch-variant fast path a row's bits depend on the rows beside it, so a verify step's
    k + 1 query rows change log-probs (the mismatch lab's fast+speculative row measures this)."""
    plain_fast = generate(Sampler(repeater(), rollout_mode="fast"))
    spec_fast = generate(Sampler(repeater(), rollout_mode="fast", speculative_tokens=K))
    assert not all(a.logprobs == b.logprobs for a, b in zip(plain_fast, spec_fast))


class Accepts:
    """speculative.accept, recording the steps whose stop token was an accepted draft with more after it."""

    def __init__(self):
        self.cut = 0

    def __call__(self, drafts, n_draft, sampled, stop_ids):
        k, stopped = ACCEPT(drafts, n_draft, sampled, stop_ids)
        t = torch.arange(drafts.shape[1])
        confirmed = ((sampled[:, :-1] == drafts) & (t < n_draft[:, None])).long().cumprod(1).sum(1)
        self.cut += int((stopped & (k - 1 < confirmed)).sum())
        return k, stopped


ACCEPT = speculative.accept


def own_loops() -> tuple[list[list[int]], tuple[int, ...]]:
    """Prompts that are the model's own greedy texts (it goes on with their loops: a copy task of its
    own), and two ids of those loops as stop tokens, so that the drafts carry stop tokens."""
    texts = [o.prompt + o.tokens for o in plain((0.0, 1.0, 0))[::3]]
    counts = torch.bincount(torch.tensor([t for x in texts for t in x[-6:]]), minlength=VOCAB)
    return texts, tuple(counts.argsort(descending=True)[:2].tolist())


@pytest.mark.parametrize("setting", [(0.0, 1.0, 0), (1.0, 1.0, 0)], ids=["greedy", "T1"])
def test_stop_tokens_inside_an_accepted_run(setting, monkeypatch):
    """A stop token among the accepted drafts ends the turn there (the accepted drafts after it are
    dropped), as plain decoding stops; control: keeping the run past the stop differs."""
    texts, stop = own_loops()
    kw = dict(max_new_tokens=MAX_NEW, temperature=setting[0], n=3, seed=7, stop_token_ids=stop)
    ref = Sampler(repeater()).generate(texts, **kw)
    assert_contract(repeater(), ref, setting[0])
    assert any(o.finish_reason == "stop" for o in ref)
    accepts = Accepts()
    monkeypatch.setattr(speculative, "accept", accepts)
    assert_same(ref, Sampler(repeater(), speculative_tokens=K).generate(texts, **kw), "stops")
    assert accepts.cut > 0, "no stop token fell inside an accepted run"
    monkeypatch.setattr(speculative, "accept", lambda d, n, s, ids: ACCEPT(d, n, s, ids[:0]))   # control
    outs = Sampler(repeater(), speculative_tokens=K).generate(texts, **kw)
    assert not all(same(a, b) for a, b in zip(ref, outs))


PROPOSE = speculative.propose


@pytest.mark.parametrize("max_new", [3, 5, 9])
def test_max_new_tokens_reached_mid_run(max_new, monkeypatch):
    """The drafts stop at the turn's end (a sequence never holds more than max_new_tokens), so a run
    the drafts would carry further ends as plain decoding's; control: drafting past it differs."""
    capped = []

    def recording(tokens, n_tok, room, k, ngram):
        out = PROPOSE(tokens, n_tok, room, k, ngram)
        capped.append(bool((PROPOSE(tokens, n_tok, torch.full_like(room, k), k, ngram)[1] > out[1]).any()))
        return out
    ref = generate(Sampler(repeater()), (0.0, 1.0, 0), max_new_tokens=max_new)
    monkeypatch.setattr(speculative, "propose", recording)
    assert_same(ref, generate(Sampler(repeater(), speculative_tokens=K), (0.0, 1.0, 0), max_new_tokens=max_new), "max_new")
    assert any(capped), "no verify step met the turn's end"

    def uncapped(tokens, n_tok, room, k, ngram):                 # the padding row (1 token) keeps its 0
        return PROPOSE(tokens, n_tok, torch.where(n_tok > 1, k, 0), k, ngram)
    monkeypatch.setattr(speculative, "propose", uncapped)
    outs = generate(Sampler(repeater(), speculative_tokens=K), (0.0, 1.0, 0), max_new_tokens=max_new)
    assert not all(same(a, b) for a, b in zip(ref, outs))


@pytest.mark.parametrize("config", ["default", "batch3", "chunk7", "preempt", "block32_no_cache"])
def test_episodes_are_plain_decodings_bits(config, monkeypatch):
    """Multi-turn episodes: a turn's end (a stop token or max_new_tokens), its observation prefilled into
    the live KV, the next turn's verify steps; every policy token and route is score's. Control (once):
    drafts accepted unchecked give other episodes."""
    configs = {"default": {}, "batch3": dict(max_batch_size=3), "chunk7": dict(max_num_batched_tokens=7),
               "preempt": dict(num_blocks=11, max_batch_size=10),
               "block32_no_cache": dict(block_size=32, prefix_cache=False)}
    kw = dict(max_new_tokens=6, n=2, seed=5, stop_token_ids=own_loops()[1][:1], max_episode_tokens=40)
    ref = Sampler(repeater()).generate(prompts(), on_turn_end=ToyEnv(max_obs=12), **kw)
    assert all(o.num_turns >= 2 for o in ref)
    sampler = Sampler(repeater(), speculative_tokens=K, **configs[config])
    outs = sampler.generate(prompts(), on_turn_end=ToyEnv(max_obs=12), **kw)
    assert_same(ref, outs, config)
    assert_episode_contract(repeater(), outs)
    assert sampler.num_accepted_tokens > 0 and (sampler.num_preemptions > 0) == (config == "preempt")
    if config == "default":
        monkeypatch.setattr(speculative, "accept", unchecked)
        outs = Sampler(repeater(), speculative_tokens=K).generate(prompts(), on_turn_end=ToyEnv(max_obs=12), **kw)
        assert not all(same(a, b) for a, b in zip(ref, outs))


def test_route_detail_and_a_reused_sampler():
    """Route weights and margins live beside the routes (also thrown away where rejected); a second
    request on the same sampler (its buffers hold the first one's ids past each row's end) is plain too."""
    ref = Sampler(repeater(), record_route_detail=True)
    sampler = Sampler(repeater(), record_route_detail=True, speculative_tokens=K)
    for seed in (7, 8):
        a, b = generate(ref, seed=seed), generate(sampler, seed=seed)
        assert_same(a, b, f"seed {seed}")
        assert all(torch.equal(x.route_weights, y.route_weights) and torch.equal(x.route_margins, y.route_margins)
                   for x, y in zip(a, b))


@pytest.mark.parametrize("preset", ["tiny-gpt-oss", "tiny-mla"])
def test_sinks_windows_and_mla(preset):
    """The 2026 families' attention: sinks and a sliding window of 8 (a verify step's queries start
    their walk at the lowest one's window), MLA's latent KV cache."""
    model = Transformer(ModelConfig.preset(preset))
    model.reset_parameters(seed=0)
    model.eval()
    texts = [(p * 9)[:n] for p, n in (([3, 1, 4], 20), ([5, 9], 7), ([2, 6, 5, 3], 30))]
    kw = dict(max_new_tokens=24, temperature=0.0, n=2, seed=3)
    ref = Sampler(model).generate(texts, **kw)
    assert_contract(model, ref, 0.0)
    sampler = Sampler(model, speculative_tokens=K)
    assert_same(ref, sampler.generate(texts, **kw), preset)
    assert sampler.num_accepted_tokens > 0


# ---------------------------------------------------------------------------------------------------
# the scheduler's side: blocks for a verify step, lengths that advance by what was kept
# ---------------------------------------------------------------------------------------------------
def test_scheduler_holds_blocks_for_the_drafts_and_advances_by_the_kept():
    bm = BlockManager(6, 16)
    sched = Scheduler(bm, max_batch_size=4, max_num_batched_tokens=64, speculative_tokens=K)
    a = Sequence(0, list(range(14)), max_len=40, num_tokens=14)
    b = Sequence(1, list(range(30)), max_len=33, num_tokens=30)
    sched.add([a])
    sched.add([b])
    step = sched.schedule()
    assert step.is_prefill
    sched.postprocess(step, [False, False])                     # 15 and 31 tokens, each sampled its next one
    step = sched.schedule()                                     # a: positions 14..18 -> 2 blocks; b: its turn
    assert not step.is_prefill and len(a.block_table) == 2     # ends at 33, so it feeds 30..31 at most
    assert len(b.block_table) == 2 and sorted(r for r, _, _ in step.new_blocks) == [a.row]
    step.kept, step.drafted = [4, 1], [4, 1]                    # a kept 3 drafts and a bonus; b only its token
    sched.postprocess(step, [False, False])
    assert (sched.length(a), sched.length(b)) == (19, 32)
    assert (sched.num_drafted_tokens, sched.num_accepted_tokens) == (5, 3)
    step = sched.schedule()                                     # a: positions 18..22, still 2 blocks
    assert step.new_blocks == [] and sched.num_preemptions == 0
    step.kept, step.drafted = [1, 1], [0, 0]
    assert sched.postprocess(step, [False, True]) == [b]        # b's turn ended at 33
    assert b.num_tokens == 33 and (sched.length(a), a in sched.running) == (20, True)
    # 20 drafts would take positions 15..35 (3 blocks each): the newest is preempted, not plain decoding's case
    tight = Scheduler(BlockManager(4, 16), max_batch_size=4, max_num_batched_tokens=64, speculative_tokens=20)
    c, d = Sequence(2, list(range(15)), max_len=60, num_tokens=15), Sequence(3, list(range(15)), max_len=60, num_tokens=15)
    tight.add([c])
    tight.add([d])
    tight.postprocess(tight.schedule(), [False, False])          # a block each, 16 tokens each, 2 blocks free
    step = tight.schedule()
    assert step.batch == [c] and len(c.block_table) == 3 and tight.num_preemptions == 1 and d.block_table == []


def test_sampler_rates_are_rates_of_the_summed_counts():
    row = {"prefix_cached_tokens": 30, "prefilled_tokens": 90, "spec_drafted_tokens": 40, "spec_accepted_tokens": 10}
    assert sampler_rates(row) == {"prefix_hit_rate": 0.25, "spec_accept_rate": 0.25}
    assert sampler_rates({"prefix_cached_tokens": 0, "prefilled_tokens": 0}) == {"prefix_hit_rate": 0.0}


# ---------------------------------------------------------------------------------------------------
# settings and refusals; train.py logs the same metrics
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, match", [("speculative_tokens", -1, "--speculative_tokens=-1: must be >= 0"),
                                                 ("speculative_ngram", 0, "--speculative_ngram=0: must be >= 1")])
def test_bad_settings_are_one_line(field, value, match):
    with pytest.raises(ConfigError, match=match) as e:
        RolloutConfig(**{field: value})
    assert "\n" not in str(e.value)


def test_in_flight_updates_are_refused():
    """An in-flight update lands after a number of engine steps, which verify steps change."""
    with pytest.raises(ValueError, match="on_step .* speculative_tokens=4"):
        Sampler(repeater(), speculative_tokens=4).generate([[1, 2]], on_step=lambda: None)
    with pytest.raises(ConfigError, match="--speculative_tokens=4 with --inflight_update=keep_kv"):
        RolloutConfig(speculative_tokens=4).check_training(TrainConfig(max_staleness=1, inflight_update="keep_kv"))
    RolloutConfig(speculative_tokens=4).check_training(TrainConfig(max_staleness=1))


def _metrics(tmp, argv) -> list[dict]:
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    apply_overrides(train.parse_args(argv + [f"--out_dir={tmp}", "--progress=false"]), tcfg, rcfg)
    train.train(tcfg, rcfg)
    return [json.loads(line) for line in open(tmp / "metrics.jsonl")]


def test_a_train_run_logs_the_same_metrics(tmp_path):
    """Two steps on the tiny preset with and without --speculative_tokens=4: every metric but the
    timings has the same value, and the speculative run adds its three counters. Control: on the
    fast rollout (batch-variant kernels) the verify steps change the train-rollout mismatch."""
    argv = ["--steps=2", "--task=copy", "--n_digits=8", "--prompts_per_step=8", "--group_size=4",
            "--minibatch_size=16", "--temperature=0.5"]
    spec = {"spec_drafted_tokens", "spec_accepted_tokens", "spec_accept_rate"}

    def kept(rows):
        return [{k: v for k, v in r.items() if k not in runlog.TIMINGS and k not in spec} for r in rows]
    a = _metrics(tmp_path / "plain", argv)
    b = _metrics(tmp_path / "spec", argv + ["--speculative_tokens=4"])
    assert all(set(y) - set(x) == spec and set(x) <= set(y) for x, y in zip(a, b))
    assert kept(a) == kept(b)
    assert sum(y["spec_accepted_tokens"] for y in b) > 0 and all(0 <= y["spec_accept_rate"] <= 1 for y in b)
    fast = _metrics(tmp_path / "fast", argv + ["--rollout_mode=fast"])
    fast_spec = _metrics(tmp_path / "fast_spec", argv + ["--rollout_mode=fast", "--speculative_tokens=4"])
    assert [r["train_rollout_kl"] for r in fast] != [r["train_rollout_kl"] for r in fast_spec]


def test_bench_section_runs_and_checks_the_outputs():
    import argparse
    from tooling import bench
    args = argparse.Namespace(preset="tiny", seed=0, spec_prompts=2, spec_digits=12, spec_tokens=K, temperature=0.0,
                              warmup=0, repeats=1)
    rows = bench.bench_speculative(args)
    assert [r[0] for r in rows] == ["speculative: plain", f"speculative: speculative k={K}", "speculative: drafts accepted",
                                    f"speculative k={K} / plain"]
    assert not any("DIFFER" in note for _, _, note in rows) and 0 < rows[2][1] <= 1


# ---------------------------------------------------------------------------------------------------
# CUDA: verify steps replayed as graphs (skipped without a GPU)
# ---------------------------------------------------------------------------------------------------
@cuda
def test_cuda_graph_verify_steps_equal_eager_and_score():
    model = repeater("cuda")
    eager = generate(Sampler(model, cuda_graphs=False))
    assert_contract(model, eager, 1.0)
    for config in ("default", "preempt", "batch2"):
        sampler = Sampler(model, cuda_graphs=True, speculative_tokens=K, **CONFIGS[config])
        for _ in range(2):                                        # the first use of a bucket runs eagerly
            outs = generate(sampler)
        assert sampler.runner.graphs, "no graph was captured"
        assert_same(eager, outs, config)
