"""One run at any world size: the same metrics.jsonl and weights at 1, 2 and 4 ranks (gloo on the CPU).

    python tests/world_check.py OUT                                   # the one-process references
    torchrun --standalone --nproc_per_node=2 tests/world_check.py OUT
    torchrun --standalone --nproc_per_node=4 tests/world_check.py OUT

Runs train.py's loop in-process for each layout of this world size (LAYOUTS: DDP or FSDP2, with or
without --expert_parallel=2; at 2 ranks FSDP2 with each block recomputed in the backward and EP=2 with
each MoE layer, --activation_checkpointing, both with the optimizer on the host, --offload_optimizer)
of each run (RUNS: fp32 with packed micro-batches, bf16 compute over fp32 masters with padded ones and the
router bias, LoRA's adapters over a bf16 base, started from a PEFT adapter folder (--lora_init: at EP=2 each
rank takes its experts' rows and hashes the whole base with its peer), and --grad_reduce=fast, the control), and writes
OUT/world{N}.json: per layout, every metrics row without its per-layout keys, and the SHA-256 of the
checkpoint's tensors (whole experts). The 1- and 4-rank launches also resume the 2-rank DDP EP=2 fp32
run from its step-3 checkpoint, the 1-rank one the LoRA run's too (RESUMED). tests/test_distributed.py
compares the files.
"""
import gc
import hashlib
import json
import os
import shutil
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train                                                       # noqa: E402
from config import RolloutConfig, TrainConfig                      # noqa: E402
from support import runlog                                         # noqa: E402
from support.distributed import Dist                               # noqa: E402

STEPS = 4
BASE = dict(device="cpu", task="copy", n_digits=2, prompts_per_step=8, group_size=4, minibatch_size=32,
            progress=False, lr=1e-2, warmup_steps=1, logits_chunk=24, steps=STEPS, save_every=STEPS // 2,
            keep_checkpoints=2)
RUNS = {   # what defines a run: the micro-batches (--micro_batch_tokens / --micro_batch_size), dtypes, the reduction
    "fp32": dict(micro_batch_tokens=64),                          # packed: about 4 micro-batches a minibatch
    "bf16": dict(dtype="bfloat16", micro_batch_tokens=0, micro_batch_size=10, init_from="tiny-sigmoid",
                 expert_bias_update_rate=1e-3),                   # padded slices of 10 (the last one short)
    "fast": dict(micro_batch_tokens=64, grad_reduce="fast"),      # the control: fp32 accumulation and all-reduce
    "lora": dict(dtype="bfloat16", micro_batch_tokens=64, lora_rank=4,   # lora/: adapters on every target (the
                 lora_targets="attention,mlp,experts,router"),           # experts' by expert, cut by EP), bf16 base
}
DDP, FSDP = dict(parallel="ddp"), dict(parallel="fsdp")
EP2 = dict(expert_parallel=2)
AC = dict(activation_checkpointing="full"), dict(activation_checkpointing="moe")   # memory/: the same bits
OFF = dict(offload_optimizer=True)        # memory/: the masters apart (FSDP2's CPUOffloadPolicy; a copy under DDP)
LAYOUTS = {   # world size -> (run, layout name, layout): DDP and FSDP2, EP=2 with one and with two EP groups
    1: [("fp32", "one", {}), ("bf16", "one", {}), ("fast", "one", {}), ("lora", "one", {})],
    2: [("fp32", "fsdp", {**FSDP, **AC[0], **OFF}), ("fp32", "ddp-ep2", {**DDP, **EP2}),
        ("bf16", "ddp-ep2", {**DDP, **EP2, **AC[1], **OFF}), ("fast", "ddp", DDP), ("lora", "ddp-ep2", {**DDP, **EP2})],
    4: [("bf16", "fsdp-ep2", {**FSDP, **EP2})],
}
# a 2-rank run's step-3 checkpoint resumed: fp32 DDP EP=2 by 1 rank and by 4 (DDP, EP=2: two EP groups, the
# experts' sums all-reduced over their replicas), LoRA's EP=2 by 1 rank (its adapters' expert rows gathered)
RESUMED = {1: [("fp32", "ddp-ep2", {}), ("lora", "ddp-ep2", {})], 4: [("fp32", "ddp-ep2", dict(DDP, **EP2))]}
PER_LAYOUT = runlog.PER_LAYOUT                                       # what a layout means by itself


def digest(out: str) -> str:
    """SHA-256 of the latest checkpoint's tensors (the export and the fp32 masters), by key."""
    from safetensors.torch import load_file
    folder = os.path.join(out, open(os.path.join(out, "latest")).read().strip())
    h = hashlib.sha256()
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        state = load_file(os.path.join(folder, name))
        for k in sorted(state):
            h.update(f"{name}:{k}".encode())
            h.update(state[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run(out: str, d: Dist, resume: bool = False, **kw) -> list[dict]:
    tcfg = TrainConfig(**{**BASE, "out_dir": out, "resume": resume, "overwrite": not resume, **kw})
    return train._train(tcfg, RolloutConfig(), d)


def start_adapter(out: str, d: Dist) -> str:
    """OUT/adapter: adapters on the lora run's base (the tiny preset at the run's seed, cast to bf16), B drawn
    nonzero, written by python -m lora.export's writer: the lora run's --lora_init, the same at every launch."""
    from lora.export import write_adapter
    from lora.hooks import Lora
    from support.checkpoint import build_model, run_task
    path = f"{out}/adapter"
    if d.rank == 0 and not os.path.isdir(path):
        tcfg = TrainConfig(**{**BASE, **RUNS["lora"], "out_dir": path})
        _, preset, _ = run_task(tcfg, RolloutConfig())
        model = build_model(tcfg, torch.device("cpu"), torch.float32, preset, None)
        Lora(tcfg).adapt(model)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in (p for n, p in model.named_parameters() if "lora_B" in n):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        write_adapter(model, path, tcfg.lora_rank, tcfg.lora_alpha)
    if d.world > 1:
        dist.barrier()
    return path


def summary(rows: list[dict], out: str) -> dict:
    return {"metrics": [{k: v for k, v in r.items() if k not in PER_LAYOUT} for r in rows], "digest": digest(out)}


def main(out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
        from parallel import fsdp
        fsdp.ExactReduceScatter.CHUNK = 50_000        # FSDP2's exact reduce-scatter of a block in pieces
    d = Dist(int(os.environ.get("RANK", "0")), world, torch.device("cpu"))
    found, runs = {}, dict(RUNS, lora=dict(RUNS["lora"], lora_init=start_adapter(out, d)))
    for name, layout, kw in LAYOUTS[world]:
        rows = run(f"{out}/w{world}-{name}-{layout}", d, **runs[name], **kw)
        found[f"{name}/{layout}"] = summary(rows, f"{out}/w{world}-{name}-{layout}")
    for name, leg, kw in RESUMED.get(world, []):      # a 2-rank run from its middle checkpoint
        mine = f"{out}/w{world}-{name}-resumed"
        if d.rank == 0:
            shutil.copytree(f"{out}/w2-{name}-{leg}", mine)
            shutil.rmtree(f"{mine}/ckpt-{STEPS:06d}")                  # as if the run had stopped halfway
            with open(f"{mine}/latest", "w") as f:
                f.write(f"ckpt-{STEPS // 2:06d}")
        if world > 1:
            dist.barrier()
        rows = run(mine, d, resume=True, **runs[name], **kw)
        found[f"{name}/resumed"] = summary(rows, mine)
    if d.rank == 0:
        with open(f"{out}/world{world}.json", "w") as f:
            json.dump(found, f)
    if world > 1:
        dist.barrier()
        gc.collect()      # the runs' cycles (their gloo work) go while Python is alive, as in train.py
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
