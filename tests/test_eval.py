"""tooling/eval.py and the exports' identity: pass rates by hand, the trainer's eval equal to tooling/eval.py on the
saved checkpoint, --keep_checkpoints, and transformers' generate stopping at the EOS an export carries.

    python -m pytest -q tests/test_eval.py
"""
import json
import os
import shutil

import pytest
import torch

import train
from config import ModelConfig
from model import Transformer
from support.tasks import Example
from tooling import eval as evaluation

FAST = ["--task=copy", "--n_digits=2", "--prompts_per_step=2", "--group_size=2", "--minibatch_size=4",
        "--warmup_steps=1", "--progress=false"]


# ---- the formulas, on outputs fixed by hand ------------------------------------------------------
class Out:
    def __init__(self, tokens):
        self.tokens = tokens


class StubSampler:
    """Answers greedily with `greedy[i]`, sampled with `sampled[i][j]` (rewards are the token itself)."""

    def __init__(self, greedy, sampled):
        self.greedy, self.sampled = greedy, sampled

    def generate(self, prompts, temperature, n, **_):
        if temperature == 0:
            return [Out([self.greedy[p[0]]]) for p in prompts]
        return [Out([self.sampled[p[0]][j]]) for p in prompts for j in range(n)]


class StubTask:
    """Three examples; a response's reward is its token."""
    rows = [0, 1, 2]
    reward_source = "the stub's reward"

    def reward(self, example, tokens):
        return float(tokens[0])

    def load_state_dict(self, state):
        assert state == {"epoch": 0, "pos": 0}

    def sample(self, n):
        return [Example([i], None) for i in range(n)]


def test_evaluate_by_hand():
    sampler = StubSampler(greedy=[1, 0, 1], sampled=[[0, 0], [1, 0.5], [0, 0]])
    r = evaluation.evaluate(sampler, StubTask(), samples=2, max_new_tokens=4, temperature=1.0)
    assert r == {"eval_greedy_reward": 2 / 3, "eval_greedy_pass": 2 / 3, "eval_sampled_reward": (1 + 0.5) / 2 / 3,
                 "eval_pass@2": 1 / 3}
    assert evaluation.format_result(r).endswith("pass@2 0.333")


# ---- a JSONL task with a word-level tokenizer ----------------------------------------------------
@pytest.fixture
def jsonl(tmp_path):
    tk = pytest.importorskip("tokenizers")
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "=": 2, **{str(i): 3 + i for i in range(10)}}
    tok = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    rows = [{"prompt": f"{a} {b} =", "answer": f"{a} {b}"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[2:]))
    # a reward with a spread: the fraction of the answer's characters found in the response
    (tmp_path / "reward.py").write_text("def reward(prompt, response, answer):\n"
                                        "    return sum(c in response for c in answer.split()) / 2\n")
    return tmp_path


def args(folder, *extra):
    return FAST + ["--task=jsonl", f"--data={folder / 'data.jsonl'}", f"--tokenizer={folder / 'tokenizer.json'}",
                   f"--reward_fn={folder / 'reward.py'}:reward", f"--out_dir={folder / 'out'}", "--max_new_tokens=3", "--vocab_size=auto",
                   *extra]


def test_trainers_eval_is_eval_py_on_the_saved_checkpoint(jsonl, capsys):
    train.cli(args(jsonl, "--steps=2", f"--eval_data={jsonl / 'heldout.jsonl'}", "--eval_every=1",
                   "--eval_samples=3", "--save_every=1", "--keep_checkpoints=2"))
    rows = [json.loads(line) for line in open(jsonl / "out" / "metrics.jsonl")]
    keys = ["eval_greedy_reward", "eval_greedy_pass", "eval_sampled_reward", "eval_pass@3"]
    assert all(set(keys) <= set(r) for r in rows)
    assert sorted(os.listdir(jsonl / "out")) == ["ckpt-000001", "ckpt-000002", "latest", "metrics.jsonl", "routes.jsonl",
                                                 "run.json"]
    for step in (1, 2):                            # tooling/eval.py scores each kept checkpoint as the trainer did
        got = evaluation.main([str(jsonl / "out" / f"ckpt-{step:06d}"), f"--data={jsonl / 'heldout.jsonl'}",
                               "--samples=3"])     # tokenizer and reward fn from the checkpoint
        assert got == {k: rows[step - 1][k] for k in keys}
    assert "pass@3" in capsys.readouterr().out


def readme_run(jsonl):
    """README's sequence, shortened: train, then extend with --resume=true --steps=N (one checkpoint kept)."""
    out = jsonl / "out"
    train.cli(args(jsonl, "--steps=1"))
    train.cli(args(jsonl, "--steps=2", "--resume=true"))
    assert sorted(n for n in os.listdir(out) if n.startswith("ckpt")) == ["ckpt-000002"]
    return out


def test_export_takes_a_run_folder_after_the_readmes_own_commands(jsonl, capsys):
    """The run folder stands for its latest checkpoint; a checkpoint the run no longer keeps, a folder that is
    neither and a path that does not exist are one line each."""
    from support import checkpoint
    out = readme_run(jsonl)
    with pytest.raises(SystemExit) as e:
        checkpoint.export_cli(["export", str(out / "ckpt-000001"), str(out / "hf")])
    assert str(e.value.code) == (f"error: '{out / 'ckpt-000001'}' does not exist; '{out}' is a run folder: pass it "
                                 "for its latest checkpoint")
    capsys.readouterr()
    checkpoint.export_cli(["export", str(out), str(out / "hf")])
    assert capsys.readouterr().out.splitlines() == [
        f"{out} is a run folder: exporting its latest checkpoint, {out / 'ckpt-000002'}",
        f"exported {out / 'ckpt-000002'} to {out / 'hf'}"]
    assert Transformer.from_pretrained(str(out / "hf")).config == Transformer.from_pretrained(str(out / "ckpt-000002")).config
    (jsonl / "empty").mkdir()
    for name, says in [("empty", "is neither a checkpoint folder (no config.json) nor a run folder (no 'latest'); "
                                 "pass out_dir (its latest checkpoint) or out_dir/ckpt-NNNNNN"),
                       ("nothing", "does not exist")]:
        with pytest.raises(SystemExit) as e:
            checkpoint.export_cli(["export", str(jsonl / name), str(jsonl / "hf")])
        assert str(e.value.code) == f"error: '{jsonl / name}' {says}"


def test_eval_takes_a_run_folder_with_the_runs_reward_and_tokenizer(jsonl, capsys):
    out = readme_run(jsonl)
    capsys.readouterr()
    heldout = f"--data={jsonl / 'heldout.jsonl'}"
    got = evaluation.main([str(out), heldout, "--samples=2"])      # no --reward_fn, --tokenizer: the run's
    assert capsys.readouterr().out.startswith(f"{out} is a run folder: evaluating its latest checkpoint, "
                                              f"{out / 'ckpt-000002'}\n")
    assert got == evaluation.main([str(out / "ckpt-000002"), heldout, "--samples=2"])


def test_keep_checkpoints_keeps_the_newest_k(jsonl):
    train.cli(args(jsonl, "--steps=4", "--save_every=1", "--keep_checkpoints=3"))
    assert sorted(n for n in os.listdir(jsonl / "out") if n.startswith("ckpt")) == [
        "ckpt-000002", "ckpt-000003", "ckpt-000004"]
    assert open(jsonl / "out" / "latest").read() == "ckpt-000004"


@pytest.mark.parametrize("argv, needle", [([], "usage: python -m tooling.eval CKPT --data=FILE"),
                                          (["/nonexistent"], "'/nonexistent' does not exist"),
                                          (["Qwen/Qwen3-30B-A3B"], "fetch it first (`hf download Qwen/Qwen3-30B-A3B --local-dir DIR`)"),
                                          (["{ck}", "--dta=x"], "unknown option --dta; did you mean --data?"),
                                          (["{ck}", "--data=x", "--reward_fn=r:f", "--tokenizer=t", "--samples=0"], "--samples=0: must be >= 1"),
                                          (["{ck}", "--data=x", "--reward_fn=r:f", "--tokenizer=t", "--temperature=-1"], "--temperature=-1.0: must be >= 0"),
                                          (["{ck}", "--samples=x"], "--samples expects int, got 'x'"),
                                          (["{ck}"], "--data=... is needed")])
def test_eval_cli_mistakes_get_one_line(tmp_path, argv, needle):
    torch.manual_seed(0)
    Transformer(ModelConfig.preset("tiny")).save_pretrained(str(tmp_path / "ck"))
    with pytest.raises(SystemExit) as e:
        evaluation.cli([a.format(ck=tmp_path / "ck") for a in argv])
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg and needle in msg, msg


def test_eval_help_describes_every_option(capsys):
    evaluation.cli(["--help"])                                       # returns: exit status 0
    out = capsys.readouterr().out
    for k in evaluation.OPTIONS:
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(f"--{k}="))
        assert line.split(None, 1)[1] == evaluation.OPTION_DOCS[k]


def test_eval_data_needs_the_jsonl_task(tmp_path):
    with pytest.raises(SystemExit, match="--eval_data='x.jsonl': needs --task=jsonl"):
        train.cli(FAST + ["--eval_data=x.jsonl", f"--out_dir={tmp_path}"])
    with pytest.raises(SystemExit, match="--eval_every=2: needs --eval_data=FILE"):
        train.cli(FAST + ["--eval_every=2", f"--out_dir={tmp_path}"])


# ---- exports carry their identity: transformers' generate stops at EOS -----------------------------
def _hf_greedy(folder, prompt, n, **kw):
    transformers = pytest.importorskip("transformers")
    m = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


def test_export_carries_init_froms_identity_and_generate_stops_at_eos(tmp_path, jsonl):
    torch.manual_seed(0)
    src = tmp_path / "src"
    Transformer(ModelConfig.preset("tiny")).save_pretrained(str(src))
    prompt, n = [11, 3, 4, 10], 12
    free = _hf_greedy(src, prompt, n)              # the source knows no EOS: generate runs to max_new_tokens
    assert len(free) == n
    eos = free[3]                                  # a token greedy decoding reaches: an EOS generate must stop on
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [eos, 31], "bos_token_id": 11}))
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 31], "bos_token_id": 11,
                                                            "top_k": 20}))
    shutil.copy(jsonl / "tokenizer.json", src / "tokenizer.json")
    train.cli(FAST + [f"--init_from={src}", "--steps=1", "--lr=1e-9", f"--out_dir={tmp_path / 'out'}"])
    ck = tmp_path / "out" / "ckpt-000001"
    config = json.loads((ck / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"], config["pad_token_id"]) == ([eos, 31], 11, eos)
    assert json.loads((ck / "generation_config.json").read_text())["top_k"] == 20      # the source's, kept
    assert (ck / "tokenizer.json").read_bytes() == (jsonl / "tokenizer.json").read_bytes()
    stopped = _hf_greedy(ck, prompt, n)
    first = free.index(eos)
    assert stopped == free[:first + 1], (stopped, free)      # the same tokens, ending at the first EOS
    assert train.Transformer.from_pretrained(str(ck)).config == ModelConfig.preset("tiny")


def test_jsonl_export_carries_the_tokenizer_and_the_stop_id(jsonl):
    train.cli(args(jsonl, "--steps=1"))
    ck = jsonl / "out" / "ckpt-000001"
    assert (ck / "tokenizer.json").read_bytes() == (jsonl / "tokenizer.json").read_bytes()
    config = json.loads((ck / "config.json").read_text())
    assert config["eos_token_id"] == 0 == config["pad_token_id"]        # <|endoftext|>, the task's stop id
    assert json.loads((ck / "generation_config.json").read_text())["eos_token_id"] == 0


def test_eval_with_a_tokenizer_larger_than_the_model_is_one_line(jsonl, tmp_path):
    tk = pytest.importorskip("tokenizers")
    big = {"<|endoftext|>": 0, "[UNK]": 1, "=": 2, **{str(i): 3 + i for i in range(10)}, **{f"w{i}": 13 + i for i in range(40)}}
    tok = tk.Tokenizer(tk.models.WordLevel(big, unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    train.cli(args(jsonl, "--steps=1"))                              # vocab_size=auto: 13 ids
    ck = jsonl / "out" / "ckpt-000001"
    with pytest.raises(SystemExit) as e:
        evaluation.cli([str(ck), f"--data={jsonl / 'heldout.jsonl'}", f"--tokenizer={tmp_path / 'big.json'}"])
    msg = str(e.value.code)
    assert msg.startswith(f"error: --tokenizer={tmp_path / 'big.json'} has 53 tokens, {ck} has vocab_size=13") and "\n" not in msg
    result = evaluation.main([str(ck), f"--data={jsonl / 'heldout.jsonl'}"])   # control: its own tokenizer scores
    assert 0 <= result["eval_greedy_reward"] <= 1


def test_export_is_a_clean_hf_folder_transformers_loads_with_our_logits(tmp_path):
    """python -m support.checkpoint export: the weights in --save_dtype (the masters' exact bits in float32), config,
    generation_config and tokenizer files, nothing of the optimizer; transformers' logits equal ours within
    1e-5 relative (fp32), and the bf16 default equals the checkpoint's own export bit for bit."""
    transformers = pytest.importorskip("transformers")
    from support import checkpoint
    from safetensors.torch import load_file
    train.cli(FAST + ["--steps=1", "--dtype=bfloat16", f"--out_dir={tmp_path / 'run'}"])
    ck = tmp_path / "run" / "ckpt-000001"
    assert (ck / "masters.safetensors").exists() and (ck / "trainer_state.pt").exists()     # what a resume needs
    checkpoint.export_cli(["export", str(ck), str(tmp_path / "fp32"), "--save_dtype=float32"])
    checkpoint.export_cli(["export", str(ck), str(tmp_path / "bf16")])                      # the run's dtype
    assert sorted(os.listdir(tmp_path / "fp32")) == ["config.json", "generation_config.json", "model.safetensors"]
    masters = load_file(str(ck / "masters.safetensors"))
    ours = Transformer.from_pretrained(str(tmp_path / "fp32"))
    assert all(torch.equal(v, masters[k]) for k, v in ours.state_dict().items())             # the exact weights
    bf16, saved = load_file(str(tmp_path / "bf16" / "model.safetensors")), load_file(str(ck / "model.safetensors"))
    assert bf16.keys() == saved.keys() and all(torch.equal(bf16[k], saved[k]) for k in saved)
    assert json.loads((tmp_path / "fp32" / "generation_config.json").read_text())["eos_token_id"] == 12
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp32")).eval()
    tokens = torch.randint(0, 13, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = hf(tokens).logits, ours(tokens)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    with pytest.raises(SystemExit, match="exists and is not an empty folder"):                # nothing overwritten
        checkpoint.export_cli(["export", str(ck), str(tmp_path / "fp32")])
