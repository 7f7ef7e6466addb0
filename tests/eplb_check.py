"""EPLB's replicas against no replicas, on every rank of a torchrun job (gloo on the CPU).

    torchrun --standalone --nproc_per_node=2 tests/eplb_check.py

Every rank builds the same tiny model and tokens and computes the EP=1 reference itself, then runs EP=N
(N = the world) with EPLB layouts (replicas planned from the tokens' own load, and every expert on
every rank) and compares: score's log-probs and routes, the sampler's outputs, and the exact gradient
sums after the replicas' pieces are folded home, all bitwise; with a control, a replica whose weights
differ by one ulp, which changes the log-probs. gpt-oss's biased experts too (2 processes): a replica
slot carries the biases (the control: one ulp on a replica's b2) and their gradients fold home. Prints
one `ok ...` line per check on rank 0; any mismatch raises. tests/test_expert_parallel.py runs it with 2 and 4 processes.
"""
import copy
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from config import ModelConfig                                                  # noqa: E402
from parallel import eplb                                                       # noqa: E402
from support import exact_sum                                                   # noqa: E402
from support.distributed import Dist                                            # noqa: E402
from ep_check import build                                        # noqa: E402
from parallel.expert_parallel import (ExpertSums, Placement, Replicas, expert_tensors, init_expert_parallel, is_expert,
                                      shard_experts)                                                                       # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def say(msg):
    if dist.get_rank() == 0:
        print("ok", msg, flush=True)


def tokens_of(cfg, n):
    return torch.randint(0, cfg.vocab_size, (2 * n, 12), generator=torch.Generator().manual_seed(1))


def layouts(routes, n, cfg):
    """(name, per MoE layer Placement): planned from the load of these routes (rank r scores rows 2r,
    2r + 1: its source rows), and every expert on every rank (R = E * (N - 1))."""
    load = eplb.measured_load(routes, torch.ones(routes.shape[:2], dtype=torch.bool), n, n, cfg.num_experts)
    yield "planned R=N", [eplb.place(part, n) for part in load]
    yield "all on all", [eplb.place(part, cfg.num_experts * (n - 1)) for part in load]


def replica_rows(layout: list[Placement], routes, n) -> int:
    """Rows the layouts send to a replica slot (not an expert's first): the check exercises them."""
    total = 0
    for j, pl in enumerate(layout):
        first = torch.tensor(pl.table)
        for s in range(n):
            ids = routes[2 * s:2 * s + 2, :, j].reshape(-1)
            total += int((pl.physical(ids, s) != first[ids]).sum())
    return total


@torch.no_grad()
def check_score(cfg, dtype, tag=""):
    """score at EP=N under EPLB layouts equals EP=1's, bitwise; the control: one ulp on a replica's
    weights (gpt-oss: on its down bias b2)."""
    n = dist.get_world_size()
    whole = build(cfg, dtype)
    tokens = tokens_of(cfg, n)
    ref_logp, ref_routes = whole.score(tokens)
    ep = init_expert_parallel(n, n_experts=cfg.num_experts)
    model = shard_experts(copy.deepcopy(whole), ep)
    b = slice(2 * ep.rank, 2 * ep.rank + 2)
    for name, layout in layouts(ref_routes, n, cfg):
        ep.eplb = Replicas(layout)
        logp, routes = model.score(tokens[b])
        assert torch.equal(logp, ref_logp[b]) and torch.equal(routes, ref_routes[b]), f"score EPLB {name} {dtype}"
        rows = replica_rows(layout, ref_routes, n)
        assert rows > 0, f"no row reached a replica ({name})"
        say(f"{tag}score EP={n} EPLB {name} {dtype}: logp and routes equal EP=1's ({rows} rows on replicas)")
    key = "b2" if cfg.expert_bias else "w13"
    nudged = nudge_a_replica(model, ep, ref_routes, n, key)
    logp, routes = model.score(tokens[b])
    moved = torch.tensor(int(not torch.equal(logp, ref_logp[b])))
    dist.all_reduce(moved)
    assert moved.item() > 0, "control: one ulp on a replica changed nothing"
    say(f"control {tag}EP={n} {dtype}: one ulp on replica slot {nudged}'s {key} changes the log-probs of "
        f"{moved.item()} rank(s)")
    ep.eplb = None


def nudge_a_replica(model, ep, routes, n, key="w13") -> int:
    """Add one ulp to every element of expert tensor `key` of a replica slot that receives rows, in the
    first MoE layer's copy on the rank holding it (the other ranks' copies stay right). -> the slot."""
    layer = next(m for m in model.modules() if getattr(m, "ep", None) is not None and m.ep_layer == 0)
    pl = ep.eplb.layouts[0]
    used = {int(p) for s in range(n) for p in pl.physical(routes[2 * s:2 * s + 2, :, 0].reshape(-1), s)}
    slot = next(p for e, p in pl.replicas if p in used)
    if slot // pl.per_rank == ep.rank:
        _, slots = ep.eplb.copies[layer]
        with torch.no_grad():
            row = slots[key][slot % pl.per_rank]
            row.copy_(torch.nextafter(row, torch.full_like(row, float("inf"))))
    return slot


def check_sampler(cfg, dtype):
    """The sampler at EP=N under a planned EPLB layout (ranks with different prompts, so prefill, decode
    and idle ranks mix) gives the outputs of the sampler without EPLB, and score at EP=1's bits."""
    from ep_check import score_outputs
    from rollout import Sampler
    n, rank = dist.get_world_size(), dist.get_rank()
    whole = build(cfg, dtype)
    g = torch.Generator().manual_seed(10 + rank)
    prompts = [torch.randint(1, cfg.vocab_size, (3 + 2 * rank + i,), generator=g).tolist() for i in range(1 + rank)]
    runs = []
    for with_eplb in (False, True):
        ep = init_expert_parallel(n, n_experts=cfg.num_experts)
        model = shard_experts(copy.deepcopy(whole), ep)
        if with_eplb:
            skewed = torch.arange(n * cfg.num_experts).view(n, -1) % 5      # some experts hot, some cold
            ep.eplb = Replicas([eplb.place(skewed, n)] * len(cfg.moe_layers))
        sampler = Sampler(model, max_batch_size=4, num_blocks=64)
        runs.append(sampler.generate(prompts, max_new_tokens=4 + 3 * rank, n=2, temperature=1.0, seed=7,
                                     progress=False, stop_token_ids=(5,)))
    for a, b in zip(*runs):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs and torch.equal(a.routes, b.routes), f"sampler {dtype}"
    for o, (logp, routes) in zip(runs[1], score_outputs(whole, runs[1])):
        assert torch.equal(torch.tensor(o.logprobs), logp) and torch.equal(o.routes, routes), f"sampler vs EP=1 {dtype}"
    say(f"sampler EP={n} EPLB {dtype}: the outputs without EPLB, and score at EP=1's logp and routes")


def exact_grads(model, tokens, d, ep):
    """One minibatch of one micro-batch per rank (its rows of tokens) through an exact_sum.Reducer (ExpertSums) ->
    the gradients of the expert tensors per MoE layer (this rank's shard) and of the router gates."""
    experts = {id(p) for name, p in model.named_parameters() if is_expert(name)}
    reducer = ExpertSums(model, d, trained=model, ep=ep, experts=experts)
    reducer.start()
    reducer.last = True
    logp, _ = model.score(tokens)
    (logp * torch.linspace(-1, 1, logp.shape[1])).sum().backward()
    reducer.finish()
    moes = [m for m in model.modules() if hasattr(m, "w13")]
    return [(*(t.grad for t in expert_tensors(m).values()), m.gate.weight.grad) for m in moes]


def check_exact_grads(cfg, tag=""):
    """Training through replicas: each source's rows of an expert run whole on one slot, so every piece is
    EP=1's of that micro-batch; folded home as integers, the sums equal EP=N without EPLB and the exact
    sum of the EP=1 micro-batches' gradients, bitwise."""
    n, rank = dist.get_world_size(), dist.get_rank()
    whole = build(cfg)
    tokens = tokens_of(cfg, n)
    d = Dist(rank, n, torch.device("cpu"))
    per_slice = []
    for r in range(n):                                              # EP=1, one micro-batch at a time
        m = copy.deepcopy(whole)
        m.score(tokens[2 * r:2 * r + 2])[0].mul(torch.linspace(-1, 1, 11)).sum().backward()
        per_slice.append([(*(t.grad for t in expert_tensors(x).values()), x.gate.weight.grad)
                          for x in m.modules() if hasattr(x, "w13")])
    _, ref_routes = whole.score(tokens)
    got = {}
    for name in ("none", "planned"):
        ep = init_expert_parallel(n, n_experts=cfg.num_experts)
        model = shard_experts(copy.deepcopy(whole), ep)
        if name == "planned":
            ep.eplb = Replicas(next(layouts(ref_routes, n, cfg))[1])
            assert replica_rows(ep.eplb.layouts, ref_routes, n) > 0, "no row reached a replica"
        got[name] = exact_grads(model, tokens[2 * rank:2 * rank + 2], d, ep)
    mine = torch.tensor(ep.placement.experts_of(rank))
    for j, (a, b) in enumerate(zip(got["none"], got["planned"])):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"EPLB grads layer {j}"
        for i in range(len(b)):                                      # the expert tensors, then the router
            want = exact_sum.Limbs(per_slice[0][j][i].shape, "cpu")
            for part in per_slice:
                want.add(part[j][i])
            value = want.value()
            assert torch.equal(b[i], value[mine] if i < len(b) - 1 else value), f"grad {i} layer {j} vs EP=1"
    names = ", ".join(expert_tensors(model.layers[1].mlp))
    say(f"{tag}exact grads EP={n} EPLB planned: {names}, router = EP={n} without replicas = EP=1's exact sums, bitwise")


def check_training(out):
    """train.py's loop with replicas (--eplb_redundant=2, re-planned every step) against EP=1: every
    metric but the layout's own bit for bit, in fp32 and bf16 over fp32 masters; eplb.jsonl and the
    diagnostics rows; a resume continues every metric (the eplb ones too) and eplb.jsonl; the control:
    one ulp on every replica's weights moves the run."""
    import json
    from parallel import expert_parallel
    from ep_train_check import compare, resume, run
    for kw in (dict(), dict(dtype="bfloat16")):
        ref, got = run(f"{out}/ref", **kw), run(f"{out}/eplb", expert_parallel=2, eplb_redundant=2, **kw)
        compare(ref, got, f"EPLB R=2 EP=2 vs EP=1{' bf16' if kw else ''}")
        assert all("eplb_imbalance_before" not in r for r in ref) and all(r["eplb_imbalance_after"] >= 1 for r in got)
    plans = [json.loads(line) for line in open(f"{out}/eplb/eplb.jsonl")]
    assert [p["step"] for p in plans] == [0, 1, 2], plans
    for p in plans:
        for layer in p["layers"]:
            slots = sorted(s for e in layer["slots"] for s in e)
            assert slots == list(range(10)) and layer["ranks"] == [[s // 5 for s in e] for e in layer["slots"]], layer
    run(f"{out}/diag", expert_parallel=2, eplb_redundant=2, diagnostics=2, recompute_old_logp=True,
        rollout={"rollout_dtype": "bfloat16"})                      # a mismatch, so sequences qualify
    rows = [json.loads(line) for line in open(f"{out}/diag/diagnostics.jsonl")]
    assert rows and all(r["eplb_plan"] == r["step"] - 1 for r in rows), rows
    say(f"eplb.jsonl: a plan per step over the 10 slots; diagnostics rows name theirs ({len(rows)} rows)")
    kw = dict(expert_parallel=2, eplb_redundant=2, eplb_interval=2)
    straight = run(f"{out}/straight", steps=3, **kw)
    run(f"{out}/leg", steps=1, lr_decay_steps=3, **kw)
    cont = resume(f"{out}/leg", steps=3, **kw)
    assert [{k: v for k, v in r.items() if k not in runlog_timings()} for r in straight[1:]] == \
        [{k: v for k, v in r.items() if k not in runlog_timings()} for r in cont], (straight[1:], cont)
    assert open(f"{out}/straight/eplb.jsonl").read() == open(f"{out}/leg/eplb.jsonl").read()
    say("resume EPLB --eplb_interval=2 at step 1: every metric, eplb_* too, and eplb.jsonl as the straight run's")
    gather = expert_parallel._gather_slots

    def off_by_one_ulp(w, ep, layout):                              # every replica slot's weights
        got = gather(w, ep, layout)
        first = {p - ep.rank * layout.per_rank for p in layout.table if p // layout.per_rank == ep.rank}
        for j in set(range(layout.per_rank)) - first:
            got[j] = torch.nextafter(got[j], torch.full_like(got[j], float("inf")))
        return got
    expert_parallel._gather_slots = off_by_one_ulp
    try:
        bad = run(f"{out}/bad", expert_parallel=2, eplb_redundant=2)
    finally:
        expert_parallel._gather_slots = gather
    ref = run(f"{out}/ref")
    assert any(a["loss"] != b["loss"] or a["grad_norm"] != b["grad_norm"] for a, b in zip(ref, bad)), "control"
    say(f"control: one ulp on the replicas moves the run (step 1 grad norm {bad[0]['grad_norm']!r} vs "
        f"{ref[0]['grad_norm']!r})")


def check_training_fsdp(out):
    """4 ranks, two EP groups of 2, FSDP2: the replicas' sums are folded home, then reduce-scattered over
    the shard's replicas; every metric but the layout's own as one EP=1 FSDP2 run's, bit for bit."""
    from ep_train_check import compare, run
    ref = run(f"{out}/ref4", parallel="fsdp")
    got = run(f"{out}/eplb4", parallel="fsdp", expert_parallel=2, eplb_redundant=2)
    compare(ref, got, "EPLB R=2 EP=2 x 2 groups fsdp vs EP=1 fsdp")


def runlog_timings():
    from support import runlog
    return set(runlog.TIMINGS) | set(runlog.PER_RANK)


def main(out=None):
    dist.init_process_group("gloo")
    checks(out)
    dist.barrier()
    gc.collect()      # the runs' cycles (their gloo work) go while Python is alive, as in train.py
    dist.destroy_process_group()


def checks(out=None):
    tiny = ModelConfig.preset("tiny")
    for dtype in DTYPES.values():
        check_score(tiny, dtype)
    check_sampler(tiny, torch.float32)
    check_exact_grads(ModelConfig(**{**tiny.__dict__, "num_experts_per_tok": 4}))
    if dist.get_world_size() == 2:                                   # gpt-oss: biased experts, the clamped SwiGLU
        oss = ModelConfig.preset("tiny-gpt-oss")
        check_score(oss, torch.float32, tag="gpt-oss ")
        check_exact_grads(ModelConfig(**{**oss.__dict__, "num_experts_per_tok": 4}), tag="gpt-oss ")
    if out is not None:
        (check_training if dist.get_world_size() == 2 else check_training_fsdp)(out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
