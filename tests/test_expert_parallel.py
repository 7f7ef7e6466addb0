"""Expert parallelism: placement, the degree checks, the slot-order combine (with its control), and
tests/ep_check.py under torchrun with 2 and 4 gloo processes (score and gradients against EP=1, the
memory plan against the bytes allocated; gpt-oss's biased experts with their controls); EPLB: placements with replicas, the plan, its checks, and
tests/eplb_check.py under torchrun (replicas against none, bitwise); the three run as one torchrun job, tests/ep_suite.py."""
import os
import re
import subprocess
import sys

import pytest
import torch

import kernels
from config import ConfigError, ModelConfig
from model import Transformer
from parallel import eplb
from parallel.expert_parallel import ExpertParallel, Placement, check_degree, placement_of, shard_experts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_contiguous_placement_owns_ranges():
    pl = Placement.contiguous(8, 4)
    ids = torch.arange(8)
    assert pl.owner(ids).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert pl.local(ids).tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [pl.experts_of(r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_permuted_placement_maps_logical_to_physical():
    pl = Placement((5, 0, 7, 2, 1, 6, 3, 4), 2)                      # expert e sits at physical slot table[e]
    for r in range(2):
        for j, e in enumerate(pl.experts_of(r)):
            assert pl.owner(torch.tensor(e)).item() == r and pl.local(torch.tensor(e)).item() == j
    assert sorted(pl.experts_of(0) + pl.experts_of(1)) == list(range(8))
    routes = torch.tensor([[[1, 4]], [[0, -1]]])                     # -1: padding, on no rank
    assert pl.rows_per_rank(routes).tolist() == [2, 1]               # experts 1, 4 on rank 0; 0 on rank 1


@pytest.mark.parametrize("table, n", [((0, 1, 1, 3), 2), ((0, 1, 2), 2)])
def test_bad_placement_is_one_line(table, n):
    with pytest.raises(ConfigError):
        Placement(table, n)


@pytest.mark.parametrize("n, experts, world, says", [(3, 8, 6, "number of experts (8)"),
                                                     (2, 8, 3, "number of ranks (3)"), (0, 8, 1, ">= 1")])
def test_expert_parallel_degree_errors(n, experts, world, says):
    with pytest.raises(ConfigError, match=f"--expert_parallel={n}: .*{says}".replace("(", r"\(").replace(")", r"\)")):
        check_degree(n, experts, world)
    check_degree(2, 8, 4)                                            # a valid one passes


@pytest.mark.parametrize("table, n, says", [([1, 0, 2, 3], 1, "needs --expert_parallel > 1"),
                                            ([1, 0, 2], 2, "3 slots for 4 experts"),
                                            ([0, 0, 2, 3], 2, "not a permutation")])
def test_expert_placement_option_errors(table, n, says):
    with pytest.raises(ConfigError, match=says):
        placement_of(table, n, 4)
    assert placement_of([], 2, 4) is None                           # the contiguous default
    assert placement_of([3, 2, 1, 0], 2, 4).owner(torch.tensor([0, 3])).tolist() == [1, 0]


@pytest.mark.parametrize("flags, says", [(["--expert_parallel=3"], "--expert_parallel=3: must divide the number of experts (8)"),
                                         (["--eplb_redundant=2"], "--eplb_redundant=2: replicas spread experts over EP "
                                          "ranks; it needs --expert_parallel > 1"),
                                         (["--expert_parallel=2"], "--expert_parallel=2: must divide the number of ranks (1)"),
                                         (["--expert_placement=1,0,2,3,4,5,6,7"],
                                          "--expert_placement: needs --expert_parallel > 1 (one rank holds every expert)")])
def test_expert_parallel_flags_are_one_line_in_train(tmp_path, flags, says):
    from conftest import cli_error
    assert cli_error([*flags, "--steps=1", "--device=cpu", f"--out_dir={tmp_path}"]) == f"error: {says}"


def test_shard_keeps_only_local_experts_in_placement_order():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset("tiny"))
    whole = {k: v.clone() for k, v in model.state_dict().items()}
    pl = Placement((3, 6, 0, 5, 1, 7, 2, 4), 4)
    shard_experts(model, ExpertParallel(pl, rank=1))
    for name, p in model.named_parameters():
        if name.endswith((".w13", ".w2")):
            assert p.shape[0] == 2 and torch.equal(p, whole[name][pl.experts_of(1)])
        else:
            assert torch.equal(p, whole[name])


def test_slot_order_combine_and_its_control():
    """The combine's order is the contract: EP's rows come back grouped by owner rank, and summing them
    in that arrival order, or per rank first, gives other bits than the slot-order sum at EP=1."""
    g = torch.Generator().manual_seed(0)
    M, D, I, E, k = 64, 48, 32, 8, 4
    x = torch.randn(M, D, generator=g)
    w13, w2 = torch.randn(E, 2 * I, D, generator=g) * 0.2, torch.randn(E, D, I, generator=g) * 0.2
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
    weights = torch.rand(M, k, generator=g)
    ref = kernels.moe_experts(x, w13, w2, ids, weights)
    order, counts = kernels.sort_slots(ids, E)
    per_slot = kernels.grouped_experts(x, k, order, counts, w13, w2, weights.reshape(-1)).view(M, k, D)
    assert torch.equal(kernels.combine_slots(per_slot, x.dtype), ref)
    owner = Placement.contiguous(E, 2).owner(ids)                   # (M, k)
    arrival = torch.sort(owner * E + ids, dim=1, stable=True).indices   # by owner, by expert inside
    in_arrival_order = kernels.combine_slots(per_slot.gather(1, arrival[..., None].expand(-1, -1, D)), x.dtype)
    per_rank = [kernels.combine_slots(per_slot * (owner == r)[..., None], x.dtype) for r in range(2)]
    rank_first = per_rank[0] + per_rank[1]
    assert not torch.equal(in_arrival_order, ref) and not torch.equal(rank_first, ref)
    torch.testing.assert_close(in_arrival_order, ref)                # the same sum, other roundings
    torch.testing.assert_close(rank_first, ref)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize("nproc", [2, 4])
def test_expert_parallel_under_torchrun(nproc, tmp_path):
    """tests/ep_suite.py: ep_check, ep_train_check and eplb_check in one torchrun job of nproc gloo processes,
    each one's lines read apart and checked below."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "tests/ep_suite.py", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                       timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    parts = dict(re.findall(r"^== (\w+)\n(.*?)(?=^== |\Z)", r.stdout, flags=re.M | re.S))
    assert list(parts) == ["ep_check", "ep_train_check", "eplb_check"], r.stdout[-2000:]
    check_ep_score_and_grads(nproc, parts["ep_check"])
    check_training_under_ep(nproc, parts["ep_train_check"], r.stderr)
    check_eplb_replicas(nproc, parts["eplb_check"])


def check_ep_score_and_grads(nproc, stdout):
    """tests/ep_check.py: score and gradients at EP > 1 against EP=1, bit for bit."""
    degrees = [n for n in (1, 2, 4) if nproc % n == 0]
    ok = [line for line in stdout.splitlines() if line.startswith("ok ")]
    # gpt-oss: 3 checks x 2 dtypes at each EP degree (2; on 4 processes 2 and 4) and the sampler in 2 dtypes;
    # on 2 processes also the controls and the plan
    oss = [line for line in ok if line.startswith(("ok gpt-oss", "ok control gpt-oss"))]
    oss_degrees = [2] if nproc == 2 else [2, 4]
    assert len(oss) == 3 * 2 * len(oss_degrees) + 2 + (2 if nproc == 2 else 0), oss
    # score, grads, exact grads; 2 dtypes, 2 placements; on 2 processes MLA's and the hybrid's 4 each
    assert len(ok) == 3 * 2 * 2 * len(degrees) + 6 + len(oss) + (8 if nproc == 2 else 0), stdout
    assert sum("b13, b2 bitwise" in line or "w13 / w2 / b13 / b2 bitwise" in line for line in oss) == 4 * len(oss_degrees)
    for n in oss_degrees:
        assert sum(f"EP={n} " in line for line in oss if line.startswith(("ok gpt-oss score", "ok gpt-oss grads"))) == 4
    assert sum(line.startswith("ok gpt-oss sampler EP=2") for line in oss) == 2
    mla = [line for line in ok if line.startswith("ok mla ")]     # score and the sampler, 2 dtypes, 2 processes
    assert len(mla) == (4 if nproc == 2 else 0), mla
    assert sum(line.startswith(("ok mla score EP=2", "ok mla sampler EP=2")) for line in mla) == len(mla)
    hybrid = [line for line in ok if line.startswith("ok hybrid ")]   # across the GDN grid's boundary, 2 dtypes
    assert len(hybrid) == (4 if nproc == 2 else 0), hybrid
    assert sum(line.startswith(("ok hybrid score EP=2", "ok hybrid sampler EP=2")) for line in hybrid) == len(hybrid)
    assert any(line.startswith("ok decode exchange: no host read") for line in ok)
    assert any(line.startswith("ok expert_map fault: EP=2 equals EP=1") for line in ok)
    assert sum(line.startswith("ok sampler EP=2") for line in ok) == 2
    assert sum(line.startswith(("ok plan ddp EP=2", "ok plan fsdp EP=2")) for line in ok) == 2
    for n in degrees:
        assert sum(f"EP={n} " in line for line in ok if line.startswith(("ok score", "ok grads"))) == 8


def check_training_under_ep(nproc, stdout, stderr):
    """tests/ep_train_check.py: train.py's loop at EP>1 against EP=1, bit for bit: the router bias, R3, a placement,
    a checkpoint folder, gpt-oss's biased experts (with a control; on 4 ranks under FSDP2 over two replicas), resume
    at the same and another EP degree (DDP / FSDP2 x fp32 / bf16: tests/world_check.py)."""
    ok = [line for line in stdout.splitlines() if line.startswith("ok ")]
    assert len(ok) == (12 if nproc == 2 else 6), stdout
    for what in ("checkpoint folder EP=2", "gpt-oss from a checkpoint folder EP=2", "control gpt-oss EP=2", "R3 replay EP=2",
                 "permuted placement EP=2", "device load EP=2", "expert_map fault EP=1 vs EP=2"):
        assert nproc == 4 or any(what in line for line in ok), (what, stdout)
    for what in ("fsdp EP=2 on 4 ranks, tiny:", "fsdp EP=2 on 4 ranks, tiny-gpt-oss:", "w13, w2, b13, b2",
                 "gpt-oss from a checkpoint folder EP=2 fsdp on 4 ranks", "control gpt-oss EP=2 fsdp on 4 ranks"):
        assert nproc == 2 or any(what in line for line in ok), (what, stdout)
    assert any("resume EP=2 -> EP=2" in line and "every metric bit for bit" in line for line in ok)
    assert "returned a view tensor" not in stderr          # FSDP2's warning, silenced for the Router and the MoE


# ---------------------------------------------------------------------------------------------------
# EPLB: replicas placed by measured load
# ---------------------------------------------------------------------------------------------------
def test_placement_with_replicas_sends_each_source_to_one_slot():
    pl = Placement((0, 1, 2, 3), 2, replicas=((0, 4), (3, 5)))       # 6 slots, 3 a rank: expert 0 at 0 and 4
    assert pl.slots_of(0) == (0, 4) and pl.slots_of(3) == (3, 5) and pl.per_rank == 3
    assert pl.routing() == [[0, 1, 2, 3], [4, 1, 2, 5]]              # source s -> slots_of(e)[s % r_e]
    ids = torch.tensor([0, 3, 1])
    assert pl.owner(ids, 0).tolist() == [0, 1, 0] and pl.owner(ids, 1).tolist() == [1, 1, 0]
    assert pl.local(ids, 1).tolist() == [1, 2, 1]
    assert [pl.experts_of(r) for r in range(2)] == [[0, 1, 2], [3, 0, 3]]
    load = torch.tensor([[5, 1, 1, 2], [7, 1, 1, 4]])                # rows of expert e from source s
    assert pl.rank_rows(load).tolist() == [5 + 1 + 1 + 1 + 1, 2 + 7 + 4]
    assert Placement.contiguous(4, 2).rank_rows(load).tolist() == [5 + 1 + 7 + 1, 1 + 2 + 1 + 4]


@pytest.mark.parametrize("table, replicas, says", [((0, 1, 2, 3), ((0, 3), (1, 4)), "not 0..5 once each"),
                                                   ((0, 1, 2, 3), ((4, 4), (0, 5)), "of experts 0..3"),
                                                   ((0, 1, 2, 3), ((0, 4), (0, 5)), "at most 2 slots each"),
                                                   ((0, 1, 2, 3), ((0, 4),), "2 must divide 5")])
def test_bad_replicas_are_one_line(table, replicas, says):
    with pytest.raises(ConfigError, match=says):
        Placement(table, 2, replicas)


def test_eplb_plan_replicates_the_hot_expert_and_balances_the_ranks():
    """Expert 0 takes most rows: it gets a slot on each rank, and the E + R slots pack to a near even load
    (before: the contiguous placement's busiest rank has 1.4x the mean's rows; after: exactly the mean)."""
    load = torch.tensor([[60, 5, 5, 5, 5, 5, 5, 10], [50, 5, 5, 5, 5, 5, 5, 20]])   # (N, E)
    pl = eplb.place(load, 2)
    assert len(pl.slots_of(0)) == 2 and {p // pl.per_rank for p in pl.slots_of(0)} == {0, 1}
    assert sorted([*pl.table, *(p for _, p in pl.replicas)]) == list(range(10))
    before = eplb.imbalance([Placement.contiguous(8, 2)], load[None])
    after = eplb.imbalance([pl], load[None])
    assert (before, after) == (1.4, 1.0)
    assert eplb.place(load, 2) == pl                                 # a function of the load alone
    even = eplb.place(torch.ones(2, 8, dtype=torch.long), 2)         # the first plan: every pair alike
    assert eplb.imbalance([even], torch.ones(1, 2, 8, dtype=torch.long)) == 1.0


def test_eplb_measured_load_counts_rows_by_sampling_rank():
    """Rows of the global batch by the group rank that sampled them (rank r: rows r*B/world ...), summed
    over the EP groups; unrecorded positions and -1 out."""
    routes = torch.tensor([[[[0, 1]], [[2, -1]]], [[[1, 1]], [[3, 3]]], [[[0, 2]], [[0, 0]]], [[[3, 1]], [[1, 1]]]])
    mask = torch.tensor([[True, True], [True, False], [True, True], [False, True]])   # (B=4, T=2)
    load = eplb.measured_load(routes, mask, world=4, n=2, n_experts=4)   # ranks 0, 2 are group rank 0
    assert load.shape == (1, 2, 4)
    assert load[0].tolist() == [[0 + 2 + 2, 1, 1 + 1, 0], [0, 2 + 2, 0, 0]]


@pytest.mark.parametrize("flags, says", [(dict(eplb_redundant=-1), "--eplb_redundant=-1: must be >= 0"),
                                         (dict(eplb_interval=0), "--eplb_interval=0: must be >= 1"),
                                         (dict(eplb_redundant=2), "it needs --expert_parallel > 1"),
                                         (dict(eplb_redundant=2, expert_parallel=2, grad_reduce="fast"),
                                          "it needs --grad_reduce=exact")])
def test_eplb_flags_are_one_line(flags, says):
    from config import TrainConfig
    with pytest.raises(ConfigError, match=says):
        TrainConfig(**flags)
    TrainConfig(eplb_redundant=2, expert_parallel=2)                  # control: a valid one passes


@pytest.mark.parametrize("r, n, says", [(1, 2, "must split evenly over the --expert_parallel=2 ranks"),
                                        (10, 2, "at most 8, each of the 8 experts on at most 2 slots")])
def test_eplb_against_the_model_is_one_line(r, n, says):
    with pytest.raises(ConfigError, match=says):
        eplb.check(r, n, 8)
    eplb.check(8, 2, 8)                                              # control: every expert on both ranks


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def check_eplb_replicas(nproc, stdout):
    """tests/eplb_check.py: score, the sampler and the exact gradient sums with replicas at EP=nproc equal
    EP=1's (with the one-ulp control; gpt-oss's biases on the replicas too); with 2 ranks train.py's loop too (fp32,
    bf16, a resume, the files); with 4, two EP groups of 2 under FSDP2."""
    ok = [line for line in stdout.splitlines() if line.startswith("ok ")]
    assert len(ok) == 8 + (9 if nproc == 2 else 1), stdout          # 2 processes: gpt-oss's 2 layouts, control, grads
    assert sum(line.startswith("ok control") for line in ok) == 2 + 2 * (nproc == 2)
    assert sum(line.startswith("ok gpt-oss") for line in ok) == 3 * (nproc == 2), stdout
