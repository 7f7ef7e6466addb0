"""LoRA (lora/): unmerged adapters run by the invariant kernels, the base frozen; the contract under them,
their gradients, a run, its resume, the PEFT adapter out.

    python -m pytest -q tests/test_lora.py
"""
import copy
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from conftest import assert_contract, rel_err  # noqa: E402
from config import ConfigError, ModelConfig, RolloutConfig, TrainConfig  # noqa: E402
from lora.adapters import adapt, merged, merged_state  # noqa: E402
from model import Transformer  # noqa: E402
from rollout import Sampler  # noqa: E402
from support.runlog import TIMINGS  # noqa: E402

ALL = {"attention", "mlp", "experts", "router"}


def tiny(**kw) -> Transformer:
    """Qwen2-MoE: 1 dense + 2 MoE layers of 6 experts, a gated shared expert, q/k/v biases: every kind of target."""
    cfg = ModelConfig(model_type="qwen2_moe", attention_bias=True, qk_norm="none", vocab_size=48, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
                      mlp_only_layers=[0], max_position_embeddings=128, initializer_range=0.2,
                      shared_expert_intermediate_size=32, **kw)
    model = Transformer(cfg)
    model.reset_parameters(seed=0)
    return model


def adapted(dtype=torch.float32, shared_outer=False, words=ALL, trained=True) -> tuple[Transformer, Transformer]:
    """(base, the base with rank-4 adapters), B drawn nonzero (as after training) unless trained=False."""
    base = tiny()
    model = copy.deepcopy(base)
    adapt(model, 4, 8.0, set(words), shared_outer, 1, dtype, torch.float32 if dtype == torch.float32 else dtype)
    if trained:
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return base, model.to(dtype)


def tokens(n=3, T=21, seed=0):
    return torch.randint(0, 48, (n, T), generator=torch.Generator().manual_seed(seed))


def test_adapters_start_at_the_base_and_only_they_train():
    """B = 0: the adapted model's logits are the base's bit for bit; every base weight is frozen (in its
    compute dtype), every adapter trains, and each targeted kind has one."""
    base, model = adapted(trained=False)
    tok = tokens()
    assert torch.equal(model(tok), base(tok))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {n for n in model.state_dict() if ".lora_" in n}
    assert {"layers.0.self_attn.q_proj.lora_A", "layers.0.mlp.down_proj.lora_B", "layers.1.mlp.gate.lora_A",
            "layers.1.mlp.shared_expert.up_proj.lora_B", "layers.2.mlp.lora_A13", "layers.2.mlp.lora_B2"} <= trained
    assert "layers.1.mlp.shared_expert_gate.lora_A" not in model.state_dict()     # the 1-wide gate: not a target
    bf16 = adapted(torch.bfloat16, trained=False)[1]
    assert {p.dtype for n, p in bf16.named_parameters() if not p.requires_grad} == {torch.bfloat16}


@pytest.mark.parametrize("shared_outer", [False, True], ids=["per_expert", "shared_outer"])
def test_adapter_gradients_are_the_merged_weights_gradients_through_the_factors(shared_outer):
    """With W' = W + s B A the loss is the merged model's, so dL/dB = s G A^T and dL/dA = s B^T G where G
    = dL/dW' of the merged model (autograd there, plain weights): every adapter, experts included, within
    fp32 rounding."""
    _, model = adapted(shared_outer=shared_outer)
    tok = tokens()
    (model(tok).float().log_softmax(-1)[..., 0].sum()).backward()
    plain = merged(model).float()
    for p in plain.parameters():
        p.requires_grad_(True)
    (plain(tok).float().log_softmax(-1)[..., 0].sum()).backward()
    G = {n: p.grad for n, p in plain.named_parameters()}
    checked = 0
    torch.set_grad_enabled(False)
    for name, m in model.named_modules():
        if hasattr(m, "lora_A"):
            g = G[f"{name}.weight"]
            assert rel_err(m.lora_B.grad, m.scale * g @ m.lora_A.T) < 1e-4, name
            assert rel_err(m.lora_A.grad, m.scale * m.lora_B.T @ g) < 1e-4, name
            checked += 1
        elif hasattr(m, "lora_A13"):
            g13, g2 = G[f"{name}.w13"], G[f"{name}.w2"]                          # (E, 2I, D), (E, D, I)
            dA13 = m.scale * m.lora_B13.transpose(1, 2) @ g13                    # (E, r, D)
            dB2 = m.scale * g2 @ m.lora_A2.transpose(1, 2)                       # (E, D, r)
            if shared_outer:                                                      # one row: the experts' sum
                dA13, dB2 = dA13.sum(0, keepdim=True), dB2.sum(0, keepdim=True)
            A13 = m.lora_A13.expand(g13.shape[0], -1, -1)
            B2 = m.lora_B2.expand(g2.shape[0], -1, -1)
            assert rel_err(m.lora_A13.grad, dA13) < 1e-4 and rel_err(m.lora_B2.grad, dB2) < 1e-4, name
            assert rel_err(m.lora_B13.grad, m.scale * g13 @ A13.transpose(1, 2)) < 1e-4, name
            assert rel_err(m.lora_A2.grad, m.scale * B2.transpose(1, 2) @ g2) < 1e-4, name
            checked += 1
    torch.set_grad_enabled(True)
    assert checked == 3 * 4 + 3 + 2 + 2 * 3 + 2     # 3 layers' attention, the dense MLP, 2 routers, 2 shared experts, 2 MoE


@pytest.mark.parametrize("dtype, shared_outer", [(torch.float32, False), (torch.bfloat16, False),
                                                 (torch.bfloat16, True)], ids=["fp32", "bf16", "bf16-shared"])
def test_the_sampler_under_lora_is_score_bitwise_and_merged_weights_are_not(dtype, shared_outer):
    """The sampler's log-probs and routes are score's, bit for bit, with the adapters unmerged, also in a
    pool so small that sequences are preempted; control: the same adapter merged into the weights (an
    engine's refit) gives other log-probs."""
    _, model = adapted(dtype, shared_outer)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 48, (n,), generator=g).tolist() for n in (1, 15, 16, 17, 31, 40, 5, 33)]
    outs = None
    for kw in (dict(), dict(num_blocks=6, max_batch_size=16)):                # the second preempts
        sampler = Sampler(model, **kw)
        outs = sampler.generate(prompts, max_new_tokens=12, temperature=1.0, n=3, seed=7, progress=False)
        assert_contract(model, outs)
    assert sampler.num_preemptions > 0
    fused = merged(model)
    o = outs[0]
    logp = fused.score(torch.tensor([o.prompt + o.tokens]))[0][0, len(o.prompt) - 1:]
    assert not torch.equal(logp, torch.tensor(o.logprobs))


def test_merged_state_folds_each_adapter_once():
    _, model = adapted(shared_outer=True)
    state = merged_state(model)
    assert not any(".lora_" in k for k in state)
    m = model.layers[1].mlp
    w = m.w13.float() + m.scale * m.lora_B13 @ m.lora_A13                 # A13 shared: broadcast over experts
    assert torch.equal(state["layers.1.mlp.w13"], w)


def test_a_checkpoints_merged_export_is_made_on_the_host():
    """The HF export of a LoRA checkpoint (Lora.exported) is merged onto the host, a weight at a time
    (merged_state's device), so the GPU never holds a second base (Qwen3-30B-A3B's 61 GB on a 141 GB GPU):
    its tensors are those of the merge on the weights' own device, bitwise; the kept unused tensors (MTP's) go
    with it. On a CPU the device is shown by routing the state to `meta`."""
    from lora.hooks import Lora
    _, model = adapted(torch.bfloat16)
    model.extra_tensors = {"mtp.fc.weight": torch.ones(3)}
    here = merged(model)
    out = Lora(TrainConfig(lora_rank=4)).exported(model)
    assert {t.device.type for t in [*out.state_dict().values(), *out.extra_tensors.values()]} == {"cpu"}
    assert all(torch.equal(a, b) for a, b in zip(out.state_dict().values(), here.state_dict().values()))
    assert torch.equal(out.extra_tensors["mtp.fc.weight"], torch.ones(3))
    assert {t.device.type for t in merged_state(model, "meta").values()} == {"meta"}


def lora_run(tmp_path, name, steps=3, resume=False, fault=False, **kw):
    import train
    tcfg = TrainConfig(out_dir=str(tmp_path / name), steps=steps, prompts_per_step=4, group_size=4, minibatch_size=8,
                       lora_rank=4, resume=resume, progress=False, **kw)
    rcfg = RolloutConfig(lora_rollout="merged" if fault else "adapter")
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in train.train(tcfg, rcfg)]


@pytest.mark.parametrize("kw", [dict(), dict(dtype="bfloat16", micro_batch_tokens=40, grad_reduce="fast",
                                             lora_targets="attention,experts,router")],
                         ids=["fp32", "bf16-packed-fast"])
def test_a_lora_run_keeps_the_contract_and_its_base(tmp_path, kw):
    """Each step's train-rollout KL, |dlogp| and route flips are exactly 0; the adapters move, the base
    stays at its initial bits (the checkpoint's masters), and the HF export is the merged weights."""
    from safetensors.torch import load_file
    from support.checkpoint import build_model, run_task
    rows = lora_run(tmp_path, "run", **kw)
    for r in rows:
        assert r["train_rollout_kl"] == 0 and r["logp_max_abs_diff"] == 0 and r["route_flip_frac"] == 0, r
        assert r["grad_norm"] > 0
    ckpt = tmp_path / "run" / "ckpt-000003"
    masters = load_file(str(ckpt / "masters.safetensors"))
    tcfg = TrainConfig(lora_rank=4, **{k: v for k, v in kw.items() if k == "dtype"})
    init = build_model(tcfg, "cpu", torch.float32, run_task(tcfg, RolloutConfig())[1]).state_dict()
    dtype = getattr(torch, tcfg.dtype)
    for k, v in init.items():                                           # frozen in the compute dtype
        assert torch.equal(masters[k], v.to(masters[k].dtype)), k
        assert masters[k].dtype == dtype or k.endswith("gate.weight"), k   # a router: its own dtype
    assert any(".lora_B" in k and masters[k].abs().max() > 0 for k in masters)
    exported = Transformer.from_pretrained(str(ckpt))
    assert not torch.equal(exported.layers[0].self_attn.q_proj.weight, masters["layers.0.self_attn.q_proj.weight"])


def test_a_resumed_lora_run_continues_bit_for_bit(tmp_path):
    whole = lora_run(tmp_path, "whole", steps=4)
    lora_run(tmp_path, "split", steps=2)
    assert lora_run(tmp_path, "split", steps=4, resume=True) == whole[2:]


def test_export_writes_a_peft_adapter_and_the_merged_checkpoint(tmp_path):
    """peft loads the adapter folder onto transformers' model of the base: its logits are ours within fp32
    rounding (scale ~6, tolerance 1e-4), as are the merged checkpoint's; a base of other weights is refused."""
    peft = pytest.importorskip("peft")
    import transformers
    from lora.export import check_base, write_adapter
    for shared_outer in (False, True):
        base, model = adapted(shared_outer=shared_outer)
        base.save_pretrained(str(tmp_path / "base"))
        out = tmp_path / f"adapter{shared_outer}"
        write_adapter(model, str(out), 4, 8.0)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
        with_adapter = peft.PeftModel.from_pretrained(hf, str(out))
        tok = tokens()
        ours = model(tok)
        assert (with_adapter(tok).logits - ours).abs().max() < 1e-4
        assert (ours - base(tok)).abs().max() > 1                         # the adapter matters
        merged(model).save_pretrained(str(tmp_path / "merged"))
        flat = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
        assert (flat(tok).logits - ours).abs().max() < 1e-4
        check_base(str(out), model)
        with pytest.raises(ConfigError, match="trained on another base"):
            check_base(str(out), adapted(trained=False)[1].requires_grad_(False).apply(_nudge))
    with open(out / "adapter_config.json") as f:
        assert json.load(f)["r"] == 4


def test_gpt_oss_experts_adapter_loads_into_peft_and_reads_back(family, tmp_path):
    """gpt-oss's fused experts (gate_up_proj (E, D, 2I) with gate and up outputs alternating): the exported
    adapter's B rows alternate as well, peft's model of the checkpoint gives our logits (the adapter moves
    them by more than 0.1), and --lora_init reads the adapter back bitwise."""
    peft = pytest.importorskip("peft")
    from lora.export import read_adapter, write_adapter
    hf, _, base = family("gpt_oss")

    def with_adapters(trained):
        model = copy.deepcopy(base)
        adapt(model, 4, 8.0, {"attention", "experts"}, False, 1, torch.float32, torch.float32)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3 if trained else torch.zeros(p.shape))
        return model
    model, tok = with_adapters(True), tokens(2, 30)
    write_adapter(model, str(tmp_path / "a"), 4, 8.0)
    with torch.no_grad():
        ours = model(tok)
        theirs = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "a"))(tok).logits
        assert (ours - base(tok)).abs().max() > 0.1 and rel_err(theirs, ours) < 1e-4
    again = with_adapters(False)
    read_adapter(again, str(tmp_path / "a"), 4, 8.0)
    assert all(torch.equal(a, b) for (n, a), b in zip(model.named_parameters(), again.parameters()) if "lora" in n)


def test_an_expert_parallel_rank_reads_an_adapter_onto_its_experts(tmp_path, monkeypatch):
    """--lora_init under EP: a rank holds some experts' rows (two shards of 6 here, one permuted). base_sha256
    completes a stacked tensor's expert row digests with its peers' (all_gather_object; here the shards' own,
    captured) into the whole model's hash; read_adapter gives each shard its experts' rows of the adapter,
    bitwise. Control: a shard's hash without its peers' rows is another."""
    from lora import export
    _, model = adapted()
    export.write_adapter(model, str(tmp_path / "a"), 4, 8.0)
    shards = [[4, 0, 2], [1, 3, 5]]
    parts = [adapted(trained=False)[1] for _ in shards]
    for m, held in zip(parts, shards):
        m.keep_experts(held)
    sent = []                                         # each shard's own row digests, as the gather sends them
    alone = [export.base_sha256(m, held, gather=lambda r: sent.append(r) or []) for m, held in zip(parts, shards)]
    monkeypatch.setattr(export, "_all_gather", lambda _: sent)
    whole = export.base_sha256(model)
    assert all(export.base_sha256(m, held) == whole != a for m, held, a in zip(parts, shards, alone))
    for m, held in zip(parts, shards):
        export.read_adapter(m, str(tmp_path / "a"), 4, 8.0, held)
        for (n, want), got in zip(model.named_parameters(), m.parameters()):
            if "lora" in n:
                assert torch.equal(got, want[held] if n.endswith(("A13", "B13", "A2", "B2")) else want), n


def _nudge(m):
    if hasattr(m, "weight") and isinstance(m.weight, torch.Tensor) and m.weight.dim() == 2:
        with torch.no_grad():
            m.weight.add_(1e-3)


def test_export_cli_from_a_run(tmp_path):
    import subprocess
    lora_run(tmp_path, "run", steps=2)
    r = subprocess.run([sys.executable, "-m", "lora.export", str(tmp_path / "run"), str(tmp_path / "out")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "out")) == ["adapter", "merged"]
    again = subprocess.run([sys.executable, "-m", "lora.export", str(tmp_path / "run"), str(tmp_path / "out")],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and again.stdout.startswith("error:") and "not an empty folder" in again.stdout


def test_a_lora_checkpoint_and_its_exported_adapter_start_new_runs(tmp_path):
    """--init_from a LoRA run's checkpoint continues its base and adapters at their saved bits; --lora_init
    of its exported adapter over the same base gives the same adapters; another base, rank or a plain
    export are one line each, and support.checkpoint's export of it is the merged weights."""
    import subprocess
    from safetensors.torch import load_file
    from lora.hooks import Lora
    from support.checkpoint import build_model, export, run_task
    lora_run(tmp_path, "run", steps=2)
    ckpt = tmp_path / "run" / "ckpt-000002"
    masters = load_file(str(ckpt / "masters.safetensors"))

    def started(**kw):
        tcfg = TrainConfig(**{"lora_rank": 4, **kw})
        model = build_model(tcfg, "cpu", torch.float32, run_task(tcfg, RolloutConfig())[1])
        Lora(tcfg).adapt(model)
        return model.state_dict()
    assert all(torch.equal(v, masters[k]) for k, v in started(init_from=str(ckpt)).items())
    with pytest.raises(ConfigError, match="holds adapters of --lora_rank=4"):
        started(init_from=str(ckpt), lora_rank=2)
    r = subprocess.run([sys.executable, "-m", "lora.export", str(ckpt), str(tmp_path / "out")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    adapter = str(tmp_path / "out" / "adapter")
    assert all(torch.equal(v, masters[k]) for k, v in started(lora_init=adapter).items())
    with pytest.raises(ConfigError, match="trained on another base"):
        started(lora_init=adapter, seed=1)
    with pytest.raises(ConfigError, match="rank 4, alpha 32"):
        started(lora_init=adapter, lora_alpha=16.0)
    export(str(ckpt), str(tmp_path / "plain"))
    plain, merged_hf = load_file(str(tmp_path / "plain" / "model.safetensors")), load_file(str(ckpt / "model.safetensors"))
    assert plain.keys() == merged_hf.keys() and all(torch.equal(v, merged_hf[k]) for k, v in plain.items())


def test_the_plan_counts_the_frozen_base_once_and_the_adapters_state():
    """Qwen3-30B-A3B, rank 32 on every target, bf16 over fp32 adapter masters, 1,024-token responses, one
    141 GB GPU: the plan fits (and on 8 x 80 GB with EP=8); its base is one bf16 copy of every base weight, its masters 4 bytes an adapter
    parameter of the adapted model (a meta build), and the adapters' factors shared cost less."""
    from config import apply_command_line, parse_args
    from lora.adapters import adapted_shapes
    from tooling import plan
    args = ["--init_from=qwen3-30b-a3b", "--dtype=bfloat16", "--max_new_tokens=1024", "--gpu_memory_gb=141",
            "--lora_rank=32"]
    text, fits = plan.main(args + ["--world_size=1"])
    assert fits and "frozen base" in text and "fits: the run needs" in text
    text, fits = plan.main([a for a in args if "gpu_memory_gb" not in a]
                           + ["--gpu_memory_gb=80", "--world_size=8", "--expert_parallel=8"])
    assert fits and "8 rank(s), DDP, --expert_parallel=8" in text               # 8 x 80 GB with EP
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    apply_command_line(parse_args([a for a in args if "gpu_memory_gb" not in a]), tcfg, rcfg)
    p, _, _ = plan.plan_of(tcfg, rcfg, 1)
    trained, frozen = adapted_shapes(plan.preset_or_folder(tcfg), tcfg)
    n_trained = sum(torch.Size(s).numel() for _, s in trained)
    assert p.frozen == 2 * sum(torch.Size(s).numel() for _, s in frozen) and p.frozen_params * 2 == p.frozen
    assert p.masters == 4 * n_trained and p.compute_copy == 2 * n_trained and 60e9 < p.frozen < 62e9
    apply_command_line(parse_args(["--lora_expert_factors=shared_outer"]), tcfg, rcfg)
    assert plan.plan_of(tcfg, rcfg, 1)[0].masters < p.masters / 2


def test_bench_lora_section_times_both_steps_and_both_samplers(capsys):
    from tooling import bench
    bench.main(["--only", "lora", "--score-batch=2", "--score-len=8", "--prompts=2", "--max-new-tokens=3",
                "--repeats=1", "--warmup=0", "--threads=1", "--lora-rank=4"])
    out = capsys.readouterr().out
    assert "LoRA / full, trainer step time" in out and "rollout, LoRA r4 unmerged" in out


def test_the_merged_rollout_fault_samples_from_merged_weights_and_breaks_the_contract(tmp_path):
    """--lora_rollout=merged (the lab's fault): the sampler's copy is the merged weights, refreshed after each
    update; in a bf16 run the train-rollout gap is then not zero, where the unmerged adapter's is."""
    rows = lora_run(tmp_path, "merged", steps=2, dtype="bfloat16", lr=1e-2, fault=True)
    assert rows[-1]["logp_max_abs_diff"] > 0 and rows[-1]["train_rollout_kl"] != 0


@pytest.mark.parametrize("args, words", [
    (["--lora_targets=foo"], "a comma-separated subset"),
    (["--lora_rank=100"], "above layers.0.self_attn.k_proj's smaller dimension"),
    (["--lora_targets=experts", "--init_from=tiny-dense"], "no layer of this model matches"),
    (["--expert_parallel=2", "--lora_expert_factors=shared_outer"], "is not an expert's row to shard"),
    (["--expert_parallel=2", "--eplb_redundant=2"], "with --eplb_redundant and experts"),
    (["--parallel=fsdp"], "not supported yet"),
])
def test_lora_options_that_cannot_apply_are_one_line(tmp_path, args, words):
    from conftest import cli_error
    line = cli_error(["--lora_rank=4", "--steps=1", f"--out_dir={tmp_path}/o", *args])
    assert line.startswith("error:") and words in line, line


def test_an_ep_shard_holds_ep1s_adapter_rows_and_the_merged_fault_stays_at_ep1():
    """adapt on a model holding experts [5, 2] (an EP rank's shard, built so) draws every expert's factors
    and keeps those rows: the shard's adapters are EP=1's rows 5 and 2, the dense ones equal (the EP=2 run
    against one process: tests/world_check.py). The lab's merged copy needs whole experts: one line under EP."""
    from lora.hooks import Lora
    cfg = ModelConfig.preset("tiny")
    whole, shard = Transformer(cfg), Transformer(cfg)
    shard.keep_experts([5, 2])
    for m, experts in ((whole, None), (shard, [5, 2])):
        adapt(m, 4, 8.0, {"attention", "experts"}, False, 1, torch.float32, torch.float32, experts)
    mine, ref = shard.state_dict(), whole.state_dict()
    for k, v in mine.items():
        if "lora_" in k:
            assert torch.equal(v, ref[k][[5, 2]] if k.rsplit(".", 1)[-1][-2:] in ("13", "A2", "B2") else ref[k]), k
    assert not torch.equal(mine["layers.1.mlp.lora_A13"], ref["layers.1.mlp.lora_A13"][:2])      # control: rows differ
    tcfg = TrainConfig(lora_rank=4, expert_parallel=2)
    with pytest.raises(ConfigError, match="the merged copy holds whole experts"):
        Lora(tcfg, RolloutConfig(lora_rollout="merged")).check_build(None, cfg)
