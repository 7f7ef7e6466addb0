"""support/tasks.py and its options: stop tokens, chat templates, the reward's inputs and errors, --vocab_size,
--help's descriptions, nearest-name suggestions and range messages (config.py).

    python -m pytest -q tests/test_tasks.py
"""
from __future__ import annotations

import builtins
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "arithmetic"))
import config  # noqa: E402
from config import ConfigError, ModelConfig, RolloutConfig, TrainConfig, apply_overrides, import_task  # noqa: E402
from support import hf  # noqa: E402
from support import tasks  # noqa: E402
from support.tasks import JsonlTask, TaskError  # noqa: E402

tk = pytest.importorskip("tokenizers")
import build_tokenizer  # noqa: E402  (examples/arithmetic)

QWEN_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture
def folder(tmp_path):
    """A task folder: a char-level tokenizer with two eos-like specials, data.jsonl, reward.py."""
    tok = build_tokenizer.build()
    tok.normalizer = tk.normalizers.Replace(" ", "")              # spaces normalized away: the ids lose them
    tok.add_special_tokens(["<|im_end|>", "<|im_start|>"])       # ids 14, 15: a chat model's specials
    tok.add_tokens(list("abcdefghijklmnopqrstuvwxyz\n"))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "data.jsonl").write_text('{"prompt": "12 + 34 =", "answer": "46"}\n')
    (tmp_path / "reward.py").write_text("SEEN = []\n\ndef reward(prompt, response, answer):\n"
                                        "    SEEN.append((prompt, response, answer))\n    return 1.0\n")
    return tmp_path


def task(folder, **kw) -> JsonlTask:
    return JsonlTask(str(folder / "data.jsonl"), str(folder / "tokenizer.json"), f"{folder / 'reward.py'}:reward", **kw)


# ---- stop tokens ----------------------------------------------------------------------------------
def test_tokenizer_eos_fallback_takes_every_eos_name(folder):
    t = task(folder)
    im_end, eot = t.tok.token_to_id("<|im_end|>"), t.tok.token_to_id("<|endoftext|>")
    assert eot == 0 and set(t.stop_token_ids) == {im_end, eot}            # id 0 counts; both names, not the first
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    assert task(folder).stop_token_ids[0] == eot                            # the declared eos first


def test_checkpoint_eos_ids_int_list_and_precedence(tmp_path):
    assert hf.eos_token_ids(str(tmp_path)) == ((), "")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert hf.eos_token_ids(str(tmp_path)) == ((7,), str(tmp_path / "config.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 9]}))
    assert hf.eos_token_ids(str(tmp_path)) == ((3, 9), str(tmp_path / "generation_config.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ConfigError, match="eos_token_id='x'"):
        hf.eos_token_ids(str(tmp_path))


def test_stop_token_precedence_and_override(folder):
    ids = ((5, 6), "ckpt/generation_config.json")
    t = task(folder, model_eos=ids)
    assert t.stop_token_ids == (5, 6) and "generation_config.json" in tasks.generation_line(t, 64)
    t = task(folder, model_eos=ids, stop_tokens=RolloutConfig(stop_tokens="3, 4").stop_token_ids)
    assert t.stop_token_ids == (3, 4) and t.stop_source == "--stop_tokens"
    with pytest.raises(ConfigError, match="--stop_tokens='3;4': comma-separated token ids"):
        RolloutConfig(stop_tokens="3;4")
    with pytest.raises(TaskError, match=r"--stop_tokens: \[999\] not in the tokenizer"):
        task(folder, stop_tokens=(999,))
    digits = tasks.make_task("copy", stop_tokens=(4,))
    assert digits.stop_token_ids == (4,) and tasks.make_task("copy").stop_token_ids == (tasks.DigitTask.EOS,)


def test_jsonl_length_default_is_stated_in_help(folder):
    assert task(folder).max_new_tokens == tasks.JSONL_MAX_NEW_TOKENS and task(folder, max_new_tokens=5).max_new_tokens == 5
    assert f"--task=jsonl: {tasks.JSONL_MAX_NEW_TOKENS}" in config.field_docs(RolloutConfig)["max_new_tokens"]
    line = tasks.generation_line(task(folder), 64)
    assert line.startswith("generation: stop ids [") and "'<|im_end|>'" in line and "at most 64 new tokens" in line


# ---- the reward's inputs, chat templates ----------------------------------------------------------
def test_reward_gets_the_jsonl_prompt_text(folder):
    t = task(folder)
    ex = t.sample(1)[0]
    assert t.decode(ex.prompt) == "12+34="                                  # control: the ids lost the spaces
    t.reward(ex, t.tok.encode("46").ids + [0])
    assert t.reward_fn.__globals__["SEEN"][-1] == ("12 + 34 =", "46", "46")  # text as written; no stop token


def test_chat_template_formats_the_prompt_but_not_the_reward_text(folder):
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN_LIKE, "eos_token": "<|im_end|>"}))
    t = task(folder, chat_template=True, system_prompt="be brief")
    ex = t.sample(1)[0]
    want = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n12 + 34 =<|im_end|>\n<|im_start|>assistant\n"
    assert ex.prompt == t.tok.encode(want, add_special_tokens=False).ids
    assert ex.prompt != task(folder).sample(1)[0].prompt                    # control: without the template
    t.reward(ex, [])
    assert t.reward_fn.__globals__["SEEN"][-1][0] == "12 + 34 ="
    ck = folder / "ckpt"                                                    # or the checkpoint's chat_template.jinja
    ck.mkdir()
    (folder / "tokenizer_config.json").unlink()
    (ck / "chat_template.jinja").write_text("q= {{ messages[-1].content }} a=")
    t = task(folder, chat_template=True, checkpoint=str(ck))
    assert t.sample(1)[0].prompt == t.tok.encode("q= 12 + 34 = a=", add_special_tokens=False).ids


def test_chat_template_mistakes_are_one_line(folder, monkeypatch):
    with pytest.raises(TaskError, match="no chat template in"):
        task(folder, chat_template=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(TaskError, match="does not parse"):
        task(folder, chat_template=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN_LIKE}))
    real_import = builtins.__import__

    def no_jinja(name, *args, **kwargs):
        if name.startswith("jinja2"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_jinja)
    with pytest.raises(TaskError, match="pip install jinja2"):
        task(folder, chat_template=True)
    with pytest.raises(ConfigError, match="--system_prompt goes into the checkpoint's chat template"):
        TrainConfig(task="jsonl", system_prompt="hi")
    with pytest.raises(ConfigError, match="add --task=jsonl"):
        TrainConfig(chat_template=True)


def test_reward_signature_is_checked_at_load(folder):
    (folder / "reward.py").write_text("def reward(prompt, response):\n    return 1.0\n")
    with pytest.raises(TaskError, match=r"its signature is reward\(prompt, response\); expected "
                                        r"reward\(prompt, response, answer\)"):
        task(folder)
    (folder / "reward.py").write_text("def reward(*args, scale=1):\n    return 1.0\n")
    task(folder)                                                            # control: anything that binds 3 is fine


def test_reward_that_raises_keeps_its_traceback_and_names_the_call(folder, capsys):
    import train
    (folder / "reward.py").write_text("def reward(prompt, response, answer):\n    return 1 / 0\n")
    argv = ["--task=jsonl", f"--data={folder / 'data.jsonl'}", f"--tokenizer={folder / 'tokenizer.json'}",
            f"--reward_fn={folder / 'reward.py'}:reward", f"--out_dir={folder / 'out'}", "--vocab_size=auto",
            "--steps=1", "--prompts_per_step=2", "--group_size=2", "--minibatch_size=4", "--max_new_tokens=3",
            "--progress=false"]
    with pytest.raises(SystemExit) as e:
        train.cli(argv)
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "return 1 / 0" in err and "ZeroDivisionError" in err
    assert "train.py" not in err and "support/tasks.py" not in err                  # the user's frames only
    msg = str(e.value.code)
    assert msg.startswith("error: step 1: --reward_fn=") and "raised ZeroDivisionError" in msg
    assert "prompt '12 + 34 ='" in msg and "response '" in msg and "answer '46'" in msg and "\n" not in msg


# ---- text the tokenizer has no token for -----------------------------------------------------------
def test_the_example_tokenizer_has_an_unknown_token_of_its_own():
    tok = build_tokenizer.build()
    assert tok.encode("*").ids == [13] and tok.decode([2, 13, 3]) == "12"      # never the stop token 0
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.encode("0123456789+=").ids == list(range(1, 13))
    assert tasks.unknown_token_id(tok) == 13 == tok.token_to_id("<unk>")      # appended: no id moved


def test_a_prompt_or_answer_the_tokenizer_cannot_spell_is_one_line_naming_row_text_and_character(folder, capsys):
    import train
    rows = ['{"prompt": "1+2=", "answer": "3"}', "", '{"prompt": "12*34=", "answer": "408"}']
    (folder / "data.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(TaskError) as e:
        task(folder)
    assert str(e.value) == (f"{folder / 'data.jsonl'}:3: the prompt '12*34=' holds '*', which the tokenizer has no "
                            "token for (it would encode it as its unknown token '<unk>', id 13); add what is missing "
                            "to the tokenizer, or take it out of the data")
    (folder / "data.jsonl").write_text('{"prompt": "1+2=", "answer": "3 Apples!"}\n{"prompt": "2+2=", "answer": "4?"}\n')
    with pytest.raises(TaskError, match=r"data.jsonl:1: the answer '3 Apples!' holds 'A', '!', which .* encode them "
                                        r"as .*id 13\); 2 texts of the file hold such text; add"):
        task(folder)
    (folder / "data.jsonl").write_text('{"prompt": "1+2=", "answer": 3}\n{"prompt": "2+2=", "answer": ["?!"]}\n')
    task(folder)                                                   # control: a reward reads other JSON as it likes
    (folder / "data.jsonl").write_text('{"prompt": "1+2=", "answer": "3"}\n')
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "Q: {{ messages[-1].content }}"}))
    with pytest.raises(TaskError, match=r"--chat_template=true: the chat template's text holds 'Q', ':', which"):
        task(folder, chat_template=True)
    (folder / "data.jsonl").write_text('{"prompt": "12*34=", "answer": "408"}\n')
    with pytest.raises(SystemExit) as e:                           # the command line: one line, no traceback
        train.cli(["--task=jsonl", f"--data={folder / 'data.jsonl'}", f"--tokenizer={folder / 'tokenizer.json'}",
                   f"--reward_fn={folder / 'reward.py'}:reward", f"--out_dir={folder / 'out'}", "--vocab_size=auto"])
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg and "'12*34=' holds '*'" in msg
    assert "Traceback" not in capsys.readouterr().err


def test_a_tokenizer_without_an_unknown_token_is_refused_the_characters_it_drops(tmp_path):
    tok = tk.Tokenizer(tk.models.BPE())                            # no unk_token: an unknown character vanishes
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    tok.train_from_iterator(["12+34=46", "<|endoftext|>"], tk.trainers.BpeTrainer(special_tokens=["<|endoftext|>"]))
    assert tok.encode("1é2").ids == tok.encode("12").ids                # control: dropped without a trace
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "data.jsonl").write_text('{"prompt": "1 + 2 =", "answer": "3"}\n{"prompt": "1é+2=", "answer": "3"}\n')
    (tmp_path / "reward.py").write_text("def reward(prompt, response, answer):\n    return 1.0\n")
    with pytest.raises(TaskError, match=r"data.jsonl:2: the prompt '1é\+2=' holds 'é', which the tokenizer has no "
                                        r"token for \(it would drop it: it has no unknown token\)"):
        task(tmp_path)


# ---- token classes (--route_filter_tokens) --------------------------------------------------------
def test_token_classes_of_the_digit_tasks_and_of_a_tokenizer(folder):
    """digits: the ids 0..9 of the digit tasks (the episodes' too); with a tokenizer every id whose decoded
    text is digits, whitespace around them aside (not a special token, not a mix with letters). A class a
    task does not define is one TaskError line naming the classes."""
    import_task("lookup")                                            # multi_turn/'s
    for name in ("copy", "lookup"):
        t = tasks.make_task(name, n_digits=3)
        assert t.token_class("digits") == list(range(10)) and [t.decode([i]) for i in range(10)] == list("0123456789")
        with pytest.raises(TaskError, match="not a token id nor a token class of task '" + name):
            t.token_class("vowels")
    tok = tk.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens(["12", " 7", "a1"])
    tok.save(str(folder / "tokenizer.json"))
    t = task(folder)
    ids = t.token_class("digits")
    want = {t.tok.token_to_id(c) for c in [*"0123456789", "12", " 7"]}
    assert set(ids) == want and len(ids) == 12
    assert t.tok.token_to_id("a1") not in ids and t.tok.token_to_id("<|im_end|>") not in ids
    with pytest.raises(TaskError, match="its classes: digits"):
        t.token_class("letters")
    from route_filter.filter import route_filter_token_ids
    ids_of = route_filter_token_ids(TrainConfig(route_filter_tokens="digits, 13"), t, t.vocab_size)
    assert ids_of == tuple(sorted(want | {13}))                      # ids and classes together, sorted
    with pytest.raises(ConfigError, match="are not in the model's vocabulary"):
        route_filter_token_ids(TrainConfig(route_filter_tokens=f"{t.vocab_size}"), t, t.vocab_size)


# ---- --vocab_size ---------------------------------------------------------------------------------
def test_vocab_size_follows_the_tokenizer_or_says_what_to_pass(tmp_path):
    tiny = ModelConfig.preset("tiny").vocab_size
    with pytest.raises(ConfigError, match=f"ids 13..{tiny - 1} would decode to nothing; pass --vocab_size=auto"):
        TrainConfig().model_preset(13, tokenizer=True)
    assert TrainConfig(vocab_size="auto").model_preset(13, tokenizer=True).vocab_size == 13
    assert TrainConfig(vocab_size="40").model_preset(13, tokenizer=True).vocab_size == 40     # asked for
    with pytest.raises(ConfigError, match="uses 100 token ids, the model has vocab_size=32.*--vocab_size=auto"):
        TrainConfig().model_preset(100, tokenizer=True)
    assert TrainConfig(vocab_size="auto").model_preset(100, tokenizer=True).vocab_size == 100
    assert TrainConfig().model_preset(13, tokenizer=False) == ModelConfig.preset("tiny")   # the digit tasks
    with pytest.raises(ConfigError, match="--vocab_size='x'"):
        TrainConfig(vocab_size="x")
    with pytest.raises(ConfigError, match="only a preset's vocabulary"):
        TrainConfig(init_from=str(tmp_path), vocab_size="auto").model_preset(13, tokenizer=True)


# ---- config.py: --help, nearest names, ranges -----------------------------------------------------
def test_help_describes_every_option_once():
    for cls in (TrainConfig, RolloutConfig, ModelConfig):
        docs = config.field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a trailing comment: {missing}"
    text = config.help_text(TrainConfig(), RolloutConfig())
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("--route_filter_threshold="))
    assert line.split(None, 1)[1] == config.field_docs(TrainConfig)["route_filter_threshold"]
    hidden = ["model_overrides"]                                      # set through the ModelConfig options
    groups = len(config.option_groups(TrainConfig)) + len(config.option_groups(RolloutConfig))   # a header each
    assert len(text.splitlines()) == groups + len(dataclasses.fields(TrainConfig)) - len(hidden) + \
        len(dataclasses.fields(RolloutConfig)) and "--model_overrides" not in text


def test_help_lists_every_option_the_command_line_takes():
    """train.py --help: every TrainConfig and RolloutConfig option, every ModelConfig field a preset takes,
    the presets, and --plan with its own keys, each once."""
    from tooling import plan
    r = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    listed = re.findall(r"^  --(\w+)=", r.stdout, flags=re.M)
    want = [f.name for cls in (TrainConfig, RolloutConfig) for f in dataclasses.fields(cls) if f.name != "model_overrides"]
    want += list(config.MODEL_OPTIONS) + list(plan.PLAN_KEYS)
    assert sorted(listed) == sorted(want)                             # each once, none missing
    assert all(re.search(rf"^  {name} ", r.stdout, flags=re.M) for name in config.MODEL_PRESETS)
    assert "--plan" in r.stdout and "--num_hidden_layers=4" in r.stdout


@pytest.mark.parametrize("key, near", [("stepz", "--steps"), ("frobnicate", None), ("max_new_token", "--max_new_tokens"),
                                       ("learning_rate", "--lr"), ("n_layer", None)])
def test_unknown_option_suggests_the_nearest(key, near):
    with pytest.raises(ConfigError) as e:
        apply_overrides({key: "1"}, TrainConfig(), RolloutConfig())
    msg = str(e.value)
    assert msg.startswith(f"unknown config key --{key}") and len(msg) < 120
    assert (f"did you mean {near}?" in msg) if near else "did you mean" not in msg


@pytest.mark.parametrize("key, raw, needle", [
    ("lr", "-1", "--lr=-1: must be >= 0"), ("grad_clip", "0", "--grad_clip=0: must be > 0"),
    ("kl_coef", "-0.1", "--kl_coef=-0.1: must be >= 0"), ("eps_low", "1", "--eps_low=1: must be in [0, 1)"),
    ("top_p", "0", "--top_p=0: must be in (0, 1]"), ("temperature", "-1", "--temperature=-1: must be >= 0"),
    ("block_size", "0", "--block_size=0: must be > 0"), ("save_every", "0", "--save_every=0: must be >= 1"),
    ("group_size", "1", "--group_size=1: must be >= 2"),
])
def test_each_range_check_names_its_option(key, raw, needle):
    with pytest.raises(ConfigError) as e:
        apply_overrides({key: raw}, TrainConfig(), RolloutConfig())
    assert str(e.value).startswith(needle)


def test_a_checkpoint_run_stops_on_its_generation_config_eos(folder, capsys):
    import torch
    import train
    from model import Transformer
    torch.manual_seed(0)
    ck = folder / "ck"
    Transformer(dataclasses.replace(ModelConfig.preset("tiny"), vocab_size=64)).save_pretrained(str(ck))
    (ck / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    train.cli(["--task=jsonl", f"--data={folder / 'data.jsonl'}", f"--tokenizer={folder / 'tokenizer.json'}",
               f"--reward_fn={folder / 'reward.py'}:reward", f"--init_from={ck}", f"--out_dir={folder / 'out'}",
               "--steps=1", "--prompts_per_step=2", "--group_size=2", "--minibatch_size=4", "--progress=false"])
    out = capsys.readouterr().out
    assert f"generation: stop ids [5, 7] ('4', '6'; {ck / 'generation_config.json'}), at most 64 new tokens" in out


def test_make_checkpoint_gives_a_folder_train_py_learns_from(tmp_path):
    """examples/make_checkpoint.py: a Qwen3-MoE folder and a BPE tokenizer of one's own (eos named in
    config.json), sized on the command line; train.py trains 2 steps from it, stopping at that eos."""
    pytest.importorskip("tokenizers")
    out, env = tmp_path / "my-moe", dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "examples/make_checkpoint.py", str(out), "--data=examples/arithmetic/train.jsonl",
                        "--num_experts=6", "--hidden_size=48"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith(f"wrote {out}: "), r.stderr[-2000:]
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_experts"], cfg["hidden_size"], cfg["vocab_size"], cfg["eos_token_id"]) == \
        ("qwen3_moe", 6, 48, 32, 0)
    r = subprocess.run([sys.executable, "train.py", "--task=jsonl", f"--init_from={out}", f"--tokenizer={out}/tokenizer.json",
                        "--data=examples/arithmetic/train.jsonl", "--reward_fn=examples/arithmetic/reward.py:reward",
                        "--max_new_tokens=4", "--steps=2", "--prompts_per_step=4", "--group_size=2", "--minibatch_size=8",
                        f"--out_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "done: 2 steps" in r.stdout, r.stderr[-2000:]
    assert "stop ids [0] ('<|endoftext|>'" in r.stdout
    r = subprocess.run([sys.executable, "examples/make_checkpoint.py", str(tmp_path / "x"), "--data=examples/arithmetic/train.jsonl",
                        "--n_layer=2"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and r.stderr.startswith("error: unknown config key --n_layer; did you mean --num_hidden_layers?")
