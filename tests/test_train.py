"""train.py: routing replay in the trainer, the trainer's forward without host reads, an end-to-end run,
and resume. The loss formulas are tested in test_losses.py, the mismatch measurement in test_replay.py.
"""
import dataclasses
import json
import math
import os
import sys

import pytest
import torch

import config
import kernels
import train
from config import ConfigError, ModelConfig, RolloutConfig, TrainConfig, apply_overrides, import_task
from conftest import with_options
from model import Transformer
from replay import pack_routes, route_audit
from rollout import Sampler
from support import checkpoint, distributed, runlog
from host_reads import HostReads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cfg(**kw) -> TrainConfig:
    return TrainConfig(**kw)


# ---- routing replay in the trainer ------------------------------------------------------------------
def _model(seed=0):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=24, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, num_experts=6, num_experts_per_tok=2,
                                   moe_intermediate_size=16, intermediate_size=32, max_position_embeddings=64,
                                   initializer_range=0.3))


def test_r3_replays_recorded_routes_and_router_learns():
    model = _model()
    outs = Sampler(model).generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=6, n=2, progress=False)
    batch = train.make_batch(outs, torch.zeros(len(outs)))
    # the trainer reproduces the rollout exactly, with and without replay
    lp_free, r_free = model.score(batch.tokens)
    lp_r3, r_r3 = model.score(batch.tokens, routes=batch.routes)
    m = batch.route_mask
    assert torch.equal(r_free[m], batch.routes[m]) and torch.equal(r_r3[m], batch.routes[m])
    assert torch.equal(lp_r3 * batch.mask, batch.rollout_logp * batch.mask)
    # replay forces other routes (the experts computed are the forced ones), score still reports the
    # router's own choice (so the audit can count flips), and gradients still reach every router
    forced = batch.routes.clone()
    forced[m] = (forced[m] + 1) % 6
    seen, real = [], kernels.moe_experts
    kernels.moe_experts = lambda x, w13, w2, ids, w: (seen.append(ids.clone()), real(x, w13, w2, ids, w))[1]
    try:
        lp, own = model.score(batch.tokens, routes=forced)
    finally:
        kernels.moe_experts = real
    B, T = batch.tokens.shape
    used = torch.stack([ids.view(B, T, -1) for ids in seen], dim=2)
    assert torch.equal(used[m], forced[m])
    assert torch.equal(own[m][:, 0], r_free[m][:, 0])               # first MoE layer: the free run's inputs
    assert route_audit(batch.routes, r_r3, m, 6)["route_flip_frac"] == 0   # replaying its own: no flips
    (lp * batch.mask).sum().backward()
    for layer in model.layers:
        if layer.is_moe:
            assert layer.mlp.gate.weight.grad.abs().sum() > 0
    # routes that do not fit the tokens are errors
    with pytest.raises(ValueError, match="do not fit"):
        pack_routes([o.routes[:-1] for o in outs], [len(o.prompt) + len(o.tokens) for o in outs], batch.tokens.shape[1])
    with pytest.raises(ValueError, match="shape"):
        model.score(batch.tokens[:, :-1], routes=batch.routes)


# ---- the trainer's forward reads nothing back to the host ------------------------------------------
def test_trainers_forward_under_r3_reads_nothing_back():
    """model.score's checks read the inputs back (a sync per micro-batch on a GPU); the trainer's
    forward (distributed.Scorer, as train.forward calls it, R3 replay, entropy, logits chunks,
    backward) makes none of them: no read from model.py, support/distributed.py, train.py or replay.py. The
    torch backend's own grouping of MoE rows by expert and its attention's tile count read on the
    host (kernels.py, the CPU backend); the Triton backend's do not."""
    from support.distributed import Scorer
    model = _model()
    outs = Sampler(model).generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=6, n=2, progress=False)
    batch = train.make_batch(outs, torch.zeros(len(outs)))
    scorer = Scorer(model)
    kw = dict(temperature=1.0, routes=batch.routes, with_entropy=True, logits_chunk=8)
    with HostReads() as trainer:
        logp, routes, entropy = scorer(batch.tokens, **kw)
        logp.sum().backward()
    ours = {f: n for f, n in trainer.by_file.items() if f != "kernels.py"}
    assert ours == {}, ours
    # packed, as the trainer runs by default: the Packing's index tensors are built from its lengths on the
    # host (no read), the forward and backward read nothing either
    from support.packing import Packing
    pk = Packing.concat([len(o.prompt) + len(o.tokens) for o in outs])
    packed_tokens, packed_routes = pk.from_padded(batch.tokens), pk.from_padded(batch.routes, fill=-1)
    with HostReads() as packed:
        out = scorer(packed_tokens, **{**kw, "routes": packed_routes}, packing=pk)
        out[0].sum().backward()
    ours = {f: n for f, n in packed.by_file.items() if f != "kernels.py"}
    assert ours == {}, ours
    with HostReads() as checked:                                     # control: the public, checked score
        logp_checked, routes_checked, _ = model.score(batch.tokens, **kw)
    assert checked.by_file.get("model.py", 0) >= 7, checked.by_file  # aminmax + the route checks
    assert torch.equal(logp_checked, logp) and torch.equal(routes_checked, routes)   # the same forward
    # the errors stay where users meet them
    bad = batch.routes.clone()
    bad[0, 0, 0, 0] = model.config.num_experts
    with pytest.raises(ValueError, match="num_experts"):
        model.score(batch.tokens, routes=bad)
    with pytest.raises(ValueError, match="vocab_size"):
        model.score(batch.tokens + model.config.vocab_size)


# ---- end to end -------------------------------------------------------------------------------------
def _run(tmp, argv):
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    apply_overrides(train.parse_args(argv + [f"--out_dir={tmp}", "--progress=false"]), tcfg, rcfg)
    return train.train(tcfg, rcfg)


SMALL = ["--task=copy", "--n_digits=2", "--prompts_per_step=16", "--group_size=8", "--minibatch_size=64",
         "--lr=1e-2", "--warmup_steps=2"]


def test_short_run_learns_with_zero_mismatch(tmp_path):
    hist = _run(tmp_path, SMALL + ["--steps=30", "--save_every=100"])
    first = sum(h["reward_mean"] for h in hist[:5]) / 5
    last = sum(h["reward_mean"] for h in hist[-5:]) / 5
    assert last > first + 0.15, (first, last)
    for h in hist:
        assert h["train_rollout_kl"] == 0 and h["logp_max_abs_diff"] == 0 and h["route_flip_frac"] == 0
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 31))
    for key in ("reward_mean", "train_rollout_kl", "logp_max_abs_diff", "route_flip_frac", "clip_frac", "grad_norm"):
        assert key in rows[0]
    assert os.path.isfile(tmp_path / "ckpt-000030" / "model.safetensors")


@pytest.mark.parametrize("extra", [["--recompute_old_logp=true", "--replay=r3", "--epochs=2", "--micro_batch_size=24"],
                                   ["--loss=gspo", "--correction=seq_mis", "--recompute_old_logp=true",
                                    "--kl_coef=0.05"]])
def test_variants_run_with_zero_mismatch(tmp_path, extra):
    hist = _run(tmp_path, SMALL + ["--steps=2"] + extra)
    for h in hist:
        assert h["train_rollout_kl"] == 0 and h["logp_max_abs_diff"] == 0 and h["route_flip_frac"] == 0
        assert math.isfinite(h["loss"])


def test_resume_reproduces_uninterrupted_run(tmp_path):
    timing = set(runlog.TIMINGS)
    full = _run(tmp_path / "a", SMALL + ["--steps=6", "--save_every=3"])
    _run(tmp_path / "b", SMALL + ["--steps=3", "--save_every=3", "--lr_decay_steps=6"])   # a 6-step plan, cut at 3
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    apply_overrides(train.parse_args(SMALL + ["--steps=6", "--save_every=3", f"--out_dir={tmp_path / 'b'}",
                                              "--resume=true", "--progress=false"]), tcfg, rcfg)
    resumed = train.train(tcfg, rcfg)
    assert [h["step"] for h in resumed] == [4, 5, 6]
    for a, b in zip(full[3:], resumed):
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
    rows = [json.loads(line) for line in open(tmp_path / "b" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 7))


def test_cli_errors_and_help(capsys):
    import train
    from conftest import cli_error
    assert "--stepz" in cli_error(["--stepz=3"])
    assert "--steps expects int" in cli_error(["--steps=x"])
    train.cli(["--help"])
    out = capsys.readouterr().out
    assert "--group_size=8" in out and "--replay='none'" in out
    with pytest.raises(ConfigError, match="loss"):
        TrainConfig(loss="ppo")


def test_kernels_backend_field(monkeypatch):
    """--kernels_backend picks the backend for the whole run (sampler and trainer) and restores the
    previous one after; '' keeps KERNELS_BACKEND's choice; anything else is a clear error."""
    seen = []
    monkeypatch.setattr(train, "_train", lambda tcfg, rcfg, d, hooks=None: seen.append(kernels.get_backend()) or [])
    before = kernels.get_backend()
    for choice, want in [("torch", "torch"), ("triton", "triton"), ("", before)]:
        tcfg = TrainConfig(device="cpu")
        apply_overrides({"kernels_backend": choice}, tcfg)
        train.train(tcfg, RolloutConfig())
        assert seen[-1] == want and kernels.get_backend() == before
    with pytest.raises(ConfigError, match="kernels_backend"):
        TrainConfig(kernels_backend="cuda")


# ---- the lr schedule and the router's lr ------------------------------------------------------------
def test_length_surge_fires_once_at_the_step_it_is_detected():
    """The mean of the last W response lengths over (1 + r) times the mean of the W before: not before
    2W steps, not at exactly (1 + r) times, once a run (the state a checkpoint saves), never when off."""
    assert not runlog.is_length_surge([1.0, 1.0, 9.0], 2, 0.5)               # 3 < 2W steps: not yet
    assert runlog.is_length_surge([1.0, 1.0, 2.0, 1.1], 2, 0.5)              # 1.55 > 1.5 x 1.0
    assert not runlog.is_length_surge([1.0, 1.0, 2.0, 1.0], 2, 0.5)          # exactly 1.5 x: no
    assert not runlog.is_length_surge([4.0, 4.0, 2.0, 2.0], 2, 0.5) and not runlog.is_length_surge([9.0] * 4, 0, 0.5)
    history = [10, 10, 10, 10, 10, 11, 13, 16, 19, 22, 30, 40, 10, 10, 10, 10, 30, 40]   # grows from step 6 on
    tcfg = cfg(surge_window=3, surge_ratio=0.5)
    surge = runlog.LengthSurge()
    fired = [step for step, n in enumerate(history, 1) if surge.observe(tcfg, step, float(n))]
    assert fired == [9] and surge.step == 9        # steps 7-9: 16 > 1.5 x 10.33 (steps 4-6); step 8: 13.33 < 1.5 x 10
    assert surge.lengths == [10.0, 10.0, 10.0, 10.0, 30.0, 40.0]              # the last 2W: what a resume needs
    again = runlog.LengthSurge()
    again.load_state_dict(surge.state_dict())
    assert again == surge and not again.observe(tcfg, 19, 100.0)               # once a run, across resumes too
    fresh = runlog.LengthSurge()
    fresh.load_state_dict(None)                                               # a checkpoint from before it
    assert fresh == runlog.LengthSurge()


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def _gate_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}


def hooks_of(tcfg):
    """The step hooks a run of tcfg has (router_training/'s optimizer where --router_lr_scale != 1)."""
    from support.hooks import plugin_hooks
    return plugin_hooks(tcfg, RolloutConfig())


@pytest.mark.parametrize("scale", [0.0, 0.5])
def test_router_lr_scale_trains_the_gates_at_lr_times_s(scale):
    tcfg = cfg(router_lr_scale=scale, weight_decay=0.1, lr=1e-2)
    model, gates_only = _model(), _model()
    gates0 = _gate_weights(model)
    assert len(gates0) == len(model.config.moe_layers)
    opt = distributed.build_optimizer(model, tcfg, hooks_of(tcfg))
    ref = torch.optim.AdamW([p for n, p in gates_only.named_parameters() if n in gates0], lr=tcfg.lr * scale,
                            betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay if scale else 0.0)
    for step in range(3):
        for g in opt.param_groups:                                   # as the loop sets it: every group, lr_at
            g["lr"] = tcfg.lr / (step + 1)
        for g in ref.param_groups:
            g["lr"] = tcfg.lr * scale / (step + 1)
        _grads(model, step), _grads(gates_only, step)
        opt.step(), ref.step()
    after, expected = _gate_weights(model), _gate_weights(gates_only)
    for n in gates0:
        assert torch.equal(after[n], expected[n])
        if scale == 0:                                               # frozen: bitwise, weight decay included
            assert torch.equal(after[n].view(torch.int32), gates0[n].view(torch.int32))
        else:
            assert not torch.equal(after[n], gates0[n])
    init = dict(_model().named_parameters())
    moved = [n for n, p in model.named_parameters() if n not in gates0 and not torch.equal(p, init[n])]
    assert len(moved) == len(init) - len(gates0)                     # everything else trains at lr


def test_router_lr_scale_default_keeps_one_param_group_and_adamws_bits():
    model, plain = _model(), _model()
    opt = distributed.build_optimizer(model, cfg(weight_decay=0.1), hooks_of(cfg()))
    assert len(opt.param_groups) == 1
    ref = torch.optim.AdamW(plain.parameters(), lr=cfg().lr, betas=(cfg().beta1, cfg().beta2), weight_decay=0.1)
    for step in range(2):
        _grads(model, step), _grads(plain, step)
        opt.step(), ref.step()
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), n
    frozen = distributed.build_optimizer(_model(), cfg(router_lr_scale=0.0), hooks_of(cfg(router_lr_scale=0.0)))
    assert len(frozen.param_groups) == 2                             # control: S != 1 splits the gates off


def test_router_lr_scale_errors():
    dense = Transformer(ModelConfig(num_experts=0))
    with pytest.raises(ConfigError, match="no MoE layer"):
        distributed.build_optimizer(dense, cfg(router_lr_scale=0.0), hooks_of(cfg(router_lr_scale=0.0)))
    with pytest.raises(ConfigError, match="--router_lr_scale=-1.0"):
        cfg(router_lr_scale=-1.0)
    state = {"step": 2, "train_config": dataclasses.asdict(cfg(steps=2))}
    with pytest.raises(ConfigError, match="router_lr_scale=1.0; resume with 1"):
        checkpoint.resume_plan(cfg(steps=4, router_lr_scale=0.0, resume=True), state, print)
    checkpoint.resume_plan(cfg(steps=4, resume=True), state, print)           # control: the same layout resumes


@pytest.mark.parametrize("option", [dict(train_capacity_factor=1.25), dict(replay="r3"), dict(route_filter="mask")])
def test_route_options_refuse_a_dense_model(option):
    with pytest.raises(ConfigError, match=f"--{next(iter(option))}=.*no MoE layer"):
        cfg(**option).check_model(ModelConfig.preset("tiny-dense"), 13)
    cfg(**option).check_model(ModelConfig.preset("tiny"), 13)           # control: an MoE takes it
    cfg().check_model(ModelConfig.preset("tiny-dense"), 13)              # and the defaults pass


def test_a_run_with_a_frozen_router_keeps_its_gates(tmp_path):
    _run(tmp_path, SMALL + ["--steps=2", "--save_every=2", "--router_lr_scale=0", "--weight_decay=0.1"])
    trained = Transformer.from_pretrained(str(tmp_path / "ckpt-000002"))
    init = train.build_model(cfg(), torch.device("cpu"), torch.float32)
    gates, start = _gate_weights(trained), _gate_weights(init)
    assert gates and all(torch.equal(gates[n], start[n]) for n in gates)
    experts = [n for n, _ in trained.named_parameters() if n.endswith("w13")]
    trained_p, init_p = dict(trained.named_parameters()), dict(init.named_parameters())
    assert experts and all(not torch.equal(trained_p[n], init_p[n]) for n in experts)   # control: the rest trains


# ---- what a run shows ------------------------------------------------------------------------------
def test_banner_checkpoint_and_progress_lines(tmp_path, capsys):
    argv = ["--task=copy", "--n_digits=2", "--prompts_per_step=2", "--group_size=2", "--minibatch_size=4",
            f"--out_dir={tmp_path}", "--progress=false", "--save_every=2", "--log_every=2"]
    train.cli(argv + ["--steps=4"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("train: tiny (qwen3_moe, ") and "M parameters, 8 experts top-2) on cpu, float32" in out[0]
    assert f"task copy; out_dir {tmp_path}; steps 1..4" in out[0]
    assert out[1].startswith("generation: stop ids [12] (") and "at most 3 new tokens (--max_new_tokens); temperature 1.0" in out[1]
    assert [line.split(":")[0] for line in out if line.startswith("step ") and "/4:" in line] == ["step 2/4", "step 4/4"]
    assert [line for line in out if ": saved " in line] == [f"step {s}: saved {tmp_path / f'ckpt-{s:06d}'}"
                                                              for s in (2, 4)]
    # a resume says where it continues
    train.cli(argv + ["--steps=6", "--resume=true"])
    assert f"resume: continuing from step 4 ({tmp_path / 'ckpt-000004'}) to step 6" in capsys.readouterr().out


def test_console_names_staleness_and_an_episodes_budget():
    """Under staleness the console's gap is the policy's age, so it says so (control: a synchronous row says
    nothing of it); an episode's banner gives a turn's limit and the episode's, since its policy tokens
    add up past one turn's."""
    from types import SimpleNamespace
    from support.tasks import generation_line, make_task
    run = SimpleNamespace(tcfg=SimpleNamespace(steps=9))
    row = {"step": 3, "reward_mean": 0.5, "loss": 0.1, "train_rollout_kl": 2e-3, "route_flip_frac": 0.01,
           "response_len": 4.0, "step_time": 1.0}
    assert "(staleness" not in runlog.progress_line(run, row)
    line = runlog.progress_line(run, {**row, "kl_staleness": 2e-3, "kl_numerics": None})
    assert "train-rollout kl 2.0e-03 (staleness; numerics -), route flips 0.010 (staleness)" in line
    assert set(runlog.bar_postfix(row)) == {"reward", "kl", "flip"}
    assert set(runlog.bar_postfix({**row, "kl_staleness": 2e-3})) == {"reward", "stale_kl", "stale_flip"}
    import_task("lookup")                                            # multi_turn/'s
    task = make_task("lookup")
    assert "at most 4 new tokens (--max_new_tokens)" in generation_line(task, 4)
    line = generation_line(task, 4, 30)
    assert "at most 4 new tokens a turn (--max_new_tokens), an episode at most 30 tokens" in line


def test_replay_old_replays_the_old_policys_routes(tmp_path, monkeypatch):
    """--replay=old (vanilla routing replay): the updates replay the routes of the recomputed old-policy
    forward. With an invariant rollout and one update per step (the policy has not moved yet) those
    are the routes the free forward takes, so the run is the no-replay run bit for bit; under a fast rollout the updates get the old forward's routes, not the
    rollout's (R3's)."""
    timing = set(runlog.TIMINGS)
    one = ["--steps=2", "--recompute_old_logp=true", "--minibatch_size=128"]
    base = _run(tmp_path / "a", SMALL + one)
    old = _run(tmp_path / "b", SMALL + one + ["--replay=old"])
    assert [{k: v for k, v in h.items() if k not in timing} for h in base] == \
        [{k: v for k, v in h.items() if k not in timing} for h in old]
    seen, real = [], train.forward

    def spy(run, score, b, micro, **kw):
        if kw.get("grad"):
            seen.append((kw.get("routes"), micro.rows))
        else:
            seen.append(("old forward", None))
        return real(run, score, b, micro, **kw)
    monkeypatch.setattr(train, "forward", spy)
    recorded = []
    real_old = train.old_policy

    def old_spy(run, batch):
        recorded.append((real_old(run, batch), batch))
        return recorded[-1][0]
    monkeypatch.setattr(train, "old_policy", old_spy)
    _run(tmp_path / "c", SMALL + ["--steps=1", "--recompute_old_logp=true", "--replay=old", "--rollout_mode=fast",
                                  "--rollout_dtype=bfloat16", "--router_bf16=true"])
    (policy, batch), = recorded
    updates = [(r, rows) for r, rows in seen if r is not None and rows is not None]
    assert updates and all(torch.equal(r, policy.audit.routes[rows]) for r, rows in updates)
    assert any(not torch.equal(r[batch.route_mask[rows]], batch.routes[rows][batch.route_mask[rows]])
               for r, rows in updates)                                # not the rollout's routes
    with pytest.raises(ConfigError, match="recompute_old_logp"):
        TrainConfig(replay="old")


FAST = ["--rollout_mode=fast", "--rollout_dtype=bfloat16", "--router_bf16=true"]   # a mismatched rollout


@pytest.mark.parametrize("layout", [[], ["--micro_batch_tokens=0"]], ids=["packed", "padded"])
def test_r3_under_a_fast_rollout_computes_with_the_rollouts_routes(tmp_path, monkeypatch, layout):
    """R3 where it matters: a fast bf16 rollout picks other experts than the trainer would. Every trainer
    forward (the old-policy recompute and the update) computes with exactly the rollout's recorded routes
    (kernels.route's ids used, per MoE layer, are the batch's routes as a multiset of rows, and equal the
    forced ids wherever one was recorded), so the routes used flip nowhere, where the free router's choice
    flips; and the train-rollout KL (k3) and worst log-prob gap fall below the no-replay run's on the same samples."""
    seen, batches, real_route, real_batch = [], [], kernels.route, train.make_batch

    def route_spy(logits, top_k, norm, forced=None, **kw):
        out = real_route(logits, top_k, norm, forced, **kw)
        if forced is not None:                                        # a trainer forward under replay
            seen.append((forced.long(), out[0]))
        return out
    monkeypatch.setattr(kernels, "route", route_spy)
    monkeypatch.setattr(train, "make_batch", lambda *a: batches.append(real_batch(*a)) or batches[-1])
    one = SMALL + FAST + layout + ["--steps=1", "--recompute_old_logp=true", "--minibatch_size=128"]
    r3 = _run(tmp_path / "r3", one + ["--replay=r3"])[0]
    free = _run(tmp_path / "none", one)[0]
    assert len(batches) == 2 and torch.equal(batches[0].tokens, batches[1].tokens)   # the same samples
    batch = batches[0]
    n_moe = batch.routes.shape[2]
    assert len(seen) == 2 * n_moe                                     # 2 forwards of one micro-batch, every MoE layer
    for c, (forced, used) in enumerate(seen):
        recorded = (forced >= 0).all(-1)
        assert torch.equal(used[recorded], forced[recorded])          # the forced experts are the ones computed
        want = batch.routes[:, :, c % n_moe][batch.route_mask]        # (N, k): the rollout's, every recorded position
        assert torch.equal(torch.unique(used[recorded], dim=0, return_counts=True)[1],
                           torch.unique(want, dim=0, return_counts=True)[1])
        assert torch.equal(torch.unique(used[recorded], dim=0), torch.unique(want, dim=0))
    assert free["route_flip_frac"] > 0 and r3["route_flip_frac"] > 0  # the router's own choice flips in both
    assert 0 < r3["train_rollout_k3"] < free["train_rollout_k3"]
    assert r3["logp_max_abs_diff"] < free["logp_max_abs_diff"]


@pytest.mark.parametrize("bound, forced_updates", [(0, [True, True, True, True]), (1, [True, False, False, False]),
                                                     (3, [True, True, True, False])])
def test_bounded_replay_replays_the_first_updates_of_a_batch_only(tmp_path, monkeypatch, bound, forced_updates):
    """--replay_steps=N: R3 on a batch's first N optimizer steps (2 epochs x 2 minibatches here), then the
    router's own routes; the old-policy forward replays either way (it is no update). Counted by the
    trainer forwards that hand kernels.route forced ids: one per MoE layer and micro-batch."""
    forwards, real = [], train.forward
    monkeypatch.setattr(train, "forward", lambda *a, **kw: forwards.append((kw["grad"], kw["routes"] is not None))
                        or real(*a, **kw))
    _run(tmp_path, SMALL + FAST + ["--steps=1", "--recompute_old_logp=true", "--minibatch_size=64", "--epochs=2",
                                   "--micro_batch_tokens=0", "--replay=r3", f"--replay_steps={bound}"])
    assert [replayed for grad, replayed in forwards if not grad] == [True, True]     # the old policy: 2 micro-batches
    assert [replayed for grad, replayed in forwards if grad] == forced_updates               # 4 updates, 1 micro-batch each
    with pytest.raises(ConfigError, match="--replay=r3 or --replay=old"):
        TrainConfig(replay_steps=2)
    with pytest.raises(ConfigError, match=">= 0"):
        TrainConfig(replay="r3", replay_steps=-1)


# ---- what the routes say: the probe, routes.jsonl, diagnostics.jsonl, the sequence-level filter -------
TIMING = set(runlog.TIMINGS)


def test_probe_drift_is_zero_at_lr_0_and_grows_with_training(tmp_path):
    probe = ["--probe_every=1", "--probe_prompts=4"]
    frozen = _run(tmp_path / "frozen", SMALL + ["--steps=3", "--lr=0"] + probe)
    assert [h["probe_route_drift"] for h in frozen] == [0.0, 0.0, 0.0]
    assert all(h["probe_route_flip_frac"] == 0 and h["probe_train_rollout_kl"] == 0 for h in frozen)
    moving = _run(tmp_path / "moving", SMALL + ["--steps=3"] + probe)
    assert moving[0]["probe_route_drift"] == 0 and moving[-1]["probe_route_drift"] > 0
    assert moving[-1]["probe_route_flip_frac"] == 0                 # the contract holds on the probe too
    # drawing the probe leaves the task's prompts (and so the run) as they were without it
    plain = _run(tmp_path / "plain", SMALL + ["--steps=3"])
    for a, b in zip(plain, moving):
        assert a == {k: v for k, v in b.items() if not k.startswith("probe_") and k not in TIMING} | \
            {k: a[k] for k in TIMING}
    every2 = _run(tmp_path / "every2", SMALL + ["--steps=2", "--probe_every=2", "--probe_prompts=2"])
    assert "probe_route_drift" not in every2[0] and every2[1]["probe_route_drift"] == 0


def test_routes_and_diagnostics_files_under_mismatch(tmp_path):
    """The router_bf16 lab flips routes: diagnostics.jsonl names the step of each row, with both sides'
    log-probs, the flipped layers and both margins per response token; routes.jsonl has the load
    histograms; metrics carry the flips binned by margin. An invariant run writes no diagnostics."""
    argv = SMALL + ["--steps=2", "--router_bf16=true", "--diagnostics=3", "--record_route_detail=true"]
    hist = _run(tmp_path / "lab", argv)
    rows = [json.loads(line) for line in open(tmp_path / "lab" / "diagnostics.jsonl")]
    assert rows and {r["step"] for r in rows} <= {1, 2} and all(sum(r["step"] == s for r in rows) <= 3 for s in (1, 2))
    for r in rows:
        n = len(r["response"])
        assert len(r["logp_train"]) == len(r["logp_rollout"]) == len(r["flipped_layers"]) == len(r["margin_rollout"]) == n
        assert r["topk_overlap"] < 1 or r["logp_max_abs_diff"] > math.log(2)
        assert isinstance(r["response_text"], str)
        fed = len(r["prompt"]) + n - 1                               # every position the sampler fed, top-2 each
        assert [sum(layer) for layer in r["expert_hist"]] == [2 * fed] * len(hist[0]["route_flip_frac_layer"])
        assert 1 / 8 <= r["expert_hot_frac"] <= 1 / 2                # 8 experts, top-2
    loads = [json.loads(line) for line in open(tmp_path / "lab" / "routes.jsonl")]
    assert [r["step"] for r in loads] == [1, 2]
    n_moe = len(hist[0]["route_flip_frac_layer"])
    assert len(loads[0]["expert_load_train"]) == n_moe
    assert sum(map(sum, loads[0]["expert_load_train"])) == sum(map(sum, loads[0]["expert_load_rollout"]))
    assert hist[0]["route_flip_frac"] > 0
    assert sum(hist[0]["route_flip_frac_by_margin"]) == pytest.approx(hist[0]["route_flip_frac"], abs=1e-6)
    _run(tmp_path / "inv", SMALL + ["--steps=2", "--diagnostics=3"])
    assert not os.path.exists(tmp_path / "inv" / "diagnostics.jsonl")


def test_sequence_route_filter_is_a_no_op_without_mismatch(tmp_path):
    """One update a step (a later minibatch would see the routes of weights moved by the first)."""
    one = ["--steps=2", "--minibatch_size=128"]
    plain = _run(tmp_path / "plain", SMALL + one)
    seq = _run(tmp_path / "seq", SMALL + one + ["--route_filter=mask", "--route_filter_level=sequence",
                                                "--route_filter_threshold=1.0"])
    for a, b in zip(plain, seq):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}
    lab = _run(tmp_path / "lab", SMALL + ["--steps=1", "--router_bf16=true", "--route_filter=mask",
                                          "--route_filter_level=sequence", "--route_filter_threshold=1.0"])
    assert lab[0]["route_filtered_frac"] > 0                         # control: under mismatch it acts


# ---- the diagnostics holdout and the key-token filter -----------------------------------------------
def _step_batch(tmp, *argv):
    """A small run's Run and its first rollout batch, with random advantages (every sequence's terms count)."""
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    apply_overrides(train.parse_args(SMALL + [f"--out_dir={tmp}", "--progress=false", *argv]), tcfg, rcfg)
    run = train.setup(tcfg, rcfg, distributed.Dist(0, 1, torch.device("cpu")))
    outs = train.rollout(run, 0, version=0).outs
    return run, train.make_batch(outs, torch.randn(len(outs), generator=torch.Generator().manual_seed(1)))


def _update(run, batch, idx, old=None, **kw):
    """old_policy (unless given) and one minibatch_step of rows idx under the config with kw (and the step
    hooks its options ask for): the old policy, the result and the clipped gradients."""
    run = with_options(run, **kw)
    old = old or train.old_policy(run, batch)
    r = train.minibatch_step(run, batch, old, idx, 0, run.tcfg.replay)
    return old, r, {n: p.grad.clone() for n, p in run.policy.master.named_parameters()}


def _deviate(batch, rows, how):
    """The batch with the rollout's recorded routes of `rows` changed by how(routes) (a deviating rollout)."""
    pick = torch.zeros(batch.tokens.shape[0], dtype=torch.bool)
    pick[rows] = True
    pick = pick[:, None, None, None] & (batch.routes >= 0)
    return dataclasses.replace(batch, routes=torch.where(pick, how(batch.routes), batch.routes))


def test_holdout_sequences_get_no_gradient(tmp_path):
    """--diagnostics_holdout takes the most mismatched sequences (here the ones whose recorded routes were
    shifted) out of the update: with token-mean aggregation the loss and gradients are bitwise those of the
    batch with their loss-mask rows zeroed by hand; per sequence, those of the minibatch without them (the
    sequence count drops too; other micro-batches, so the backward's rounding: 1e-5)."""
    run, batch = _step_batch(tmp_path, "--recompute_old_logp=true", "--diagnostics=3")
    B, E = batch.tokens.shape[0], run.policy.full.config.num_experts
    batch = _deviate(batch, torch.arange(1, B, 9), lambda r: (r + 1) % E)
    idx = torch.arange(B)
    held_old, held, g_held = _update(run, batch, idx, diagnostics_holdout=True)
    rows = held_old.held_out
    assert len(rows) == 3 and (rows % 9 == 1).all() and (held_old.loss_mask[rows] == 0).all()
    plain = train.old_policy(run, batch)
    mask = plain.loss_mask.clone()
    mask[rows] = 0
    _, by_hand, g_hand = _update(run, batch, idx, old=dataclasses.replace(plain, loss_mask=mask))
    assert held.loss == by_hand.loss and all(torch.equal(g_held[n], g_hand[n]) for n in g_held)
    _, every, g_every = _update(run, batch, idx, old=plain)                  # control: it does change the update
    assert every.loss != held.loss and any(not torch.equal(g_every[n], g_held[n]) for n in g_held)
    seq = dict(agg="seq_mean_token_mean")
    _, held_seq, g_seq = _update(run, batch, idx, diagnostics_holdout=True, **seq)
    _, rest, g_rest = _update(run, batch, idx[~torch.isin(idx, rows)], **seq)
    assert held_seq.loss == pytest.approx(rest.loss, rel=1e-6, abs=1e-7)
    for n in g_seq:
        assert (g_seq[n] - g_rest[n]).norm() <= 1e-5 * g_rest[n].norm() + 1e-12, n


def test_holdout_run_writes_and_counts_what_it_holds_out(tmp_path):
    """Under a deviating rollout (router_bf16) each step's diagnostics_held_out is the number of rows the
    step wrote, each marked held_out, the rows --diagnostics alone writes; in the invariant mode nothing
    qualifies: nothing is held out and the run is the run without the option. Without
    --recompute_old_logp (or --diagnostics) it is refused."""
    hold = ["--steps=2", "--recompute_old_logp=true", "--diagnostics=3", "--diagnostics_holdout=true"]
    lab = _run(tmp_path / "lab", SMALL + hold + ["--router_bf16=true"])
    rows = [json.loads(line) for line in open(tmp_path / "lab" / "diagnostics.jsonl")]
    assert rows and all(r["held_out"] for r in rows)
    assert [h["diagnostics_held_out"] for h in lab] == [sum(r["step"] == h["step"] for r in rows) for h in lab]
    assert all(0 < h["diagnostics_held_out"] <= 3 for h in lab)
    shown = _run(tmp_path / "shown", SMALL + hold[1:3] + ["--steps=1", "--router_bf16=true"])   # no holdout: the
    assert shown[0]["route_flip_frac"] == lab[0]["route_flip_frac"]  # same step 1, whose rows the same rule chose
    assert [r["sequence"] for r in rows if r["step"] == 1] == \
        [json.loads(line)["sequence"] for line in open(tmp_path / "shown" / "diagnostics.jsonl")]
    inv = _run(tmp_path / "inv", SMALL + hold)
    plain = _run(tmp_path / "plain", SMALL + hold[:3])
    assert [h["diagnostics_held_out"] for h in inv] == [0, 0]
    assert not os.path.exists(tmp_path / "inv" / "diagnostics.jsonl")
    for a, b in zip(plain, inv):
        assert {k: v for k, v in a.items() if k not in TIMING} == \
            {k: v for k, v in b.items() if k not in TIMING | {"diagnostics_held_out"}}
    for kw in (dict(diagnostics=3), dict(recompute_old_logp=True)):
        with pytest.raises(ConfigError, match="add --recompute_old_logp=true and --diagnostics=N"):
            TrainConfig(diagnostics_holdout=True, **kw)


def test_key_token_filter_is_an_exact_no_op_without_mismatch(tmp_path):
    """--route_filter_tokens=digits: in the invariant mode no first choice differs, so the loss and the
    gradients are bitwise those without it; with rollout routes whose first two choices are swapped on some
    rows (the top-k sets agree: the overlap filter sees nothing) exactly their digit tokens are masked."""
    run, batch = _step_batch(tmp_path, "--route_filter_tokens=digits")
    table = next(h.table for h in run.hooks if type(h).__name__ == "RouteFilter")
    assert table.tolist() == [i < 10 for i in range(run.policy.full.config.vocab_size)]
    off = with_options(run, route_filter_tokens="")
    idx = torch.arange(batch.tokens.shape[0])
    _, plain, g_plain = _update(off, batch, idx)
    _, keyed, g_keyed = _update(run, batch, idx)
    assert keyed.loss == plain.loss and keyed.filtered == plain.filtered == 0
    assert all(torch.equal(g_keyed[n], g_plain[n]) for n in g_plain)
    rows = torch.arange(0, batch.tokens.shape[0], 4)
    swapped = _deviate(batch, rows, lambda r: r.flip(-1))
    _, masked, _ = _update(run, swapped, idx)
    digits = (batch.mask[rows] > 0) & (batch.tokens[rows, 1:] < 10)   # the response's digits, by the position before
    assert masked.filtered == digits.sum().item() > 0 and masked.loss != plain.loss
    _, overlap, _ = _update(off, swapped, idx, route_filter="mask", route_filter_threshold=1.0)
    assert overlap.filtered == 0                                     # the same sets: top-k overlap 1
    lab = _run(tmp_path / "lab", SMALL + ["--steps=1", "--router_bf16=true", "--route_filter_tokens=digits"])
    assert lab[0]["route_filtered_frac"] > 0                         # a real deviating rollout: it acts


# ---- the first hour: progress, run.json, resume changes, the entropy bonus, preset fields ----------
TINY_RUN = ["--task=copy", "--n_digits=2", "--prompts_per_step=2", "--group_size=2", "--minibatch_size=4",
            "--warmup_steps=1"]


def test_progress_auto_draws_a_bar_only_on_a_terminal(tmp_path, capsys, monkeypatch):
    train.cli(TINY_RUN + [f"--out_dir={tmp_path / 'a'}", "--steps=2"])          # pytest's capture: no terminal
    out, err = capsys.readouterr()
    assert "step 1/2: reward" in out and "step 2/2: reward" in out and "train:" not in err   # lines, no bar frames
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert runlog.progress_bar(TrainConfig()) and not runlog.progress_bar(TrainConfig(progress="false"))
    train.cli(TINY_RUN + [f"--out_dir={tmp_path / 'b'}", "--steps=2"])          # control: "a terminal" draws it
    out, err = capsys.readouterr()
    assert "step 1/2: reward" not in out and "2/2" in err
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)                      # stdout to a file: lines
    assert not runlog.progress_bar(TrainConfig()) and runlog.progress_bar(TrainConfig(progress="true"))


def test_a_stop_leaves_the_bar_at_the_step_it_saved(tmp_path, capsys, monkeypatch):
    import re
    calls = []
    monkeypatch.setattr(train, "stop_requested", lambda d: 2 if len(calls) == 1 or calls.append(1) else 0)
    with pytest.raises(SystemExit) as e:
        train.cli(TINY_RUN + [f"--out_dir={tmp_path}", "--steps=5", "--progress=true"])
    out, err = capsys.readouterr()
    assert e.value.code == 130 and "step 2: saved" in out
    assert re.findall(r"train: +\d+%\|[^|]*\| (\d)/5", err)[-1] == "2"        # the bar's last frame: 2 steps done
    assert runlog.count_steps(1) == "1 step" and runlog.count_steps(2) == "2 steps"


def test_run_json_holds_every_setting_and_a_resume_says_what_changed(tmp_path, capsys):
    train.cli(TINY_RUN + [f"--out_dir={tmp_path}", "--steps=1"])
    run = json.loads((tmp_path / "run.json").read_text())                       # strict JSON, readable
    core_train, core_rollout = config.configs(())                                # the run names no plug-in's option
    assert set(run["train"]) == {f.name for f in dataclasses.fields(core_train)} and "lora_rank" not in run["train"]
    assert set(run["rollout"]) == {f.name for f in dataclasses.fields(core_rollout)} and run["start_step"] == 0
    assert run["model"]["num_hidden_layers"] == 4 and run["train"]["lr_decay_steps"] == 1
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:                                         # a change of the run's numbers
        train.cli(TINY_RUN + [f"--out_dir={tmp_path}", "--resume=true", "--steps=2", "--lr=1e-4", "--top_p=0.9"])
    out, err = capsys.readouterr()
    assert "resume: --lr=0.0001 (the saved run's: 0.001): changes the run's numbers" in out
    assert "resume: --top_p=0.9 (the saved run's: 1.0)" in out and "--steps=2" in out
    assert str(e.value.code).startswith("error: --resume: --lr, --top_p differ from the saved run") and \
        "--resume_changes=allow" in str(e.value.code) and "--steps" not in str(e.value.code)
    train.cli(TINY_RUN + [f"--out_dir={tmp_path}", "--resume=true", "--steps=2", "--lr=1e-4",    # allowed: it runs
                          "--resume_changes=allow", "--log_every=2"])
    out = capsys.readouterr().out
    assert "resume: --log_every=2 (the saved run's: 1)\n" in out and "done: 1 step" in out
    assert json.loads((tmp_path / "run.json").read_text())["train"]["lr"] == 1e-4     # the leg's settings
    train.cli(TINY_RUN + [f"--out_dir={tmp_path}", "--resume=true", "--steps=3", "--save_every=1"])   # free ones
    out = capsys.readouterr().out
    assert "resume: --save_every=1 (the saved run's: 50)\n" in out and "done: 1 step" in out


def test_a_low_entropy_warning_is_one_line(tmp_path, capsys):
    """The warning: once, when the entropy has stayed below --entropy_warn for --entropy_warn_steps steps;
    control: --entropy_warn=0 says nothing."""
    train.cli(TINY_RUN + [f"--out_dir={tmp_path / 'c'}", "--steps=4", "--entropy_warn=100", "--entropy_warn_steps=2"])
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and warned[0].startswith("warning: step 2: entropy below 100 for 2 steps")
    assert "--entropy_coef=1e-3" in warned[0]
    train.cli(TINY_RUN + [f"--out_dir={tmp_path / 'd'}", "--steps=2", "--entropy_warn=0"])
    assert "warning:" not in capsys.readouterr().out


def test_a_preset_takes_its_fields_from_the_command_line(tmp_path, capsys):
    train.cli(TINY_RUN + [f"--out_dir={tmp_path}", "--steps=1", "--num_hidden_layers=2", "--num_experts=4",
                          "--hidden_size=64", "--mlp_only_layers="])
    out = capsys.readouterr().out
    assert out.startswith("train: tiny --num_hidden_layers=2 --num_experts=4 --hidden_size=64 --mlp_only_layers=[] (")
    config = json.loads((tmp_path / "ckpt-000001" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_experts"], config["hidden_size"], config["mlp_only_layers"]) == \
        (2, 4, 64, [])
    train.cli(TINY_RUN + [f"--out_dir={tmp_path}", "--steps=2", "--resume=true"])      # the resume keeps them
    assert "resume:" in capsys.readouterr().out
    ck = tmp_path / "ckpt-000002"
    with pytest.raises(ConfigError, match=r"--num_experts=2 sets a preset's field; --init_from=.* is a checkpoint "
                                          r"folder with its own config.json"):
        train.main(TINY_RUN + [f"--init_from={ck}", "--num_experts=2", f"--out_dir={tmp_path / 'x'}"])
    with pytest.raises(ConfigError, match="num_experts_per_tok"):                       # checked whole
        train.main(TINY_RUN + ["--num_experts=1", f"--out_dir={tmp_path / 'y'}"])


def test_rollout_latency_quantiles_are_logged_in_seconds(tmp_path):
    class Out:
        def __init__(self, t):
            self.finish_time = t
    d = train.Dist(0, 1, torch.device("cpu"))
    got = runlog.latency_metrics([Out(float(t)) for t in range(1, 101)], d)    # 1 .. 100 s
    assert got == pytest.approx({"rollout_latency_p50": 50.5, "rollout_latency_p95": 95.05, "rollout_latency_p99": 99.01})
    rows = _run(tmp_path, TINY_RUN + ["--steps=2"])
    assert all(0 < r["rollout_latency_p50"] <= r["rollout_latency_p95"] <= r["rollout_latency_p99"] < r["step_time"]
               for r in rows)
