"""The built-in multi-turn tasks (--task=lookup, --task=fix): digit tasks whose episodes take turns with an
environment (support/tasks.py's Episodes plays them, as it plays a JSONL task's --env). Importing this module
adds them to support/tasks.TASKS; config.py finds them by multi_turn/options.py's TASKS, so a default run
imports nothing of this folder.
"""
from __future__ import annotations

import random

from support.tasks import TASKS, DigitTask, Example, Turn, accuracy


class EpisodeTask(DigitTask):
    """What the built-in multi-turn tasks share: two more symbols, and every prompt opens with the same
    instruction, a block of INSTRUCTION_LEN ids (as an agent's system prompt does): the first group of a
    step computes it and the prefix cache serves it to the others (rollout.py, "The prefix cache")."""
    ASK, INSTRUCTION = 13, 14
    vocab_size = 15
    SYMBOLS = {**DigitTask.SYMBOLS, ASK: "?", INSTRUCTION: "#"}
    INSTRUCTION_LEN = 15                                               # with BOS, one block of 16
    episodic = True

    def opening(self) -> list[int]:
        return [self.BOS] + [self.INSTRUCTION] * self.INSTRUCTION_LEN


class LookupTask(EpisodeTask):
    """A tool call, then its use (--task=lookup): the episode's secret table maps each digit to another.

        BOS 3 1 4 ?  ->  3 1 4 EOS   the call: the prompt's keys
        env: = 7 0 9 ?                the tool's answer: the table at the keys the call asked for
             ->  7 0 9 EOS           the answer: the table at the prompt's keys; done
    The table is drawn afresh for every episode, so nothing but the tool's answer earns the answer's
    share of the reward; the call earns CALL_WEIGHT for asking the prompt's keys. (Every prompt opens
    with the instruction block, EpisodeTask.)"""
    TRANSFORMS = {"lookup": None}
    CALL_WEIGHT = 0.25

    def __init__(self, name: str = "lookup", n_digits: int = 3, seed: int = 0, stop_tokens=None):
        super().__init__(name, n_digits, seed, stop_tokens)
        self.reward_source = "the built-in 'lookup' environment"
        self.max_episode_tokens = 2 * (n_digits + 1) + n_digits + 2   # the call, the tool's answer, the answer

    def sample(self, n: int) -> list[Example]:
        out = []
        for _ in range(n):
            keys = [self.rng.randrange(10) for _ in range(self.n_digits)]
            out.append(Example([*self.opening(), *keys, self.ASK], {"keys": keys, "table_seed": self.rng.randrange(2 ** 31)}))
        return out

    reference = None        # the answer needs the episode's tool call first: no one-response reference (tooling/sft.py)

    def make_env(self, ex: Example) -> "LookupEnv":
        return LookupEnv(self, ex.answer["keys"], random.Random(ex.answer["table_seed"]).sample(range(10), 10))


class LookupEnv:
    def __init__(self, task: LookupTask, keys: list[int], table: list[int]):
        self.task, self.keys, self.table, self.called = task, keys, table, False

    def step(self, turn: list[int]) -> Turn:
        t, n = self.task, len(self.keys)
        if not self.called:                                           # the call: look up what the policy asked
            self.called = True
            asked = [self.table[i] if i < 10 else t.ASK for i in turn[:n]]
            return Turn([t.EQ, *asked, *[t.ASK] * (n - len(asked)), t.ASK], t.CALL_WEIGHT * accuracy(turn, self.keys + [t.EOS]))
        answer = [self.table[k] for k in self.keys] + [t.EOS]
        return Turn(None, (1 - t.CALL_WEIGHT) * accuracy(turn, answer), done=True)


class FixTask(EpisodeTask):
    """The reversed digits in up to MAX_TURNS attempts, each after the environment's feedback (--task=fix).

        BOS 3 1 4 =  ->  4 0 3 EOS   an attempt
        env: ? = 1 = =                feedback: '=' where right, the right digit where wrong
             ->  4 1 3 EOS           the next attempt
    Each attempt earns its accuracy / MAX_TURNS; the one that gets it right also earns the attempts
    left, so an episode's reward is 1 for a first-time solution and grows with what the feedback fixes.
    (Every prompt opens with the instruction block, EpisodeTask.)"""
    TRANSFORMS = {"fix": lambda digits: digits[::-1]}
    MAX_TURNS = 3

    def sample(self, n: int) -> list[Example]:
        return [Example(self.opening() + ex.prompt[1:], ex.answer) for ex in super().sample(n)]

    def __init__(self, name: str = "fix", n_digits: int = 3, seed: int = 0, stop_tokens=None):
        super().__init__(name, n_digits, seed, stop_tokens)
        self.reward_source = "the built-in 'fix' environment"
        m = self.MAX_TURNS
        self.max_episode_tokens = m * (n_digits + 1) + (m - 1) * (n_digits + 2)   # the attempts, the feedback

    def make_env(self, ex: Example) -> "FixEnv":
        return FixEnv(self, ex.answer)

    # reference (DigitTask's): the right attempt at the first turn, an episode the environment ends at once


class FixEnv:
    def __init__(self, task: FixTask, target: list[int]):
        self.task, self.target, self.attempt = task, target, 0

    def step(self, turn: list[int]) -> Turn:
        t, m = self.task, self.task.MAX_TURNS
        self.attempt += 1
        acc = accuracy(turn, self.target)
        if acc == 1 or self.attempt == m:                             # solved, or out of attempts
            return Turn(None, (acc + (m - self.attempt) * (acc == 1)) / m, done=True)
        marks = [t.EQ if i < len(turn) and turn[i] == d else d for i, d in enumerate(self.target[:-1])]
        return Turn([t.ASK, *marks, t.EQ], acc / m)


def _task(name: str, seed: int, n_digits: int, stop_tokens=None, **_):
    return {"lookup": LookupTask, "fix": FixTask}[name](name, n_digits, seed, stop_tokens)


TASKS.update(lookup=_task, fix=_task)
