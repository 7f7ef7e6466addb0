"""Prompts and rewards: the built-in verifiable tasks, and the hook for your own.

Built-in (no tokenizer needed; a token is a character):
    copy      BOS 3 1 4 1 =  ->  3 1 4 1 EOS     (the default task of `python train.py`)
    reverse   BOS 3 1 4 1 =  ->  1 4 1 3 EOS     (harder: the tiny preset plateaus near 0.25 in 200 steps)
Reward: the fraction of target tokens (the digits, then EOS) produced at their position, so a random
policy scores ~1/vocab and a perfect one 1.0: a dense, honest signal for RL from scratch.

Your own task: a JSONL file with one {"prompt": "...", "answer": ...} object per line, a tokenizer
(an HF tokenizer.json, read with the `tokenizers` package) and a reward function you write:

    python train.py --task=jsonl --data=my.jsonl --tokenizer=dir/tokenizer.json --reward_fn=my_mod:reward

where `def reward(prompt: str, response: str, answer) -> float` lives in my_mod.py. It gets the JSONL's
prompt text as written (not a re-decoding of its ids, nor the chat-templated text), the response decoded
without its stop token, and the row's "answer" as parsed (any JSON value; None if absent). It must return a
finite number (int, float, bool, or a numpy scalar): anything else (a string, None, NaN) stops the run with
a message naming the function, the example and the value (see `check_reward`). A prompt, or a string
answer, that holds text the tokenizer has no token for is refused at load, naming the row and the
characters (`check_known_text`). A worked example with its data, tokenizer and reward: examples/arithmetic/.

Stop tokens, in this order: --stop_tokens=ID,ID; the checkpoint's eos_token_id (hf.eos_token_ids:
generation_config.json, then config.json; one id or a list); the tokenizer's: tokenizer_config.json's
eos_token and every one of STOP_NAMES it holds. Responses end there or after --max_new_tokens (64 by
default for JSONL: JSONL_MAX_NEW_TOKENS). `generation_line` says which are in force.

--chat_template=true formats each prompt with the checkpoint's template (chat_template.jinja or
tokenizer_config.json's chat_template, next to the tokenizer or in --init_from), rendered with jinja2 as
one user message (after --system_prompt's system message) with the generation prompt.

A new built-in task is one entry in TASKS (at the bottom): --task=NAME builds it, and config.py checks
--task against the same table (and the plug-ins' TASKS: multi_turn/'s lookup and fix). A task's
`reference(example)` is the response that earns the full reward, stop token included: what --sft_steps trains
on (tooling/sft.py; SUPERVISED_TASKS names the core's tasks that have one, tooling.options.supervised_tasks
adds a plug-in's).
A task's `token_class(name)` gives the ids of a class of tokens (TOKEN_CLASSES: digits) that
--route_filter_tokens may name instead of ids. Mistakes in a task's files raise TaskError (one line `error: ...`).
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import random
import sys
import traceback
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
    text: str | None = None   # the prompt as the data wrote it (JSONL), before any chat template


class DigitTask:
    """Digit-string transformations with a per-position reward; `name` picks one of TRANSFORMS."""

    DIGITS = "0123456789"
    EQ, BOS, EOS = 10, 11, 12
    vocab_size = 13          # ids used; the model may have more (they are never rewarded)
    SYMBOLS = {EQ: "=", BOS: "^", EOS: "$"}
    episodic = False         # the multi-turn tasks below are: their examples make environments (make_env)
    TRANSFORMS: dict[str, Callable[[list[int]], list[int]]] = {
        "copy": lambda digits: digits,
        "reverse": lambda digits: digits[::-1],
    }

    def __init__(self, name: str = "copy", n_digits: int = 4, seed: int = 0, stop_tokens: tuple[int, ...] | None = None):
        if name not in self.TRANSFORMS:
            raise ValueError(f"unknown digit task {name!r}; choose one of {', '.join(self.TRANSFORMS)}")
        self.name, self.n_digits = name, n_digits
        self.rng = random.Random(seed)
        self.stop_token_ids = (self.EOS,) if stop_tokens is None else stop_tokens
        self.stop_source = "the task's EOS" if stop_tokens is None else "--stop_tokens"
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
        return accuracy(response, ex.answer)

    def reference(self, ex: Example) -> list[int]:
        """The response that earns the full reward, stop token included (--sft_steps' target, tooling/sft.py)."""
        return list(ex.answer)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.DIGITS[i] if i < 10 else self.SYMBOLS.get(i, f"<{i}>") for i in ids)

    def token_name(self, i: int) -> str:
        return self.decode([i])

    def token_class(self, name: str) -> list[int]:
        """The ids of a class of tokens the task defines (--route_filter_tokens=NAME): digits, the ids 0..9."""
        _known_class(name, self)
        return list(range(len(self.DIGITS)))

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(_as_tuple(state["rng"]))


TOKEN_CLASSES = ("digits",)      # what --route_filter_tokens may name besides ids (each task's token_class)


def _known_class(name: str, task) -> None:
    """A class in TOKEN_CLASSES, else TaskError (one line naming them)."""
    if name not in TOKEN_CLASSES:
        raise TaskError(f"--route_filter_tokens={name}: not a token id nor a token class of task "
                        f"{getattr(task, 'name', 'jsonl')!r} (its classes: {', '.join(TOKEN_CLASSES)})")


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def accuracy(response: list[int], target: list[int]) -> float:
    """The share of target ids the response holds at their position: the digit tasks' reward."""
    return sum(int(i < len(response) and response[i] == t) for i, t in enumerate(target)) / len(target)


# ---------------------------------------------------------------------------------------------------
# multi-turn episodes: a prompt, then turns of (the policy's response, the environment's answer)
# ---------------------------------------------------------------------------------------------------
@dataclass
class Turn:
    """What an environment answers a policy turn with (env.step(turn) -> Turn, or the tuple of its fields)."""
    observation: list[int] | str | None = None   # ids (or text a tokenizer task encodes once) to append; None: none
    reward: float = 0.0                          # this turn's reward; an episode's reward is the sum of its turns'
    done: bool = False                           # the episode ends after this turn


class Episodes:
    """The environments of one rollout: one per sequence (output i plays example i // G), their turns'
    rewards, and the sampler's on_turn_end (rollout.Sampler.generate). What an environment answers is
    checked here, the edge where it enters: a step that raises keeps its traceback and adds one line
    naming the step and the episode; an answer that is not a Turn or (observation, reward, done), a
    non-finite reward, or ids that are not ints in [0, vocab_size) is one line `error: ...` too."""

    def __init__(self, task, examples: list[Example], G: int, step: int, vocab_size: int, offset: int = 0):
        self.task, self.examples, self.G, self.step, self.vocab, self.offset = task, examples, G, step, vocab_size, offset
        self.envs = [self._call(i, lambda ex=ex: task.make_env(ex), "make_env")
                     for i, ex in enumerate(e for e in examples for _ in range(G))]
        self.rewards: list[list[float]] = [[] for _ in self.envs]     # per episode, each turn's reward

    def on_turn_end(self, i: int, turn_ids: list[int]) -> list[int] | None:
        """The environment's answer to episode i's turn: the ids to append, or None when it is done."""
        # a text task's environment reads the turn as its tokenizer decodes it (a plain-text stop such as "?"
        # kept, special tokens dropped); the built-in environments read ids
        shown = self.task.decode(turn_ids) if hasattr(self.task, "encode_observation") else turn_ids
        got = self._call(i, lambda: self.envs[i].step(shown), "step")
        turn = self._as_turn(i, got)
        self.rewards[i].append(turn.reward)
        if turn.done:
            return None
        return self._observation_ids(i, turn.observation)

    def episode_rewards(self) -> list[float]:
        """Each episode's reward: the sum of its turns' (0.0 for an episode the token budget ended before a turn)."""
        return [sum(r) for r in self.rewards]

    def _name(self, i: int) -> str:
        ex = self.examples[i // self.G]
        prompt = ex.text if ex.text is not None else self.task.decode(ex.prompt)
        return f"step {self.step}, episode {self.offset + i} (prompt {prompt[:80]!r})"

    def _call(self, i: int, fn, what: str):
        try:
            return fn()
        except TaskError:
            raise
        except Exception as e:                                        # the user's environment raised: its traceback
            print_user_traceback(e)
            raise TaskError(f"{self._name(i)}: the environment's {what} raised {type(e).__name__} (traceback above)") from None

    def _as_turn(self, i: int, got) -> Turn:
        if isinstance(got, tuple) and len(got) == 3:
            got = Turn(*got)
        if not isinstance(got, Turn):
            raise TaskError(f"{self._name(i)}: the environment's step returned {type(got).__name__}; return "
                            "tasks.Turn(observation, reward, done) or the tuple (observation, reward, done)")
        try:
            return Turn(got.observation, check_reward(got.reward), bool(got.done))
        except RewardError as e:
            raise TaskError(f"{self._name(i)}: the environment's reward {e}") from None

    def _observation_ids(self, i: int, obs) -> list[int]:
        if obs is None:
            return []
        if isinstance(obs, str):
            if not hasattr(self.task, "encode_observation"):
                raise TaskError(f"{self._name(i)}: the environment returned text, but this task has no tokenizer: "
                                "return token ids")
            return self.task.encode_observation(obs)
        if not isinstance(obs, (list, tuple)) or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                         for t in obs):
            raise TaskError(f"{self._name(i)}: the environment's observation is {type(obs).__name__} "
                            f"{str(obs)[:60]}; return a list of token ids, text, or None")
        bad = [int(t) for t in obs if not 0 <= t < self.vocab]
        if bad:
            raise TaskError(f"{self._name(i)}: the environment's observation holds ids {bad[:5]} outside the "
                            f"model's vocabulary [0, {self.vocab})")
        return [int(t) for t in obs]


JSONL_MAX_NEW_TOKENS = 64        # --max_new_tokens=0 on --task=jsonl (config.py's --help says so)
STOP_NAMES = ("<|im_end|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "<|end_of_text|>", "<|end|>")


class JsonlTask:
    """Prompts and answers from a JSONL file, a tokenizer, and a user reward function, or a user
    environment (--env: each example an episode; "Environments" below).

    Examples are drawn in a shuffled order, epoch after epoch; the position is saved in checkpoints.
    stop_tokens: --stop_tokens (None: not given); model_eos: the checkpoint's (ids, file) (hf.eos_token_ids);
    checkpoint: the --init_from folder, where a chat template may live.
    """

    def __init__(self, path: str, tokenizer_path: str, reward_fn: str, max_new_tokens: int = 0, seed: int = 0,
                 stop_tokens: tuple[int, ...] | None = None, model_eos: tuple[tuple[int, ...], str] = ((), ""),
                 chat_template: bool = False, system_prompt: str = "", checkpoint: str = "", env: str = ""):
        rows = numbered_rows(path)
        self.rows = [row for _, row in rows]
        self.tok = load_tokenizer(tokenizer_path)
        check_known_text(self.tok, path, rows)
        self.reward_fn: Callable | None = load_function(reward_fn) if reward_fn else None
        if self.reward_fn is not None:
            check_signature(self.reward_fn, reward_fn)
        self.env_fn: Callable | None = load_function(env, "--env") if env else None
        if self.env_fn is not None:
            check_env_signature(self.env_fn, env)
        self.env_spec = env
        self.reward_source = f"--env={env}" if env else f"--reward_fn={reward_fn}"
        self.max_new_tokens = max_new_tokens or JSONL_MAX_NEW_TOKENS
        self.max_episode_tokens = 4 * self.max_new_tokens              # --env: an episode's budget (--max_episode_tokens)
        self.max_new_tokens_given = max_new_tokens > 0                  # --max_new_tokens on the command line
        self.vocab_size = self.tok.get_vocab_size()
        dirs = [os.path.dirname(os.path.abspath(tokenizer_path)) if not os.path.isdir(tokenizer_path)
                else tokenizer_path] + ([checkpoint] if checkpoint and os.path.isdir(checkpoint) else [])
        self.tok_config = read_tokenizer_config(dirs)
        self.stop_token_ids, self.stop_source = self._stop_tokens(stop_tokens, model_eos)
        self.template = load_chat_template(dirs, system_prompt) if chat_template else None
        if self.template is not None:
            self._check_template()
        self.seed, self.epoch, self.pos = seed, 0, 0
        self._order = self._shuffle()

    def _stop_tokens(self, given, model_eos) -> tuple[tuple[int, ...], str]:
        """(ids, where they came from): --stop_tokens, else the checkpoint's eos, else the tokenizer's."""
        if given is not None:
            bad = [i for i in given if not 0 <= i < self.vocab_size]
            if bad:
                raise TaskError(f"--stop_tokens: {bad} not in the tokenizer's {self.vocab_size} ids")
            return given, "--stop_tokens"
        if model_eos[0]:
            return model_eos[0], model_eos[1]
        eos = self.tok_config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        names = ([eos] if isinstance(eos, str) else []) + [n for n in STOP_NAMES if n != eos]
        ids = [self.tok.token_to_id(n) for n in names]
        ids = tuple(dict.fromkeys(i for i in ids if i is not None))    # id 0 is a valid stop token
        if not ids and not self.max_new_tokens_given:                   # every response would run to the limit
            raise TaskError(f"no stop token: the tokenizer has no eos token ({', '.join(STOP_NAMES[:3])}, ...; nor "
                            "tokenizer_config.json's eos_token) and the checkpoint names none, so every response would "
                            f"run to {self.max_new_tokens} tokens; pass --stop_tokens=ID[,ID] (the ids that end a "
                            "response), or --max_new_tokens=N to train on fixed-length responses")
        return ids, "the tokenizer's eos tokens" if ids else "none found (only --max_new_tokens ends a response)"

    def _encode(self, text: str) -> list[int]:
        if self.template is None:
            return self.tok.encode(text).ids
        return self.tok.encode(self.template(text), add_special_tokens=False).ids   # the template has its specials

    def _check_template(self) -> None:
        """The chat template's own text (and --system_prompt's) must be text the tokenizer knows, as the prompts."""
        (pieces,) = unknown_pieces(self.tok, [self.template("")])
        if pieces:
            raise TaskError(f"--chat_template=true: the chat template's text {unknown_text_error(self.tok, pieces)}; "
                            "fix the template (or --system_prompt), or pass a tokenizer that knows them")

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
            out.append(Example(self._encode(row["prompt"]), row.get("answer"), row["prompt"]))
        return out

    @property
    def episodic(self) -> bool:
        return self.env_fn is not None

    def make_env(self, ex: Example):
        """--env's make_env(prompt, answer) -> an environment with a step(response: str) method."""
        env = self.env_fn(ex.text, ex.answer)
        if not callable(getattr(env, "step", None)):
            raise TaskError(f"--env={self.env_spec}: make_env returned {type(env).__name__}, which has no "
                            "step(response) method")
        return env

    def encode_observation(self, text: str) -> list[int]:
        """An environment's text as ids, encoded once (never the history again): no special tokens added."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def response_text(self, response: list[int]) -> str:
        """The response as the reward function sees it: decoded, its stop tokens left out."""
        return self.tok.decode([t for t in response if t not in self.stop_token_ids])

    def reward(self, ex: Example, response: list[int]):
        """The user function's value, unconverted: float("0.5") would hide a bug (see check_reward)."""
        return self.reward_fn(ex.text, self.response_text(response), ex.answer)

    def reference(self, ex: Example) -> list[int]:
        """The row's answer as a response (--sft_steps' target, tooling/sft.py): its text (a string as written, any other
        JSON value as JSON) encoded without special tokens, then the first stop token, so that response_text
        gives the reward function that text back."""
        if ex.answer is None:
            raise TaskError(f"--sft_steps: the example {ex.text[:80]!r} has no 'answer' field to train on; give every "
                            "row of --data an answer, or drop --sft_steps")
        text = ex.answer if isinstance(ex.answer, str) else json.dumps(ex.answer)
        return self.tok.encode(text, add_special_tokens=False).ids + list(self.stop_token_ids[:1])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def token_name(self, i: int) -> str:
        """The token's own spelling (decode drops special tokens)."""
        return self.tok.id_to_token(i) or f"<{i}>"

    def token_class(self, name: str) -> list[int]:
        """The ids of a class of tokens (--route_filter_tokens=NAME): digits, every id whose decoded text is ASCII
        digits only, whitespace around them aside (a byte-level BPE's " 12"); special tokens decode to nothing."""
        _known_class(name, self)
        texts = self.tok.decode_batch([[i] for i in range(self.vocab_size)])
        ids = [i for i, t in enumerate(texts) if t.strip() and all(c in "0123456789" for c in t.strip())]
        if not ids:
            raise TaskError(f"--route_filter_tokens={name}: the tokenizer has no token that decodes to digits")
        return ids

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._shuffle()


def generation_line(task, max_new_tokens: int, episode_tokens: int | None = None) -> str:
    """One line: the stop ids in force, where they came from, and the response length limits (an episode's
    policy turns add up past one turn's limit, up to the episode's budget)."""
    names = ", ".join(repr(task.token_name(i)) for i in task.stop_token_ids)
    stops = f"stop ids {list(task.stop_token_ids)} ({names}; {task.stop_source})" if task.stop_token_ids else \
        f"no stop ids ({task.stop_source})"
    if episode_tokens is None:
        return f"generation: {stops}, at most {max_new_tokens} new tokens (--max_new_tokens)"
    return (f"generation: {stops}, at most {max_new_tokens} new tokens a turn (--max_new_tokens), an episode "
            f"at most {episode_tokens} tokens after its prompt, observations included (--max_episode_tokens)")


PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository's root


def is_ours(filename: str) -> bool:
    """Whether a frame's file is this project's code: a top-level module or one of its packages' (a
    user's reward or environment, in examples/ or anywhere, is not)."""
    folder = os.path.dirname(os.path.abspath(filename))
    package = os.path.dirname(folder) == PROJECT and os.path.isfile(os.path.join(folder, "__init__.py"))
    return folder == PROJECT or package


def print_user_traceback(e: BaseException) -> None:
    """The traceback of an exception raised in the user's code, without the frames of this project above it."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None and is_ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb, file=sys.stderr)


def example_text(task, ex: Example, response: list[int]) -> str:
    """An example as an error message shows it: the prompt, the response and the answer, each cut to 80."""
    prompt = ex.text if ex.text is not None else task.decode(ex.prompt)
    shown = task.response_text(response) if hasattr(task, "response_text") else task.decode(response)
    return f"prompt {prompt[:80]!r}, response {shown[:80]!r}, answer {str(ex.answer)[:80]!r}"


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
    return [row for _, row in numbered_rows(path)]


def numbered_rows(path: str) -> list[tuple[int, dict]]:
    """read_jsonl's objects with their line numbers, for messages that name a row."""
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
        rows.append((lineno, row))
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


def unknown_token_id(tok) -> int | None:
    """The id the tokenizer's model encodes text it has no token for (None: it has no such token)."""
    if type(tok.model).__name__ == "Unigram":                         # Unigram names it by id
        return json.loads(tok.to_str())["model"].get("unk_id")
    name = getattr(tok.model, "unk_token", None)                     # WordLevel, WordPiece, BPE (often None)
    return tok.token_to_id(name) if name else None


def unknown_pieces(tok, texts: list[str]) -> list[list[str]]:
    """Per text, the pieces the tokenizer has no token for ([] for a text it knows whole): those it encodes
    to its unknown token, found by the encoding's offsets. A tokenizer without an unknown token drops such
    characters instead: those are the ones that encode to nothing on their own (whitespace aside, which
    a pre-tokenizer may drop by design)."""
    unk = unknown_token_id(tok)
    if unk is None:
        chars = sorted(c for c in set("".join(texts)) if not c.isspace())
        dropped = [c for c, e in zip(chars, tok.encode_batch(chars, add_special_tokens=False)) if not e.ids]
        return [[c for c in dropped if c in text] for text in texts]
    found = []
    for lo in range(0, len(texts), 4096):                             # bounded memory on a large file
        chunk = texts[lo:lo + 4096]
        for text, e in zip(chunk, tok.encode_batch(chunk, add_special_tokens=False)):
            found.append([text[a:b] for i, (a, b) in zip(e.ids, e.offsets) if i == unk] if unk in e.ids else [])
    return found


def unknown_text_error(tok, pieces: list[str]) -> str:
    """What the refusals say of the pieces a text holds: which, and what the tokenizer would make of them."""
    pieces = list(dict.fromkeys(pieces))
    it = "it" if len(pieces) == 1 else "them"
    unk = unknown_token_id(tok)
    made = (f"it would encode {it} as its unknown token {tok.id_to_token(unk)!r}, id {unk}" if unk is not None
            else f"it would drop {it}: it has no unknown token")
    return f"holds {', '.join(repr(p) for p in pieces)}, which the tokenizer has no token for ({made})"


def check_known_text(tok, path: str, rows: list[tuple[int, dict]]) -> None:
    """Refuse (TaskError, one line) a row whose prompt, or whose answer string (what a reward compares a
    decoded response with), holds text the tokenizer has no token for: the model would see its unknown
    token (which may be a stop token too) or nothing, and no response could spell the answer. Checked
    once, at load. Answers of other JSON types are the reward's to read."""
    fields = [(n, key, row[key]) for n, row in rows for key in ("prompt", "answer") if isinstance(row.get(key), str)]
    bad = [(field, pieces) for field, pieces in zip(fields, unknown_pieces(tok, [t for _, _, t in fields])) if pieces]
    if bad:
        (lineno, key, text), pieces = bad[0]
        more = f"; {len(bad)} texts of the file hold such text" if len(bad) > 1 else ""
        raise TaskError(f"{path}:{lineno}: the {key} {text[:80]!r} {unknown_text_error(tok, pieces)}{more}; "
                        "add what is missing to the tokenizer, or take it out of the data")


def check_env_signature(fn: Callable, spec: str) -> None:
    """--env's function must take (prompt, answer) and return an environment: said at load time."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind("prompt", "answer")
    except TypeError:
        raise TaskError(f"--env={spec}: its signature is {fn.__name__}{sig}; expected make_env(prompt, answer) "
                        "returning an environment with step(response) -> (observation, reward, done)") from None


def check_signature(fn: Callable, spec: str) -> None:
    """The reward function must take (prompt, response, answer): said at load time, not as a TypeError mid-run."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):                  # a builtin without a signature: let it run
        return
    try:
        sig.bind("prompt", "response", "answer")
    except TypeError:
        raise TaskError(f"--reward_fn={spec}: its signature is {fn.__name__}{sig}; expected "
                        "reward(prompt, response, answer)") from None


def read_tokenizer_config(dirs: list[str]) -> dict:
    """The first tokenizer_config.json in dirs ({} if none): its eos_token and chat_template."""
    for d in dirs:
        path = os.path.join(d, "tokenizer_config.json")
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    return {**json.load(f), "_path": path}
            except json.JSONDecodeError as e:
                raise TaskError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    return {}


def load_chat_template(dirs: list[str], system_prompt: str) -> Callable[[str], str]:
    """prompt -> the chat-formatted text: the first chat_template.jinja or tokenizer_config.json's
    chat_template in dirs, rendered with jinja2 as transformers' apply_chat_template does (one user message
    after an optional system one, add_generation_prompt=True)."""
    source, cfg = None, {}
    for d in dirs:
        cfg = read_tokenizer_config([d])              # its special tokens fill the template's bos_token, ...
        if os.path.isfile(os.path.join(d, "chat_template.jinja")):
            with open(os.path.join(d, "chat_template.jinja"), encoding="utf-8") as f:
                source = f.read()
        elif cfg.get("chat_template"):
            source = cfg["chat_template"]
            if isinstance(source, list):              # named templates: the default one
                source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if source:
            break
    if not source:
        raise TaskError(f"--chat_template=true: no chat template in {' or '.join(dirs)} (chat_template.jinja or "
                        "tokenizer_config.json's chat_template); drop the option or add one")
    try:
        import jinja2.sandbox
    except ImportError:
        raise TaskError("--chat_template=true renders the template with jinja2: pip install jinja2") from None

    def raise_exception(msg):
        raise TaskError(f"--chat_template=true: the chat template refused the prompt: {msg}")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    try:
        template = env.from_string(source)
    except jinja2.TemplateError as e:
        raise TaskError(f"--chat_template=true: the chat template does not parse ({e})") from None
    special = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in cfg.items()
               if k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []

    def render(prompt: str) -> str:
        return template.render(messages=system + [{"role": "user", "content": prompt}],
                               add_generation_prompt=True, **special)
    render("")                                       # a template that fails, fails before the run starts
    return render


def load_function(spec: str, option: str = "--reward_fn") -> Callable:
    """'module:function' or 'path/to/file.py:function' -> the function; errors name `option`."""
    mod_name, _, fn_name = spec.rpartition(":")
    if not mod_name or not fn_name:
        raise TaskError(f"{option}={spec!r}: expected 'module:function' or 'file.py:function'")
    if mod_name.endswith(".py"):
        if not os.path.isfile(mod_name):
            raise TaskError(f"{option}={spec!r}: no such file {mod_name!r}")
        spec_ = importlib.util.spec_from_file_location(os.path.basename(mod_name)[:-3], mod_name)
        module = importlib.util.module_from_spec(spec_)
        import_user_module(spec, lambda: spec_.loader.exec_module(module), option)
    else:
        if os.getcwd() not in sys.path:    # a module in the folder train.py runs from (after the project's)
            sys.path.append(os.getcwd())
        try:
            module = import_user_module(spec, lambda: importlib.import_module(mod_name), option)
        except ModuleNotFoundError:        # the module itself is missing (one inside it: import_user_module)
            raise TaskError(f"{option}={spec!r}: no module {mod_name!r} on the path "
                           "(run from its folder, or pass path/to/file.py:function)") from None
    if not callable(getattr(module, fn_name, None)):
        raise TaskError(f"{option}={spec!r}: {mod_name} has no function {fn_name!r}")
    return getattr(module, fn_name)


def import_user_module(spec: str, load: Callable, option: str = "--reward_fn"):
    """load() the user function's module (option: --reward_fn or --env). Whatever its own code raises (an import inside it that fails,
    a SyntaxError, an exception at import) is one TaskError naming the error, the file and the line (the
    innermost of the user's frames). A ModuleNotFoundError of the module itself passes through
    (load_function says where it looked)."""
    mod_name = spec.rpartition(":")[0]
    try:
        return load()
    except ModuleNotFoundError as e:
        if e.name == mod_name or mod_name.startswith(f"{e.name}."):
            raise
        where, err = user_frame(e), e
    except Exception as e:                                            # noqa: BLE001 (user code: anything)
        where, err = user_frame(e), e
    msg = err.msg if isinstance(err, SyntaxError) else str(err).splitlines()[0] if str(err) else ""
    raise TaskError(f"{option}={spec}: importing it raised {type(err).__name__}: {msg} ({where}); fix the module "
                    "(or pip install what it imports)") from None


def user_frame(e: BaseException) -> str:
    """'file, line N' of the innermost frame outside this project and Python's import machinery (a
    SyntaxError: its own file and line)."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"{e.filename}, line {e.lineno}"
    skip = (sys.prefix, sys.base_prefix)                              # the stdlib, packages
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")
              and not is_ours(f.filename) and not os.path.abspath(f.filename).startswith(skip)]
    return f"{frames[-1].filename}, line {frames[-1].lineno}" if frames else "at import"


# ---------------------------------------------------------------------------------------------------
# the task table: --task=NAME builds TASKS[NAME] (config.TrainConfig checks --task against it)
# ---------------------------------------------------------------------------------------------------
def _digit_task(name: str, seed: int, n_digits: int, stop_tokens=None, **_):
    return DigitTask(name, n_digits, seed, stop_tokens)


def _jsonl_task(name: str, seed: int, data: str, tokenizer: str, reward_fn: str, max_new_tokens: int, n_digits: int,
                **kw):
    given = {"data": data, "tokenizer": tokenizer, "reward_fn": reward_fn or kw.get("env")}
    wanted = {"data": "--data=file.jsonl", "tokenizer": "--tokenizer=tokenizer.json",
              "reward_fn": "--reward_fn=mod:fn (or --env=file.py:make_env)"}
    missing = [form for name, form in wanted.items() if not given[name]]
    if missing:
        raise TaskError(f"--task=jsonl needs {' and '.join(missing)} too (your prompts, their tokenizer and the "
                        "reward function: README, \"Your own task\")")
    return JsonlTask(data, tokenizer, reward_fn, max_new_tokens, seed, **kw)


# the tasks whose examples have a reference response (task.reference), what --sft_steps trains on; lookup's
# answer needs its tool's reply first, and --env's environments have no reference (tooling/options.py checks both)
SUPERVISED_TASKS = ("copy", "reverse", "jsonl")          # and a plug-in's (multi_turn/options.py: fix)

# the core's tasks; a plug-in's (multi_turn/: lookup, fix) join when a run names one (config.plugin_value)
TASKS: dict[str, Callable] = {**{name: _digit_task for name in DigitTask.TRANSFORMS}, "jsonl": _jsonl_task}



def make_task(name: str, seed: int = 0, n_digits: int = 4, data: str = "", tokenizer: str = "",
              reward_fn: str = "", max_new_tokens: int = 0, **options):
    """TASKS[name] built from the run's options; `options` are JsonlTask's keyword arguments (stop_tokens,
    model_eos, chat_template, system_prompt, checkpoint), stop_tokens also the digit tasks'."""
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name](name=name, seed=seed, n_digits=n_digits, data=data, tokenizer=tokenizer,
                       reward_fn=reward_fn, max_new_tokens=max_new_tokens, **options)


def compute_rewards(task, examples, outs, G: int, step: int, episodes: Episodes | None = None) -> list[float]:
    """The B rewards of the responses (example i // G for output i), each a finite number, else TaskError
    naming the reward function, the step, the example and the value (after the function's own traceback).
    Episodes: each episode's reward, the sum of its turns' (checked as they came)."""
    if episodes is not None:
        return episodes.episode_rewards()
    values = []
    for i, o in enumerate(outs):
        ex = examples[i // G]
        try:
            values.append(check_reward(task.reward(ex, o.tokens)))
        except RewardError as e:                                      # a value that is not a finite number
            raise TaskError(f"step {step}: {task.reward_source} {e}; example: {example_text(task, ex, o.tokens)}") from None
        except Exception as e:                                        # it raised: its traceback, then which call
            print_user_traceback(e)
            raise TaskError(f"step {step}: {task.reward_source} raised {type(e).__name__} (traceback above); "
                           f"example: {example_text(task, ex, o.tokens)}") from None
    return values
