"""The mismatch lab: a deviating rollout shows a nonzero mismatch, the invariant one exactly zero,
corrections act only where there is a mismatch, and the experiment command runs end to end."""
import importlib.util
import math
import os
import subprocess
import tempfile
import sys

import pytest
import torch

import kernels
import train
from config import ConfigError, ModelConfig, RolloutConfig, TrainConfig, apply_overrides, parse_args
from model import Transformer
from rollout import Sampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(initializer_range=0.2))


def _gap(sampler_kwargs, model=None, weights_dtype=None):
    """max |rollout logp - trainer logp| and the fraction of route rows that differ."""
    model = model or _model()
    rollout_model = model
    if weights_dtype is not None:
        rollout_model = Transformer(model.config).to(weights_dtype)
        rollout_model.load_state_dict(model.state_dict())
    prompts = [[1, 2, 3, 4], [5, 6, 7], list(range(20))]
    outs = Sampler(rollout_model, **sampler_kwargs).generate(prompts, max_new_tokens=12, n=4, progress=False)
    diff, flips, rows = 0.0, 0, 0
    for o in outs:
        P = len(o.prompt)
        lp, r = model.score(torch.tensor([o.prompt + o.tokens]))
        diff = max(diff, (lp[0, P - 1:] - torch.tensor(o.logprobs)).abs().max().item())
        used = r[0, :len(o.routes)]
        flips += (used.sort(-1).values != o.routes.sort(-1).values).any(-1).sum().item()
        rows += used.shape[0] * used.shape[1]
    return diff, flips / rows


def test_invariant_rollout_has_zero_mismatch():
    assert _gap({}) == (0.0, 0.0)


def test_fast_rollout_has_a_mismatch():
    diff, _ = _gap({"mode": "fast"})
    assert diff > 0                                   # batch-variant fp32 kernels: tiny but nonzero
    diff_bf16, flips = _gap({"mode": "fast", "router_bf16": True}, weights_dtype=torch.bfloat16)
    assert diff_bf16 > 1e-3 and flips > 0             # lower precision: large, and routes flip


def test_router_bf16_alone_flips_routes():
    _, flips = _gap({"router_bf16": True})
    assert flips > 0


def test_variant_is_scoped():
    m = _model()
    t = torch.randint(0, 32, (2, 30))
    before = m.score(t)[0]
    with kernels.variant(batch_variant=True, router_bf16=True):
        m.score(t)
    assert torch.equal(m.score(t)[0], before)


def _run(tmp, argv):
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    apply_overrides(parse_args(argv + [f"--out_dir={tmp}", "--progress=false", "--steps=2", "--prompts_per_step=8",
                                       "--task=copy", "--n_digits=2"]), tcfg, rcfg)
    return train.train(tcfg, rcfg)


def test_corrections_change_the_loss_only_under_mismatch(tmp_path):
    fast = ["--rollout_mode=fast", "--rollout_dtype=bfloat16", "--recompute_old_logp=true"]
    for corr in ("tis", "mis", "seq_tis", "seq_mis"):
        base = _run(tmp_path / f"i0{corr}", ["--recompute_old_logp=true"])
        fixed = _run(tmp_path / f"i1{corr}", ["--recompute_old_logp=true", f"--correction={corr}"])
        assert [h["loss"] for h in base] == [h["loss"] for h in fixed]          # exact no-op: rho == 1
        assert fixed[0]["train_rollout_kl"] == 0
    base = _run(tmp_path / "f0", fast)
    tis = _run(tmp_path / "f1", fast + ["--correction=tis"])
    assert base[0]["logp_max_abs_diff"] > 0
    assert base[0]["loss"] != tis[0]["loss"]                                    # acts where rho != 1
    assert base[0]["reward_mean"] == tis[0]["reward_mean"]                      # same samples


def test_correction_without_recompute_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="recompute_old_logp"):
        _run(tmp_path, ["--rollout_mode=fast", "--correction=tis"])


def test_lab_command_runs_end_to_end(tmp_path):
    r = subprocess.run([sys.executable, "bench.py", "--only", "lab", "--lab-steps", "1", "--lab-out", str(tmp_path),
                        "--lab-seeds", "0,1", "--lab-args", "--prompts_per_step=4 --group_size=4 --n_digits=2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    table = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in table[1:]] == ["invariant", "fast", "fast+tis", "fast+reject",
                                                                  "fast+icepop", "fast+r3", "fast+route_filter",
                                                                  "fast+gspo", "fast+sigmoid"]
    # columns: run, final reward (mean ± sd over seeds), per seed, mean KL, max KL, max |dlogp|, extreme, flips, wall
    inv = table[1].split("|")
    assert "±" in inv[2] and len(inv[3].split()) == 2                          # two seeds
    assert float(inv[4]) == 0 and float(inv[6]) == 0 and float(inv[8]) == 0   # KL, max |dlogp|, flips
    fast = table[2].split("|")
    assert float(fast[6]) > 0
    assert (tmp_path / "fast" / "seed1" / "metrics.jsonl").is_file()
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "lab.png").is_file() and "figure:" in r.stdout


def test_route_filter_and_rejection_act_only_under_mismatch(tmp_path):
    """The route-consistency filter and dropping rejected tokens: exact no-ops with zero mismatch; under a
    deviating rollout the filter removes tokens (counted in route_filtered_frac) and changes the loss."""
    base = _run(tmp_path / "i0", [])
    for i, extra in enumerate((["--route_filter=mask", "--route_filter_threshold=1.0"], ["--route_filter=downweight"],
                               ["--correction=reject", "--rejected_tokens=drop", "--recompute_old_logp=true"])):
        same = _run(tmp_path / f"i{i + 1}", extra)
        assert [h["loss"] for h in base] == [h["loss"] for h in same], extra
        assert all(h["route_filtered_frac"] == 0 for h in same)
    fast = ["--rollout_mode=fast", "--rollout_dtype=bfloat16", "--router_bf16=true", "--recompute_old_logp=true"]
    plain = _run(tmp_path / "f0", fast)
    masked = _run(tmp_path / "f1", fast + ["--route_filter=mask", "--route_filter_threshold=1.0"])
    assert plain[0]["route_flip_frac"] > 0                                    # routes did flip
    assert masked[0]["route_filtered_frac"] > 0 and plain[0]["route_filtered_frac"] == 0
    assert masked[0]["loss"] != plain[0]["loss"] and masked[0]["reward_mean"] == plain[0]["reward_mean"]
    # a narrow band rejects most tokens: zero_weight keeps them in the token mean, drop takes them out
    narrow = fast + ["--correction=reject", "--mis_low=0.9999", "--mis_high=1.0001"]
    kept, dropped = _run(tmp_path / "f2", narrow), _run(tmp_path / "f3", narrow + ["--rejected_tokens=drop"])
    assert kept[0]["loss"] != dropped[0]["loss"] and kept[0]["reward_mean"] == dropped[0]["reward_mean"]


def _run_tmp(argv):
    with tempfile.TemporaryDirectory() as tmp:
        return _run(tmp, argv)


def test_true_entropy_is_logged_beside_the_sampled_logprob():
    hist = _run_tmp(["--steps=1"])
    h = hist[0]
    assert 0 < h["entropy"] <= math.log(32) + 1e-6                            # at most log(vocab)
    assert h["neg_logp_mean"] > 0 and h["entropy"] != h["neg_logp_mean"]
