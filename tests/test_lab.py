"""The mismatch lab: a deviating rollout shows a nonzero mismatch, the invariant one exactly zero,
corrections act only where there is a mismatch, and the experiment command runs end to end."""
import importlib.util
import json
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
from lab import faults as lab
from lab import fast_ops
from model import Transformer
from rollout import Sampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(initializer_range=0.2))


def _gap(sampler_kwargs, model=None, weights_dtype=None, rollout_model=None):
    """max |rollout logp - trainer logp| and the fraction of route rows that differ."""
    model = model or _model()
    rollout_model = rollout_model or model
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
    diff, _ = _gap({"rollout_mode": "fast"})
    assert diff > 0                                   # batch-variant fp32 kernels: tiny but nonzero
    diff_bf16, flips = _gap({"rollout_mode": "fast", "router_bf16": True}, weights_dtype=torch.bfloat16)
    assert diff_bf16 > 1e-3 and flips > 0             # lower precision: large, and routes flip


def test_router_bf16_alone_flips_routes():
    _, flips = _gap({"router_bf16": True})
    assert flips > 0


def test_variant_is_scoped():
    m = _model()
    t = torch.randint(0, 32, (2, 30))
    before = m.score(t)[0]
    with kernels.op_set(fast_ops.op_set(batch_variant=True, router_bf16=True)):
        assert not torch.equal(m.score(t)[0], before)                # control: the block computes otherwise
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


def _lab(tmp_path, runs: str, seeds: str, *extra: str) -> list[str]:
    """tooling/bench.py's lab at 1 step of 4 groups of 4 -> its table's lines (header first)."""
    r = subprocess.run([sys.executable, "-m", "tooling.bench", "--only", "lab", "--lab-steps", "1", "--lab-out", str(tmp_path),
                        "--lab-seeds", seeds, "--lab-runs", runs, *extra,
                        "--lab-args", "--prompts_per_step=4 --group_size=4 --n_digits=2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "lab.png").is_file() and "figure:" in r.stdout
    return [line for line in r.stdout.splitlines() if line.startswith("| ")]


def test_lab_command_runs_every_row_end_to_end(tmp_path):
    """Every row of bench.LAB runs (one seed), in the table's order, its columns filled."""
    from tooling import bench
    table = _lab(tmp_path, "", "0")
    names = [line.split("|")[1].strip() for line in table[1:]]
    assert names == list(bench.LAB) and names[:9] == ["invariant", "fast", "fast+tis", "fast+reject", "fast+icepop",
                                                      "fast+r3", "fast+route_filter", "fast+gspo", "fast+sigmoid"]
    rows = {line.split("|")[1].strip(): line.split("|") for line in table[1:]}
    # columns: run, final reward (mean ± sd over seeds), per seed, mean KL, max KL, max |dlogp|, extreme, flips, wall
    assert float(rows["int8"][6]) > 0 and float(rows["dense fast"][8]) == 0   # a gap; no router, no flips
    assert float(rows["fast"][6]) > 0                                          # numerics
    # the contract: KL, |dlogp|, flips 0; a stale row's one step trains version 0 on version 0's batch
    for name in ("invariant", "gpt-oss", "mla", "hybrid", "stale K=1", "stale K=4 decoupled"):
        assert float(rows[name][4]) == 0 and float(rows[name][6]) == 0 and float(rows[name][8]) == 0, name
    assert (tmp_path / "stale K=1" / "seed0" / "metrics.jsonl").is_file()


def test_lab_command_pools_seeds_from_one_supervised_start(tmp_path):
    """Two seeds: the reward as mean ± sd, one value per seed, a run folder per seed; --lab-sft-steps: one
    supervised checkpoint per preset, which every row and seed of that preset starts from."""
    table = _lab(tmp_path, "invariant,fast+sigmoid", "0,1", "--lab-sft-steps", "2")
    inv = table[1].split("|")
    assert "±" in inv[2] and len(inv[3].split()) == 2
    assert float(inv[4]) == 0 and float(inv[6]) == 0 and float(inv[8]) == 0
    for name, preset in (("invariant", "tiny"), ("fast+sigmoid", "tiny-sigmoid")):
        start = tmp_path / f"sft-{preset}" / "ckpt-000000"
        assert (start / "model.safetensors").is_file()
        for seed in (0, 1):
            run = json.load(open(tmp_path / name / f"seed{seed}" / "run.json"))
            assert run["train"]["init_from"] == str(start), (name, seed)
    sft = [json.loads(line) for line in open(tmp_path / "sft-tiny" / "metrics.jsonl")]
    assert [row.get("sft_step") for row in sft if row.get("phase") == "sft"] == [1, 2]
    r = subprocess.run([sys.executable, "-m", "tooling.bench", "--only", "lab", "--lab-runs", "lookup", "--lab-sft-steps", "2",
                        "--lab-out", str(tmp_path / "refused")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--lab-sft-steps: ['lookup']" in r.stderr and "Traceback" not in r.stderr


def test_lab_docs_name_bench_rows_and_count_them():
    """README's and docs/results.md's lab tables and commands speak of bench.LAB's rows: the names as the
    table prints them, the counts the commands run."""
    import re
    from tooling import bench
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    results = open(os.path.join(ROOT, "docs", "results.md"), encoding="utf-8").read()
    lab = results.split("## The mismatch lab\n", 1)[1].split("\n## ", 1)[0]
    names = {line.split("|")[1].strip() for line in lab.splitlines() if line.startswith("| ") and "---" not in line}
    assert names - {"run"} <= set(bench.LAB), f"rows not in bench.LAB: {names - {'run'} - set(bench.LAB)}"
    assert len(names - {"run"}) == len(bench.LAB)                    # and every row of LAB is shown
    rows = re.search(r"--lab-seeds=0,1,2 +# (\d+) rows x 3 seeds", readme)
    runs = re.search(r"--lab-steps=150 +# (\d+) runs", lab)
    assert rows and runs and int(rows.group(1)) == int(runs.group(1)) == len(bench.LAB)


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


# ---- quantized rollouts, router faults, trainer-side token dropping, the dense control --------------
def test_fake_quantize_by_hand():
    from lab.faults import fake_quantize
    # scales chosen as powers of two, so every expected value is exact: int8 absmax 127/16, fp8 448/16
    w = torch.tensor([[127 / 16, 0.1, -3.03], [0.0, 0.0, 0.0]])
    assert torch.equal(fake_quantize(w, "int8"), torch.tensor([[127 / 16, 2 / 16, -48 / 16], [0.0, 0.0, 0.0]]))
    # e4m3: 1.6 -> 1.625 (3 mantissa bits in [1, 2)), 48.48 -> 48 (steps of 4 in [32, 64)), 16 exact
    w8 = torch.tensor([[28.0, 0.1, -3.03, 1.0]])
    assert torch.equal(fake_quantize(w8, "fp8_e4m3"), torch.tensor([[28.0, 1.625 / 16, -48 / 16, 1.0]]))
    # one scale per output channel: stacked experts (E, out, in) quantize each (e, out) row on its own
    stack = torch.randn(3, 4, 8)
    assert torch.equal(fake_quantize(stack, "int8")[1, 2], fake_quantize(stack[1, 2][None], "int8")[0])
    err = (fake_quantize(stack, "int8") - stack).abs()
    assert (err <= stack.abs().amax(-1, keepdim=True) / 127 / 2 + 1e-7).all() and err.max() > 0
    assert fake_quantize(stack.bfloat16(), "fp8_e4m3").dtype == torch.bfloat16


def test_quantized_rollout_has_a_mismatch_and_the_trainer_stays_exact():
    from lab.faults import quantized_copy
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q, sync = quantized_copy(model, "int8", lambda: None)
    sync()
    gate = model.layers[1].mlp.gate.weight
    assert not torch.equal(q.layers[1].mlp.w13, model.layers[1].mlp.w13)           # quantized
    assert not torch.equal(q.layers[1].mlp.gate.weight, gate)
    assert torch.equal(q.embed_tokens.weight, model.embed_tokens.weight)          # kept
    assert torch.equal(q.lm_head.weight, model.lm_head.weight) and torch.equal(q.norm.weight, model.norm.weight)
    q_fp_router, sync_fp = quantized_copy(model, "int8", lambda: None, quantize_router=False)
    sync_fp()
    assert torch.equal(q_fp_router.layers[1].mlp.gate.weight, gate)
    diff, _ = _gap({}, model=model, rollout_model=q)
    assert diff > 0                                                              # nonzero rollout-trainer gap
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the trainer's weights untouched
    assert _gap({}, model=model) == (0.0, 0.0)                                   # and its own rollout exact
    with torch.no_grad():                                                         # a refresh follows the source
        model.layers[1].mlp.w2.mul_(2)
    sync()
    assert torch.equal(q.layers[1].mlp.w2, _fq(model.layers[1].mlp.w2))
    oss = Transformer(ModelConfig.preset("tiny-gpt-oss"))                      # experts' biases: 2-D, not matrices
    with torch.no_grad():
        oss.layers[0].mlp.b13.normal_()
    q, sync = quantized_copy(oss, "int8", lambda: None)
    sync()
    assert torch.equal(q.layers[0].mlp.b13, oss.layers[0].mlp.b13)
    assert not torch.equal(_fq(oss.layers[0].mlp.b13), oss.layers[0].mlp.b13)  # control: quantizing them rounds
    assert not torch.equal(q.layers[0].mlp.w13, oss.layers[0].mlp.w13)


def _fq(w):
    from lab.faults import fake_quantize
    return fake_quantize(w, "int8")


def _sigmoid_moe():
    from model import MoE
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                      router_scoring="sigmoid", score_correction_bias=True, initializer_range=0.5)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
        moe.gate.e_score_correction_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    return moe


def _route_seen(moe, x):
    """The ids and weights moe.forward hands to kernels.moe_experts."""
    seen, real = [], kernels.moe_experts
    kernels.moe_experts = lambda x2, w13, w2, ids, w: (seen.append((ids.clone(), w.clone())), real(x2, w13, w2, ids, w))[1]
    try:
        moe(x)
    finally:
        kernels.moe_experts = real
    return seen[0]


@pytest.mark.parametrize("fault", ["none", "no_bias", "bias_sign", "bias_in_weights", "no_renorm"])
def test_router_fault_vs_hand_computed_routing(fault):
    moe = _sigmoid_moe()
    x = torch.randn(1, 6, 16)
    lab.set_layer_fault(moe, fault)
    ids, weights = _route_seen(moe, x)
    scores = 1 / (1 + torch.exp(-(x[0] @ moe.gate.weight.T)))                      # (6, 4) by hand
    bias = moe.gate.e_score_correction_bias
    choice = {"no_bias": scores, "bias_sign": scores - bias}.get(fault, scores + bias)
    want_ids = torch.topk(choice, 2, dim=-1).indices                               # distinct scores: no ties
    w = (scores + bias if fault == "bias_in_weights" else scores).gather(-1, want_ids)
    if fault != "no_renorm":
        w = w / w.sum(-1, keepdim=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, w, rtol=1e-6, atol=1e-7)
    if fault != "none":                                                           # each fault changes something
        lab.set_layer_fault(moe, "none")
        right_ids, right_w = _route_seen(moe, x)
        assert not (torch.equal(right_ids, ids) and torch.equal(right_w, weights))


def test_expert_map_fault_sends_the_right_routes_to_the_wrong_experts():
    moe = _sigmoid_moe()
    x = torch.randn(1, 6, 16)
    right_ids, right_w = _route_seen(moe, x)
    out, routes = moe(x)
    lab.set_layer_fault(moe, "expert_map")
    ids, weights = _route_seen(moe, x)
    swap = torch.tensor([3, 1, 2, 0])                                             # experts 0 and E-1 trade places
    assert torch.equal(ids, swap[right_ids]) and torch.equal(weights, right_w)
    assert (right_ids == 0).any() or (right_ids == 3).any()                       # the swap is exercised
    bad_out, bad_routes = moe(x)
    assert torch.equal(bad_routes, routes)                                        # routes logged as the router chose
    assert not torch.equal(bad_out, out)


def test_shared_in_topk_fault_renormalises_the_shared_expert_with_the_routed_ones():
    """shared_in_topk: the engine's fused top-k counts the shared expert as one more slot of score 1 and
    renormalises the k + 1: routed weights w / (1 + sum w), the shared expert's output times 1 / (1 + sum
    w); by hand from the right layer's weights and outputs. The router's choice is unchanged."""
    from model import MoE
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                      router_scoring="sigmoid", score_correction_bias=True, n_shared_experts=1, initializer_range=0.5)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(1, 6, 16)
    right_ids, right_w = _route_seen(moe, x)
    out, routes = moe(x)
    shared = moe.shared_experts(x[0])                                             # (6, 16)
    lab.set_layer_fault(moe, "shared_in_topk")
    ids, weights = _route_seen(moe, x)
    total = 1 + right_w.sum(-1, keepdim=True)
    assert torch.equal(ids, right_ids)
    torch.testing.assert_close(weights, right_w / total, rtol=1e-6, atol=1e-7)
    bad_out, bad_routes = moe(x)
    assert torch.equal(bad_routes, routes)
    routed = out[0] - shared                                                      # the right layer's routed part
    torch.testing.assert_close(bad_out[0], routed / total + shared / total, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="shared experts"):
        lab.check_router_fault(ModelConfig.preset("tiny"), "shared_in_topk")


def test_router_fault_is_on_the_rollout_copy_only(tmp_path):
    model = Transformer(ModelConfig.preset("tiny-sigmoid"))
    rollout, _ = lab.router_fault_copy(model, model, "bias_sign", lambda: None)
    assert rollout is not model
    assert {lab.router_fault_of(l.mlp) for l in model.layers if l.is_moe} == {"none"}
    assert {lab.router_fault_of(l.mlp) for l in rollout.layers if l.is_moe} == {"bias_sign"}
    with pytest.raises(ConfigError, match="score-correction bias"):
        lab.router_fault_copy(_model(), _model(), "no_bias", lambda: None)
    hist = _run(tmp_path, ["--init_from=tiny-sigmoid", "--rollout_router_fault=no_renorm", "--recompute_old_logp=true"])
    assert hist[0]["logp_max_abs_diff"] > 0                                      # the rollout's weights were wrong


def test_capacity_keep_by_hand():
    from parallel.hooks import capacity_keep
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    # slot order: e0 gets slots (0,0) (1,0) (2,0) (3,1), e1 (0,1) (2,1) (3,0), e2 (1,1); capacity 2
    want = torch.tensor([[True, True], [True, True], [False, True], [False, False]])
    assert torch.equal(capacity_keep(ids, 3, 2), want)
    assert capacity_keep(ids, 3, 4).all()


def test_train_capacity_drops_only_inside_the_trainers_forward(tmp_path):
    from parallel.hooks import CapacityLimit, capacity_limit
    model = _model()
    t = torch.randint(0, 32, (3, 20))
    free = model.score(t)[0]
    with capacity_limit(CapacityLimit(100.0), model) as big:                             # nothing overflows
        assert torch.equal(model.score(t)[0], free)
    assert big.pop_metrics()["capacity_dropped"] == 0
    limit = CapacityLimit(0.5)
    with capacity_limit(limit, model):
        dropped = model.score(t)[0]
    m = limit.pop_metrics()
    assert not torch.equal(dropped, free) and m["capacity_dropped"] > 0
    assert m["capacity_drop_frac"] >= 0.5 - 1e-9          # at C = 0.5 at least half the (token, slot) rows go
    assert torch.equal(model.score(t)[0], free)                                   # scoped: dropless again
    hist = _run(tmp_path, ["--train_capacity_factor=1.0"])
    assert hist[0]["capacity_drop_frac"] > 0 and hist[0]["logp_max_abs_diff"] > 0
    with pytest.raises(ConfigError, match="train_capacity_factor"):
        TrainConfig(train_capacity_factor=-1.0)


def test_dense_control_matches_tiny_active_parameters():
    moe, dense = ModelConfig.preset("tiny"), ModelConfig.preset("tiny-dense")
    assert dense.moe_layers == [] and dense.hidden_size == moe.hidden_size
    assert dense.intermediate_size == moe.num_experts_per_tok * moe.moe_intermediate_size
    n = lambda m, pred=lambda k: True: sum(p.numel() for k, p in m.named_parameters() if pred(k))
    tm, td = Transformer(moe), Transformer(dense)
    experts = n(tm, lambda k: ".w13" in k or ".w2" in k)
    active = n(tm) - experts * (1 - moe.num_experts_per_tok / moe.num_experts) - n(tm, lambda k: k.endswith("mlp.gate.weight"))
    assert n(td) == active


def test_lab_options_refuse_bad_values():
    for kw, msg in ((dict(rollout_dtype="int4"), "rollout_dtype"), (dict(rollout_router_fault="flip"), "rollout_router_fault"),
                    (dict(rollout_quant_router=False), "rollout_quant_router")):
        with pytest.raises(ConfigError, match=msg):
            RolloutConfig(**kw)


def test_the_core_carries_no_fault_branch():
    """The lab's faults live in lab/faults.py and act on the rollout's copy from outside: no name in model.py's
    or support/distributed.py's code speaks of a fault or a quantized copy, and no branch of train.py tests a
    lab option (it hands the copy's choice to lab.rollout_copy). Control: lab/faults.py itself is full of them."""
    import ast
    import tokenize
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def names(path):
        with open(os.path.join(root, path), "rb") as f:
            return {t.string for t in tokenize.tokenize(f.readline) if t.type == tokenize.NAME}
    import re
    lab_word = re.compile(r"(^|_)(fault|quantiz|lower_precision|rollout_dtype|rollout_mode)", re.I)   # not setdefault
    for core in ("model.py", "support/distributed.py"):
        assert not [n for n in names(core) if lab_word.search(n)], core
    assert len([n for n in names("lab/faults.py") if lab_word.search(n)]) > 10
    tree = ast.parse(open(os.path.join(root, "train.py")).read())
    tests = [node.test for node in ast.walk(tree) if isinstance(node, (ast.If, ast.IfExp, ast.While))]
    tested = {n.attr if isinstance(n, ast.Attribute) else n.id for t in tests for n in ast.walk(t)
              if isinstance(n, (ast.Attribute, ast.Name))}
    assert tests and not [n for n in tested if lab_word.search(n)], tested


# ---------------------------------------------------------------------------------------------------
# per-request expert hotness (--log_hotness, lab/observe.py)
# ---------------------------------------------------------------------------------------------------
def test_request_hotness_counts_the_fed_positions_by_hand():
    """A sequence's row from its routes at Batch.route_mask's positions: layer 0 always picks experts 0
    and 1 (each takes half its choices), layer 1 picks expert 2 in slot 0 and a different expert in slot 1
    at each of its 3 positions (2 takes half); an unrecorded position holding other experts counts nothing."""
    from types import SimpleNamespace
    from lab.observe import request_row
    routes = torch.tensor([[[0, 1], [2, 3]], [[1, 0], [2, 4]], [[0, 1], [2, 5]], [[3, 3], [3, 3]]])  # (T, 2, k=2)
    mask = torch.tensor([True, True, True, False])
    batch = SimpleNamespace(routes=routes[None], route_mask=mask[None], mask=torch.tensor([[0, 1, 1]]))
    row = request_row(4, 0, batch, 0.5, n_experts=8)
    assert row["layer_hot_frac"] == [0.5, 0.5] and row["expert_hot_frac"] == 0.5
    assert row["step"] == 5 and row["reward"] == 0.5 and row["response_tokens"] == 2
    batch.route_mask = torch.ones(1, 4, dtype=torch.bool)             # control: the fourth position counted
    assert request_row(4, 0, batch, 0.5, n_experts=8)["layer_hot_frac"] == [0.375, 0.375]   # 3 of 8 each


def test_log_hotness_writes_every_sequence_and_its_quantiles(tmp_path):
    """--log_hotness: hotness.jsonl holds every sequence of each step in the batch's order, with the rewards
    metrics.jsonl's reward_mean is the mean of; request_hot_frac_* are those rows' quantiles. Off (the
    default): no file, no keys, and the other metrics are the same bits."""
    on = _run(tmp_path / "on", ["--log_hotness=true"])
    rows = [json.loads(line) for line in open(tmp_path / "on" / "hotness.jsonl")]
    B = 8 * TrainConfig().group_size
    assert [(r["step"], r["sequence"]) for r in rows] == [(s, i) for s in (1, 2) for i in range(B)]
    for step, h in enumerate(on, 1):
        mine = [r for r in rows if r["step"] == step]
        assert torch.tensor([r["reward"] for r in mine]).mean().item() == h["reward_mean"]
        fracs = torch.tensor([r["expert_hot_frac"] for r in mine], dtype=torch.float64)
        assert h["request_hot_frac_p50"] == torch.quantile(fracs, 0.5).item()
        assert h["request_hot_frac_max"] == fracs.max().item()
        top_k, E = ModelConfig.preset("tiny").num_experts_per_tok, ModelConfig.preset("tiny").num_experts
        assert all(1 / E - 1e-9 <= f <= 1 / top_k + 1e-9 for f in fracs.tolist())
    off = _run(tmp_path / "off", [])
    assert not (tmp_path / "off" / "hotness.jsonl").exists() and not any("request_hot" in k for k in off[0])
    timing = ("step_time", "rollout_tokens_per_s", "rollout_latency_p50", "rollout_latency_p95", "rollout_latency_p99")
    strip = [{k: v for k, v in h.items() if k not in timing and not k.startswith("request_hot")} for h in on]
    assert strip == [{k: v for k, v in h.items() if k not in timing} for h in off]


# ---------------------------------------------------------------------------------------------------
# the gap by position and by turn (--mismatch_split, lab/observe.py)
# ---------------------------------------------------------------------------------------------------
def test_token_places_count_policy_tokens_and_turns_by_hand():
    """A prompt of 2 ids, a policy turn of 2, an observation of 2, a policy turn of 1, padding: log-prob
    column j scores token j + 1."""
    from lab.observe import token_places
    observed = torch.tensor([[0, 0, 0, 0, 1, 1, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0]])                      # tokens 2, 3 and 6 are the policy's
    index, turn = token_places(mask, observed)
    assert (index * mask).tolist() == [[0, 1, 2, 0, 0, 3, 0]]
    assert (turn * mask).tolist() == [[0, 1, 1, 0, 0, 2, 0]]


def test_mismatch_split_buckets_sum_to_the_steps_gap(tmp_path):
    """--mismatch_split on the fast rollout: each bucket's values are the audit's over its tokens, so turn 1
    of a single-turn task (every token) equals the step's own keys, bit for bit, and the buckets no token
    reaches are None; on the invariant rollout every bucket is exactly 0 (control)."""
    fast = ["--rollout_mode=fast", "--rollout_dtype=bfloat16", "--recompute_old_logp=true", "--mismatch_split=true",
            "--n_digits=12"]
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    apply_overrides(parse_args(fast + [f"--out_dir={tmp_path / 'f'}", "--progress=false", "--steps=1",
                                       "--prompts_per_step=8", "--task=copy"]), tcfg, rcfg)
    h = train.train(tcfg, rcfg)[0]
    assert h["kl_by_turn"][0] == h["train_rollout_k3"] and h["extreme_by_turn"][0] == h["extreme_token_frac"]
    assert h["kl_by_turn"][1:] == [None, None, None] and h["kl_by_position"][3] is None   # 13 tokens at most
    assert all(v is not None for v in h["kl_by_position"][:2]) and h["train_rollout_k3"] > 0
    inv = _run(tmp_path / "i", ["--recompute_old_logp=true", "--mismatch_split=true"])[0]
    assert inv["kl_by_position"][0] == 0 and inv["flips_by_position"][0] == 0 and inv["extreme_by_turn"][0] == 0


def test_lab_lengths_runs_and_reports(tmp_path):
    """python -m lab.lengths at tiny sizes: a copy run and a multi-turn run, their tables by position and by
    turn (the lookup run reaches turn 2, the copy run only turn 1), and --report reads the same back."""
    argv = [sys.executable, "-m", "lab.lengths", "--runs", "fast copy 8,int8 lookup", "--steps", "1", "--seeds", "0",
            "--prompts", "2", "--group", "2", "--out", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| "): line for line in run.stdout.splitlines() if line.startswith("| ")}
    by_turn = run.stdout.split("the gap by turn")[1]
    lookup = next(line for line in by_turn.splitlines() if line.startswith("| int8 lookup")).split(" | ")
    copy = next(line for line in by_turn.splitlines() if line.startswith("| fast copy 8")).split(" | ")
    assert lookup[2] != "-" and copy[1] != "-" and copy[2] == "-"     # k3 KL at turn 2: lookup's only
    assert "fast copy 8" in rows
    again = subprocess.run(argv + ["--report"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0 and again.stdout.split("the gap by")[1:] == run.stdout.split("the gap by")[1:]
