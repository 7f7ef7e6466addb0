"""hybrids/ (Qwen3.5-MoE and Qwen3-Next: Gated DeltaNet layers beside gated attention) in the model, the sampler
and the lab. The families' generic checks (logits, gradients, save -> transformers, batch invariance, the
sampler contract, greedy == generate on short prompts) run in tests/test_hf.py (conftest.FAMILY_HF); here:
what the grid is for, the contract across chunk boundaries.

    python -m pytest -q tests/test_hybrids.py
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os

import pytest
import torch

from conftest import assert_contract, assert_greedy_like_generate, load_hf_auto, make_model, rel_err
from config import ModelConfig
from support.hf import CheckpointError
from model import Transformer
from rollout import Sampler

transformers = pytest.importorskip("transformers")
# prompt lengths of every alignment to the 64-position grid: shorter than a chunk, exactly one, one past,
# several chunks; with 70 new tokens each generation crosses a boundary
ALIGNED = (1, 5, 63, 64, 65, 130)


def prompts(lengths=ALIGNED, seed=1, vocab=50):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("mt", ["qwen3_5_moe_text", "qwen3_next"])
def test_logits_over_several_chunks_within_transformers_own_fp32(family, mt):
    """150 positions (two boundaries): ours (fp32) against transformers in fp64, within 1e-4 relative, beside
    transformers' own fp32 forward's error (printed; 1-3e-5 here)."""
    hf, _, model = family(mt)
    toks = torch.randint(0, 50, (2, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = copy.deepcopy(hf).double()(toks).logits
        own, ours = rel_err(hf(toks).logits, ref), rel_err(model(toks), ref)
    print(f"\n[{mt} vs transformers fp64] ours {ours:.2e}, transformers fp32 {own:.2e}")
    assert ours < 1e-4


@pytest.mark.parametrize("engine", [dict(), dict(max_num_batched_tokens=40), dict(num_blocks=14, block_size=16)],
                         ids=["whole", "chunked-prefill", "preempted"])
def test_sampler_is_score_bitwise_across_boundaries(engine):
    """Prompts of every alignment, two samples each (a group: the members copy their leader's state), 70
    tokens (crossing boundaries), in one mixed batch; prefilled in 40-token pieces (chunked prefill off the
    grid) and with a pool so small that sequences are preempted and recomputed (40 tokens: the prompts of 63
    and more cross a boundary): every log-prob and route equal to score()'s."""
    model = make_model(ModelConfig.preset("tiny-hybrid"), std=0.1).eval()
    sampler = Sampler(model, **engine)
    outs = sampler.generate(prompts(vocab=32), max_new_tokens=70 if not engine else 40, temperature=1.0, n=2, seed=3,
                            progress=False)
    assert_contract(model, outs, 1.0)
    assert (sampler.num_preemptions > 0) == ("num_blocks" in engine)


def test_sampler_contract_in_bf16():
    model = make_model(ModelConfig.preset("tiny-hybrid"), std=0.1).eval().to(torch.bfloat16)
    outs = Sampler(model).generate(prompts((3, 64, 70), vocab=32), max_new_tokens=66, temperature=1.0, seed=4,
                                   progress=False)
    assert_contract(model, outs, 1.0)


def test_packed_score_is_the_padded_bits_and_gradients():
    """Packed rows (the trainer's default): each sequence runs its Gated DeltaNet layers from the grid's
    origin, so its log-probs and routes are the padded forward's bits (lengths across boundaries), and the
    gradients of a sum of log-probs through the packed layout are the padded one's."""
    from support.packing import Packing
    model = make_model(ModelConfig.preset("tiny-hybrid"), std=0.1)
    seqs = [torch.tensor(p) for p in prompts((70, 5, 130, 64), seed=8, vocab=32)]
    batch = torch.zeros(len(seqs), 130, dtype=torch.long)
    for i, q in enumerate(seqs):
        batch[i, :len(q)] = q
    packing = Packing.concat([len(q) for q in seqs])
    mask = torch.zeros(len(seqs), 130, dtype=torch.bool)
    for i, q in enumerate(seqs):
        mask[i, :len(q) - 1] = True

    def run(packed: bool):
        model.zero_grad()
        logp, routes = model.score(torch.cat(seqs)[None], packing=packing) if packed else model.score(batch)
        if packed:
            logp, routes = packing.to_padded(logp), packing.to_padded(routes)
        (logp * mask[:, :logp.shape[1]]).sum().backward()          # packed: one more (masked) column
        return logp.detach(), routes, [p.grad.clone() for p in model.parameters()]
    (logp, routes, grads), (plogp, proutes, pgrads) = run(False), run(True)
    for i, q in enumerate(seqs):
        assert torch.equal(plogp[i, :len(q) - 1], logp[i, :len(q) - 1]), i
        assert torch.equal(proutes[i, :len(q)], routes[i, :len(q)]), i
    for a, b in zip(pgrads, grads):
        assert (a - b).abs().max() <= 1e-5 * (1 + b.abs().max())


def test_control_the_engines_recurrent_decode_breaks_the_contract():
    """The lab's fault (--rollout_linear_decode=recurrent): the same weights, the GDN layers stepped token by
    token as engines do. Close (the same model), but not the trainer's bits."""
    from lab.faults import recurrent_decode_copy
    model = make_model(ModelConfig.preset("tiny-hybrid"), std=0.1).eval()
    engine, _ = recurrent_decode_copy(model, model, lambda: None)
    outs = Sampler(engine).generate(prompts((5, 70), vocab=32), max_new_tokens=40, temperature=1.0, seed=3,
                                    progress=False)
    with pytest.raises(AssertionError, match="logprobs differ"):
        assert_contract(model, outs, 1.0)
    for o in outs:                                                       # close all the same
        logp, _ = model.score(torch.tensor([o.prompt + o.tokens]))
        assert (torch.tensor(o.logprobs) - logp[0, len(o.prompt) - 1:]).abs().max() < 1e-3


@pytest.mark.parametrize("mt", ["qwen3_5_moe_text", "qwen3_next"])
def test_greedy_across_a_boundary_matches_transformers_generate(family, mt):
    hf, _, model = family(mt)
    assert_greedy_like_generate(hf, model, prompts((60, 64, 3)), 8)


def test_a_multimodal_qwen3_5_checkpoint_loads_as_its_text_model_and_mtp_is_kept(family, tmp_path):
    """Qwen3.5's published checkpoints are its vision-language model: config.json's text_config, the text
    weights under model.language_model., a vision tower under model.visual., MTP under mtp.. They load as the
    text model; MTP's tensors are written back by save_pretrained; an unknown key is still refused."""
    from safetensors.torch import load_file, save_file
    _, path, model = family("qwen3_5_moe_text")
    text = json.load(open(os.path.join(path, "config.json")))
    t = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
         for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    t["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(6, 2)
    t["mtp.fc.weight"] = torch.ones(4, 8)
    save_file(t, str(tmp_path / "model.safetensors"))
    json.dump({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
               "text_config": text, "vision_config": {}}, open(tmp_path / "config.json", "w"))
    vl = Transformer.from_pretrained(str(tmp_path))
    assert vl.config == model.config
    for (k, a), b in zip(vl.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    vl.save_pretrained(str(tmp_path / "out"))
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(saved["mtp.fc.weight"], t["mtp.fc.weight"]) and not any("visual" in k for k in saved)
    t["model.language_model.layers.0.linear_attn.extra"] = torch.zeros(3)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="linear_attn.extra"):
        Transformer.from_pretrained(str(tmp_path))


def test_the_pool_holds_no_pages_for_linear_layers():
    """A linear layer keeps no KV pages (0 heads); its state pool is per sampler row."""
    model = make_model(ModelConfig.preset("tiny-hybrid")).eval()
    s = Sampler(model, max_batch_size=4)
    heads = [k.shape[2] for k, _ in s.caches]
    assert heads == [0, 0, 0, 2]
    pools = s.runner.states
    assert sorted(pools) == [0, 1, 2] and pools[0].state.shape == (5, 4, 16, 16)


def repeater():
    """tiny-hybrid with its embeddings x20 and LM head x3: the next token leans on the current one, so the text
    falls into loops that n-gram drafts find (test_speculative's trick)."""
    model = make_model(ModelConfig.preset("tiny-hybrid"), std=0.1).eval()
    with torch.no_grad():
        model.embed_tokens.weight.mul_(20)
        model.lm_weight().mul_(3 if model.lm_head is not None else 1)
    return model


@pytest.mark.parametrize("engine", [dict(), dict(num_blocks=14, block_size=16)], ids=["whole", "preempted"])
def test_speculative_drafts_keep_the_contract_across_boundaries(engine):
    """Drafts (k=4) on the hybrid: a verify step never completes a chunk (ModelRunner._verify_step caps its
    drafts at the next boundary), so no rejected draft enters a state: every output is plain decoding's bits
    (hence score's), with drafts kept and rejected and generations crossing boundaries, also through
    preemption. Control: drafts uncapped (runner.grid = 0: a verify step crosses the boundary through the
    prefill's piecewise path) put rejected drafts in the state, and the outputs differ."""
    model = repeater()
    ps = prompts((5, 60, 64, 70), vocab=32) + [[3, 7, 9] * 20, [4, 4, 11, 2] * 16]
    kw = dict(max_new_tokens=80 if not engine else 40, temperature=1.0, n=2, seed=3, progress=False)
    plain = Sampler(model, **engine).generate(ps, **kw)
    spec = Sampler(model, speculative_tokens=4, **engine)
    outs = spec.generate(ps, **kw)
    assert 0 < spec.num_accepted_tokens < spec.num_drafted_tokens
    for a, b in zip(plain, outs):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs and torch.equal(a.routes, b.routes)
    assert_contract(model, outs, 1.0)
    naive = Sampler(model, speculative_tokens=4, **engine)
    naive.runner.grid = 0
    bad = naive.generate(ps, **kw)
    assert any(a.logprobs != b.logprobs for a, b in zip(plain, bad))


@pytest.mark.parametrize("engine", [dict(), dict(max_num_batched_tokens=48, num_blocks=16, state_snapshots=2)],
                         ids=["whole", "chunked-preempted-two-slots"])
def test_prefix_hits_start_from_their_boundary_state(engine):
    """A 130-token system prompt shared by prompts ending at every alignment, n=2, two requests on the same
    weights: the prefix cache serves the shared blocks up to a 64-position boundary whose state it kept
    (scheduler.BoundaryStates), in the first request (groups wait for the leader's blocks) and the second
    (whole prompts, up to their last boundary); also in 48-token prefill pieces through preemption with two
    snapshot slots (evicted, hits cut back). Every output equals a sampler without the cache bitwise, and
    score's. Controls (whole): a hit whose row is not given its boundary state differs; new weights forget
    every snapshot (the outputs equal a new sampler's)."""
    model = make_model(ModelConfig.preset("tiny-hybrid"), std=0.1).eval()
    system = prompts((130,), seed=5, vocab=32)[0]
    ps = [system + p for p in prompts((1, 5, 60, 70), vocab=32)]
    kw = dict(max_new_tokens=20, temperature=1.0, n=2, seed=3, progress=False)
    plain = Sampler(model, prefix_cache=False, **engine).generate(ps, **kw)
    sampler = Sampler(model, **engine)
    for _ in range(2):
        outs = sampler.generate(ps, **kw)
        assert sampler.num_cached_tokens >= 3 * 128
        for a, b in zip(plain, outs):
            assert a.tokens == b.tokens and a.logprobs == b.logprobs and torch.equal(a.routes, b.routes)
    assert (sampler.num_preemptions > 0) == ("num_blocks" in engine)
    assert_contract(model, outs, 1.0)
    if engine:
        return
    bm, copy = sampler.block_manager, sampler.runner.copy_states    # control: hits keep what their row held
    bm.copy = lambda pairs, load=False: None if load else copy(pairs)
    bad = sampler.generate(ps, **kw)
    assert sampler.num_cached_tokens > 0 and any(a.logprobs != b.logprobs for a, b in zip(plain, bad))
    bm.copy = copy
    sampler.generate(ps, **kw)                        # the cache full of this version's states ...
    with torch.no_grad():
        model.layers[0].linear_attn.A_log.add_(0.5)   # ... then new weights
    fresh = Sampler(model, prefix_cache=False, **engine).generate(ps, **kw)
    for a, b in zip(fresh, sampler.generate(ps, **kw)):
        assert a.logprobs == b.logprobs and torch.equal(a.routes, b.routes)


def test_refusals_are_one_line():
    from lab.faults import recurrent_decode_copy
    model = make_model(ModelConfig.preset("tiny-hybrid")).eval()
    engine, _ = recurrent_decode_copy(model, model, lambda: None)
    with pytest.raises(ValueError, match="a rejected draft cannot be rolled back"):
        Sampler(engine, speculative_tokens=2)
    with pytest.raises(ValueError, match="linear_num_value_heads > 0 go together"):
        dataclasses.replace(ModelConfig.preset("tiny-hybrid"), layer_types=["full_attention"] * 4)
    with pytest.raises(ValueError, match="model_type qwen3_5_moe_text or qwen3_next"):
        dataclasses.replace(ModelConfig.preset("tiny-hybrid"), model_type="qwen3_moe")
    with pytest.raises(ValueError, match="a multiple of linear_num_key_heads"):
        dataclasses.replace(ModelConfig.preset("tiny-hybrid"), linear_num_key_heads=3)


def saved_bytes_per_token(module, x) -> float:
    """The bytes autograd keeps for the backward of module(x), per token (each storage once; weights are not
    saved per token, so they are left out: the tensors with a parameter's storage)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values()) / (x.shape[0] * x.shape[1])


class Call(torch.nn.Module):
    """An attention layer called on x alone (the rest of its arguments fixed), for saved_bytes_per_token."""

    def __init__(self, layer, cos, sin, positions):
        super().__init__()
        self.layer, self.args = layer, (cos, sin, positions, None, 0)

    def forward(self, x):
        return self.layer(x, *self.args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plan_counts_a_gdn_layers_activations_and_the_state_pool(dtype):
    """tooling/plan.gdn_bytes against what autograd keeps for one Gated DeltaNet layer on the CPU (torch
    backend), within 10%, at two shapes; a gated attention layer's extra over a plain one within 10%; the state
    a sampler row and a prefix-cache snapshot hold are the pool's bytes exactly; and the KV bytes per token count the paged layers alone."""
    from tooling import plan
    for heads, dims, D in ((4, 16, 128), (8, 64, 256)):
        cfg = dataclasses.replace(ModelConfig.preset("tiny-hybrid"), hidden_size=D, linear_num_key_heads=heads // 2,
                                  linear_num_value_heads=heads, linear_key_head_dim=dims // 2, linear_value_head_dim=dims)
        layer = Transformer(cfg).to(dtype).layers[0].linear_attn
        real = saved_bytes_per_token(layer, torch.randn(2, 256, D, dtype=dtype, requires_grad=True))
        want = plan.gdn_bytes(cfg, dtype.itemsize, "torch")
        assert abs(want - real) <= 0.1 * real, (heads, dims, want, real)
    model = make_model(ModelConfig.preset("tiny-hybrid")).to(dtype)
    # the gated attention layer: what it keeps over a plain attention layer's, against the plan's gate term
    plain_cfg = dataclasses.replace(ModelConfig.preset("tiny"), partial_rotary_factor=0.25)
    cos, sin = model.rope("cpu")
    pos = torch.arange(256)[None].expand(2, 256)
    x = torch.randn(2, 256, 128, dtype=dtype, requires_grad=True)
    kept = [saved_bytes_per_token(Call(m, cos[pos], sin[pos], pos), x)
            for m in (model.layers[3].self_attn, Transformer(plain_cfg).to(dtype).layers[1].self_attn)]
    want = plan.layer_bytes(model.config, "torch", dtype.itemsize, 256, 3)[0] - \
        plan.layer_bytes(plain_cfg, "torch", dtype.itemsize, 256, 1)[0]
    assert abs(want - (kept[0] - kept[1])) <= 0.1 * (kept[0] - kept[1]), (want, kept)
    pools = Sampler(model, max_batch_size=3, state_snapshots=5).runner.states
    pool_bytes = sum(t.numel() * t.element_size() for p in pools.values() for t in vars(p).values())
    assert plan.state_bytes_per_sequence(model.config, dtype.itemsize) * 4 + \
        plan.state_bytes_per_sequence(model.config, dtype.itemsize, snapshot=True) * 5 == pool_bytes
    assert plan.kv_bytes_per_token(model.config, 4, False) == 2 * 2 * 32 * 4 + 4 * 2   # one paged layer, routes


def test_qwen3_5_35b_a3b_plan_on_one_node():
    """The plan the README quotes: Qwen3.5-35B-A3B on 8 x 80 GB (FSDP2, EP=8, bf16, the optimizer on the host),
    its linear-attention state in its own row."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "train.py", "--plan", "--init_from=qwen3.5-35b-a3b", "--world_size=8",
                        "--parallel=fsdp", "--dtype=bfloat16", "--expert_parallel=8", "--max_new_tokens=1024",
                        "--gpu_memory_gb=80", "--offload_optimizer=true"], cwd=os.path.dirname(os.path.dirname(
                            os.path.abspath(__file__))), capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "linear-attention state (a row per sampler row" in r.stdout and "fits: the run needs" in r.stdout
    assert "91.9 MiB per sequence (30 Gated DeltaNet layers" in r.stdout and "(10 layers x 1,024 numbers" in r.stdout


def test_multi_turn_episodes_train_with_the_contract(tmp_path):
    """--task=lookup (a tool call, its observation prefilled on the sequence's own state row, the answer):
    two steps of the hybrid, the train-rollout KL and the route flips exactly 0."""
    import train
    train.main(["--init_from=tiny-hybrid", "--task=lookup", "--n_digits=3", "--steps=2", "--prompts_per_step=8",
                "--group_size=4", f"--out_dir={tmp_path}", "--progress=false"])
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 2 and all(r["train_rollout_kl"] == 0 and r["route_flip_frac"] == 0 for r in rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hybrid_contract_on_cuda(dtype):
    """On a GPU (the default backend: Triton attention and MoE, the GDN's torch ops): a sequence's log-probs
    alone and in a padded batch are the same bits, and the sampler's are score's across boundaries."""
    model = make_model(ModelConfig.preset("tiny-hybrid"), std=0.1).eval().to("cuda", dtype)
    seqs = [torch.tensor(p, device="cuda") for p in prompts((70, 5, 130), seed=9, vocab=32)]
    batch = torch.zeros(3, 140, dtype=torch.long, device="cuda")
    for i, q in enumerate(seqs):
        batch[i, :len(q)] = q
    with torch.no_grad():
        logp, _ = model.score(batch)
        for i, q in enumerate(seqs):
            assert torch.equal(model.score(q[None])[0][0], logp[i, :len(q) - 1]), i
    outs = Sampler(model).generate(prompts((5, 63, 65), vocab=32), max_new_tokens=70, temperature=1.0, n=2, seed=3,
                                   progress=False)
    assert_contract(model, outs, 1.0)


def test_what_a_hybrid_refuses_is_one_line():
    """A hybrid family with a layer kind it cannot hold: a ConfigError naming it, before anything is built."""
    with pytest.raises(ValueError, match="needs layer_types of gated_attention and linear_attention layers"):
        dataclasses.replace(ModelConfig.preset("tiny-hybrid"), layer_types=["linear_attention"] * 3 + ["full_attention"])
    with pytest.raises(ValueError, match="needs layer_types of gated_attention and linear_attention layers"):
        ModelConfig(model_type="qwen3_5_moe_text")


def test_mtp_weights_survive_an_export_in_another_dtype(family, tmp_path):
    """The MTP tensors a checkpoint carried are written by every save path (here: the export's dtype cast)."""
    from support.checkpoint import export_model
    _, _, model = family("qwen3_next")
    model = copy.deepcopy(model)
    model.extra_tensors = {"mtp.fc.weight": torch.ones(4, 8)}
    out = export_model(model, None, "bfloat16")
    assert out is not model and out.extra_tensors["mtp.fc.weight"].dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------
# LoRA on a hybrid: the Gated DeltaNet's projections adapted like attention's
# ---------------------------------------------------------------------------------------------------
def lora_hybrid(model, words=("attention", "mlp", "experts"), dtype=torch.float32):
    """model with rank-4 adapters on words, B drawn nonzero (as after training)."""
    from lora.adapters import adapt
    model = copy.deepcopy(model)
    adapt(model, 4, 8.0, set(words), False, 1, dtype, torch.float32 if dtype == torch.float32 else dtype)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_on_the_gdn_keeps_the_contract_across_boundaries(dtype):
    """The GDN's in_proj_qkv, in_proj_z and out_proj and gated attention's projections adapted (not the
    per-head gates in_proj_a / in_proj_b): the sampler's log-probs and routes are score's bit for bit across
    grid boundaries, with a pool small enough to preempt; control: the adapter merged into the weights (an
    engine's refit) gives other log-probs."""
    from lora.adapters import merged
    model = lora_hybrid(make_model(ModelConfig.preset("tiny-hybrid"), std=0.1), dtype=dtype).eval()
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"layers.0.linear_attn.in_proj_qkv.lora_A", "layers.0.linear_attn.in_proj_z.lora_B",
            "layers.0.linear_attn.out_proj.lora_A", "layers.3.self_attn.q_proj.lora_B"} <= names
    assert not any(".in_proj_a." in n or ".in_proj_b." in n for n in names)
    for engine in (dict(), dict(num_blocks=14, block_size=16)):
        sampler = Sampler(model, **engine)
        outs = sampler.generate(prompts((5, 63, 64, 65), vocab=32), max_new_tokens=40, temperature=1.0, n=2, seed=3,
                                progress=False)
        assert_contract(model, outs, 1.0)
    assert sampler.num_preemptions > 0
    o = outs[1]
    logp = merged(model).score(torch.tensor([o.prompt + o.tokens]))[0][0, len(o.prompt) - 1:]
    assert not torch.equal(logp, torch.tensor(o.logprobs))


def test_a_lora_run_on_a_hybrid_keeps_the_contract(tmp_path):
    """train.py with --lora_rank on tiny-hybrid (packed rows): KL, |dlogp| and flips exactly 0 each step, the
    adapters move."""
    import train
    from config import RolloutConfig, TrainConfig
    tcfg = TrainConfig(init_from="tiny-hybrid", out_dir=str(tmp_path / "r"), steps=2, prompts_per_step=4, group_size=4,
                       minibatch_size=8, lora_rank=4, progress=False)
    rows = train.train(tcfg, RolloutConfig())
    assert all(r["train_rollout_kl"] == 0 and r["logp_max_abs_diff"] == 0 and r["route_flip_frac"] == 0 for r in rows)
    assert all(r["grad_norm"] > 0 for r in rows)


def test_both_families_adapters_load_into_peft_and_their_merged_checkpoints(family, tmp_path):
    """The PEFT adapter folder (GDN projections among target_modules) loads onto transformers' model of the
    checkpoint: its logits are ours within 2e-4 relative (the adapter moves them by more than 0.1), and so are
    the merged checkpoint's. The bound is twice the base's (tests/test_hf.py): B drawn at 0.3 makes weights whose
    fp32 rounding the GDN's state carries further (measured against transformers' fp64: ours 4.2e-5 / 1.4e-4 for
    Qwen3.5 / Qwen3-Next, transformers' own fp32 2.9e-5 / 3.7e-5). Qwen3-Next fuses in_proj_qkv and in_proj_z
    (in_proj_qkvz): its two adapters are written as one of rank 2r (rank_pattern), which --lora_init reads back
    into the same two, bitwise; a fused adapter whose factors mix the two parts is one line."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file, save_file
    from lora.adapters import merged
    from lora.export import read_adapter, write_adapter
    from config import ConfigError
    toks = torch.randint(0, 50, (2, 70), generator=torch.Generator().manual_seed(0))
    for mt in ("qwen3_5_moe_text", "qwen3_next"):
        hf, path, base = family(mt)
        model = lora_hybrid(base)
        with torch.no_grad():
            ours = model(toks)
            assert (ours - base(toks)).abs().max() > 0.1
        write_adapter(model, str(tmp_path / mt), 4, 8.0)
        with open(tmp_path / mt / "adapter_config.json") as f:
            config = json.load(f)
        assert "linear_attn" in config["target_modules"]
        assert ("in_proj_qkvz" in config["target_modules"]) == (mt == "qwen3_next")
        with torch.no_grad():
            theirs = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / mt))(toks).logits
        assert rel_err(theirs, ours) < 2e-4
        again = lora_hybrid(base)
        with torch.no_grad():
            for p in (p for n, p in again.named_parameters() if "lora" in n):
                p.zero_()
        read_adapter(again, str(tmp_path / mt), 4, 8.0)
        assert all(torch.equal(a, b) for (n, a), b in zip(model.named_parameters(), again.parameters()) if "lora" in n)
        merged(model).save_pretrained(str(tmp_path / f"{mt}-merged"))
        flat = load_hf_auto(str(tmp_path / f"{mt}-merged"))
        with torch.no_grad():
            assert rel_err(flat(toks).logits, ours) < 2e-4
    file = tmp_path / "qwen3_next" / "adapter_model.safetensors"
    state = load_file(str(file))
    key = next(k for k in state if k.endswith("in_proj_qkvz.lora_B.weight"))
    state[key] = torch.ones_like(state[key])                         # every row reads both parts' factors
    save_file(state, str(file))
    with pytest.raises(ConfigError, match="mixes the qkv and z rows' factors"):
        read_adapter(lora_hybrid(base), str(tmp_path / "qwen3_next"), 4, 8.0)
