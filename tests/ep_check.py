"""Expert parallelism against EP=1, on every rank of a torchrun job (gloo on the CPU).

    torchrun --standalone --nproc_per_node=4 tests/ep_check.py

Every rank builds the same tiny model and the same tokens, computes the EP=1 reference itself, then runs
each EP degree that divides the world (with the contiguous and a permuted placement) on its own slice of
the tokens and compares; and holds plan.memory_plan against the bytes an EP=2 run allocates. gpt-oss's
experts (biases, the clamped SwiGLU) too: score, gradients and the sampler (fp32 and bf16) at EP=2, and
on 4 processes at EP=4 and as two EP=2 groups; the controls (a bias or the SwiGLU lost on the exchanged
path changes the bits) on 2. The MLA preset (its latent cache, GLM-4.5's router) and the tiny hybrid (Gated DeltaNet
layers across a grid boundary, a gated shared expert): score and the sampler at EP=2. Prints one `ok ...` line per check on rank 0; any mismatch raises.
tests/test_expert_parallel.py runs it with 2 and 4 processes.
"""
import copy
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from config import ModelConfig                                    # noqa: E402
from lab import faults as lab                                     # noqa: E402
from model import Transformer                                     # noqa: E402
from parallel import expert_parallel                              # noqa: E402
from parallel.expert_parallel import Placement, gather_experts, init_expert_parallel, shard_experts  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The router's gradient sums over tokens: each rank sums its own, then the ranks add up (the reduction
# DDP does too), so it is EP=1's sum re-associated. Bound in norm (an element that is a near-total
# cancellation moves by more): fp32 1e-5 relative; bf16 2e-2 (each rank's partial sum rounded to bf16).
ROUTER_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def say(msg):
    if dist.get_rank() == 0:
        print("ok", msg, flush=True)


def placements(E, n):
    g = torch.Generator().manual_seed(n)
    yield "contiguous", Placement.contiguous(E, n)
    yield "permuted", Placement(tuple(torch.randperm(E, generator=g).tolist()), n)


def build(cfg, dtype=torch.float32):
    """The tiny model seeded 0; gpt-oss's expert biases (zero at init) drawn, so that a lost one shows."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    if cfg.expert_bias:
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for m in model.modules():
                for b in (getattr(m, "b13", None), getattr(m, "b2", None)):
                    if isinstance(b, torch.nn.Parameter):
                        b.copy_(torch.randn(b.shape, generator=g) * 0.5)
    return model.to(dtype)


def split(total, n, r):
    """Rank r's slice of total rows: uneven, and the group's last rank gets none when n > 1."""
    if n == 1:
        return 0, total
    cuts = [total * i // (n - 1) for i in range(n)] + [total]      # n = 4, total = 37: 0 12 24 37 37
    return cuts[r], cuts[r + 1]


def check_score(cfg, dtype, n, name, placement, tag="", length=12):
    model = build(cfg, dtype)
    tokens = torch.randint(0, cfg.vocab_size, (2 * n, length), generator=torch.Generator().manual_seed(1))
    ref_logp, ref_routes = model.score(tokens)
    ep = init_expert_parallel(n, placement)
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    shard_experts(model, ep)
    b = slice(2 * ep.rank, 2 * ep.rank + 2)                        # this rank's two sequences
    logp, routes = model.score(tokens[b])
    assert torch.equal(logp, ref_logp[b]), f"score logp EP={n} {name} {dtype}"
    assert torch.equal(routes, ref_routes[b]), f"score routes EP={n} {name} {dtype}"
    back = gather_experts(model, ep)                               # rank 0 only; None on the others
    assert (back is None) == (dist.get_rank() != 0), "gather_experts: whole experts on rank 0 alone"
    assert back is None or all(torch.equal(back[k], whole[k]) for k in whole), "gather_experts is not the whole model"
    say(f"{tag}score EP={n} {name} {dtype}: logp and routes equal EP=1's; gather_experts round trip")


def check_grads(cfg, dtype, n, name, placement, tag=""):
    """One MoE layer, forward and backward, on this rank's slice of 37 tokens (some ranks get none)."""
    moe = build(cfg, dtype).layers[1].mlp
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 37, cfg.hidden_size, generator=g).to(dtype)
    probe = torch.randn(1, 37, cfg.hidden_size, generator=g)       # loss = sum(out * probe)
    xr = x.clone().requires_grad_()
    out, ids = moe(xr)
    (out.float() * probe).sum().backward()
    ep = init_expert_parallel(n, placement)
    mine = placement.experts_of(ep.rank)
    local = shard_experts(copy.deepcopy(moe), ep)
    local.zero_grad()
    lo, hi = split(37, n, ep.rank)
    xl = x[:, lo:hi].clone().requires_grad_()
    out_l, ids_l = local(xl)
    (out_l.float() * probe[:, lo:hi]).sum().backward()
    what = f"EP={n} {name} {dtype}"
    assert torch.equal(out_l, out[:, lo:hi]) and torch.equal(ids_l, ids[:, lo:hi]), f"MoE forward {what}"
    assert torch.equal(xl.grad, xr.grad[:, lo:hi]), f"grad of x {what}"
    names = list(expert_parallel.expert_tensors(moe))               # w13, w2 (gpt-oss: b13, b2)
    for key in names:
        assert torch.equal(getattr(local, key).grad, getattr(moe, key).grad[mine]), f"grad of {key} {what}"
    router = local.gate.weight.grad.float()
    dist.all_reduce(router, group=ep.group)
    ref = moe.gate.weight.grad.float()
    gap = ((router - ref).norm() / ref.norm()).item()
    assert gap < ROUTER_RTOL[dtype], f"router grad {what}: relative gap {gap:.2e}"
    say(f"{tag}grads {what}: x, {', '.join(names)} bitwise; router {gap:.1e} relative (bound {ROUTER_RTOL[dtype]})")


class Pieces:
    """A grad sink (expert_parallel._owner_rows) that keeps every source's expert weight gradient."""

    def __init__(self, moe):
        self.moe, self.got = moe, {name: [] for name in expert_parallel.expert_tensors(moe)}

    def key(self, w):
        return next(name for name, t in expert_parallel.expert_tensors(self.moe).items() if t is w)

    def __call__(self, key, grad):
        self.got[key].append(grad.clone())


def slice_grads(moe, x, probe, lo, hi):
    """EP=1: the gradients of one MoE layer from the tokens lo:hi alone (one micro-batch)."""
    moe.zero_grad()
    xs = x[:, lo:hi].clone().requires_grad_()
    out, _ = moe(xs)
    (out.float() * probe[:, lo:hi]).sum().backward()
    grads = {"router": moe.gate.weight.grad, **{k: t.grad for k, t in expert_parallel.expert_tensors(moe).items()}}
    return {"x": xs.grad, **{k: None if v is None else v.clone() for k, v in grads.items()}}   # None: a sink took it


def check_exact_grads(cfg, dtype, n, name, placement, tag=""):
    """With an exact gradient sum (ep.grad_sink set) the owner runs each source rank's rows apart: a
    rank's slice is one micro-batch, and at EP=n its router and x gradients, and each source's expert
    weight gradient on the owner, are bitwise EP=1's of that slice alone, so their exact sum is EP=1's.
    Control: the one call over every source's rows (--grad_reduce=fast) sums the slices inside the
    expert kernel's backward, in fp32: not the exact sum of the slices' gradients."""
    from support import exact_sum
    moe = build(cfg, dtype).layers[1].mlp
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 37, cfg.hidden_size, generator=g).to(dtype)
    probe = torch.randn(1, 37, cfg.hidden_size, generator=g)
    ep = init_expert_parallel(n, placement)
    group = [(37 * r // n, 37 * (r + 1) // n) for r in range(n)]   # every rank's slice of the EP group
    refs = [slice_grads(moe, x, probe, lo, hi) for lo, hi in group]
    mine = placement.experts_of(ep.rank)
    local = shard_experts(copy.deepcopy(moe), ep)
    sink = ep.grad_sink = Pieces(local)
    got = slice_grads(local, x, probe, *group[ep.rank])
    what = f"EP={n} {name} {dtype}"
    assert torch.equal(got["router"], refs[ep.rank]["router"]), f"router grad {what}"
    assert torch.equal(got["x"], refs[ep.rank]["x"]), f"grad of x {what}"
    for key in sink.got:                                              # every expert tensor, biases too
        assert got[key] is None and len(sink.got[key]) == n, f"{key} pieces {what}"
        want = [r[key][mine] for r in refs]
        for piece in sink.got[key]:                                  # each source's, in whichever order
            hit = next(i for i, w in enumerate(want) if torch.equal(piece, w))
            want.pop(hit)
    if n > 1 and name == "contiguous":                              # control: one call over all sources
        one = slice_grads(shard_experts(copy.deepcopy(moe), init_expert_parallel(n, placement)), x, probe, *group[ep.rank])
        exact = exact_sum.Limbs(one["w13"].shape, "cpu")
        for r in refs:
            exact.add(r["w13"][mine])
        assert not torch.equal(one["w13"].float(), exact.value()), f"control {what}"
    say(f"{tag}exact grads {what}: router, x and each source's {' / '.join(sink.got)} bitwise EP=1's of its micro-batch")


def check_decode_reads_nothing_back(cfg):
    """The decode step's exchange (fixed buffers) reads nothing back to the host: no count exchange, no
    value read in parallel/expert_parallel.py or model.py (the torch backend's per-expert loop reads its counts
    in kernels.py; the Triton backend's fused kernel does not). Control: the counted exchange of prefill
    and training reads the counts (send and receive)."""
    from host_reads import HostReads
    torch.manual_seed(0)
    moe = Transformer(cfg).layers[1].mlp
    ep = init_expert_parallel(2, n_experts=cfg.num_experts)
    shard_experts(moe, ep)
    x = torch.randn(1, 3 + ep.rank, cfg.hidden_size)                 # a decode step: a few sequences a rank
    with torch.no_grad():
        with HostReads() as counted:
            ref, _ = moe(x)
        ep.capacity = 4 * cfg.num_experts_per_tok                     # max_batch_size x top_k rows per destination
        try:
            with HostReads() as fixed:
                out, _ = moe(x)
        finally:
            ep.capacity = 0
    assert torch.equal(out, ref), "the fixed-size exchange changed the bits"
    mine = {f: n for f, n in fixed.by_file.items() if f in ("parallel/expert_parallel.py", "model.py")}
    assert mine == {}, f"decode exchange reads back: {fixed.by_file}"
    assert counted.by_file.get("parallel/expert_parallel.py", 0) >= 2, counted.by_file
    say(f"decode exchange: no host read (counted exchange: {counted.by_file['parallel/expert_parallel.py']}); same bits")


def check_expert_map_fault(cfg):
    """--rollout_router_fault=expert_map is a wrong table, the same at every EP degree: the faulted
    score at EP=2 equals EP=1's faulted score bitwise, its routes are the router's, its log-probs are not
    the right model's."""
    torch.manual_seed(0)
    whole = Transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 12), generator=torch.Generator().manual_seed(3))
    right = whole.score(tokens)
    lab.set_router_fault(whole, "expert_map")
    wrong = whole.score(tokens)
    sharded = shard_experts(copy.deepcopy(whole), init_expert_parallel(2, n_experts=cfg.num_experts))
    b = slice(2 * (dist.get_rank() % 2), 2 * (dist.get_rank() % 2) + 2)
    logp, routes = sharded.score(tokens[b])
    assert torch.equal(logp, wrong[0][b]) and torch.equal(routes, wrong[1][b]), "expert_map at EP=2 vs EP=1"
    assert not torch.equal(wrong[0], right[0]), "the fault changed nothing"
    assert torch.equal(wrong[1][:, :, 0], right[1][:, :, 0]), "the first MoE layer's routes are the router's"
    say("expert_map fault: EP=2 equals EP=1 bitwise; the first layer's routes unchanged, log-probs not")


def score_outputs(model, outs):
    """score() of the sampled sequences, right-padded: (logp, routes) per output, cut to its tokens."""
    lengths = [len(o.prompt) + len(o.tokens) for o in outs]
    tokens = torch.zeros(len(outs), max(lengths), dtype=torch.long)
    for i, o in enumerate(outs):
        tokens[i, :lengths[i]] = torch.tensor(o.prompt + o.tokens)
    logp, routes = model.score(tokens)
    return [(logp[i, len(o.prompt) - 1:n - 1], routes[i, :n - 1]) for i, (o, n) in enumerate(zip(outs, lengths))]


def sample_ep2(whole, cfg, shortest=3):
    """The sampler at EP=2 over a copy of whole: each rank its own prompts and lengths (from shortest) ->
    its outputs and the number of decode steps that ran the fixed-size exchange."""
    from rollout import Sampler
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(10 + rank)
    prompts = [torch.randint(1, cfg.vocab_size, (shortest + 2 * rank + i,), generator=g).tolist() for i in range(1 + rank)]
    model = shard_experts(copy.deepcopy(whole), init_expert_parallel(2, n_experts=cfg.num_experts))
    sampler = Sampler(model, max_batch_size=4, num_blocks=64)
    fixed, calls = expert_parallel._moe_experts_fixed, []
    expert_parallel._moe_experts_fixed = lambda *a: calls.append(1) or fixed(*a)   # count the decode exchanges
    try:
        outs = sampler.generate(prompts, max_new_tokens=4 + 3 * rank, n=2, temperature=1.0, seed=7, progress=False,
                                stop_token_ids=(5,))
    finally:
        expert_parallel._moe_experts_fixed = fixed
    return outs, len(calls)


def check_sampler(cfg, dtype, tag="", shortest=3):
    """The sampler at EP=2 (ranks of a group with different prompts, so they finish at different steps:
    prefill and decode mix in one group step, a finished rank exchanges zero rows) against score at
    EP=1 and at EP=world, bitwise."""
    whole = build(cfg, dtype)
    world = dist.get_world_size()
    outs, calls = sample_ep2(whole, cfg, shortest)
    assert calls, "no decode step ran the fixed-size exchange"
    assert shortest < 60 or all(len(o.prompt) <= 64 < len(o.prompt) + len(o.tokens) for o in outs), \
        "a long prompt's decode did not cross the 64-position boundary"
    ref = score_outputs(whole, outs)
    wide = shard_experts(copy.deepcopy(whole), init_expert_parallel(world, n_experts=cfg.num_experts))
    for name, scored in (("EP=1", ref), (f"EP={world}", score_outputs(wide, outs))):
        for o, (logp, routes) in zip(outs, scored):
            assert torch.equal(torch.tensor(o.logprobs), logp), f"sampler EP=2 vs score {name} logp {dtype}"
            assert torch.equal(o.routes, routes), f"sampler EP=2 vs score {name} routes {dtype}"
    say(f"{tag}sampler EP=2 {dtype}: logp and routes equal score at EP=1 and EP={world}")


def check_gpt_oss_controls(cfg):
    """Controls for gpt-oss's experts under EP: the owner running them without b2 (the bias on the
    exchanged rows) or with SiLU(gate) * up for the clamped SwiGLU gives other log-probs than EP=1's
    (score, and the sampler's decode exchange), and without b13 other gradients of x and w13, b13 none."""
    whole = build(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    ref_logp, _ = whole.score(tokens)
    b = slice(2 * (dist.get_rank() % 2), 2 * (dist.get_rank() % 2) + 2)
    rows = expert_parallel._rows
    naive = {"no b2": lambda x, ws, ids, w, swiglu: rows(x, {k: v for k, v in ws.items() if k != "b2"}, ids, w, swiglu),
             "SiLU": lambda x, ws, ids, w, swiglu: rows(x, ws, ids, w, None)}
    moved = []
    for what, fault in naive.items():
        expert_parallel._rows = fault
        try:
            logp, _ = shard_experts(copy.deepcopy(whole), init_expert_parallel(2, n_experts=cfg.num_experts)).score(tokens[b])
        finally:
            expert_parallel._rows = rows
        assert not torch.equal(logp, ref_logp[b]), f"control {what}: EP=2 still equals EP=1"
        moved.append(what)
    ref_outs, _ = sample_ep2(whole, cfg)                              # the decode exchange without b2
    fixed = expert_parallel._moe_experts_fixed
    expert_parallel._moe_experts_fixed = lambda x, ws, *a: fixed(x, {k: v for k, v in ws.items() if k != "b2"}, *a)
    try:
        outs, _ = sample_ep2(whole, cfg)
    finally:
        expert_parallel._moe_experts_fixed = fixed
    differ = torch.tensor(int(any(a.logprobs != o.logprobs for a, o in zip(ref_outs, outs))))
    dist.all_reduce(differ)
    assert differ.item() > 0, "control: the decode exchange without b2 changed no log-prob"
    moe = whole.layers[1].mlp
    x = torch.randn(1, 10, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    ref = slice_grads(shard_experts(copy.deepcopy(moe), init_expert_parallel(2, n_experts=cfg.num_experts)), x, x, 0, 10)
    expert_parallel._rows = lambda x, ws, ids, w, swiglu: rows(x, {k: v for k, v in ws.items() if k != "b13"}, ids, w, swiglu)
    try:
        bad = slice_grads(shard_experts(copy.deepcopy(moe), init_expert_parallel(2, n_experts=cfg.num_experts)), x, x, 0, 10)
    finally:
        expert_parallel._rows = rows
    assert bad["b13"] is None and not torch.equal(bad["x"], ref["x"]) and not torch.equal(bad["w13"], ref["w13"])
    say(f"control gpt-oss EP=2: {', '.join(moved)} on the owner change score's log-probs; no b2 in the decode "
        "exchange the sampler's; no b13 the gradients of x and w13")


def check_plan_bytes(cfg, parallel, tag=""):
    """plan.memory_plan against the bytes this run allocates at EP=2 (DDP or FSDP2 over every rank): the
    parameters, their gradients after a backward, AdamW's two moments after a step. The plan counts the
    most loaded rank (FSDP2's first shards): rank 0's bytes equal it, no rank's exceed it."""
    from config import TrainConfig
    from support.distributed import Dist, parallelize
    from tooling import plan
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = shard_experts(Transformer(cfg), init_expert_parallel(2, n_experts=cfg.num_experts))
    scorer, _, _ = parallelize(model, TrainConfig(parallel=parallel), Dist(rank, world, torch.device("cpu")))
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank))
    scorer(tokens, temperature=1.0)[0].sum().backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()

    def local(t):
        return getattr(t, "to_local", lambda: t)().nbytes
    moments = sum(local(v) for st in opt.state.values() for v in st.values() if v.dim() > 0)   # not the step counts
    got = torch.tensor([sum(local(p) for p in model.parameters()), sum(local(p.grad) for p in model.parameters()),
                        moments])
    want = plan.memory_plan(plan.parameter_shapes(cfg), world, parallel, 2, 4, 4, 0)
    most = got.clone()
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    assert got.tolist() == [want.masters, want.grads, want.adamw] or rank != 0, (parallel, got.tolist(), want)
    assert most.tolist() == [want.masters, want.grads, want.adamw], (parallel, most.tolist(), want)
    say(f"{tag}plan {parallel} EP=2 on {world} ranks: masters, gradients, AdamW moments = the bytes allocated "
        f"({want.masters} / {want.grads} / {want.adamw})")


def main():
    dist.init_process_group("gloo")
    checks()
    dist.barrier()
    gc.collect()      # the runs' cycles (their gloo work) go while Python is alive, as in train.py
    dist.destroy_process_group()


def checks():
    world = dist.get_world_size()
    tiny = ModelConfig.preset("tiny")
    top4 = ModelConfig(**{**tiny.__dict__, "num_experts_per_tok": 4})   # k > 2: the slot order matters
    oss = ModelConfig.preset("tiny-gpt-oss")                          # biased experts, the clamped SwiGLU
    oss4 = ModelConfig(**{**oss.__dict__, "num_experts_per_tok": 4})
    mla = ModelConfig.preset("tiny-mla")                              # MLA's latent cache, GLM-4.5's router
    hybrid = ModelConfig.preset("tiny-hybrid")                        # Gated DeltaNet layers, a shared expert
    check_decode_reads_nothing_back(tiny)
    for parallel in ("ddp", "fsdp"):
        check_plan_bytes(tiny, parallel)
    check_expert_map_fault(tiny)
    for dtype in DTYPES.values():
        check_sampler(tiny, dtype)
        for n in [d for d in (1, 2, 4) if world % d == 0]:
            for name, placement in placements(tiny.num_experts, n):
                check_score(tiny, dtype, n, name, placement)
                check_grads(top4, dtype, n, name, placement)
                check_exact_grads(top4, dtype, n, name, placement)
        # gpt-oss: EP=2 on 2 processes; on 4, EP=4 and EP=2 twice over (two EP groups of 2)
        for n in (2,) if world == 2 else (2, 4):
            _, permuted = list(placements(oss.num_experts, n))[1]
            check_score(oss, dtype, n, "permuted", permuted, tag="gpt-oss ")
            check_grads(oss4, dtype, n, "permuted", permuted, tag="gpt-oss ")
            check_exact_grads(oss4, dtype, n, "permuted", permuted, tag="gpt-oss ")
        check_sampler(oss, dtype, tag="gpt-oss ")
        if world == 2:
            _, permuted = list(placements(mla.num_experts, 2))[1]
            check_score(mla, dtype, 2, "permuted", permuted, tag="mla ")
            check_sampler(mla, dtype, tag="mla ")
            # the hybrid: 70 positions score across the 64-position grid's boundary; prompts of 61 to 64
            # tokens decode across it, each rank's GDN state per row beside the experts' exchange
            _, permuted = list(placements(hybrid.num_experts, 2))[1]
            check_score(hybrid, dtype, 2, "permuted", permuted, tag="hybrid ", length=70)
            check_sampler(hybrid, dtype, tag="hybrid ", shortest=61)
    if world == 2:
        check_gpt_oss_controls(oss)
        check_plan_bytes(oss, "ddp", tag="gpt-oss ")                  # b13, b2 counted as expert shards


if __name__ == "__main__":
    main()
