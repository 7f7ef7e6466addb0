"""A calculator tool as a multi-turn environment for train.py --env (support/tasks.py, "Environments").

    python examples/calculator/build_tokenizer.py
    python train.py --task=jsonl --data=examples/arithmetic/train.jsonl --tokenizer=examples/calculator/tokenizer.json \
        --env=examples/calculator/calculator.py:make_env --stop_tokens=0,13 --vocab_size=auto --max_new_tokens=8 \
        --out_dir=out/calculator

An episode: the prompt is a sum ("14+19="); a turn that ends with "?" is a tool call ("14+19?"): the
calculator answers "=33;" and the policy writes again; any other turn is the answer ("33"), scored
digit by digit (the arithmetic example's reward) and the episode ends. At most MAX_TURNS turns.

train.py calls make_env(prompt, answer) once per episode (each response of a group gets its own) and
env.step(response) after each turn, with the turn's text as the tokenizer decodes it ("?" kept, the
special <|endoftext|> dropped); step returns (observation text or None, reward, done). The observation
is encoded once by the tokenizer and appended to the live sequence: nothing is decoded and re-encoded.
"""
from __future__ import annotations

import re

MAX_TURNS = 3


def make_env(prompt: str, answer) -> "Calculator":
    return Calculator(str(answer))


def evaluate(expression: str) -> str:
    """A sum of non-negative integers ("14+19" -> "33"), or "" for anything else: parsed, never eval()'d."""
    if not re.fullmatch(r"\d+(\+\d+)*", expression):
        return ""
    return str(sum(int(term) for term in expression.split("+")))


def score(response: str, answer: str) -> float:
    """The fraction of the answer's digits right at their place, plus one share for the right length."""
    right = sum(i < len(response) and response[i] == c for i, c in enumerate(answer))
    return (right + (len(response) == len(answer))) / (len(answer) + 1)


class Calculator:
    def __init__(self, answer: str):
        self.answer, self.turns = answer, 0

    def step(self, response: str):
        self.turns += 1
        if response.endswith("?") and self.turns < MAX_TURNS:         # a tool call: its result, then the next turn
            return f"={evaluate(response[:-1])};", 0.0, False
        return None, score(response, self.answer), True
