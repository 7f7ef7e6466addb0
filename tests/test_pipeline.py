"""asynchrony/pipeline.py: bounded staleness and in-flight updates. The schedule (which version generates which
batch), provenance per token under every --inflight_update mode, the contract across versions (the
trainer's forward at the version that drew a token recomputes its log-prob bitwise; keep_kv's tokens
are another function: the control; partial rollouts' carried tokens too), the routes that drew each
token kept through recompute_kv and through a preemption before an update, K = 0 as the synchronous
loop, and resume at the same K.

    python -m pytest -q tests/test_pipeline.py
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

import train
from asynchrony.pipeline import Colocated, Rollout, rollout_from_state, rollout_state
from config import ConfigError, ModelConfig, RolloutConfig, TrainConfig, apply_overrides, parse_args
from model import Transformer
from rollout import Sampler
from scheduler import Scheduler
from support import runlog


# ---- the schedule ---------------------------------------------------------------------------------
def _schedule(K, inflight, steps=5):
    """(batch, version it started with, whether an update landed inside it) as Colocated runs them."""
    made = []

    def generate(j, version, on_step=None, recompute_kv=False):
        inside = on_step is not None and any(on_step() is not None for _ in range(3))
        made.append((j, version, inside))
        return Rollout([], [], None, version, 0.0)
    rollouts = Colocated(generate, K, inflight, midpoint=2)
    for step in range(steps):
        ro = rollouts.take(step)
        assert ro.version == max(0, step - K)
        rollouts.update(step, lambda: None)
    return made


def test_batch_j_is_generated_by_version_j_minus_k():
    assert _schedule(0, "off") == [(j, j, False) for j in range(5)]                  # synchronous
    assert _schedule(1, "off") == [(0, 0, False)] + [(j, j - 1, False) for j in range(1, 6)]
    assert _schedule(2, "off")[:4] == [(0, 0, False), (1, 0, False), (2, 0, False), (3, 1, False)]
    keep = _schedule(1, "keep_kv")                                  # batch step + 1 starts by version step ...
    assert keep == [(0, 0, False)] + [(j, j - 1, True) for j in range(1, 6)]         # ... the update lands inside


def test_rollout_state_round_trips(tmp_path):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny"))
    outs = Sampler(model).generate([[11, 3, 10]], max_new_tokens=4, n=2, version=3)
    from support import tasks
    r = Rollout([tasks.Example([11, 3, 10], [3, 12])], outs, [[0.5], [0.25]], 3, 1.5)
    torch.save(rollout_state(r), tmp_path / "r.pt")
    back = rollout_from_state(torch.load(tmp_path / "r.pt", weights_only=True))
    assert back.examples == r.examples and back.turn_rewards == r.turn_rewards and back.version == 3
    for a, b in zip(back.outs, outs):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs and torch.equal(a.routes, b.routes)
        assert a.token_versions == b.token_versions == [3] * len(b.tokens)


# ---- provenance and the contract across versions --------------------------------------------------------
def _inflight(recompute_kv, switch_after=3):
    """Sample with version 5, then after `switch_after` engine steps the weights move in place to version 6.
    -> the outputs and the two versions' weights."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny"))
    v5 = copy.deepcopy(model.state_dict())
    g = torch.Generator().manual_seed(1)
    steps = [0]

    def on_step():
        steps[0] += 1
        if steps[0] != switch_after:
            return None
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
        return 6
    outs = Sampler(model, max_batch_size=8).generate([[11, 3, 1, 4, 10], [11, 2, 7, 10]], max_new_tokens=8, n=3,
                                                    seed=4, version=5, on_step=on_step, recompute_kv=recompute_kv)
    return outs, v5, copy.deepcopy(model.state_dict())


def _tainted_cache(register):
    """A 6-token prompt sampled 12 tokens with a keep_kv update after 3 engine steps (its first block then
    holds KV of both versions), then, at the new version, a request for its prompt + tokens. register:
    BlockManager.register as the sampler uses it. -> (the second request's output, its cached tokens,
    the new version's weights)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny"))
    sampler = Sampler(model, max_batch_size=8)
    steps, g = [0], torch.Generator().manual_seed(1)

    def on_step():
        steps[0] += 1
        if steps[0] != 3:
            return None
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
        return 6
    sampler.block_manager.register = register.__get__(sampler.block_manager)
    first = sampler.generate([[11, 3, 1, 4, 10, 2]], max_new_tokens=12, seed=4, version=5, on_step=on_step)[0]
    assert len(first.prompt + first.tokens) > 16 and min(first.kv_versions) == 5       # a full block of old KV
    again = sampler.generate([first.prompt + first.tokens], max_new_tokens=2, seed=4, version=6)[0]
    return again, sampler.num_cached_tokens, copy.deepcopy(model.state_dict())


def test_the_prefix_cache_never_serves_kv_an_older_version_wrote():
    """After a keep_kv update a running sequence's blocks hold the old weights' KV: at its end they stay
    out of the prefix cache (whose chain is the new version's), so a later request at that version
    recomputes them and its log-probs are that version's. Control: registering them serves the first
    block's old KV, and the log-probs are then not the new version's."""
    from scheduler import BlockManager

    def naive(bm, seq, num_computed):
        seq.stale_kv = False
        return BlockManager.register(bm, seq, num_computed)
    out, cached, v6 = _tainted_cache(BlockManager.register)
    assert cached == 0 and torch.equal(torch.tensor(out.logprobs), _score_at(v6, out)[-len(out.logprobs):])
    out, cached, v6 = _tainted_cache(naive)
    assert cached == 16 and not torch.equal(torch.tensor(out.logprobs), _score_at(v6, out)[-len(out.logprobs):])


def _score_at(state, o):
    model = Transformer(ModelConfig.preset("tiny"))
    model.load_state_dict(state)
    logp, _ = model.score(torch.tensor([o.prompt + o.tokens]))
    return logp[0, len(o.prompt) - 1:]


@pytest.mark.parametrize("mode", ["keep_kv", "recompute_kv"])
def test_each_token_records_the_version_that_drew_it_and_the_oldest_kv(mode):
    outs, v5, v6 = _inflight(recompute_kv=mode == "recompute_kv")
    for o in outs:
        n = len(o.tokens)
        assert o.token_versions == [5] * 3 + [6] * (n - 3)           # the prefill's and two decode steps' tokens, then 6
        assert o.kv_versions == ([5] * n if mode == "keep_kv" else [5] * 3 + [6] * (n - 3))
    for o in outs:                                                   # the contract across versions
        at5, at6 = _score_at(v5, o), _score_at(v6, o)
        lp = torch.tensor(o.logprobs)
        assert torch.equal(lp[:3], at5[:3])                          # version 5's tokens: version 5's bits
        if mode == "recompute_kv":
            assert torch.equal(lp[3:], at6[3:])                      # recomputed KV: version 6's bits
        else:                                                        # control: old KV makes another function
            assert not torch.equal(lp[3:], at6[3:]) and not torch.equal(lp[3:], at5[3:])
    off = Sampler(Transformer(ModelConfig.preset("tiny"))).generate([[11, 3, 10]], max_new_tokens=4, version=2)
    assert off[0].token_versions == off[0].kv_versions == [2] * len(off[0].tokens)   # off: one version


def _perturbed(model, seed):
    """Move the weights in place (an update): -> a copy of the new ones."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return copy.deepcopy(model.state_dict())


@pytest.mark.parametrize("mode", ["keep_kv", "recompute_kv"])
def test_carried_tokens_keep_the_bits_of_the_version_that_drew_them(mode):
    """Partial rollouts (asynchrony/partial_rollout.py): batch 0 by version 5, batch 1 by version 6, which an in-flight
    update moves to 7 after its first engine step. A token whose version and KV version agree (drawn in
    its batch, or after a carry's recompute under new weights) has the trainer's bits at its version:
    log-prob, and the route that drew it; the earlier tokens of a carried sequence keep theirs, and so
    do the positions that batch 1's first step fed under version 6 when recompute_kv prefills them again.
    The controls: a carried token is not its earlier version's function, and (keep_kv) a token drawn on KV
    an older version wrote is neither version's."""
    from asynchrony.partial_rollout import PartialRollouts
    from support.tasks import DigitTask
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny"))
    sampler = Sampler(model, max_batch_size=16)
    states, engine_steps = {5: copy.deepcopy(model.state_dict())}, [0]

    def sample(j, prompts, budgets, draw, version, on_step=None, recompute_kv=False):
        outs = sampler.generate(prompts, max_new_tokens=budgets, stop_token_ids=tuple(range(0, 32, 3)), seed=draw,
                                version=version, on_step=on_step, recompute_kv=recompute_kv)
        return outs, sampler.counters

    def on_step():
        engine_steps[0] += 1
        if engine_steps[0] == 1:
            states[7] = _perturbed(model, 2)
            return 7
        return None
    gen = PartialRollouts(DigitTask("copy", n_digits=2), sample, prompts_per_step=2, group_size=2, budget=2,
                          max_new_tokens=8, context=256)
    b0 = gen(0, version=5)
    states[6] = _perturbed(model, 1)
    b1 = gen(1, version=6, on_step=on_step, recompute_kv=mode == "recompute_kv")
    assert len(b0.outs) == len(b1.outs) == 4 and len(b1.examples) == 2              # the batch keeps its size
    assert b1.metrics["partial_carried_seqs"] > 0 and b1.metrics["partial_carried_tokens"] > 0
    seen = set()
    for o in b0.outs + b1.outs:
        P, lp = len(o.prompt), torch.tensor(o.logprobs)
        versions = set(o.token_versions) | set(o.kv_versions)
        scored = {v: model_at(states[v]).score(torch.tensor([o.prompt + o.tokens])) for v in versions}
        assert torch.equal(o.routes[:P - 1], scored[o.token_versions[0]][1][0, :P - 1])   # the prompt's, at its birth
        own = [t for t, (v, kv) in enumerate(zip(o.token_versions, o.kv_versions)) if v == kv]
        for t in own:                                                # the contract: the version that drew it
            logp, routes = scored[o.token_versions[t]]
            assert torch.equal(lp[t], logp[0, P - 1 + t]) and torch.equal(o.routes[P - 1 + t], routes[0, P - 1 + t])
        stale = [t for t in range(len(o.tokens)) if t not in own]
        for v in scored:
            mine = [t for t in own if o.token_versions[t] == v]
            earlier = [w for w in scored if w < v]
            if mine and earlier:                                     # control: a carried token at an earlier version
                seen.add("carried")
                assert not torch.equal(lp[mine], scored[min(earlier)][0][0, P - 1 + torch.tensor(mine)])
        if stale:                                                    # control: drawn on older KV, neither version's
            seen.add("old kv")
            at = P - 1 + torch.tensor(stale)
            for v in {o.token_versions[t] for t in stale} | {o.kv_versions[t] for t in stale}:
                assert not torch.equal(lp[stale], scored[v][0][0, at])
    assert seen == ({"carried", "old kv"} if mode == "keep_kv" else {"carried"})   # the controls ran


def model_at(state):
    model = Transformer(ModelConfig.preset("tiny"))
    model.load_state_dict(state)
    return model


def _updated_after(steps, recompute_kv=True, **engine):
    """_inflight's request, the weights moved in place to version 6, 7, ... after each engine step of `steps`.
    engine: Sampler settings. -> the outputs, each version's weights."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny"))
    states, done = {5: copy.deepcopy(model.state_dict())}, [0]

    def on_step():
        done[0] += 1
        if done[0] not in steps:
            return None
        version = max(states) + 1
        states[version] = _perturbed(model, version)
        return version
    outs = Sampler(model, max_batch_size=8, **engine).generate(
        [[11, 3, 1, 4, 10], [11, 2, 7, 10]], max_new_tokens=8, n=3, seed=4, version=5, on_step=on_step,
        recompute_kv=recompute_kv)
    return outs, states


def test_recompute_kv_records_the_routes_that_drew_each_token():
    """Two recompute_kv updates, after engine steps 3 and 6: each prefills every sequence again, writing its
    route pages again. A position still records the routes, weights and margins of the version whose
    forward drew its next token, beside that token's log-prob: positions [0, P + 2) version 5's (they drew
    tokens 0 to 2), [P + 2, P + 5) version 6's (tokens 3 to 5), then version 7's. Control: the last
    recompute's routes differ at the earlier positions."""
    outs, states = _updated_after({3, 6}, record_route_detail=True)
    differ = []
    for o in outs:
        P, ids, lp = len(o.prompt), torch.tensor([o.prompt + o.tokens]), torch.tensor(o.logprobs)
        assert o.token_versions == o.kv_versions == [5] * 3 + [6] * 3 + [7] * 2
        scored = {v: model_at(states[v]).score(ids, route_detail=True) for v in (5, 6, 7)}
        for v, (a, b) in zip((5, 6, 7), ((0, P + 2), (P + 2, P + 5), (P + 5, len(o.routes)))):
            logp, routes, detail = scored[v]
            drew = max(a, P - 1)                                      # the positions there that drew a token
            assert torch.equal(lp[drew - P + 1:b - P + 1], logp[0, drew:b])
            for got, want in zip((o.routes, o.route_weights, o.route_margins), (routes, detail.weights, detail.margin)):
                assert torch.equal(got[a:b], want[0, a:b])
        differ += [not torch.equal(o.routes[:P + 5], scored[7][1][0, :P + 5]),
                   not torch.equal(o.routes[P + 2:P + 5], scored[7][1][0, P + 2:P + 5])]
    assert all(differ[::2]) and any(differ[1::2])                 # control: version 7 routes otherwise there


def _small_pool(monkeypatch, recompute_kv=False, update=True, num_blocks=8, **engine):
    """Two groups of 3 grow past two block boundaries in a pool of 8 blocks, so the second boundary preempts
    the newest sequences; the weights move to version 6 right after the first preemption (update), while the
    preempted ones wait, holding no block. -> the outputs, each version's weights, the sequences preempted
    before the update."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny"))
    states, preempted = {5: copy.deepcopy(model.state_dict())}, []
    preempt = Scheduler._preempt

    def spy(sched, seq):
        if 6 not in states:
            preempted.append(seq.seq_id)
        preempt(sched, seq)
    monkeypatch.setattr(Scheduler, "_preempt", spy)

    def on_step():
        if update and preempted and 6 not in states:
            states[6] = _perturbed(model, 1)
            return 6
        return None
    prompts = [[11, 3, 1, 4, 10, 5, 9, 2, 6, 5, 3, 5, 8, 9], [11, 2, 7, 10, 4, 4, 1, 2, 3, 8, 1, 7, 2]]
    sampler = Sampler(model, max_batch_size=8, num_blocks=num_blocks, **engine)
    outs = sampler.generate(prompts, max_new_tokens=24, n=3, seed=4, version=5, on_step=on_step,
                            recompute_kv=recompute_kv)
    return outs, states, preempted


@pytest.mark.parametrize("mode", ["keep_kv", "recompute_kv"])
def test_a_sequence_preempted_before_an_update_keeps_the_routes_that_drew_its_tokens(monkeypatch, mode):
    """The sequences preempted before an update are prefilled again by version 6 (either mode): every
    position still records the routes of the forward that drew its next token, so the prompt's are those
    of its first version, and each token whose version and KV version agree has that version's log-prob
    and route bitwise. Control: at a preempted sequence's version-5 positions version 6 routes otherwise."""
    outs, states, preempted = _small_pool(monkeypatch, recompute_kv=mode == "recompute_kv")
    assert preempted
    for i, o in enumerate(outs):
        P, lp = len(o.prompt), torch.tensor(o.logprobs)
        scored = {v: model_at(states[v]).score(torch.tensor([o.prompt + o.tokens])) for v in (5, 6)}
        assert torch.equal(o.routes[:P - 1], scored[o.token_versions[0]][1][0, :P - 1])   # the prompt's, at its birth
        for t, (v, kv) in enumerate(zip(o.token_versions, o.kv_versions)):
            if v == kv:
                logp, routes = scored[v]
                assert torch.equal(lp[t], logp[0, P - 1 + t]) and torch.equal(o.routes[P - 1 + t], routes[0, P - 1 + t])
        if i in preempted:                                            # t tokens by version 5, the rest by 6 ...
            t = o.token_versions.index(6)
            assert 0 < t and o.kv_versions[t:] == [6] * (len(o.tokens) - t)      # ... on its re-prefill's KV
            fed = P - 1 + t                                           # the positions fed before its preemption
            assert not torch.equal(o.routes[:fed], scored[6][1][0, :fed])       # control


def test_plain_preemption_keeps_the_bits(monkeypatch):
    """Without an update the kept routes are bitwise what the recompute writes again (the contract): the
    small pool's outputs, route detail and versions included, are those of a pool that preempts nothing."""
    small, _, preempted = _small_pool(monkeypatch, update=False, record_route_detail=True)
    large, _, none = _small_pool(monkeypatch, update=False, record_route_detail=True, num_blocks=64)
    assert preempted and not none
    for a, b in zip(small, large):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs and a.token_versions == b.token_versions == [5] * 24
        assert torch.equal(a.routes, b.routes) and torch.equal(a.route_weights, b.route_weights)
        assert torch.equal(a.route_margins, b.route_margins)


# ---- in training ----------------------------------------------------------------------------------------
def _run(tmp, argv):
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    apply_overrides(parse_args(argv + [f"--out_dir={tmp}", "--progress=false"]), tcfg, rcfg)
    return train.train(tcfg, rcfg)


SMALL = ["--n_digits=2", "--prompts_per_step=8", "--group_size=4", "--minibatch_size=32", "--lr=1e-2",
         "--warmup_steps=1", "--recompute_old_logp=true", "--save_every=100"]
TIMING = set(runlog.TIMINGS)


def _same(a, b):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in a] == \
        [{k: v for k, v in r.items() if k not in TIMING} for r in b]


@pytest.mark.parametrize("extra", [["--max_staleness=2"], ["--max_staleness=1", "--inflight_update=keep_kv"],
                                   ["--max_staleness=1", "--inflight_update=recompute_kv", "--task=lookup"]])
def test_stale_runs_measure_staleness_alone(tmp_path, extra):
    hist = _run(tmp_path, SMALL + ["--steps=3"] + extra)
    K = int(extra[0].split("=")[1])
    assert hist[0]["staleness_max"] == 0 and hist[0]["train_rollout_kl"] == 0      # version 0 trains on version 0
    for h in hist[1:]:
        assert 1 <= h["staleness_max"] <= K and h["kv_staleness_max"] >= h["staleness_max"]
        assert sum(h["staleness_tokens"]) > 0 and h["kl_staleness"] is not None and h["kl_staleness"] != 0
        assert h["kl_numerics"] in (None, 0.0) and h["route_flip_frac_numerics"] in (None, 0.0)   # numerics: exactly 0
    if "recompute_kv" in extra:
        assert hist[1]["kl_numerics"] == 0.0                          # the halfway tokens are the trainer's own


def test_k0_is_the_synchronous_loop_and_resume_keeps_k(tmp_path):
    sync = _run(tmp_path / "a", SMALL + ["--steps=3"])
    assert all("staleness_max" not in h for h in sync)               # K = 0: the synchronous loop's row
    straight = _run(tmp_path / "b", SMALL + ["--steps=4", "--max_staleness=2"])
    _run(tmp_path / "c", SMALL + ["--steps=2", "--max_staleness=2", "--save_every=2", "--lr_decay_steps=4"])
    resumed = _run(tmp_path / "c", SMALL + ["--steps=4", "--max_staleness=2", "--resume=true"])
    rows = [json.loads(line) for line in open(tmp_path / "c" / "metrics.jsonl")]
    assert _same(rows, straight) and len(resumed) == 2               # the batches ahead came back with the run
    with pytest.raises(ConfigError, match="max_staleness=2 and its batches generated ahead"):
        _run(tmp_path / "c", SMALL + ["--steps=5", "--max_staleness=1", "--resume=true"])
    with pytest.raises(ConfigError, match="only with --max_staleness >= 1"):
        TrainConfig(inflight_update="keep_kv")


# ---- disaggregated: --rollout_ranks under torchrun (gloo) ---------------------------------------------
def _torchrun(tmp, nproc, *argv, check=True):
    import os
    import subprocess
    import sys
    from conftest import ROOT
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py",
           "--device=cpu", *SMALL, f"--out_dir={tmp}", "--progress=false", *argv]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                       timeout=300)
    assert not check or r.returncode == 0, r.stderr[-3000:]
    return r, [json.loads(line) for line in open(tmp / "metrics.jsonl")] if (tmp / "metrics.jsonl").exists() else []


WAITS = {"rollout_idle_s", "trainer_idle_s"}                          # the disaggregated run's own keys


def _same_but_waits(a, b):
    drop = TIMING | WAITS
    return [{k: v for k, v in r.items() if k not in drop} for r in a] == \
        [{k: v for k, v in r.items() if k not in drop} for r in b]


@pytest.mark.parametrize("trainers, rollout_ranks, extra", [
    (1, 1, ["--max_staleness=1", "--inflight_update=recompute_kv"]),
    (2, 1, ["--max_staleness=2", "--inflight_update=keep_kv", "--parallel=fsdp"]),
    (2, 2, ["--max_staleness=0"]),                                     # 4 processes, synchronous: KL 0
    # EP groups on both sides, shard to shard, under FSDP2 with the KV kept across an in-flight update
    (2, 2, ["--max_staleness=1", "--expert_parallel=2", "--parallel=fsdp", "--inflight_update=keep_kv"]),
])
def test_rollout_ranks_run_the_colocated_schedule_bit_for_bit(tmp_path, trainers, rollout_ranks, extra):
    """The last ranks generate, the others train: the run equals the colocated run of the same trainers
    at the same K, every metric (the waits aside), and each side logs how long it waited."""
    if trainers == 1:
        colocated = _run(tmp_path / "c", SMALL + ["--steps=3"] + extra)
    else:
        _, colocated = _torchrun(tmp_path / "c", trainers, "--steps=3", *extra)
    _, split = _torchrun(tmp_path / "s", trainers + rollout_ranks, "--steps=3", f"--rollout_ranks={rollout_ranks}", *extra)
    assert _same_but_waits(colocated, split) and len(split) == 3
    assert all(r["trainer_idle_s"] >= 0 and r["rollout_idle_s"] >= 0 for r in split)
    if extra == ["--max_staleness=0"]:
        assert all(r["train_rollout_kl"] == 0 and r["route_flip_frac"] == 0 for r in split)


def test_a_rollout_rank_that_dies_leaves_a_resumable_run(tmp_path):
    """An environment that raises on the rollout rank at the third batch: its one line, the trainer saves
    the last whole step and stops, and a resume (the environment mended) continues from it."""
    env = tmp_path / "env.py"
    env.write_text("import os\nMADE = [0]\n"
                   "def make_env(prompt, answer):\n    MADE[0] += 1\n    return Env(MADE[0] > 64 and not os.path.exists(%r))\n"
                   "class Env:\n    def __init__(self, broken):\n        self.broken = broken\n"
                   "    def step(self, response):\n        if self.broken:\n            raise RuntimeError('tool down')\n"
                   "        return None, float(len(response) > 0), True\n" % str(tmp_path / "mended"))
    pytest.importorskip("tokenizers")
    import subprocess
    import sys
    import os
    from conftest import ROOT
    subprocess.run([sys.executable, "examples/calculator/build_tokenizer.py"], cwd=ROOT, check=True, capture_output=True)
    tok = os.path.join(ROOT, "examples", "calculator", "tokenizer.json")
    jsonl = ["--task=jsonl", "--data=examples/arithmetic/train.jsonl", f"--tokenizer={tok}", f"--env={env}:make_env",
             "--stop_tokens=0,13", "--vocab_size=auto", "--max_new_tokens=4"]
    r, rows = _torchrun(tmp_path / "o", 2, "--steps=4", "--rollout_ranks=1", "--max_staleness=1", *jsonl, check=False)
    assert r.returncode != 0 and "error: rollout rank 0: step 3, episode" in r.stderr and "tool down" in r.stderr
    assert "error: step 3: the rollout ranks stopped" in r.stderr and "step 2 is saved" in r.stderr
    assert [row["step"] for row in rows] == [1, 2] and (tmp_path / "o" / "ckpt-000002").is_dir()
    (tmp_path / "mended").write_text("")
    r, rows = _torchrun(tmp_path / "o", 2, "--steps=4", "--rollout_ranks=1", "--max_staleness=1", "--resume=true", *jsonl)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
