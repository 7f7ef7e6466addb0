"""`python train.py --plan`: the memory arithmetic held against the bytes of a tiny model's real, sharded
parameters, and the plan's verdict for Qwen3-30B-A3B on 8 x 80 GB with and without expert parallelism."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import plan
from config import ConfigError, ModelConfig
from expert_parallel import ExpertParallel, Placement, shard_experts
from model import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sharded_tiny(n, rank, dtype=torch.float32):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny")).to(dtype)
    return shard_experts(model, ExpertParallel(Placement.contiguous(8, n), rank)) if n > 1 else model


def is_expert(name):
    return name.endswith((".mlp.w13", ".mlp.w2"))


@pytest.mark.parametrize("world, n", [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)])
def test_plan_matches_the_bytes_of_sharded_parameters(world, n):
    shapes = plan.parameter_shapes(ModelConfig.preset("tiny"))
    for rank in range(n):
        fp32, bf16 = sharded_tiny(n, rank), sharded_tiny(n, rank, torch.bfloat16)
        ddp = plan.memory_plan(shapes, world, "ddp", n, 2, 2, 0)
        assert ddp.masters == sum(p.nbytes for p in fp32.parameters())
        assert ddp.compute_copy == sum(p.nbytes for p in bf16.parameters()) and ddp.sampler_copy == 0
        assert ddp.grads == ddp.masters and ddp.adamw == 2 * ddp.masters
        if world == 1:                                                   # one process: no FSDP2
            continue
        # FSDP2 shards dim 0 as torch.chunk does: dense over the world, this rank's experts over world / n
        fsdp = plan.memory_plan(shapes, world, "fsdp", n, 2, 2, 0)
        first_shards = sum(torch.chunk(p, world // n if is_expert(k) else world)[0].nbytes
                           for k, p in fp32.named_parameters())
        assert fsdp.masters == first_shards
        assert fsdp.sampler_copy == ddp.compute_copy                     # whole dense + E/N experts, bf16
        assert fsdp.compute_copy == first_shards // 2


def allocated(model):
    """(parameters, gradients, AdamW moments) bytes after a real backward and AdamW step."""
    tokens = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    model.score(tokens)[0].float().sum().backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    moments = sum(v.nbytes for s in opt.state.values() for v in s.values() if v.dim() > 0)   # not the step counts
    return (sum(p.nbytes for p in model.parameters()), sum(p.grad.nbytes for p in model.parameters()), moments)


@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16])
def test_plan_matches_a_real_optimizer_step(master):
    """Masters, gradients and AdamW's moments in the --master_dtype (bf16: 2 + 2 + 4 bytes, no compute
    copy), as one process allocates them."""
    shapes = plan.parameter_shapes(ModelConfig.preset("tiny"))
    masters, grads, moments = allocated(sharded_tiny(1, 0, master))
    b = 4 if master == torch.float32 else 2
    p = plan.memory_plan(shapes, 1, "ddp", 1, b, b, 0, master_bytes=b)
    assert (p.masters, p.grads, p.adamw) == (masters, grads, moments) and p.compute_copy == 0


def gb(table, row):
    """The GB of a row of plan.main's table."""
    return float(next(line for line in table.splitlines() if line.strip().startswith(row)).split()[-2])


def test_plan_lab_copies_and_master_dtype_from_the_command_line():
    common = ["--init_from=qwen3-30b-a3b", "--world_size=8", "--dtype=bfloat16", "--expert_parallel=8"]
    ddp = plan.main(common)
    assert gb(ddp, "sampler's copy") == 0                              # DDP: the sampler reads the compute copy
    for lab in ("--rollout_dtype=int8", "--rollout_dtype=fp8_e4m3", "--rollout_router_fault=expert_map"):
        assert gb(plan.main(common + [lab]), "sampler's copy") == gb(ddp, "compute copy"), lab   # a copy in bf16
    fsdp = plan.main(common + ["--parallel=fsdp"])
    assert gb(plan.main(common + ["--parallel=fsdp", "--rollout_dtype=float32"]), "sampler's copy") == \
        pytest.approx(3 * gb(fsdp, "sampler's copy"), abs=0.02)       # FSDP2's bf16 copy + the lab's fp32 one
    half = plan.main(common + ["--master_dtype=bfloat16"])
    assert gb(half, "masters (bf16)") == gb(ddp, "masters (fp32)") / 2 == gb(ddp, "compute copy")
    assert gb(half, "compute copy") == 0


def test_kv_pool_from_tokens_or_the_room_left():
    shapes = [((10, 10), False), ((4, 5, 5), True)]
    assert plan.memory_plan(shapes, 1, "ddp", 1, 4, 4, 64, kv_tokens=100).kv_pool == 6400
    p = plan.memory_plan(shapes, 1, "ddp", 1, 4, 4, 64, gpu_bytes=10_000, kv_fraction=0.5)
    assert p.kv_tokens == int((10_000 - 16 * 200) * 0.5 // 64) and p.total <= 10_000


def test_qwen3_30b_a3b_on_eight_80gb_gpus_fits_only_with_expert_parallelism(tmp_path):
    from hf import config_to_hf
    folder = tmp_path / "qwen3-30b-a3b"                # a checkpoint folder's config.json: the plan reads no weight
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_to_hf(ModelConfig.preset("qwen3-30b-a3b"))))
    common = [f"--init_from={folder}", "--world_size=8", "--dtype=bfloat16", "--gpu_memory_gb=80",
              "--parallel=fsdp"]                # the KV pool: half of what the state leaves
    without, with_ep = plan.main(common), plan.main(common + ["--expert_parallel=8"])
    assert without.splitlines()[-2].startswith("does not fit") and with_ep.splitlines()[-1].startswith("fits")
    assert "KV pool (0 tokens)" in without and "KV pool (0 tokens)" not in with_ep
    # the start-up: from the folder, each rank loads its dense weights and its 16 of 128 experts in fp32
    # (20.6 GB) at EP=8, all 30.5B parameters (122 GB) at EP=1; a preset is drawn whole on every rank
    assert without.splitlines()[-1].startswith("start-up: every rank loads its dense weights and experts whole, 122.13 GB")
    preset = plan.main([a.replace(f"={folder}", "=qwen3-30b-a3b") for a in common] + ["--expert_parallel=8"])
    assert preset.splitlines()[-1].startswith("start-up: a preset is drawn whole on every rank, 122.13 GB")
    assert preset.splitlines()[:-1] == with_ep.replace(str(folder), "qwen3-30b-a3b").splitlines()
    assert "start-up" not in plan.main(["--init_from=tiny", "--world_size=2", "--expert_parallel=2"])


def test_train_plan_entry_prints_the_table():
    r = subprocess.run([sys.executable, "train.py", "--plan", "--init_from=qwen3-30b-a3b", "--world_size=8",
                        "--expert_parallel=8"], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    rows = ("masters", "gradients", "AdamW state", "compute copy", "sampler's copy", "KV pool", "total")
    assert r.returncode == 0 and all(f"  {row}" in r.stdout for row in rows), r.stdout + r.stderr


@pytest.mark.parametrize("bad, says", [(["--expert_parallel=3"], "number of experts (128)"),
                                       (["--expert_parallel=16", "--world_size=8"], "number of ranks (8)"),
                                       (["--world_size=x"], "integers"),
                                       (["--expert_parallel=8", "--world_size=8", "--expert_placement=1,0"],
                                        "2 slots for 128 experts"),
                                       (["--expert_placement=1,0"], "needs --expert_parallel > 1")])
def test_plan_bad_values_are_config_errors(bad, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        plan.main(["--init_from=qwen3-30b-a3b"] + bad)


def test_kv_bytes_per_token_of_gqa_and_mla():
    """The plan's KV line: gpt-oss-20b caches 8 heads x 64 keys and values a layer, Moonlight its 576-number
    latent (8.9x fewer than its 16 heads' keys and values); the sampler sizes and allocates its pool by the
    same count (ModelConfig.kv_numbers_per_token)."""
    from rollout import Sampler
    gpt = plan.main(["--init_from=gpt-oss-20b", "--dtype=bfloat16"])
    assert "KV cache: 49,152 bytes per token (24 layers x 1,024 numbers: keys and values of 8 heads x 64)" in gpt
    moon = plan.main(["--init_from=moonlight-16b-a3b", "--dtype=bfloat16"])
    assert ("KV cache: 31,104 bytes per token (27 layers x 576 numbers: MLA's latent 512 + RoPE key 64; its 16 "
            "heads' keys and values would be 5,120, 8.9x as many)") in moon
    for cfg in (ModelConfig(), ModelConfig(model_type="deepseek_v3", kv_lora_rank=16, qk_nope_head_dim=8, head_dim=8,
                                           v_head_dim=8, qk_norm="none")):
        sampler = Sampler(Transformer(cfg), num_blocks=5)
        pages = {id(t): t for pair in sampler.caches for t in pair}.values()     # MLA: one tensor per layer
        per_token = sum(t.nbytes for t in pages) // (6 * 16)                     # 5 blocks + the scratch page
        assert per_token == cfg.num_hidden_layers * cfg.kv_numbers_per_token * 4
