"""memory/: activation checkpointing recomputes a layer's forward in the backward with the same kernels on
the same inputs, so its gradients are the run's without it, bit for bit (FSDP2 and EP: tests/world_check.py).

    python -m pytest -q tests/test_memory.py
"""
import copy

import pytest
import torch
from torch.utils.checkpoint import CheckpointError

import kernels
from config import ConfigError, ModelConfig, TrainConfig
from memory.checkpointing import checkpoint_layers
from model import Transformer
from support.packing import Packing

LENGTHS = (9, 5, 12)


def make_model(dtype, preset="tiny"):
    torch.manual_seed(0)
    cfg = ModelConfig.preset(preset)
    return Transformer(cfg).to(dtype)


def batch(vocab):
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, vocab, (len(LENGTHS), max(LENGTHS)), generator=g)
    return tok


def grads_of(model, tok, packed: bool):
    """Every parameter's gradient of a loss over the log-probs, the entropy and the router logits (the
    router losses' path: logits kept by the forward, outside the checkpointed region's outputs)."""
    model.zero_grad(set_to_none=True)
    if packed:
        pk = Packing.concat(LENGTHS)
        tok = pk.from_padded(tok)
        out = model.score(tok, with_entropy=True, packing=pk, route_detail=True, router_logits=True)
    else:
        out = model.score(tok, with_entropy=True, route_detail=True, router_logits=True)
    logp, routes, entropy, detail = out
    w = torch.linspace(-1, 1, logp.numel()).view(logp.shape)
    loss = (logp.float() * w).sum() + entropy.float().sum() + detail.logits.float().square().mean()
    loss.backward()
    return (logp, routes, detail.weights), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["moe", "full"])
@pytest.mark.parametrize("dtype,packed", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)])
def test_checkpointed_gradients_are_the_plain_ones(kind, dtype, packed):
    plain = make_model(dtype)
    ckpt = copy.deepcopy(plain)
    assert checkpoint_layers(ckpt, kind) == (len(plain.config.moe_layers) if kind == "moe" else len(plain.layers))
    tok = batch(plain.config.vocab_size)
    outs, grads = grads_of(plain, tok, packed)
    outs2, grads2 = grads_of(ckpt, tok, packed)
    for a, b in zip(outs, outs2):
        assert torch.equal(a, b)
    assert grads.keys() == grads2.keys()
    for name in grads:
        assert torch.equal(grads[name], grads2[name]), name
    # control: a recompute by other kernels (the lab's batch-variant ops) is not the forward it replays:
    # torch's check sees other tensors saved, or the gradients differ
    from lab.fast_ops import op_set
    ckpt.zero_grad(set_to_none=True)
    logp = ckpt.score(tok)[0]
    try:
        with kernels.op_set(op_set(batch_variant=True, router_bf16=False)):
            logp.float().sum().backward()
    except CheckpointError:
        return
    plain.zero_grad(set_to_none=True)
    plain.score(tok)[0].float().sum().backward()
    assert any(not torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), ckpt.parameters()))


def test_checkpointed_layers_leave_no_grad_forwards_and_copies_alone():
    """Without autograd (the sampler, the old policy) the layer's forward runs as is; a deepcopy of a
    checkpointed model (the lab's rollout copy) recomputes its own layers, not the original's."""
    model = make_model(torch.float32)
    checkpoint_layers(model, "full")
    tok = batch(model.config.vocab_size)
    with torch.no_grad():
        ref = model.score(tok)[0]
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
        assert torch.equal(model.score(tok)[0], ref) and not torch.equal(twin.score(tok)[0], ref)
    (twin.score(tok)[0].sum()).backward()
    assert all(p.grad is None for p in model.parameters()) and all(p.grad is not None for p in twin.parameters())


def test_train_with_checkpointing_is_the_run_without(tmp_path):
    """Two steps of train.py's loop with --activation_checkpointing=full and =moe: the same metrics but
    the timings, and the same weights, as without."""
    import train
    from config import RolloutConfig
    from support.runlog import TIMINGS
    runs = {}
    for kind in ("none", "moe", "full"):
        tcfg = TrainConfig(steps=2, prompts_per_step=4, group_size=4, minibatch_size=8, micro_batch_tokens=48,
                           out_dir=str(tmp_path / kind), progress=False, activation_checkpointing=kind)
        rows = train.train(tcfg, RolloutConfig())
        from safetensors.torch import load_file
        runs[kind] = ([{k: v for k, v in r.items() if k not in TIMINGS} for r in rows],
                      load_file(str(tmp_path / kind / "ckpt-000002" / "model.safetensors")))
    for kind in ("moe", "full"):
        assert runs[kind][0] == runs["none"][0], kind
        assert all(torch.equal(runs[kind][1][k], v) for k, v in runs["none"][1].items()), kind


def test_checkpointing_options_refuse_what_cannot_apply():
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        TrainConfig(activation_checkpointing="some")
    with pytest.raises(ConfigError, match="train_capacity_factor"):
        TrainConfig(activation_checkpointing="moe", train_capacity_factor=1.0)
    with pytest.raises(ConfigError, match="no MoE layer"):
        TrainConfig(activation_checkpointing="moe").check_model(ModelConfig.preset("tiny-dense"), 32)


def test_bench_memory_section_times_the_three_and_finds_the_same_gradients(capsys):
    from tooling import bench
    bench.main(["--only", "memory", "--score-batch=2", "--score-len=8", "--repeats=1", "--warmup=0", "--threads=1"])
    out = capsys.readouterr().out
    assert "full / none" in out and "moe / none" in out and "DIFFER" not in out


def test_a_resume_may_switch_checkpointing_and_offload_and_continues_the_run(tmp_path):
    """--activation_checkpointing and --offload_optimizer are free on resume (MemoryOptions.FREE_ON_RESUME):
    two steps without them, resumed with each block recomputed and the saved AdamW state loaded onto host
    masters, equal three steps straight, metrics and weights."""
    import train
    from safetensors.torch import load_file
    from support.checkpoint import command_line_configs
    from support.runlog import TIMINGS
    common = ["--prompts_per_step=4", "--group_size=4", "--minibatch_size=8", "--progress=false"]

    def run(out, *extra):
        from config import parse_args
        tcfg, rcfg = command_line_configs(parse_args(common + [f"--out_dir={out}", *extra]), lambda *a: None)
        return train.train(tcfg, rcfg)
    straight = run(tmp_path / "a", "--steps=3")
    run(tmp_path / "b", "--steps=2")
    resumed = run(tmp_path / "b", "--steps=3", "--resume=true", "--activation_checkpointing=full",
                  "--offload_optimizer=true")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]
    assert strip(resumed) == strip(straight[2:])
    a, b = (load_file(str(p / "ckpt-000003" / "model.safetensors")) for p in (tmp_path / "a", tmp_path / "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_offload_keeps_the_masters_apart_and_the_run_bitwise(tmp_path, monkeypatch):
    """--offload_optimizer on the CPU device, fp32: the masters (the optimizer's) are a second set apart
    from the compute copy the trainer and the sampler run (on a GPU: host and device), and two steps give
    the same metrics but the timings, and the same weights, as without; so do bf16 weights with fp32 gates
    (--master_dtype=bfloat16, GLM's router) and the router bias. Control: the host's update by
    another AdamW kernel (torch's fused one, as a step on another device may be) is another run."""
    import train
    from config import RolloutConfig
    from safetensors.torch import load_file
    from support import distributed
    from support.distributed import Dist
    from support.runlog import TIMINGS
    common = dict(steps=2, prompts_per_step=4, group_size=4, minibatch_size=8, micro_batch_tokens=48, progress=False)
    run = train.setup(TrainConfig(**common, out_dir=str(tmp_path / "setup"), offload_optimizer=True), RolloutConfig(),
                      Dist(0, 1, torch.device("cpu")))
    p = run.policy
    assert p.mp is not None and p.sampler is p.full and p.full is not p.master
    masters = {t.data_ptr() for t in p.master.parameters()}
    assert not masters & {t.data_ptr() for t in p.full.parameters()}
    assert {id(t) for g in p.optimizer.param_groups for t in g["params"]} == {id(t) for t in p.master.parameters()}

    def two_steps(name, **kw):
        rows = train.train(TrainConfig(**common, out_dir=str(tmp_path / name), **kw), RolloutConfig())
        return ([{k: v for k, v in r.items() if k not in TIMINGS} for r in rows],
                load_file(str(tmp_path / name / "ckpt-000002" / "model.safetensors")))
    plain, offloaded = two_steps("plain"), two_steps("offload", offload_optimizer=True)
    assert offloaded[0] == plain[0]
    assert all(torch.equal(offloaded[1][k], v) for k, v in plain[1].items())
    bf16 = dict(dtype="bfloat16", master_dtype="bfloat16", init_from="tiny-sigmoid", router_dtype="float32",
                expert_bias_update_rate=1e-3)
    plain16, offloaded16 = two_steps("plain16", **bf16), two_steps("offload16", offload_optimizer=True, **bf16)
    assert offloaded16[0] == plain16[0]                          # bf16 weights, fp32 gates and bias, offloaded too
    assert all(torch.equal(offloaded16[1][k], v) for k, v in plain16[1].items())
    build = distributed.build_optimizer
    monkeypatch.setattr(distributed, "build_optimizer", lambda model, tcfg, hooks=(): torch.optim.AdamW(
        model.parameters(), lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), weight_decay=tcfg.weight_decay, fused=True))
    fused = two_steps("fused", offload_optimizer=True)
    monkeypatch.setattr(distributed, "build_optimizer", build)
    assert not all(torch.equal(fused[1][k], v) for k, v in plain[1].items())


def test_offload_refuses_a_host_too_small_and_eplb(tmp_path, monkeypatch):
    """A host without the memory for the optimizer's state is one line before the first step; EPLB (its
    replicas' sums folded on the device) with offload is refused at the options."""
    import train
    from config import RolloutConfig
    from memory import offload
    from support.distributed import Dist
    monkeypatch.setattr(offload, "available_host_bytes", lambda: 10_000)
    tcfg = TrainConfig(steps=1, out_dir=str(tmp_path / "small"), progress=False, offload_optimizer=True)
    with pytest.raises(ConfigError, match=r"--offload_optimizer: the host has 0.0 GB available"):
        train.setup(tcfg, RolloutConfig(), Dist(0, 1, torch.device("cpu")))
    with pytest.raises(ConfigError, match="--offload_optimizer with --eplb_redundant"):
        TrainConfig(offload_optimizer=True, eplb_redundant=2, expert_parallel=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_on_cuda_keeps_the_contract_and_the_masters_on_the_host(tmp_path):
    """On a GPU (tools/gpu_check.sh): --offload_optimizer, bf16 over fp32 masters, two steps: the masters
    pinned on the host and the compute copy on the GPU, the train-rollout KL, the log-prob gap and the
    route flips exactly 0, less GPU memory than without, and the same run up to the host AdamW's last bits."""
    import train
    from config import RolloutConfig
    from support.distributed import Dist
    common = dict(steps=2, prompts_per_step=4, group_size=4, minibatch_size=8, micro_batch_tokens=48, progress=False,
                  device="cuda", dtype="bfloat16")
    run = train.setup(TrainConfig(**common, out_dir=str(tmp_path / "setup"), offload_optimizer=True), RolloutConfig(),
                      Dist(0, 1, torch.device("cuda")))
    assert all(t.device.type == "cpu" and t.is_pinned() for t in run.policy.master.parameters())
    assert all(t.device.type == "cuda" for t in run.policy.full.parameters())
    del run
    peaks, rows = {}, {}
    for name, kw in (("plain", {}), ("offload", dict(offload_optimizer=True))):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        rows[name] = train.train(TrainConfig(**common, out_dir=str(tmp_path / name), **kw),
                                 RolloutConfig(num_blocks=256))             # a fixed pool, not the free memory's share
        peaks[name] = torch.cuda.max_memory_allocated()
    for r in rows["offload"]:
        assert r["train_rollout_kl"] == 0 and r["logp_max_abs_diff"] == 0 and r["route_flip_frac"] == 0
    assert peaks["offload"] < peaks["plain"], peaks
    assert abs(rows["offload"][-1]["loss"] - rows["plain"][-1]["loss"]) < 1e-2


def test_the_kv_pool_is_freed_between_requests_when_asked_and_comes_back_the_same():
    """Sampler.release_kv: the pages and their routes go (their memory is the update's in the synchronous
    loop), the next generate() allocates them again and samples the same tokens, log-probs and routes as a
    sampler that kept them; the prefix cache goes with them (a repeated request hits before, not after).
    A sampler not tracking its weights keeps both (the lab's stale prefix)."""
    from rollout import Sampler
    torch.manual_seed(0)
    model = Transformer(ModelConfig()).eval()
    prompts = [[1, 2, 3, 4] * 5, [5, 6, 7] * 6]
    kept, freed = Sampler(model, num_blocks=32), Sampler(model, num_blocks=32)
    first = [sampler.generate(prompts, max_new_tokens=6, n=2, seed=3) for sampler in (kept, freed)]
    freed.release_kv()
    assert freed.caches is None and freed.runner.route_pages is None
    again = [sampler.generate(prompts, max_new_tokens=6, n=2, seed=4) for sampler in (kept, freed)]
    assert freed.caches is not None
    assert kept.prefix_hit_rate > 0 == freed.prefix_hit_rate                 # the cache went with the pages
    for a, b in zip(*(first[i] + again[i] for i in (0, 1))):
        assert a.tokens == b.tokens and torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
        assert torch.equal(a.routes, b.routes)
    kept.track_weights = False
    kept.release_kv()
    assert kept.caches is not None


def test_the_synchronous_loop_frees_the_pool_for_the_update_and_the_plan_counts_the_larger(tmp_path):
    """After each synchronous rollout the run's sampler holds no KV pool (train.py's update runs without it);
    an asynchronous source keeps it. The plan counts the pool within the sampler's phase then, beside the
    trainer's otherwise."""
    import train
    from config import RolloutConfig
    from support.distributed import Dist
    from tooling import plan
    run = train.setup(TrainConfig(steps=1, prompts_per_step=4, group_size=2, minibatch_size=8, progress=False,
                                  out_dir=str(tmp_path / "sync")), RolloutConfig(), Dist(0, 1, torch.device("cpu")))
    assert run.sampler.caches is not None
    run.rollouts.take(1)
    assert run.sampler.caches is None
    common = ["--init_from=qwen3-30b-a3b", "--world_size=8", "--parallel=fsdp", "--expert_parallel=8",
              "--dtype=bfloat16", "--max_new_tokens=8192", "--offload_optimizer=true"]
    sync, stale = (plan.main(common + extra)[0] for extra in ([], ["--max_staleness=1"]))
    gb = lambda text, row: float(next(l for l in text.splitlines() if l.strip().startswith(row)).split()[-2])
    kv, act = gb(sync, "KV pool"), gb(sync, "activations, trainer")
    assert "freed while the update runs" in sync and "freed" not in stale and kv > 1
    assert abs(gb(stale, "total") - gb(sync, "total") - kv) < 0.03 and act > kv + gb(sync, "activations, sampler")
