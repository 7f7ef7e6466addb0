"""asynchrony/partial_rollout.py: partial rollouts. A sequence continued from its tokens so far (a per-prompt budget,
the same draws) is the uninterrupted sequence bitwise; off, and a budget past max_new_tokens, are the loop
without them; carried groups train whole, within the staleness bound, and a resume continues the run
exactly; the config's one-line errors; --rollout_ranks=1 is the colocated run. (The contract for carried
tokens across versions: tests/test_pipeline.py.)

    python -m pytest -q tests/test_partial.py
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from asynchrony.partial_rollout import extend
from config import ConfigError, ModelConfig, TrainConfig
from model import Transformer
from rollout import Sampler
from test_pipeline import SMALL, _run, _same, _same_but_waits, _torchrun


# ---- the sampler: a sequence continued is the uninterrupted sequence ------------------------------------
def test_a_continued_sequence_is_the_uninterrupted_one():
    """Stopped after a per-prompt budget and continued from prompt + tokens so far (same weights, seed and
    sequence index, so the same draws), then joined by extend: every recorded value of the one long run."""
    torch.manual_seed(0)
    sampler = Sampler(Transformer(ModelConfig.preset("tiny")), record_route_detail=True)
    prompts = [[11, 3, 10], [11, 3, 10], [11, 2, 7, 1, 10]]           # a group of two shares its prompt's blocks
    whole = sampler.generate(prompts, max_new_tokens=6, seed=5, version=2)
    first = sampler.generate(prompts, max_new_tokens=[2, 3, 1], seed=5, version=2)
    assert [len(o.tokens) for o in first] == [2, 3, 1] and all(o.finish_reason == "length" for o in first)
    rest = sampler.generate([p + o.tokens for p, o in zip(prompts, first)], max_new_tokens=[4, 3, 5], seed=5, version=2)
    for a, b, c in zip(whole, first, rest):
        joined = extend(b, c)
        assert joined.prompt == a.prompt and joined.tokens == a.tokens and joined.logprobs == a.logprobs
        for name in ("routes", "route_weights", "route_margins"):
            assert torch.equal(getattr(joined, name), getattr(a, name)), name
        assert (joined.policy_mask, joined.turns, joined.finish_reason) == (a.policy_mask, a.turns, a.finish_reason)
        assert joined.token_versions == a.token_versions and joined.kv_versions == a.kv_versions
    with pytest.raises(ValueError, match="2 budgets for 1 prompts"):
        sampler.generate([[11, 3]], max_new_tokens=[2, 3])
    with pytest.raises(ValueError, match=r"max_new_tokens\[1\]=0"):
        sampler.generate([[11, 3], [11, 4]], max_new_tokens=[2, 0])


# ---- in training ----------------------------------------------------------------------------------------
# extra stop ids make the lengths (and so the rounds a group needs) vary, so groups end at different rounds
CARRY = ["--n_digits=2", "--max_new_tokens=6", "--stop_tokens=12,0,1,2,3", "--partial_rollout=true",
         "--rollout_token_budget=1"]


def test_off_and_a_budget_past_max_new_tokens_are_the_loop_bit_for_bit(tmp_path):
    """Off (the default) logs no partial_* key; with a budget >= max_new_tokens every group ends in its
    first round, so the run is the loop without partial rollouts on every key (timings aside), plus its
    own keys: nothing carried, one round a batch."""
    off = _run(tmp_path / "a", SMALL + ["--steps=3"])
    assert not any(k.startswith(("partial_", "staleness_")) for h in off for k in h)
    big = _run(tmp_path / "b", SMALL + ["--steps=3", "--partial_rollout=true", "--rollout_token_budget=3"])  # N = 3
    assert _same(off, [{k: h[k] for k in off[0]} for h in big])
    assert all(h["partial_carried_seqs"] == 0 and h["partial_rounds"] == 1 and h["staleness_max"] == 0 for h in big)


def test_carried_groups_train_whole_and_a_resume_continues_them(tmp_path):
    """With a budget of one token a round: groups are carried across batches (and in the checkpoint at
    step 2), their tokens' staleness stays within K + ceil(N / T), the numerics' share of the gap is 0;
    a run resumed from step 2 is the straight run bit for bit; the schedule cannot change on resume."""
    K, N, T = 1, 6, 1
    argv = SMALL + CARRY + [f"--max_staleness={K}"]
    straight = _run(tmp_path / "a", argv + ["--steps=4"])
    assert any(h["partial_carried_seqs"] > 0 for h in straight) and straight[1]["partial_pending_seqs"] > 0
    assert all(h["staleness_max"] <= K + math.ceil(N / T) and h["kl_numerics"] in (None, 0.0) for h in straight)
    assert max(h["staleness_max"] for h in straight) > K                 # a carried token, older than K
    _run(tmp_path / "b", argv + ["--steps=2", "--save_every=2", "--lr_decay_steps=4"])
    _run(tmp_path / "b", argv + ["--steps=4", "--resume=true"])
    rows = [json.loads(line) for line in open(tmp_path / "b" / "metrics.jsonl")]
    assert _same(rows, straight)
    with pytest.raises(ConfigError, match="partial_rollout=False: the run was saved with partial_rollout=True"):
        _run(tmp_path / "b", SMALL + ["--steps=5", f"--max_staleness={K}", "--partial_rollout=false", "--resume=true"])


def test_partial_rollout_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="budget of a partial rollout: add --partial_rollout=true"):
        TrainConfig(rollout_token_budget=4)
    with pytest.raises(ConfigError, match="rollout_token_budget=-1: must be >= 0"):
        TrainConfig(partial_rollout=True, rollout_token_budget=-1)
    tcfg = TrainConfig(partial_rollout=True, prompts_per_step=8, minibatch_size=8)
    tcfg.check_ranks(1)
    tcfg.check_ranks(2, 1)                                            # one rollout rank generates: fine
    for n_train, n_rollout, what in ((2, 0, "2 training ranks"), (1, 2, "2 rollout ranks")):
        with pytest.raises(ConfigError, match=f"run one process, or --rollout_ranks=1 \\(this job: {what}\\)"):
            tcfg.check_ranks(n_train, n_rollout)
    with pytest.raises(ConfigError, match="episodes hold environments it cannot carry"):
        _run(tmp_path, ["--task=lookup", "--n_digits=3", "--steps=1", "--partial_rollout=true"])


def test_rollout_ranks_carry_partial_rollouts_as_the_colocated_run(tmp_path):
    """One trainer and one rollout rank (gloo), an in-flight update: the colocated run's metrics bit for
    bit, the waits aside, and so is a resume from its step-2 checkpoint: the groups in flight travel with
    each batch to the trainers' checkpoint, and the resumed rollout rank continues them."""
    extra = CARRY + ["--max_staleness=1", "--inflight_update=recompute_kv", "--steps=4"]
    colocated = _run(tmp_path / "c", SMALL + extra)
    _, split = _torchrun(tmp_path / "s", 2, "--rollout_ranks=1", *extra, "--save_every=2", "--keep_checkpoints=2")
    assert _same_but_waits(colocated, split) and any(h["partial_carried_seqs"] > 0 for h in split)
    state = torch.load(tmp_path / "s" / "ckpt-000002" / "trainer_state.pt", weights_only=True)
    carry = state["rollouts"]["partial"]                            # after batch 2, the one the trainers took ahead
    assert len(carry["slots"] + carry["ready"]) * 4 == colocated[2]["partial_pending_seqs"] > 0
    (tmp_path / "s" / "latest").write_text("ckpt-000002")           # back to step 2
    _, resumed = _torchrun(tmp_path / "s", 2, "--rollout_ranks=1", *extra, "--resume=true")
    assert _same_but_waits(colocated, resumed)
