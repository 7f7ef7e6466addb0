"""Training under expert parallelism against EP=1, in one torchrun job (gloo on the CPU).

    torchrun --standalone --nproc_per_node=2 tests/ep_train_check.py OUT_DIR

Runs train.py's loop in-process for a few configurations at EP=1 and at EP>1 over the same ranks and
compares the metrics: under the exact gradient sum (the default) every key but the timings and the EP
layout's own (ep_rows, ep_load_*) is the same bit for bit, train-rollout KL and route flips 0; then a
checkpoint written under EP resumed at the same layout and at another EP degree, bit for bit too;
gpt-oss's biased experts from a checkpoint folder, with the control of a bias lost on the exchange.
DDP / FSDP2 x fp32 / bf16 at EP=2 against one process: tests/world_check.py. Prints one `ok ...` line
per check on rank 0; any mismatch raises. tests/test_expert_parallel.py runs it with 2 and 4 processes.
"""
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train                                                       # noqa: E402
from config import RolloutConfig, TrainConfig                      # noqa: E402
from support import runlog                                         # noqa: E402
from support.distributed import Dist                               # noqa: E402

BASE = dict(device="cpu", task="copy", n_digits=2, prompts_per_step=8, group_size=4, minibatch_size=32,
            micro_batch_size=8, progress=False, lr=1e-2, warmup_steps=1, logits_chunk=24, steps=2)
IGNORED = runlog.PER_LAYOUT


def say(msg):
    if dist.get_rank() == 0:
        print("ok", msg, flush=True)


def run(out, fault=False, rollout=None, **kw):
    tcfg = TrainConfig(**{**BASE, "out_dir": out, "overwrite": True, **kw})
    d = Dist(dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    rcfg = RolloutConfig(rollout_router_fault="expert_map" if fault else "none", **(rollout or {}))
    return train._train(tcfg, rcfg, d)


def resume(out, **kw):
    tcfg = TrainConfig(**{**BASE, "out_dir": out, "resume": True, **kw})
    d = Dist(dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    return train._train(tcfg, RolloutConfig(), d)


def compare(ref, got, what):
    """Every metric but the timings and the EP layout's own, bit for bit."""
    assert len(ref) == len(got), what
    for r, g in zip(ref, got):
        assert g["train_rollout_kl"] == 0 and g["logp_max_abs_diff"] == 0 and g["route_flip_frac"] == 0, what
        diff = {k: (r.get(k), g.get(k)) for k in set(r) | set(g) if k not in IGNORED and r.get(k) != g.get(k)}
        assert not diff, f"{what}: {diff}"
    say(f"train {what}: every metric bit for bit, KL 0, flips 0")


def check_fsdp_shards_experts_over_replicas(preset):
    """4 ranks, EP=2, FSDP2: each rank keeps 1/2 of its EP shard's rows (E/N = 4 experts over 2 replicas),
    of every expert tensor (gpt-oss: the biases too)."""
    from config import ModelConfig
    from model import Transformer
    from parallel import expert_parallel
    from support.distributed import parallelize
    cfg = ModelConfig.preset(preset)
    model = expert_parallel.shard_experts(Transformer(cfg), expert_parallel.init_expert_parallel(2, n_experts=cfg.num_experts))
    d = Dist(dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    parallelize(model, TrainConfig(parallel="fsdp"), d)
    moe = model.layers[1].mlp
    names = list(expert_parallel.expert_tensors(moe))
    rows = {getattr(moe, k).to_local().shape[0] for k in names}
    assert rows == {cfg.num_experts // 2 // 2}, rows
    assert all(getattr(moe, k).device_mesh.size() == 2 for k in names) and moe.gate.weight.device_mesh.size() == 4
    say(f"fsdp EP=2 on 4 ranks, {preset}: {rows.pop()} of each rank's {cfg.num_experts // 2} experts' rows of "
        f"{', '.join(names)}, the router over 4")


def check_checkpoint_folder_is_read_by_shard(out):
    """Training from a checkpoint folder at EP=2: each rank reads only its experts from disk (the
    contiguous placement: rank r the r-th half), and trains as EP=1 does from the same folder."""
    import safetensors
    from config import ModelConfig
    from disk_reads import ReadLog, experts_read
    from model import Transformer
    folder, cfg = f"{out}/init", ModelConfig.preset("tiny")
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        Transformer(cfg).save_pretrained(folder)
    dist.barrier()
    ref = run(f"{out}/ref", init_from=folder)
    real, log = safetensors.safe_open, ReadLog(safetensors.safe_open)
    safetensors.safe_open = log
    try:
        got = run(f"{out}/ep", init_from=folder, expert_parallel=2)
    finally:
        safetensors.safe_open = real
    half = cfg.num_experts // 2
    mine = set(range(dist.get_rank() * half, (dist.get_rank() + 1) * half))
    assert experts_read(log.read, cfg) == mine, (dist.get_rank(), sorted(experts_read(log.read, cfg)))
    compare(ref, got, "from a checkpoint folder EP=2")
    say(f"checkpoint folder EP=2: each rank read {half} of {cfg.num_experts} experts from disk")


def check_gpt_oss(out, **kw):
    """gpt-oss (biased experts, the clamped SwiGLU) from a checkpoint folder with drawn biases: EP=2 trains
    as EP=1, every metric bit for bit, each rank reading its experts only (kw: on 4 ranks, FSDP2 over two
    replicas of each EP shard). Control: the owner running the experts without b2 moves the first step's
    metrics."""
    import safetensors
    from config import ModelConfig
    from parallel import expert_parallel
    from disk_reads import ReadLog, experts_read
    from ep_check import build
    folder, cfg = f"{out}/oss", ModelConfig.preset("tiny-gpt-oss")
    if dist.get_rank() == 0:
        build(cfg).save_pretrained(folder)
    dist.barrier()
    ref = run(f"{out}/ref", init_from=folder, steps=1, **kw)       # one step: the drawn biases are in it already
    real, log = safetensors.safe_open, ReadLog(safetensors.safe_open)
    safetensors.safe_open = log
    try:
        got = run(f"{out}/ep", init_from=folder, expert_parallel=2, steps=1, **kw)
    finally:
        safetensors.safe_open = real
    assert len(experts_read(log.read, cfg)) == cfg.num_experts // 2, sorted(experts_read(log.read, cfg))
    layout = " fsdp on 4 ranks" if kw else ""
    compare(ref, got, f"gpt-oss from a checkpoint folder EP=2{layout}")
    rows = expert_parallel._rows
    expert_parallel._rows = lambda x, ws, ids, w, swiglu: rows(x, {k: v for k, v in ws.items() if k != "b2"}, ids, w, swiglu)
    try:
        bad = run(f"{out}/bad", init_from=folder, expert_parallel=2, steps=1, **kw)
    finally:
        expert_parallel._rows = rows
    moved = sorted(k for k in bad[0] if k not in IGNORED and bad[0][k] != ref[0].get(k))
    assert moved, "control: no b2 on the owner changed no metric"
    say(f"control gpt-oss EP=2{layout}: no b2 on the owner moves step 1's {', '.join(moved[:3])}, ...")


def main(out):
    dist.init_process_group("gloo")
    checks(out)
    dist.barrier()
    gc.collect()      # the runs' cycles (their gloo work) go while Python is alive, as in train.py
    dist.destroy_process_group()


def checks(out):
    world = dist.get_world_size()
    if world == 4:
        for preset in ("tiny", "tiny-gpt-oss"):
            check_fsdp_shards_experts_over_replicas(preset)
        check_gpt_oss(out, parallel="fsdp")
    # the router bias under EP: aux-loss-free balancing sums each rank's load (routes are logical ids);
    # R3 replays logical ids; a permuted placement; the device load is logged
    if world == 2:
        check_checkpoint_folder_is_read_by_shard(out)
        check_gpt_oss(out)
        kw = dict(init_from="tiny-sigmoid", expert_bias_update_rate=1e-3)
        compare(run(f"{out}/ref", **kw), run(f"{out}/ep", expert_parallel=2, **kw), "expert bias EP=2")
        kw = dict(replay="r3", recompute_old_logp=True)
        compare(run(f"{out}/ref", **kw), run(f"{out}/ep", expert_parallel=2, **kw), "R3 replay EP=2")
        ref = run(f"{out}/ref")
        got = run(f"{out}/ep", expert_parallel=2, expert_placement=[5, 2, 7, 0, 3, 6, 1, 4])
        compare(ref, got, "permuted placement EP=2")
        assert all(len(g["ep_load_layer"]) == len(g["route_flip_frac_layer"]) and 1.0 <= g["ep_load_max"] <= 2.0 for g in got), got[0]
        for g in got:                     # each layer: every (token, slot) row of the group, on one of 2 ranks
            rows = g["ep_rows"]
            assert len(rows) == len(g["ep_load_layer"]) and all(len(r) == 2 for r in rows), rows
            assert len({sum(r) for r in rows}) == 1 and sum(rows[0]) > 0, rows
            assert [max(r) / (sum(r) / 2) for r in rows] == g["ep_load_layer"], (rows, g["ep_load_layer"])
        assert "ep_load_max" not in ref[0] and "ep_rows" not in ref[0]
        say(f"device load EP=2: busiest rank / mean {got[0]['ep_load_max']:.3f}")
        # the expert_map fault: the rollout's table is wrong, the same at EP=1 and EP=2
        kw = dict(recompute_old_logp=True)
        bad = [run(f"{out}/{n}", expert_parallel=n, **kw, fault=True) for n in (1, 2)]
        assert all(h["train_rollout_k3"] > 0 for h in bad[0]), bad[0]
        for a, b in zip(*bad):
            assert {k: v for k, v in a.items() if k not in IGNORED} == {k: v for k, v in b.items() if k not in IGNORED}
        say(f"expert_map fault EP=1 vs EP=2: every metric equal, KL {bad[0][0]['train_rollout_k3']:.2e} at both")
        # R3 under a mismatch (a bf16 rollout copy): EP changes no bit of it, and it beats no replay
        bf16 = dict(rollout={"rollout_dtype": "bfloat16"}, recompute_old_logp=True)
        r3 = [run(f"{out}/{n}", expert_parallel=n, replay="r3", **bf16) for n in (1, 2)]
        for a, b in zip(*r3):
            assert {k: v for k, v in a.items() if k not in IGNORED} == {k: v for k, v in b.items() if k not in IGNORED}
        free = run(f"{out}/free", expert_parallel=2, **bf16)
        for a, b in zip(r3[1], free):     # the worst token may be one whose routes agree: replay leaves its gap
            assert 0 < a["logp_max_abs_diff"] <= b["logp_max_abs_diff"] and a["train_rollout_k3"] < b["train_rollout_k3"], (a, b)
        assert r3[1][0]["logp_max_abs_diff"] < free[0]["logp_max_abs_diff"]     # step 1: the same weights and samples
        say(f"R3 under a bf16 rollout, EP=1 vs EP=2: every metric equal; worst gap {r3[1][0]['logp_max_abs_diff']:.2e} "
            f"against {free[0]['logp_max_abs_diff']:.2e} without replay")
    # checkpoints: whole experts on disk; resume at the same layout, and at another EP degree
    # (4 ranks: under FSDP2, each expert shard sharded over its 2 replicas, AdamW's state too)
    n, kw = 2, (dict(parallel="fsdp") if world == 4 else {})
    straight = run(f"{out}/straight", expert_parallel=n, steps=3, **kw)
    run(f"{out}/leg", expert_parallel=n, steps=1, lr_decay_steps=3, **kw)
    cont = resume(f"{out}/leg", expert_parallel=n, steps=3, **kw)
    assert len(cont) == 2, len(cont)
    compare(straight[1:], cont, f"resume EP={n} -> EP={n}{' fsdp' if kw else ''}")
    other = 4 if world == 4 else 1
    run(f"{out}/leg2", expert_parallel=n, steps=1, lr_decay_steps=3, **kw)
    moved = resume(f"{out}/leg2", expert_parallel=other, steps=3, **kw)
    compare(straight[1:], moved, f"resume EP={n} -> EP={other}")


if __name__ == "__main__":
    main(sys.argv[1])
