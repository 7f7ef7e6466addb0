"""`python train.py --plan`: the memory arithmetic held against the bytes of a tiny model's real, sharded
parameters, the activation formula against what autograd keeps (torch and Triton backends), the whole
plan against a real run's peak memory at two sizes, and the verdict for Qwen3-30B-A3B on 8 x 80 GB."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from config import ConfigError, ModelConfig
from model import Transformer
from parallel.expert_parallel import ExpertParallel, Placement, shard_experts
from support import exact_sum
from support.distributed import Dist
from tooling import plan

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
        # --grad_reduce=exact: 16 bytes an element summed, as the reducer itself counts its accumulators
        exact = plan.memory_plan(shapes, world, "ddp", n, 2, 2, 0, exact=True).grad_sums
        assert exact == exact_sum.Reducer(fp32, Dist(0, 1, torch.device("cpu")), trained=fp32).reserve_bytes() == 4 * ddp.masters
        if world == 1:                                                   # one process: no FSDP2
            continue
        # FSDP2 shards dim 0 as torch.chunk does: dense over the world, this rank's experts over world / n
        fsdp = plan.memory_plan(shapes, world, "fsdp", n, 2, 2, 0)
        first_shards = sum(torch.chunk(p, world // n if is_expert(k) else world)[0].nbytes
                           for k, p in fp32.named_parameters())
        assert fsdp.masters == first_shards
        assert fsdp.sampler_copy == ddp.compute_copy                     # whole dense + E/N experts, bf16
        # FSDP2 keeps no cast of its shards: it casts each as it gathers; its compute weights are what its
        # all-gathers hold at once, the root group (embeddings, norm, head) and two blocks, in --dtype
        root, block = plan.gathered_groups(ModelConfig.preset("tiny"), n)
        assert fsdp.compute_copy == 0 and root == sum(p.numel() for k, p in fp32.named_parameters()
                                                      if not k.startswith("layers."))
        assert block == max(sum(p.numel() for k, p in fp32.named_parameters() if k.startswith(f"layers.{i}."))
                            for i in range(fp32.config.num_hidden_layers))
        with_groups = plan.memory_plan(shapes, world, "fsdp", n, 2, 2, 0, groups=(root, block))
        assert with_groups.compute_copy == 2 * (root + 2 * block) and with_groups.masters == fsdp.masters
        sums = sum(16 * (p.numel() if is_expert(k) and n > 1 else torch.chunk(p, world)[0].numel())   # EP shards whole
                   for k, p in fp32.named_parameters())
        assert plan.memory_plan(shapes, world, "fsdp", n, 2, 2, 0, exact=True).grad_sums == sums


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


def table(argv):
    return plan.main(argv)[0]


def test_plan_lab_copies_and_master_dtype_from_the_command_line():
    common = ["--init_from=qwen3-30b-a3b", "--world_size=8", "--dtype=bfloat16", "--expert_parallel=8"]
    ddp = table(common)
    assert gb(ddp, "sampler's copy") == 0                              # DDP: the sampler reads the compute copy
    for lab in ("--rollout_dtype=int8", "--rollout_dtype=fp8_e4m3", "--rollout_router_fault=expert_map"):
        assert gb(table(common + [lab]), "sampler's copy") == gb(ddp, "compute copy"), lab   # a copy in bf16
    fsdp = table(common + ["--parallel=fsdp"])
    assert gb(table(common + ["--parallel=fsdp", "--rollout_dtype=float32"]), "sampler's copy") == \
        pytest.approx(3 * gb(fsdp, "sampler's copy"), abs=0.02)       # FSDP2's bf16 copy + the lab's fp32 one
    half = table(common + ["--master_dtype=bfloat16"])
    assert gb(half, "masters (bf16)") == gb(ddp, "masters (fp32)") / 2 == gb(ddp, "compute copy")
    assert gb(half, "compute copy") == 0


def test_kv_pool_from_tokens_or_the_room_left():
    shapes = [((10, 10), False), ((4, 5, 5), True)]
    assert plan.memory_plan(shapes, 1, "ddp", 1, 4, 4, 64, kv_tokens=100).kv_pool == 6400
    p = plan.memory_plan(shapes, 1, "ddp", 1, 4, 4, 64, gpu_bytes=10_000, kv_fraction=0.5)
    assert p.step_temps == 4 * 200 + 12 * 100                          # AdamW's moment-sized temporary, the norm's rows
    assert p.kv_tokens == int((10_000 - 16 * 200 - p.step_temps) * 0.5 // 64) and p.total <= 10_000


def test_qwen3_30b_a3b_on_eight_96gb_gpus_fits_only_with_expert_parallelism(tmp_path):
    from support.hf import config_to_hf
    folder = tmp_path / "qwen3-30b-a3b"                # a checkpoint folder's config.json: the plan reads no weight
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_to_hf(ModelConfig.preset("qwen3-30b-a3b"))))
    common = [f"--init_from={folder}", "--world_size=8", "--dtype=bfloat16", "--gpu_memory_gb=96",
              "--parallel=fsdp", "--grad_reduce=fast"]
    (without, fits_without), (with_ep, fits_with) = plan.main(common), plan.main(common + ["--expert_parallel=8"])
    assert not fits_without and without.splitlines()[-1].startswith("does not fit: the run needs")
    assert fits_with and with_ep.splitlines()[-1].startswith("fits: the run needs")
    # exact sums (the default): 16 bytes an element of the rank's share, its 16 experts whole: 61.06 GB more
    exact, fits_exact = plan.main([a for a in common if a != "--grad_reduce=fast"] + ["--expert_parallel=8"])
    assert gb(exact, "exact gradient sums") == 61.06 and gb(with_ep, "exact gradient sums") == 0
    assert abs(gb(exact, "total") - gb(with_ep, "total") - 61.06) < 0.015 and not fits_exact   # rows rounded
    verdict = next(line for line in exact.splitlines() if line.startswith("does not fit"))
    assert ("it fits with --offload_optimizer=true (14.16 GB; the same update, on the host) or "
            "--grad_reduce=fast (88.89 GB") in verdict
    # the start-up, before FSDP2 shards: each rank holds its dense weights and its 16 of 128 experts in fp32
    # (20.66 GB) at EP=8, all 30.5B parameters (122.13 GB) at EP=1: part of the verdict, never beside it
    assert gb(with_ep, "start-up") == 20.66 and gb(without, "start-up") == 122.13
    # a preset: the same GPU plan, and the host's whole draw said apart
    preset, _ = plan.main([a.replace(f"={folder}", "=qwen3-30b-a3b") for a in common] + ["--expert_parallel=8"])
    assert preset.splitlines()[-1].startswith("host memory: a preset is drawn whole on each rank's CPU first (122.13 GB")
    assert preset.splitlines()[:-1] == with_ep.replace(str(folder), "qwen3-30b-a3b").splitlines()
    assert "start-up" not in table(["--init_from=tiny", "--world_size=2", "--expert_parallel=2"])   # DDP


QWEN3_30B = ["--init_from=qwen3-30b-a3b", "--world_size=8", "--parallel=fsdp", "--expert_parallel=8", "--dtype=bfloat16",
             "--max_new_tokens=1024", "--micro_batch_tokens=4096", "--gpu_memory_gb=80"]


def test_offload_moves_the_optimizer_to_the_host_rows():
    """--offload_optimizer: the masters, gradients, AdamW state and exact sums leave the GPU's total and are
    the host's rows, the same bytes; the start-up is sharded on the host; fp32 masters that compute get a
    compute copy on the GPU (the device's copy, memory/offload.py)."""
    gpu, fits = plan.main(QWEN3_30B)
    host, fits_host = plan.main(QWEN3_30B + ["--offload_optimizer=true"])
    assert not fits and fits_host
    moved = ["masters (fp32)", "gradients (fp32)", "AdamW state", "exact gradient sums", "the step's temporaries"]
    assert [gb(host, "on the host: " + row) for row in moved] == [gb(gpu, row) for row in moved]
    # the GPU's phases: the trainer's activations and a block's gradients in flight (FSDP2 reduce-scatters them
    # on the GPU, also with offload), the sampler's, the step's (the host's with offload)
    flight, step, act = gb(gpu, "gradients in flight"), gb(gpu, "the step's"), gb(gpu, "activations, trainer")
    assert gb(host, "gradients in flight") == flight
    state = sum(gb(gpu, row) for row in moved[:4])
    assert abs(gb(gpu, "total") - state - max(act + flight, step) - gb(host, "total") + act + flight) < 0.03
    assert abs(gb(host, "on the host: total") - state - step) < 0.03
    assert gb(host, "start-up") == 2.49 < gb(gpu, "start-up")          # the root group (embeddings, head) in fp32
    assert "host memory (--offload_optimizer): 138.00 GB a rank, 1103.99 GB for 8" in host
    tiny = ["--init_from=tiny", "--device=cpu"]
    assert gb(table(tiny), "compute copy") == 0 < gb(table(tiny + ["--offload_optimizer=true"]), "compute copy")


def verdict(text):
    return next(line for line in text.splitlines() if line.startswith(("fits", "does not fit")))


def test_the_memory_goals_and_what_the_verdict_names():
    """The goals (docs/results.md, "Memory plan"): Qwen3-30B-A3B on 8 x 80 GB (FSDP2, EP=8, bf16 over fp32
    masters, exact sums, 1,024-token responses, 4,096-token micro-batches) fits with 5 GB to spare with the
    optimizer on the host, and the verdict without it says so; 8 x 141 GB at 8,192-token responses;
    Qwen3-235B-A22B on 4 nodes of 8 x 80 GB with the recompute too. Where no setting fits, it says so."""
    text, fits = plan.main(QWEN3_30B)
    assert not fits and "; it fits with --offload_optimizer=true (" in verdict(text)
    text, fits = plan.main(QWEN3_30B + ["--offload_optimizer=true"])
    assert fits and 80 - gb(text, "total") >= 5
    long = [a for a in QWEN3_30B if not a.startswith(("--max_new", "--gpu"))] + ["--max_new_tokens=8192",
                                                                                   "--gpu_memory_gb=141"]
    assert not plan.main(long)[1]
    text, fits = plan.main(long + ["--offload_optimizer=true"])
    assert fits and 141 - gb(text, "total") >= 5
    big = ["--init_from=qwen3-235b-a22b", "--world_size=32", "--parallel=fsdp", "--expert_parallel=32",
           "--dtype=bfloat16", "--max_new_tokens=1024", "--gpu_memory_gb=80"]
    assert "it fits with --offload_optimizer=true --activation_checkpointing=full (" in verdict(plan.main(big)[0])
    text, fits = plan.main(big + ["--offload_optimizer=true", "--activation_checkpointing=full"])
    assert fits and 80 - gb(text, "total") >= 5
    hopeless = verdict(plan.main(big[:1] + ["--world_size=8", "--parallel=fsdp", "--expert_parallel=8",
                                            "--dtype=bfloat16", "--gpu_memory_gb=40"])[0])
    assert hopeless.endswith("makes it fit: more ranks, a larger --expert_parallel or larger GPUs")
    assert "no setting of --offload_optimizer=true, --activation_checkpointing=full, --grad_reduce=fast" in hopeless


def test_a_start_up_past_the_gpu_does_not_fit_even_when_the_run_would(tmp_path):
    # 32 ranks without EP: the sharded run fits in 80 GB, but every rank first holds all 128 experts in fp32
    text, fits = plan.main(["--init_from=qwen3-30b-a3b", "--world_size=32", "--dtype=bfloat16", "--parallel=fsdp",
                            "--grad_reduce=fast", "--gpu_memory_gb=96"])
    assert gb(text, "total") < 96 < gb(text, "start-up") and not fits
    assert text.splitlines()[-1].startswith("does not fit: the start-up needs 122.13 GB per GPU")


def test_the_kv_pool_follows_the_run_unless_told():
    common = ["--init_from=tiny", "--prompts_per_step=8", "--group_size=4", "--n_digits=20"]   # 22 + 21 tokens
    assert "KV pool (1,536 tokens;" in table(common)                  # 32 sequences x 3 pages of 16
    assert "KV pool (2,048 tokens;" in table(common + ["--max_new_tokens=40"])         # 62 -> 4 pages
    assert "KV pool (500 tokens;" in table(common + ["--kv_tokens=500"])
    assert "KV pool (160 tokens;" in table(common + ["--num_blocks=10"])
    assert "KV pool (768 tokens;" in table(common + ["--world_size=2"])                # this rank's half


def test_the_trainers_micro_batch_is_its_token_budget_or_its_rows():
    common = ["--init_from=tiny", "--device=cpu", "--prompts_per_step=32", "--group_size=8", "--minibatch_size=128"]
    row = "activations, trainer ("
    assert "(1,024-token micro-batch" in table(common + ["--micro_batch_tokens=1024"])     # packed: the budget
    assert "(1,408-token micro-batch" in table(common)              # the budget of 4096 holds the minibatch: 128 x 11
    assert "(352-token micro-batch" in table(common + ["--micro_batch_tokens=0", "--micro_batch_size=32"])   # padded
    assert gb(table(common + ["--micro_batch_tokens=512"]), row) < gb(table(common + ["--micro_batch_tokens=1024"]), row)


def test_a_plan_that_does_not_fit_exits_1_with_one_line():
    argv = [sys.executable, "train.py", "--plan", "--init_from=qwen3-30b-a3b", "--world_size=8", "--expert_parallel=8",
            "--parallel=fsdp", "--dtype=bfloat16", "--gpu_memory_gb=90", "--grad_reduce=fast"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(argv + ["--max_new_tokens=1024"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "does not fit" in r.stdout and r.stderr.startswith("error: --plan: this run does not fit")
    assert r.stderr.count("\n") == 1                                   # one line, no traceback
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)   # control: it fits
    assert r.returncode == 0 and r.stdout.splitlines()[-2].startswith("fits") and not r.stderr


CONFIGS = [   # (fields, sequence length): MoE and dense layers, grouped queries, several query blocks
    (dict(), 11),
    (dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=4,
          moe_intermediate_size=96, intermediate_size=160, num_hidden_layers=3, mlp_only_layers=[1]), 40),
    (dict(hidden_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=48, num_experts=16,
          num_experts_per_tok=4, moe_intermediate_size=64), 23),
]


@pytest.mark.parametrize("fields, L", CONFIGS)
def test_the_activation_formula_counts_what_the_torch_backward_keeps(fields, L, monkeypatch):
    """Within 10% of the bytes autograd saves (fp32; bf16 keeps up to 10% less: the torch path computes in
    fp32). Control: the formula without the attention's key tiles falls outside."""
    from saved_bytes import saved_bytes_per_token
    cfg = ModelConfig(**{**ModelConfig.preset("tiny").__dict__, **fields})
    kept = {b: saved_bytes_per_token(cfg, L, 2048 // L, "torch", dtype)     # ~2k tokens: a trainer's micro-batch
            for dtype, b in ((torch.float32, 4), (torch.bfloat16, 2))}
    assert kept[4] * 0.9 <= plan.train_bytes_per_token(cfg, "torch", 4, L) <= kept[4] * 1.1
    assert kept[2] * 0.9 <= plan.train_bytes_per_token(cfg, "torch", 2, L) <= kept[2] * 1.25
    monkeypatch.setattr(plan, "key_tiles", lambda cfg, seq_len: 0.0)
    assert plan.train_bytes_per_token(cfg, "torch", 4, L) < 0.9 * kept[4]


def test_the_activation_formula_counts_what_a_lora_backward_keeps():
    """LoRA (rank 16 on every target but the router): the frozen norms keep less, the rank's products
    little; the formula with frozen_norms within 5% of what autograd saves, and without it above by more."""
    from saved_bytes import saved_bytes_per_token
    cfg = ModelConfig(**{**ModelConfig.preset("tiny").__dict__, "hidden_size": 128, "num_experts": 16})
    kept = saved_bytes_per_token(cfg, 44, 32, "torch", torch.float32, lora_rank=16)
    assert abs(plan.train_bytes_per_token(cfg, "torch", 4, 44, frozen_norms=True) / kept - 1) < 0.05
    assert plan.train_bytes_per_token(cfg, "torch", 4, 44) / kept - 1 > 0.06          # control


def test_the_activation_formula_counts_what_the_triton_backward_keeps():
    """The same count with the Triton kernels (under the interpreter on a CPU, a fresh process), within 5%."""
    pytest.importorskip("triton")
    cfg = dict(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
               head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, intermediate_size=64)
    r = subprocess.run([sys.executable, "tests/saved_bytes.py", json.dumps(cfg), "40", "4", "triton", "float32"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    kept = float(r.stdout.split()[-1])
    assert abs(plan.train_bytes_per_token(ModelConfig(**cfg), "triton", 4, 40) / kept - 1) < 0.05
    assert abs(plan.train_bytes_per_token(ModelConfig(**cfg), "torch", 4, 40) / kept - 1) > 0.5   # control


RSS_RUN = ["--device=cpu", "--steps=1", "--prompts_per_step=32", "--group_size=8", "--minibatch_size=256",
           "--num_blocks=256", "--progress=false"]
RSS_SIZES = (["--micro_batch_tokens=1024"],                                             # tiny: 1.5M parameters
             ["--hidden_size=256", "--moe_intermediate_size=256", "--intermediate_size=512",
              "--micro_batch_tokens=4096"])                                             # 4.7M, a 2816-token micro-batch


def test_the_plan_holds_a_real_runs_peak_memory_at_two_sizes(tmp_path):
    """The CPU run's peak RSS above its baseline (tests/peak_rss.py) against the plan's total: within 20%
    plus 64 MB (the runtime's own: allocator slack, Python objects, the run's smaller buffers; about 50 MB
    here), and the growth from the small run to the large one within 15%. Control: a plan without its
    activations (the old one) fails the check at both sizes."""
    added, planned, no_act = [], [], []
    for i, size in enumerate(RSS_SIZES):
        r = subprocess.run([sys.executable, "tests/peak_rss.py", *RSS_RUN, *size, f"--out_dir={tmp_path / str(i)}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert r.returncode == 0, r.stderr[-2000:]
        rss = json.loads(r.stdout.splitlines()[-1])
        added.append(rss["peak"] - rss["baseline"])
        text = table(RSS_RUN + size)
        planned.append(gb(text, "total") * plan.GB)
        no_act.append(planned[-1] - max(gb(text, "activations, trainer"), gb(text, "activations, sampler")) * plan.GB)

    def close(plan_bytes, real):
        return abs(plan_bytes - real) <= 0.2 * real + 64e6
    assert all(close(p, a) for p, a in zip(planned, added)), (planned, added)
    assert abs((planned[1] - planned[0]) / (added[1] - added[0]) - 1) < 0.15, (planned, added)
    assert not any(close(p, a) for p, a in zip(no_act, added)), (no_act, added)


def test_the_plan_within_10_percent_with_and_without_recompute_and_offload(tmp_path):
    """A model whose weights' state is most of its memory (38M parameters, 32 experts a layer), a 2,816-token
    micro-batch, two steps (the second runs with AdamW's moments, the plan's steady state), at three memory
    settings: none, every block recomputed (--activation_checkpointing=full), the optimizer on the host
    (--offload_optimizer). The plan within 10% of the peak RSS less the runtime's own 50 MB (the plan's
    docstring), with glibc's mmap threshold fixed so that a freed tensor leaves RSS at once (RSS then follows
    the live tensors, as a GPU's allocated bytes do; glibc's default keeps freed pages by its history, up to
    8% one launch from the next). On the CPU the GPU's and the host's rows are one memory: the plan of the run
    with everything on one device (MemoryPlan.offload off), its offloaded compute copy included. The
    recompute lowers both the peak and the plan; offload raises both by the copy."""
    import dataclasses
    from config import RolloutConfig, TrainConfig, apply_command_line, parse_args
    big = RSS_RUN + ["--steps=2", "--hidden_size=256", "--num_experts=32", "--moe_intermediate_size=512",
                     "--intermediate_size=512", "--micro_batch_tokens=4096"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    found = []
    for i, extra in enumerate([[], ["--activation_checkpointing=full"], ["--offload_optimizer=true"],
                               ["--lora_rank=16"]]):
        r = subprocess.run([sys.executable, "tests/peak_rss.py", *big, *extra, f"--out_dir={tmp_path / str(i)}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        rss = json.loads(r.stdout.splitlines()[-1])
        tcfg, rcfg = TrainConfig(), RolloutConfig()
        apply_command_line(parse_args(big + extra), tcfg, rcfg)
        p, _, _ = plan.plan_of(tcfg, rcfg, 1)
        found.append((dataclasses.replace(p, offload=False).total, rss["peak"] - rss["baseline"] - 50e6))
    assert all(abs(p - real) <= 0.1 * real for p, real in found), found
    (none, a), (full, b), (off, c), (lora, d) = found
    assert full < 0.9 * none and b < 0.9 * a and off > none and c > a and lora < none and d < a, found


def test_train_plan_entry_prints_the_table():
    r = subprocess.run([sys.executable, "train.py", "--plan", "--init_from=qwen3-30b-a3b", "--world_size=8",
                        "--expert_parallel=8", "--gpu_memory_gb=141", "--grad_reduce=fast"], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    rows = ("masters", "gradients", "AdamW state", "compute copy", "sampler's copy", "KV pool", "activations, trainer",
            "activations, sampler", "exact gradient sums", "total")
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
    gpt, _ = plan.main(["--init_from=gpt-oss-20b", "--dtype=bfloat16"])
    assert "KV cache: 49,152 bytes per token (24 layers x 1,024 numbers: keys and values of 8 heads x 64)" in gpt
    moon, _ = plan.main(["--init_from=moonlight-16b-a3b", "--dtype=bfloat16"])
    assert ("KV cache: 31,104 bytes per token (27 layers x 576 numbers: MLA's latent 512 + RoPE key 64; its 16 "
            "heads' keys and values would be 5,120, 8.9x as many)") in moon
    for cfg in (ModelConfig(), ModelConfig(model_type="deepseek_v3", kv_lora_rank=16, qk_nope_head_dim=8, head_dim=8,
                                           v_head_dim=8, qk_norm="none")):
        sampler = Sampler(Transformer(cfg), num_blocks=5)
        pages = {id(t): t for pair in sampler.caches for t in pair}.values()     # MLA: one tensor per layer
        per_token = sum(t.nbytes for t in pages) // (6 * 16)                     # 5 blocks + the scratch page
        assert per_token == cfg.num_hidden_layers * cfg.kv_numbers_per_token * 4


def test_help_lists_the_plans_own_keys():
    r = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--plan" in r.stdout
    for key in plan.PLAN_KEYS:
        assert f"--{key}=" in r.stdout, key


def test_a_gpu_run_the_plan_refuses_ends_before_the_model_is_built(tmp_path, monkeypatch):
    """tooling/plan.Preflight (a GPU run's hook; here handed an 80 GB GPU): Qwen3-30B-A3B on one rank is one
    line naming what would fit, before anything is built; the tiny model passes it and builds."""
    import train
    from config import RolloutConfig, TrainConfig
    from support import checkpoint
    built = []
    monkeypatch.setattr(train, "build_model", lambda *a, **k: built.append(1) or checkpoint.build_model(*a, **k))
    d = Dist(0, 1, torch.device("cpu"))
    tcfg = TrainConfig(init_from="qwen3-30b-a3b", dtype="bfloat16", out_dir=str(tmp_path / "big"), progress=False)
    with pytest.raises(ConfigError) as e:
        train.setup(tcfg, RolloutConfig(), d, hooks=[plan.Preflight(tcfg, RolloutConfig(), 80 * 10**9)])
    assert str(e.value).startswith("this run needs ") and "more than this GPU's 80.00 GB; it fits with" in str(e.value)
    assert "\n" not in str(e.value) and not built
    tcfg = TrainConfig(out_dir=str(tmp_path / "tiny"), progress=False, device="cpu")
    train.setup(tcfg, RolloutConfig(), d, hooks=[plan.Preflight(tcfg, RolloutConfig(), 80 * 10**9)])
    assert built
