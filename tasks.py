"""Prompts and rewards: the built-in verifiable tasks, and the hook for your own.

Built-in (no tokenizer needed; a token is a character):
    copy      BOS 3 1 4 1 =  ->  3 1 4 1 EOS     (the default task of `python train.py`)
    reverse   BOS 3 1 4 1 =  ->  1 4 1 3 EOS     (harder: the tiny preset plateaus near 0.25 in 200 steps)
Reward: the fraction of target tokens (the digits, then EOS) produced at their position, so a random
policy scores ~1/vocab and a perfect one 1.0: a dense, honest signal for RL from scratch.

Your own task: a JSONL file with one {"prompt": "...", "answer": ...} object per line, a tokenizer
(an HF tokenizer.json, read with the `tokenizers` package) and a reward function you write:

    python train.py --task=jsonl --data=my.jsonl --tokenizer=dir/tokenizer.json --reward_fn=my_mod:reward

where `def reward(prompt: str, response: str, answer) -> float` lives in my_mod.py. It must return a
finite number (int, float, bool, or a numpy scalar): anything else (a string, None, NaN) stops the run with
a message naming the function, the example and the value (see `check_reward`).

A new built-in task is one entry in TASKS (at the bottom): --task=NAME builds it, and config.py checks
--task against the same table. Mistakes in a task's files raise TaskError (one line `error: ...`).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import numbers
import os
import random
from dataclasses import dataclass
from typing import Any, Callable


class TaskError(ValueError):
    """A task name, data file, tokenizer or reward function that cannot be used; the message says what to change.

    Its own class (a sibling of config.ConfigError): config.py reads this module's TASKS table to check
    --task, so this module imports nothing of config.py (dependencies run one way)."""


@dataclass
class Example:
    prompt: list[int]     # token ids
    answer: Any           # what the reward function compares against


class DigitTask:
    """Digit-string transformations with a per-position reward; `name` picks one of TRANSFORMS."""

    DIGITS = "0123456789"
    EQ, BOS, EOS = 10, 11, 12
    vocab_size = 13          # ids used; the model may have more (they are never rewarded)
    TRANSFORMS: dict[str, Callable[[list[int]], list[int]]] = {
        "copy": lambda digits: digits,
        "reverse": lambda digits: digits[::-1],
    }

    def __init__(self, name: str = "copy", n_digits: int = 4, seed: int = 0):
        if name not in self.TRANSFORMS:
            raise ValueError(f"unknown digit task {name!r}; choose one of {', '.join(self.TRANSFORMS)}")
        self.name, self.n_digits = name, n_digits
        self.rng = random.Random(seed)
        self.stop_token_ids = (self.EOS,)
        self.max_new_tokens = n_digits + 1
        self.reward_source = f"the built-in {name!r} reward"

    def sample(self, n: int) -> list[Example]:
        out = []
        for _ in range(n):
            digits = [self.rng.randrange(10) for _ in range(self.n_digits)]
            target = self.TRANSFORMS[self.name](digits) + [self.EOS]
            out.append(Example([self.BOS, *digits, self.EQ], target))
        return out

    def reward(self, ex: Example, response: list[int]) -> float:
        target = ex.answer
        return sum(int(i < len(response) and response[i] == t) for i, t in enumerate(target)) / len(target)

    def decode(self, ids: list[int]) -> str:
        sym = {self.EQ: "=", self.BOS: "^", self.EOS: "$"}
        return "".join(self.DIGITS[i] if i < 10 else sym.get(i, f"<{i}>") for i in ids)

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(_as_tuple(state["rng"]))


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


class JsonlTask:
    """Prompts and answers from a JSONL file, a tokenizer, and a user reward function.

    Examples are drawn in a shuffled order, epoch after epoch; the position is saved in checkpoints.
    """

    def __init__(self, path: str, tokenizer_path: str, reward_fn: str, max_new_tokens: int = 256,
                 seed: int = 0):
        self.rows = read_jsonl(path)
        self.tok = load_tokenizer(tokenizer_path)
        self.reward_fn: Callable = load_function(reward_fn)
        self.reward_source = f"--reward_fn={reward_fn}"
        self.max_new_tokens = max_new_tokens
        ids = [self.tok.token_to_id(t) for t in ("<|im_end|>", "</s>", "<|endoftext|>")]
        self.stop_token_ids = tuple(i for i in ids if i is not None)[:1]     # id 0 is a valid stop token
        self.vocab_size = self.tok.get_vocab_size()
        self.seed, self.epoch, self.pos = seed, 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def sample(self, n: int) -> list[Example]:
        out = []
        for _ in range(n):
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._shuffle()
            row = self.rows[self._order[self.pos]]
            self.pos += 1
            out.append(Example(self.tok.encode(row["prompt"]).ids, row.get("answer")))
        return out

    def reward(self, ex: Example, response: list[int]):
        """The user function's value, unconverted: float("0.5") would hide a bug (see check_reward)."""
        ids = [t for t in response if t not in self.stop_token_ids]
        return self.reward_fn(self.tok.decode(ex.prompt), self.tok.decode(ids), ex.answer)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._shuffle()


class RewardError(ValueError):
    """A reward that is not a finite number; the message names the reward function, the example and the value."""


def check_reward(value) -> float:
    """value as a float if it is a finite real number (bool, int, float, numpy scalar), else RewardError.

    Strings are refused even when they parse ("0.5"): a reward function returning text is a bug. The
    message says what came back; the caller adds which function and which example.
    """
    if not isinstance(value, numbers.Real):
        raise RewardError(f"returned {value!r} ({type(value).__name__}); a reward must be a finite number")
    if not math.isfinite(value):
        raise RewardError(f"returned {value!r}; a reward must be a finite number")
    return float(value)


def read_jsonl(path: str) -> list[dict]:
    """The objects of a JSONL file, one a line (blank lines skipped); errors name the file and line."""
    if not os.path.isfile(path):
        raise TaskError(f"--data={path!r}: no such JSONL file")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as e:
        raise TaskError(f"--data={path!r}: not UTF-8 text (byte {e.start})") from None
    rows = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise TaskError(f"{path}:{lineno}: expected an object with a string 'prompt' field")
        rows.append(row)
    if not rows:
        raise TaskError(f"--data={path!r}: the file holds no examples")
    return rows


def load_tokenizer(path: str):
    # imported here: the built-in tasks need no tokenizer (requirements.txt installs it all the same)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TaskError("--tokenizer: reading a tokenizer.json needs the `tokenizers` package: "
                       "pip install tokenizers") from None
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise TaskError(f"--tokenizer={path!r}: no tokenizer.json there")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:                  # tokenizers raises a bare Exception for a malformed file
        raise TaskError(f"--tokenizer={path!r}: not a tokenizers tokenizer.json ({e})") from None


def load_function(spec: str) -> Callable:
    """'module:function' or 'path/to/file.py:function' -> the function."""
    mod_name, _, fn_name = spec.rpartition(":")
    if not mod_name or not fn_name:
        raise TaskError(f"--reward_fn={spec!r}: expected 'module:function' or 'file.py:function'")
    if mod_name.endswith(".py"):
        if not os.path.isfile(mod_name):
            raise TaskError(f"--reward_fn={spec!r}: no such file {mod_name!r}")
        spec_ = importlib.util.spec_from_file_location(os.path.basename(mod_name)[:-3], mod_name)
        module = importlib.util.module_from_spec(spec_)
        spec_.loader.exec_module(module)   # errors inside the user's module keep their traceback
    else:
        try:
            module = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if not (e.name == mod_name or mod_name.startswith(f"{e.name}.")):
                raise                      # the module exists but an import inside it failed: show where
            raise TaskError(f"--reward_fn={spec!r}: no module {mod_name!r} on the path "
                           "(run from its folder, or pass path/to/file.py:function)") from None
    if not callable(getattr(module, fn_name, None)):
        raise TaskError(f"--reward_fn={spec!r}: {mod_name} has no function {fn_name!r}")
    return getattr(module, fn_name)


# ---------------------------------------------------------------------------------------------------
# the task table: --task=NAME builds TASKS[NAME] (config.TrainConfig checks --task against it)
# ---------------------------------------------------------------------------------------------------
def _digit_task(name: str, seed: int, n_digits: int, **_):
    return DigitTask(name, n_digits, seed)


def _jsonl_task(name: str, seed: int, data: str, tokenizer: str, reward_fn: str, max_new_tokens: int, **_):
    if not (data and tokenizer and reward_fn):
        raise TaskError("--task=jsonl needs --data=file.jsonl, --tokenizer=tokenizer.json and --reward_fn=mod:fn")
    return JsonlTask(data, tokenizer, reward_fn, max_new_tokens or 256, seed)


TASKS: dict[str, Callable] = {**{name: _digit_task for name in DigitTask.TRANSFORMS}, "jsonl": _jsonl_task}


def make_task(name: str, seed: int = 0, n_digits: int = 4, data: str = "", tokenizer: str = "",
              reward_fn: str = "", max_new_tokens: int = 0):
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name](name=name, seed=seed, n_digits=n_digits, data=data, tokenizer=tokenizer,
                       reward_fn=reward_fn, max_new_tokens=max_new_tokens)
