"""Bad input and faults: every user mistake gets one clear line, a NaN is never learned or saved, a
checkpoint never runs code, a run folder is never overwritten unasked, a resume keeps the lr schedule.

    python -m pytest -q tests/test_reliability.py

The runs are the `tiny` preset on 2-digit copy with 2 prompts x 2 responses a step: about 0.1 s a step.
"""
import errno
import glob
import hashlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import train
from config import ModelConfig, RolloutConfig, TrainConfig, apply_overrides, parse_args
from support.hf import CheckpointError
from model import Transformer
from support import tasks, runlog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--task=copy", "--n_digits=2", "--prompts_per_step=2", "--group_size=2", "--minibatch_size=4",
        "--warmup_steps=1", "--progress=false"]


def configs(out, *argv):
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    apply_overrides(parse_args(FAST + [f"--out_dir={out}", *argv]), tcfg, rcfg)
    return tcfg, rcfg


def run(out, *argv):
    return train.train(*configs(out, *argv))


def cli_error(*argv) -> str:
    """Run train.py's command line in this process; it must end in one line `error: ...`, exit status 1."""
    with pytest.raises(SystemExit) as e:
        train.cli(FAST + list(argv))
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


def checkpoints(out):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "ckpt-*")))


def assert_all_finite(ckpt):
    m = Transformer.from_pretrained(str(ckpt))                   # itself refuses a non-finite tensor
    assert all(torch.isfinite(p).all() for p in m.parameters())
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=True)
    for s in state["optimizer"]["state"].values():
        assert all(torch.isfinite(v).all() for v in s.values() if torch.is_tensor(v))


# ---------------------------------------------------------------------------------------------------
# a fresh machine: the main job needs nothing outside requirements.txt
# ---------------------------------------------------------------------------------------------------
def test_check_in_sync_hashes_the_weights_without_numpy(monkeypatch):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny")).to(torch.bfloat16)
    want = hashlib.sha256()
    for p in model.parameters():
        want.update(p.detach().view(torch.uint8).numpy().tobytes())   # numpy here only as the reference

    def no_numpy(*args, **kwargs):                                    # what a machine without numpy says
        raise RuntimeError("Numpy is not available")
    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    d = train.Dist(0, 1, torch.device("cpu"))
    assert train.check_in_sync(model, d) == want.hexdigest()
    with torch.no_grad():
        next(model.parameters())[0, 0] += 1                       # control: one changed weight changes it
    assert train.check_in_sync(model, d) != want.hexdigest()


def test_requirements_cover_what_the_code_imports():
    reqs = open(os.path.join(ROOT, "requirements.txt")).read()
    for pkg in ("torch", "safetensors", "tqdm", "tokenizers", "triton", "numpy"):
        assert f"\n{pkg}" in "\n" + reqs, pkg
    for path in glob.glob(os.path.join(ROOT, "*.py")):                # numpy is there for torch, not for us
        code = open(path).read()
        assert "import numpy" not in code and ".numpy()" not in code, path
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "venv" in ci and "--system-site-packages" not in ci
    readme = open(os.path.join(ROOT, "README.md")).read().splitlines()
    test_cmd = next(line.split("#")[0].strip() for line in readme if line.startswith("python -m pytest"))
    ci_cmd = '"$py" ' + test_cmd.removeprefix("python ")                    # CI runs README's test command
    assert ci.index("-r requirements.txt") < ci.index("train.py --steps=52 --save_every=50") \
        < ci.index("-r requirements-test.txt") < ci.index(ci_cmd), ci_cmd


# ---------------------------------------------------------------------------------------------------
# non-finite rewards, losses, gradients and weights
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf"), "0.5", None, "abc", [1.0]])
def test_bad_reward_stops_the_run_naming_function_example_and_value(tmp_path, monkeypatch, value):
    monkeypatch.setattr(tasks.DigitTask, "reward", lambda self, ex, resp: value)
    msg = cli_error(f"--out_dir={tmp_path}", "--steps=2", "--save_every=1")
    assert "step 1: the built-in 'copy' reward returned" in msg and repr(value) in msg
    assert "prompt '^" in msg and "response" in msg                # the example, decoded
    assert checkpoints(tmp_path) == []                              # nothing saved from it


@pytest.mark.parametrize("value, ok", [(1, True), (0.25, True), (True, True), ("0.5", False), (None, False),
                                       (float("nan"), False), (-float("inf"), False)])
def test_check_reward(value, ok):
    if ok:
        assert tasks.check_reward(value) == float(value)
    else:
        with pytest.raises(tasks.RewardError, match="finite number"):
            tasks.check_reward(value)
    np = pytest.importorskip("numpy")
    assert tasks.check_reward(np.float32(0.5)) == 0.5


def test_nan_reward_after_a_checkpoint_keeps_the_good_one(tmp_path, monkeypatch):
    real, calls = tasks.DigitTask.reward, []

    def reward(self, ex, resp):                                       # NaN from the second step on
        calls.append(1)
        return float("nan") if len(calls) > 4 else real(self, ex, resp)
    monkeypatch.setattr(tasks.DigitTask, "reward", reward)
    msg = cli_error(f"--out_dir={tmp_path}", "--steps=3", "--save_every=1")
    assert msg.startswith("error: step 2:")
    assert checkpoints(tmp_path) == ["ckpt-000001"]
    assert open(tmp_path / "latest").read() == "ckpt-000001"
    assert_all_finite(tmp_path / "ckpt-000001")


TOKEN_OBJECTIVE = train.token_objective


def _poison_loss(monkeypatch, bad_calls, push=0.0):
    """The objective is NaN on the given (0-based) calls: one call per optimizer step here. push adds
    -push * the mean of logp over the loss tokens, a gradient whatever the advantages (a random policy's
    groups often have none)."""
    n = [0]

    def token_objective(logp, old_logp, adv, mask, cfg, norm, *a, **k):
        loss, clipped = TOKEN_OBJECTIVE(logp, old_logp, adv, mask, cfg, norm, *a, **k)
        loss = loss - push * (logp * mask).sum() / norm.tokens
        n[0] += 1
        return (loss * float("nan") if n[0] - 1 in bad_calls else loss), clipped
    monkeypatch.setattr(train, "token_objective", token_objective)


def test_nonfinite_loss_stops_before_the_weights_and_the_last_checkpoint_stays(tmp_path, monkeypatch):
    _poison_loss(monkeypatch, {2})
    msg = cli_error(f"--out_dir={tmp_path}", "--steps=4", "--save_every=2")
    assert "step 3: the loss is nan and the gradient norm is nan before the optimizer step" in msg
    assert "--skip_nonfinite_steps" in msg
    assert checkpoints(tmp_path) == ["ckpt-000002"]
    assert_all_finite(tmp_path / "ckpt-000002")
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]


def test_skip_nonfinite_steps_skips_counts_and_stops_past_the_budget(tmp_path, monkeypatch):
    _poison_loss(monkeypatch, {1, 3})
    hist = run(tmp_path / "a", "--steps=4", "--save_every=4", "--skip_nonfinite_steps=2")
    assert [h["skipped_steps"] for h in hist] == [0, 1, 1, 2]
    assert hist[1]["loss"] is None and hist[1]["grad_norm"] is None   # no update taken in step 2: null
    assert all(math.isfinite(h["loss"]) for h in (hist[0], hist[2]))
    assert_all_finite(tmp_path / "a" / "ckpt-000004")
    rows = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    assert rows[1]["loss"] is None and rows[3]["skipped_steps"] == 2
    assert torch.load(tmp_path / "a" / "ckpt-000004" / "trainer_state.pt", weights_only=True)["skipped_steps"] == 2
    _poison_loss(monkeypatch, {1, 3})
    with pytest.raises(train.RunError, match="step 4: the loss is nan"):
        run(tmp_path / "b", "--steps=4", "--skip_nonfinite_steps=1")


def test_a_skipped_step_leaves_the_weights_alone(tmp_path, monkeypatch):
    _poison_loss(monkeypatch, set(), push=1.0)
    run(tmp_path / "a", "--steps=1")
    _poison_loss(monkeypatch, {0}, push=1.0)
    hist = run(tmp_path / "b", "--steps=1", "--skip_nonfinite_steps=1")
    assert hist[0]["skipped_steps"] == 1
    torch.manual_seed(0)
    init = Transformer(ModelConfig.preset("tiny")).state_dict()     # build_model's weights, seed 0
    skipped = Transformer.from_pretrained(str(tmp_path / "b" / "ckpt-000001")).state_dict()
    trained = Transformer.from_pretrained(str(tmp_path / "a" / "ckpt-000001")).state_dict()
    assert all(torch.equal(skipped[k], init[k]) for k in init)
    assert not all(torch.equal(trained[k], init[k]) for k in init)        # control: an update moves them


def _nan_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny"))
    with torch.no_grad():
        model.layers[1].mlp.gate.weight[3, 5] = float("nan")
    model.save_pretrained(str(tmp_path / "poisoned"))
    return tmp_path / "poisoned"


def test_nan_weight_in_init_from_is_refused_by_key(tmp_path):
    src = _nan_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.layers.1.mlp.gate.weight' holds 1"):
        Transformer.from_pretrained(str(src))
    msg = cli_error(f"--out_dir={tmp_path / 'out'}", f"--init_from={src}", "--steps=2", "--save_every=1")
    assert "model.layers.1.mlp.gate.weight" in msg
    assert checkpoints(tmp_path / "out") == []


def test_nonfinite_weights_are_never_saved(tmp_path):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny"))
    tcfg, rcfg = configs(tmp_path)
    task = tasks.DigitTask("copy", 2)
    train.save_checkpoint(str(tmp_path), 1, model, {}, tcfg, rcfg, task)
    with torch.no_grad():
        model.norm.weight[0] = float("inf")
    with pytest.raises(train.RunError, match="weight 'norm.weight' is not finite"):
        train.save_checkpoint(str(tmp_path), 2, model, {}, tcfg, rcfg, task)
    assert checkpoints(tmp_path) == ["ckpt-000001"] and open(tmp_path / "latest").read() == "ckpt-000001"


def test_metrics_are_strict_json(tmp_path):
    row = runlog.json_row({"step": 1, "a": float("nan"), "b": [0.5, float("inf")], "c": 2.0})
    assert row == {"step": 1, "a": None, "b": [0.5, None], "c": 2.0}
    run(tmp_path, "--steps=2")

    def no_constants(name):
        raise ValueError(f"{name} is not JSON")
    for line in open(tmp_path / "metrics.jsonl"):
        json.loads(line, parse_constant=no_constants)
    with pytest.raises(ValueError):                                   # control: what json.dumps writes by default
        json.loads(json.dumps({"a": float("nan")}), parse_constant=no_constants)


# ---------------------------------------------------------------------------------------------------
# checkpoints never run code; `latest` stays inside out_dir; disk full
# ---------------------------------------------------------------------------------------------------
class Exploit:
    def __reduce__(self):                                             # what a crafted pickle does on load
        return (os.system, (f"touch {Exploit.marker}",))


def test_crafted_trainer_state_is_not_unpickled(tmp_path):
    run(tmp_path, "--steps=1")
    Exploit.marker = str(tmp_path / "pwned")
    path = tmp_path / "ckpt-000001" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "task": Exploit()}, path)
    msg = cli_error(f"--out_dir={tmp_path}", "--resume=true", "--steps=2")
    assert "refusing to unpickle" in msg and "trainer_state.pt" in msg
    assert not os.path.exists(Exploit.marker)
    with pytest.raises(CheckpointError):                              # the in-process API path too
        run(tmp_path, "--resume=true", "--steps=2")
    assert not os.path.exists(Exploit.marker)
    torch.load(path, weights_only=False)                             # control: the pickle does run code
    assert os.path.exists(Exploit.marker)


@pytest.mark.parametrize("content", ["/etc", "../other/ckpt-000001", "ckpt-000001/..", "ckpt-1", "", "ckpt-000009"])
def test_latest_must_name_a_checkpoint_inside_out_dir(tmp_path, content):
    run(tmp_path, "--steps=1")
    (tmp_path / "latest").write_text(content)
    msg = cli_error(f"--out_dir={tmp_path}", "--resume=true", "--steps=2")
    assert "latest" in msg


def test_disk_full_during_a_checkpoint(tmp_path, monkeypatch):
    real, saves = torch.save, []

    def save(obj, f, *a, **k):
        saves.append(f)
        if len(saves) == 2:
            with open(f, "wb") as fh:
                fh.write(b"partial")                                   # what a full disk leaves behind
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **k)
    monkeypatch.setattr(torch, "save", save)
    msg = cli_error(f"--out_dir={tmp_path}", "--steps=3", "--save_every=1")
    assert "step 2: writing checkpoint" in msg and "disk full" in msg and "ckpt-000002.tmp" in msg
    assert "--resume" in msg and "GiB free" in msg
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000001", "latest", "metrics.jsonl", "routes.jsonl", "run.json"]   # no .tmp
    assert open(tmp_path / "latest").read() == "ckpt-000001"
    assert_all_finite(tmp_path / "ckpt-000001")


# ---------------------------------------------------------------------------------------------------
# a run folder is never overwritten unasked
# ---------------------------------------------------------------------------------------------------
def test_out_dir_holding_a_run_is_refused_unless_overwrite(tmp_path):
    run(tmp_path, "--steps=2")
    (tmp_path / "notes.txt").write_text("mine")
    before = open(tmp_path / "metrics.jsonl").read()
    msg = cli_error(f"--out_dir={tmp_path}", "--steps=2")
    assert "holds a run" in msg and "--resume=true" in msg and "--overwrite=true" in msg
    assert open(tmp_path / "metrics.jsonl").read() == before and checkpoints(tmp_path) == ["ckpt-000002"]
    hist = run(tmp_path, "--steps=1", "--overwrite=true")
    assert [h["step"] for h in hist] == [1]
    assert checkpoints(tmp_path) == ["ckpt-000001"]
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1]
    assert (tmp_path / "notes.txt").read_text() == "mine"           # only the run's own files go
    assert "contradict" in cli_error(f"--out_dir={tmp_path}", "--steps=3", "--resume=true", "--overwrite=true")


# ---------------------------------------------------------------------------------------------------
# the learning-rate schedule across a resume
# ---------------------------------------------------------------------------------------------------
def test_lr_schedule_survives_a_resume_that_extends_the_run(tmp_path, capsys):
    lr = lambda hist: [h["lr"] for h in hist]                        # noqa: E731
    whole = lr(run(tmp_path / "whole", "--steps=8"))
    # a first leg planned for the whole run (--lr_decay_steps=8), then extended to it: the same lr
    run(tmp_path / "legs", "--steps=4", "--lr_decay_steps=8")
    train.cli(FAST + [f"--out_dir={tmp_path / 'legs'}", "--resume=true", "--steps=8"])
    legs = [json.loads(line)["lr"] for line in open(tmp_path / "legs" / "metrics.jsonl")]
    assert legs == whole
    # a 4-step run extended to 8: steps 1-4 keep their 4-step cosine, 5-8 hold the minimum, and it says so
    short = lr(run(tmp_path / "ext", "--steps=4"))
    capsys.readouterr()
    train.cli(FAST + [f"--out_dir={tmp_path / 'ext'}", "--resume=true", "--steps=8"])
    assert "extends the run past its lr horizon of 4 steps" in capsys.readouterr().out
    ext = [json.loads(line)["lr"] for line in open(tmp_path / "ext" / "metrics.jsonl")]
    cfg = TrainConfig()
    assert ext[:4] == short and ext[4:] == [cfg.lr * cfg.min_lr_ratio] * 4
    assert short[3] != whole[3]                                       # control: the horizon matters
    # re-planning is explicit: --lr_decay_steps=8 on the resume gives the 8-step curve from step 5 on
    run(tmp_path / "replan", "--steps=4")
    train.cli(FAST + [f"--out_dir={tmp_path / 'replan'}", "--resume=true", "--steps=8", "--lr_decay_steps=8"])
    replan = [json.loads(line)["lr"] for line in open(tmp_path / "replan" / "metrics.jsonl")]
    assert replan[4:] == whole[4:]


def test_resume_of_a_finished_run_or_below_the_checkpoint_says_so(tmp_path):
    run(tmp_path, "--steps=2")
    assert "the run is finished; pass --steps=N with N > 2" in cli_error(f"--out_dir={tmp_path}", "--resume=true")
    msg = cli_error(f"--out_dir={tmp_path}", "--resume=true", "--steps=1")
    assert "is at step 2 and --steps=1" in msg


# ---------------------------------------------------------------------------------------------------
# every command-line mistake: one line naming the option, file or line
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def jsonl_task(tmp_path):
    """A JSONL task folder: a word-level tokenizer.json over digits, data.jsonl, reward.py."""
    tk = pytest.importorskip("tokenizers")
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "=": 2, **{str(i): 3 + i for i in range(10)}}
    tok = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "data.jsonl").write_text('{"prompt": "1 2 =", "answer": "1 2"}\n\n'     # a blank line is skipped
                                         '{"prompt": "3 4 =", "answer": "3 4"}\n')
    (tmp_path / "reward.py").write_text("import os\n\ndef reward(prompt, response, answer):\n"
                                        "    return eval(os.environ.get('REWARD', 'float(response == answer)'))\n")
    return tmp_path


def jsonl_args(folder, **change):
    args = dict(task="jsonl", data=folder / "data.jsonl", tokenizer=folder / "tokenizer.json",
                reward_fn=f"{folder / 'reward.py'}:reward", out_dir=folder / "out", steps=2, vocab_size="auto")
    args.update(change)
    return [f"--{k}={v}" for k, v in args.items()]


def test_jsonl_task_trains(jsonl_task):
    train.cli(FAST + jsonl_args(jsonl_task))
    assert checkpoints(jsonl_task / "out") == ["ckpt-000002"]


@pytest.mark.parametrize("reward, shown", [("'0.5'", "'0.5' (str)"), ("None", "None (NoneType)"),
                                           ("float('nan')", "nan")])
def test_jsonl_reward_of_the_wrong_kind(jsonl_task, monkeypatch, reward, shown):
    monkeypatch.setenv("REWARD", reward)
    msg = cli_error(*jsonl_args(jsonl_task))
    assert f"--reward_fn={jsonl_task / 'reward.py'}:reward returned {shown}" in msg
    assert "prompt '1 2 =" in msg or "prompt '3 4 =" in msg


@pytest.mark.parametrize("line, needle", [("{bad json", ":3: not valid JSON"), ('["a list"]', ":3: expected an object"),
                                          ('{"answer": 1}', ":3: expected an object with a string 'prompt'")])
def test_jsonl_bad_line_names_file_and_line(jsonl_task, line, needle):
    (jsonl_task / "data.jsonl").write_text('{"prompt": "1 ="}\n\n' + line + '\n{"prompt": "2 ="}\n')
    msg = cli_error(*jsonl_args(jsonl_task))
    assert f"{jsonl_task / 'data.jsonl'}{needle}" in msg


def _hf_dir(tmp_path, drop=None, truncate=False):
    torch.manual_seed(0)
    Transformer(ModelConfig.preset("tiny")).save_pretrained(str(tmp_path / "ck"))
    if drop:
        cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
        del cfg[drop]
        (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    if truncate:
        f = tmp_path / "ck" / "model.safetensors"
        f.write_bytes(f.read_bytes()[:100_000])
    return tmp_path / "ck"


CLI_CASES = {   # argv -> what the one line must say
    "preset": (["--init_from=nope"], "--init_from='nope' is neither a model preset (tiny"),
    "path": (["--init_from=/nonexistent/ckpt"], "--init_from='/nonexistent/ckpt': no such checkpoint folder"),
    "file": (["--init_from=train.py"], "is a file; pass the checkpoint's folder"),
    "device": (["--device=foo"], "--device='foo': choose auto, cpu, cuda or cuda:N"),
    "steps0": (["--steps=0"], "--steps=0: must be >= 1"),
    "steps-5": (["--steps=-5"], "--steps=-5: must be >= 1"),
    "lr": (["--lr=inf"], "--lr=inf: must be a finite number"),
    "type": (["--steps=x"], "--steps expects int, got 'x'"),
    "key": (["--stepz=3"], "unknown config key --stepz"),
    "task": (["--task=nope"], "--task='nope': choose one of"),
    "jsonl": (["--task=jsonl"], "--task=jsonl needs --data"),
    "no ckpt": (["--resume=true"], "--resume: no checkpoint in"),
    "prompt": (["--n_digits=300"], "step 1: the sampler refused this step's prompts: prompt 0 has 302 tokens"),
    "filter level": (["--route_filter_level=batch"], "--route_filter_level='batch': token or sequence"),
    "probe": (["--probe_every=-1"], "--probe_every=-1: must be >= 0 (0: off)"),
    "probe size": (["--probe_every=2", "--probe_prompts=0"], "--probe_prompts=0: must be >= 1"),
    "diagnostics": (["--diagnostics=-2"], "--diagnostics=-2: must be >= 0"),
    "detail": (["--record_route_detail=maybe"], "--record_route_detail"),
    "data without jsonl": (["--data=x.jsonl"], "--data='x.jsonl' is for your own task: add --task=jsonl"),
    "hub id": (["--init_from=Qwen/Qwen3-30B-A3B"], "no such folder; nothing is downloaded at run time: fetch the "
               "checkpoint first (`hf download Qwen/Qwen3-30B-A3B --local-dir DIR`"),
    "preset field on a typo": (["--n_layer=2"], "unknown config key --n_layer; did you mean --num_hidden_layers?"),
    "progress": (["--progress=sometimes"], "--progress='sometimes': auto"),
}


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_mistakes_get_one_line(tmp_path, case):
    argv, needle = CLI_CASES[case]
    assert needle in cli_error(f"--out_dir={tmp_path / 'out'}", *argv)


def test_a_preset_field_the_family_cannot_save_is_refused_before_the_run(tmp_path):
    """A preset's field set on the command line that its family's config.json cannot carry (a score-correction bias
    under qwen3_moe) would load back as another model: refused at the start, before a step runs (not at the first
    save, after the steps)."""
    out = tmp_path / "out"
    assert "model_type 'qwen3_moe' cannot express score_correction_bias=True" in cli_error(
        f"--out_dir={out}", "--score_correction_bias=true")
    assert not (out / "metrics.jsonl").exists()
    train.cli(FAST + [f"--out_dir={out}", "--steps=1", "--score_correction_bias=true", "--init_from=tiny-sigmoid"])
    assert (out / "metrics.jsonl").exists()


HOLDOUT_AND_KEY_TOKEN_CASES = {   # --route_filter_tokens and --diagnostics_holdout: argv -> what the one line says
    "unknown class": (["--route_filter_tokens=vowels"],
                      "--route_filter_tokens=vowels: not a token id nor a token class of task 'copy' (its classes: digits)"),
    "id past the vocabulary": (["--route_filter_tokens=3,32"],
                               "--route_filter_tokens=3,32: ids [32] are not in the model's vocabulary of 32 ids"),
    "not ids": (["--route_filter_tokens=3-5"], "--route_filter_tokens='3-5': comma-separated token ids and / or"),
    "empty item": (["--route_filter_tokens=3,,5"], "--route_filter_tokens='3,,5': comma-separated token ids"),
    "dense model": (["--route_filter_tokens=digits", "--init_from=tiny-dense"],
                    "--route_filter_tokens=digits: the model has no MoE layer (no routes); drop it"),
    "holdout without the old policy": (["--diagnostics_holdout=true", "--diagnostics=2"],
                                       "--diagnostics_holdout=true holds out the sequences --diagnostics=N picks before "
                                       "the update, from the recomputed old policy: add --recompute_old_logp=true"),
    "holdout without diagnostics": (["--diagnostics_holdout=true", "--recompute_old_logp=true"],
                                    "add --recompute_old_logp=true and --diagnostics=N (N > 0)"),
}


@pytest.mark.parametrize("case", HOLDOUT_AND_KEY_TOKEN_CASES)
def test_holdout_and_key_token_mistakes_get_one_line(tmp_path, case):
    argv, needle = HOLDOUT_AND_KEY_TOKEN_CASES[case]
    assert needle in cli_error(f"--out_dir={tmp_path / 'out'}", *argv)
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")   # before any step


def test_cli_checkpoint_mistakes_name_field_and_file(tmp_path):
    ck = _hf_dir(tmp_path / "a", drop="hidden_size")
    assert "lacks the required field(s) hidden_size" in cli_error(f"--init_from={ck}", f"--out_dir={tmp_path / 'o'}")
    ck = _hf_dir(tmp_path / "b", truncate=True)
    msg = cli_error(f"--init_from={ck}", f"--out_dir={tmp_path / 'o'}")
    assert f"{ck / 'model.safetensors'}: unreadable safetensors file" in msg and "truncated" in msg


def test_cli_jsonl_mistakes(jsonl_task):
    assert "no such file" in cli_error(*jsonl_args(jsonl_task, reward_fn="nothere.py:reward"))
    assert "no module 'no_such_module_x'" in cli_error(*jsonl_args(jsonl_task, reward_fn="no_such_module_x:reward"))
    assert "has no function 'nope'" in cli_error(*jsonl_args(jsonl_task, reward_fn=f"{jsonl_task / 'reward.py'}:nope"))
    assert "no tokenizer.json there" in cli_error(*jsonl_args(jsonl_task, tokenizer=jsonl_task / "none.json"))
    (jsonl_task / "bad.json").write_text("{}")
    assert "not a tokenizers tokenizer.json" in cli_error(*jsonl_args(jsonl_task, tokenizer=jsonl_task / "bad.json"))
    (jsonl_task / "empty.jsonl").write_text("\n")
    assert "holds no examples" in cli_error(*jsonl_args(jsonl_task, data=jsonl_task / "empty.jsonl"))


def test_jsonl_names_only_the_missing_option(jsonl_task):
    args = [a for a in jsonl_args(jsonl_task) if not a.startswith("--reward_fn")]
    msg = cli_error(*args)
    assert msg.startswith("error: --task=jsonl needs --reward_fn=mod:fn (or --env=file.py:make_env) too") and "--data" not in msg
    msg = cli_error(*[a for a in jsonl_args(jsonl_task) if not a.startswith(("--data", "--tokenizer"))])
    assert "needs --data=file.jsonl and --tokenizer=tokenizer.json too" in msg and "--reward_fn" not in msg


@pytest.mark.parametrize("source, says", [
    ("import numpyy\n\ndef reward(p, r, a):\n    return 1.0\n", "ModuleNotFoundError: No module named 'numpyy'"),
    ("def reward(p, r, a)\n    return 1.0\n", "SyntaxError: expected ':'"),
    ("import json\nX = json.loads('{')\n\ndef reward(p, r, a):\n    return 1.0\n", "JSONDecodeError"),
])
def test_a_reward_file_that_fails_to_import_is_one_line_naming_file_and_line(jsonl_task, source, says):
    bad = jsonl_task / "bad_reward.py"
    bad.write_text(source)
    spec = f"{bad}:reward"
    msg = cli_error(*jsonl_args(jsonl_task, reward_fn=spec))
    line = 2 if "json" in source else 1
    assert msg.startswith(f"error: --reward_fn={spec}: importing it raised {says}") and f"({bad}, line {line})" in msg


def test_a_reward_file_error_is_one_stderr_line_and_a_module_by_name_imports_from_the_cwd(jsonl_task):
    """The real command line: a reward file that fails to import gives one stderr line, status 1, no
    traceback; control: a module given by name imports from the folder train.py runs in."""
    bad = jsonl_task / "bad_reward.py"
    bad.write_text("import numpyy\n\ndef reward(p, r, a):\n    return 1.0\n")
    r = subprocess.run([sys.executable, "train.py", *FAST, *jsonl_args(jsonl_task, reward_fn=f"{bad}:reward")], cwd=ROOT,
                       capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    (jsonl_task / "good_mod.py").write_text("def reward(p, r, a):\n    return 1.0\n")   # control: a module by
    r = subprocess.run([sys.executable, str(ROOT) + "/train.py", *FAST, *jsonl_args(jsonl_task, reward_fn="good_mod:reward",   # name,
                       steps=1)], cwd=jsonl_task, capture_output=True, text=True,                      # from its folder
                       env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_tokenizer_without_eos_needs_stop_tokens_or_max_new_tokens(jsonl_task):
    tk = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "=": 1, **{str(i): 2 + i for i in range(10)}}          # no eos token of any name
    tok = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    tok.save(str(jsonl_task / "no_eos.json"))
    args = jsonl_args(jsonl_task, tokenizer=jsonl_task / "no_eos.json", steps=1)
    msg = cli_error(*args)
    assert "no stop token: the tokenizer has no eos token" in msg and "run to 64 tokens" in msg
    assert "--stop_tokens=ID[,ID]" in msg and "--max_new_tokens=N" in msg
    for given in ("--stop_tokens=1", "--max_new_tokens=3"):                   # either one, said explicitly, runs
        train.cli(FAST + args + [given, "--overwrite=true"])
        assert checkpoints(jsonl_task / "out") == ["ckpt-000001"], given


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_cuda_without_cuda(tmp_path):
    assert "no usable CUDA GPU" in cli_error("--device=cuda", f"--out_dir={tmp_path}")


@pytest.mark.parametrize("argv, needle", [(["--steps=-5"], "--steps=-5"),
                                          (["--init_from=/nonexistent"], "no such checkpoint folder")])
def test_real_command_line_prints_one_line_and_exits_1(tmp_path, argv, needle):
    r = subprocess.run([sys.executable, "train.py", f"--out_dir={tmp_path}", *argv], cwd=ROOT,
                       capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr


# ---------------------------------------------------------------------------------------------------
# torchrun: the process group is always shut down
# ---------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
def test_process_group_destroyed_after_a_torchrun_style_run(tmp_path, monkeypatch):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    run(tmp_path / "a", "--steps=1", "--device=cpu")
    assert not dist.is_initialized()
    monkeypatch.setattr(tasks.DigitTask, "reward", lambda self, ex, resp: None)
    with pytest.raises(tasks.TaskError):                             # and when the run stops on an error
        run(tmp_path / "b", "--steps=1", "--device=cpu")
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------------------
# the repository stands alone
# ---------------------------------------------------------------------------------------------------
def test_code_cites_only_the_repository():
    sources = glob.glob(os.path.join(ROOT, "*.py")) + [os.path.join(ROOT, "README.md")]
    for path in sources:
        assert "DESIGN.md" not in open(path).read(), path
    design = open(os.path.join(ROOT, "docs", "design.md")).read()
    assert "## The contract" in design and "## RL losses" in design and "## Reliability" in design
    assert "docs/design.md" in train.__doc__


# ---------------------------------------------------------------------------------------------------
# SIGINT / SIGTERM: the last whole step is saved, one line, exit 128 + signum, and the resume continues it
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_saves_the_last_whole_step_and_the_resume_continues_it(tmp_path, sig, status):
    import signal
    import time
    timing = set(runlog.TIMINGS)
    argv = FAST + ["--save_every=1000", "--lr_decay_steps=1000"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "train.py", *argv, "--steps=1000", f"--out_dir={tmp_path / 'a'}"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = tmp_path / "a" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(getattr(signal, sig))                # before the first checkpoint (save_every=1000)
    out, err = p.communicate(timeout=120)
    assert p.returncode == status, err[-2000:]
    assert "Traceback" not in err, err
    n = len(metrics.read_text().splitlines())
    assert err.splitlines()[-1] == f"interrupted at step {n}; resume with --resume=true"
    assert checkpoints(tmp_path / "a") == [f"ckpt-{n:06d}"] and f"step {n}: saved" in out
    # the resume says where it continues, and continues the same run
    r = subprocess.run([sys.executable, "train.py", *argv, f"--steps={n + 2}", f"--out_dir={tmp_path / 'a'}",
                        "--resume=true"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and f"resume: continuing from step {n} (" in r.stdout, r.stderr[-2000:]
    whole = run(tmp_path / "b", "--save_every=1000", "--lr_decay_steps=1000", f"--steps={n + 2}")
    legs = [json.loads(line) for line in open(metrics)]
    assert [h["step"] for h in legs] == list(range(1, n + 3))
    for a, b in zip(whole, legs):
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}


def test_resume_and_fresh_start_refusals_name_both_ways_out(tmp_path):
    msg = cli_error(f"--out_dir={tmp_path}", "--resume=true")              # nothing there
    assert "no checkpoint" in msg and "--overwrite=true" in msg and "--resume=true" in msg
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')             # a run stopped before its first save
    msg = cli_error(f"--out_dir={tmp_path}", "--resume=true")
    assert "metrics.jsonl" in msg and "--overwrite=true" in msg
    msg = cli_error(f"--out_dir={tmp_path}")
    assert "no checkpoint" in msg and "--overwrite=true" in msg and "--resume=true has nothing" in msg
    run(tmp_path, "--steps=1", "--overwrite=true")                        # the way out it names works
    assert checkpoints(tmp_path) == ["ckpt-000001"]


# ---------------------------------------------------------------------------------------------------
# silent acceptances: each an error or one printed decision
# ---------------------------------------------------------------------------------------------------
def test_minibatch_and_correction_checks(tmp_path, capsys):
    assert "--minibatch_size=3 must divide the batch of 8" in cli_error(
        f"--out_dir={tmp_path}", "--prompts_per_step=4", "--minibatch_size=3")
    msg = cli_error(f"--out_dir={tmp_path}", "--correction=tis")
    assert "--correction=tis" in msg and "--recompute_old_logp=true" in msg
    run(tmp_path, "--steps=1", "--minibatch_size=1000")                   # clamped, and said once
    assert capsys.readouterr().out.count("--minibatch_size=1000 is more than the batch of 4") == 1


@pytest.mark.parametrize("option, message", [("--lr=-1", "--lr=-1: must be >= 0"),   # before the process group
                                             ("--minibatch_size=6", "--minibatch_size=6 must divide the batch of 8")])
def test_torchrun_error_is_printed_once_by_rank_0(tmp_path, option, message):
    """Every rank meets the mistake; rank 0 alone prints it, no rank prints a traceback, and torchrun's own
    failure report (its launcher's traceback) names it as the root cause."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "train.py", *FAST, "--prompts_per_step=4", "--device=cpu", option,
                        f"--out_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert r.returncode != 0
    errors = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], r.stderr[-3000:]
    assert 'train.py", line' not in r.stderr and r.stderr.count("Traceback") <= 1, r.stderr[-3000:]
    root_cause = r.stderr[r.stderr.index("Root Cause"):]
    assert f"traceback : {errors[0]}" in root_cause and "To enable traceback" not in r.stderr, r.stderr[-3000:]


def test_a_virtual_environment_in_the_clone_is_ignored():
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", ".venv/bin/python"], cwd=ROOT).returncode
    assert ignored == 0 and subprocess.run(["git", "check-ignore", "-q", "train.py"], cwd=ROOT).returncode == 1


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path):
    """`python train.py | head -1`: the run stops when its stdout closes, quietly (141: 128 + SIGPIPE)."""
    p = subprocess.Popen([sys.executable, "train.py", *FAST, "--steps=50", f"--out_dir={tmp_path}"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.stdout.readline().startswith(b"train: tiny")
    p.stdout.close()                                                  # as head does after its line
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
