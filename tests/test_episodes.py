"""Multi-turn episodes in training (tasks.Episodes, the built-in lookup and fix tasks, --env): the
environments by hand, their bad answers as one line, the trainer's batch (observations in the forward,
out of the loss), and the contract on episodes in a run: KL 0 and no route flip, packed and padded,
under R3 and in bf16 over fp32 masters. The sampler's side (sessions, the prefix cache, chunked
prefill, bitwise against score) is tests/test_sessions.py.

    python -m pytest -q tests/test_episodes.py
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import train
from config import ConfigError, RolloutConfig, TrainConfig, apply_overrides, parse_args
from support import tasks
from conftest import ROOT
from rollout import Sampler
from support.packing import make_batch
from multi_turn.tasks import FixTask, LookupTask
from support.tasks import Episodes, TaskError, Turn

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# ---- the built-in environments, by hand -----------------------------------------------------------
def test_lookup_env_answers_the_call_and_scores_both_turns():
    task = LookupTask(n_digits=3, seed=0)
    (ex,) = task.sample(1)
    env = task.make_env(ex)
    keys, table = ex.answer["keys"], env.table
    assert ex.prompt == [*task.opening(), *keys, task.ASK] and sorted(table) == list(range(10))
    call = env.step([keys[0], keys[1], 7, task.EOS])                 # two keys right, one wrong
    assert call.observation == [task.EQ, table[keys[0]], table[keys[1]], table[7], task.ASK]
    assert not call.done and call.reward == pytest.approx(task.CALL_WEIGHT * 3 / 4)
    answer = env.step([table[k] for k in keys] + [task.EOS])
    assert answer.done and answer.observation is None and answer.reward == pytest.approx(1 - task.CALL_WEIGHT)
    other = task.make_env(task.sample(1)[0])                         # control: every episode draws its own table
    assert other.table != table


def test_fix_env_gives_feedback_and_counts_the_attempts_left():
    task = FixTask(n_digits=3, seed=0)
    ex = tasks.Example([*task.opening(), 3, 1, 4, task.EQ], [4, 1, 3, task.EOS])
    env = task.make_env(ex)
    first = env.step([4, 0, 3, task.EOS])                            # one digit wrong
    assert first.observation == [task.ASK, task.EQ, 1, task.EQ, task.EQ] and not first.done
    assert first.reward == pytest.approx(3 / 4 / 3)
    second = env.step([4, 1, 3, task.EOS])                           # fixed: this and the last attempt count
    assert second.done and second.reward == pytest.approx((1 + 1) / 3)
    assert first.reward + second.reward <= 1
    env = task.make_env(ex)                                          # solved at once: 1
    assert env.step([4, 1, 3, task.EOS]).reward == 1.0
    env = task.make_env(ex)                                          # never solved: three attempts, then done
    turns = [env.step([0, 0, 0, 0]) for _ in range(3)]             # no digit, no EOS right
    assert [t.done for t in turns] == [False, False, True] and sum(t.reward for t in turns) == 0


# ---- what an environment answers: checked at the edge, one line each --------------------------------
class _Env:
    def __init__(self, answer):
        self.answer = answer

    def step(self, turn):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class _Task(LookupTask):
    def __init__(self, answer):
        super().__init__(n_digits=2)
        self.answer = answer

    def make_env(self, ex):
        return _Env(self.answer)


@pytest.mark.parametrize("answer, needle", [
    ("text", "returned str"),                                        # not a Turn or a 3-tuple
    ((7, 0.0, False), "observation is int 7"),
    (([1, 2.5], 0.0, False), "observation is list"),
    (([1, 99], 0.0, False), "ids [99] outside the model's vocabulary [0, 32)"),
    (("more", 0.0, False), "returned text, but this task has no tokenizer"),
    (([], float("nan"), True), "reward returned nan"),
    (([], "1", True), "reward returned '1'"),
    (ZeroDivisionError("boom"), "step raised ZeroDivisionError (traceback above)"),
])
def test_a_bad_environment_answer_is_one_line_naming_the_episode(answer, needle, capsys):
    task = _Task(answer)
    episodes = Episodes(task, task.sample(2), 2, step=7, vocab_size=32, offset=4)
    with pytest.raises(TaskError) as e:
        episodes.on_turn_end(3, [1, 2, task.EOS])
    msg = str(e.value)
    assert needle in msg and msg.startswith("step 7, episode 7 (prompt ") and "\n" not in msg, msg
    if isinstance(answer, Exception):
        assert "ZeroDivisionError: boom" in capsys.readouterr().err  # the user's traceback, shown first
    good = Episodes(_Task(([1, 2], 0.5, False)), task.sample(1), 1, step=1, vocab_size=32)   # control
    assert good.on_turn_end(0, [1]) == [1, 2] and good.rewards == [[0.5]]


def test_episode_rewards_sum_the_turns():
    task = _Task(Turn([3], 0.25, False))
    episodes = Episodes(task, task.sample(1), 2, step=1, vocab_size=32)
    assert episodes.on_turn_end(0, [1]) == [3]
    episodes.envs[0].answer = Turn(None, 0.5, True)
    assert episodes.on_turn_end(0, [1]) is None
    assert episodes.episode_rewards() == [0.75, 0.0]                 # the second never ended a turn


# ---- the trainer's batch: observations in the forward, out of the loss --------------------------------
def test_make_batch_masks_the_environments_tokens():
    torch.manual_seed(0)
    from config import ModelConfig
    from model import Transformer
    model = Transformer(ModelConfig.preset("tiny"))
    task = LookupTask(n_digits=2, seed=1)
    examples = task.sample(3)
    episodes = Episodes(task, examples, 2, step=1, vocab_size=32)
    outs = Sampler(model).generate([ex.prompt for ex in examples], max_new_tokens=task.max_new_tokens, n=2,
                                   stop_token_ids=task.stop_token_ids, on_turn_end=episodes.on_turn_end,
                                   max_episode_tokens=task.max_episode_tokens)
    batch = make_batch(outs, torch.zeros(len(outs)))
    assert any(0 in o.policy_mask for o in outs)                     # some episode got an observation
    for i, o in enumerate(outs):
        P, N = len(o.prompt), len(o.tokens)
        assert batch.mask[i, P - 1:P - 1 + N].tolist() == [float(m) for m in o.policy_mask]
        assert batch.observed[i, P:P + N].tolist() == [m == 0 for m in o.policy_mask]
        assert batch.route_mask[i, :P + N - 1].all()                 # every fed position has its route
    logp, routes = model.score(batch.tokens)                         # the whole trajectory, one forward
    m = batch.mask.bool()
    assert torch.equal(logp[m], batch.rollout_logp[m])               # the contract at the policy's tokens
    assert torch.equal(routes[batch.route_mask], batch.routes[batch.route_mask])   # and every route
    assert not torch.equal(logp[batch.observed[:, 1:]], batch.rollout_logp[batch.observed[:, 1:]])   # fillers, masked


# ---- the contract in training -------------------------------------------------------------------------
def _run(tmp, argv):
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    apply_overrides(parse_args(argv + [f"--out_dir={tmp}", "--progress=false"]), tcfg, rcfg)
    return train.train(tcfg, rcfg)


SMALL = ["--n_digits=2", "--prompts_per_step=8", "--group_size=4", "--minibatch_size=32", "--lr=1e-2",
         "--warmup_steps=1", "--steps=2", "--recompute_old_logp=true", "--save_every=100"]


@pytest.mark.parametrize("task, extra", [
    ("lookup", []),
    ("fix", ["--micro_batch_tokens=0", "--micro_batch_size=8"]),      # padded micro-batches
    ("lookup", ["--replay=r3", "--route_filter=mask", "--correction=icepop"]),
    ("fix", ["--dtype=bfloat16", "--micro_batch_tokens=40", "--block_size=16", "--max_num_batched_tokens=5"]),
])
def test_episodes_train_with_the_contract(tmp_path, task, extra):
    """KL 0 and no route flip at every step; every prompt opens with the instruction block, which the first
    group of a step computes and the prefix cache serves to the others within the step."""
    hist = _run(tmp_path, SMALL + [f"--task={task}"] + extra)
    for h in hist:
        assert h["train_rollout_kl"] == 0 and h["logp_max_abs_diff"] == 0 and h["route_flip_frac"] == 0, h
        assert h["route_flip_frac_observation"] == 0 and h["observation_token_frac"] > 0
        assert h["episode_turns"] >= 1 and len(h["turn_reward"]) >= 2 and math.isfinite(h["final_turn_reward"])
        assert h["route_filtered_frac"] == 0 and h["prefilled_tokens"] > 0
        assert h["prefix_cached_tokens"] > 0 and h["prefix_hit_rate"] > 0, h
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]


def test_an_episode_past_the_context_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"step 1, episode 0: its prompt of 19 tokens and --max_episode_tokens=300 go "
                                          r"past the context of 256"):
        _run(tmp_path, SMALL + ["--task=lookup", "--max_episode_tokens=300"])


# ---- your own environment: --env, through a tokenizer ------------------------------------------------
CALC = ["--task=jsonl", "--data=examples/arithmetic/train.jsonl", "--tokenizer={tok}",
        "--env=examples/calculator/calculator.py:make_env", "--stop_tokens=0,13", "--vocab_size=auto",
        "--max_new_tokens=8", "--prompts_per_step=4", "--group_size=2", "--minibatch_size=8", "--steps=2"]


@pytest.fixture(scope="module")
def calculator_tokenizer(tmp_path_factory):
    pytest.importorskip("tokenizers")
    subprocess.run([sys.executable, "examples/calculator/build_tokenizer.py"], cwd=ROOT, env=ENV, check=True,
                   capture_output=True)
    return os.path.join(ROOT, "examples", "calculator", "tokenizer.json")


def test_the_calculator_example_runs_episodes_through_its_tokenizer(tmp_path, calculator_tokenizer):
    import importlib.util
    spec = importlib.util.spec_from_file_location("calculator", os.path.join(ROOT, "examples", "calculator", "calculator.py"))
    calculator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calculator)
    env = calculator.make_env("14+19=", "33")
    assert env.step("14+19?") == ("=33;", 0.0, False)                 # a call: the tool's answer, text
    assert env.step("33") == (None, 1.0, True)
    r = subprocess.run([sys.executable, "train.py", *[a.format(tok=calculator_tokenizer) for a in CALC],
                        f"--out_dir={tmp_path}", "--progress=false"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 2 and all(r["train_rollout_kl"] == 0 for r in rows)


@pytest.mark.parametrize("env, needle", [
    ("examples/calculator/calculator.py:evaluate", "its signature is evaluate(expression: 'str') -> 'str'; expected make_env(prompt, answer)"),
    ("examples/calculator/nothere.py:make_env", "--env='examples/calculator/nothere.py:make_env': no such file"),
])
def test_a_wrong_env_is_refused_at_start(tmp_path, calculator_tokenizer, env, needle):
    argv = [a.format(tok=calculator_tokenizer) for a in CALC if not a.startswith("--env")] + [f"--env={env}"]
    r = subprocess.run([sys.executable, "train.py", *argv, f"--out_dir={tmp_path}"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    with pytest.raises(ConfigError, match="needs --task=jsonl"):
        TrainConfig(env="x.py:make_env")


# ---- the lab's episode faults: each control breaks the contract the runs above keep --------------------
@pytest.mark.parametrize("fault, extra, broken", [
    ("dummy_last_route", [], "route_flip_frac"),                     # the trainer routes the turn's last token itself
    ("dummy_last_route", ["--replay=r3"], "logp_max_abs_diff"),      # replaying the dummy computes another token
    ("stale_prefix_kv", [], "logp_max_abs_diff"),                    # the instruction's KV from an older policy
    ("retokenize", [], "logp_max_abs_diff"),                         # merged ids the sampler never held
])
def test_each_episode_fault_breaks_the_contract(tmp_path, fault, extra, broken):
    hist = _run(tmp_path, SMALL + ["--task=lookup", "--steps=3", "--n_digits=3", f"--rollout_episode_fault={fault}"] + extra)
    assert max(h[broken] for h in hist) > 0, [h[broken] for h in hist]
    if fault == "stale_prefix_kv":                                   # the first step's cache was fresh
        assert hist[0]["logp_max_abs_diff"] == 0 and hist[-1]["prefix_cached_tokens"] > 0


def test_episode_faults_are_refused_where_they_mean_nothing(tmp_path):
    with pytest.raises(ConfigError, match="breaks multi-turn episodes: use a multi-turn task"):
        _run(tmp_path, SMALL + ["--task=copy", "--rollout_episode_fault=stale_prefix_kv"])
    with pytest.raises(ConfigError, match="rollout_episode_fault='flip'"):
        RolloutConfig(rollout_episode_fault="flip")


def test_retokenize_merges_repeated_digits_of_earlier_turns_only():
    from lab import faults as lab
    from rollout import SequenceOutput
    prompt = [11, 3, 3, 13]
    tokens = [5, 5, 7, 12, 10, 2, 2, 13, 4, 4, 12]               # turn [0, 4), observation [4, 8), turn [8, 11)
    o = SequenceOutput(prompt, list(tokens), [-1.0, -2.0, -3.0, -4.0, 0.0, 0.0, 0.0, 0.0, -5.0, -6.0, -7.0],
                       torch.arange(14)[:, None, None].expand(14, 1, 2).clone(), "stop",
                       policy_mask=[1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1], turns=[(0, 4), (8, 11)])
    lab.retokenize(o)
    assert o.tokens == [lab.MERGED + 5, 7, 12, 10, 2, 2, 13, 4, 4, 12]   # the first turn's "5 5" merged, nothing else
    assert o.logprobs[:3] == [-1.0, -3.0, -4.0] and o.policy_mask == [1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    assert o.turns == [(0, 3), (7, 10)] and o.routes.shape[0] == len(prompt) + len(o.tokens) - 1
    assert o.routes[len(prompt) + 1, 0, 0] == len(prompt) + 2     # the route of 7 is 7's


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_episodes_under_expert_parallelism_on_two_ranks(tmp_path):
    """Two gloo ranks, EP=2 and FSDP2: each rank plays its episodes (their environments' turns arrive at
    different steps of the EP group's lockstep), the trainer's forward over the whole trajectories keeps
    KL 0 and no route flip, observation tokens included."""
    from test_distributed import metrics, run
    out = str(tmp_path / "ep")
    run(out, 2, "--steps=2", "--task=lookup", "--expert_parallel=2", "--parallel=fsdp", "--recompute_old_logp=true",
        "--replay=r3", "--max_num_batched_tokens=24")
    for r in metrics(out):
        assert r["train_rollout_kl"] == 0 and r["logp_max_abs_diff"] == 0 and r["route_flip_frac"] == 0, r
        assert r["route_flip_frac_observation"] == 0 and r["observation_token_frac"] > 0
