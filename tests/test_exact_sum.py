"""exact_sum: the fixed-point conversion, a sum that has no order (with fp32's as the control), the norm
that is the same on whole, sharded and expert-split tensors, and the reducer in one process.
Multi-process: tests/world_check.py (tests/test_distributed.py) and tests/ep_check.py."""
import math
from fractions import Fraction

import pytest
import torch

from support import exact_sum
from support.distributed import Dist
from support.exact_sum import FRAC_BITS, LIMB_BITS, LIMIT, Limbs, from_limbs, grad_norm, to_limbs

EXACT_FROM = 2.0 ** (23 - FRAC_BITS)      # the smallest |g| whose 24 bits all lie on the 2^-72 grid

ONE = Dist(0, 1, torch.device("cpu"))


def wide(n, seed, spread=6.0):
    """n fp32 values over many orders of magnitude, both signs."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * spread)).clamp(-1e9, 1e9).float()


def exact(terms: list[torch.Tensor]) -> list[Fraction]:
    return [sum(Fraction(t[i].item()) for t in terms) for i in range(terms[0].numel())]


def test_conversion_is_exact_in_its_range_and_on_the_grid_below():
    x = wide(20000, 0, spread=14.0)
    x = torch.cat([x, torch.tensor([EXACT_FROM, -EXACT_FROM, LIMIT - 256, -(LIMIT - 256), 0.0, -0.0])])
    hi, lo, bad = to_limbs(x)
    assert not bad and bool(((lo >= 0) & (lo <= 2 ** LIMB_BITS)).all())
    inside = x.abs() >= EXACT_FROM
    assert torch.equal(from_limbs(hi, lo)[inside], x[inside])                     # every bit kept
    n = [Fraction(int(h)) * 2 ** LIMB_BITS + int(l) for h, l in zip(hi.tolist(), lo.tolist())]
    for v, k in zip(x[~inside].tolist(), [m for m, i in zip(n, inside.tolist()) if not i]):
        assert abs(Fraction(v) * 2 ** FRAC_BITS - k) <= 1                           # below: on the 2^-72 grid
    assert (~inside).sum() > 100
    for v in (math.inf, -math.inf, math.nan, LIMIT, -LIMIT):
        assert to_limbs(torch.tensor([1.0, v]))[2], v                               # out of range: flagged


def test_sum_has_no_order_and_is_the_exact_sum_rounded_once():
    """40 micro-batch gradients summed in 3 orders and groupings (ranks' partial sums then all-reduced):
    the same limbs, and the exact rational sum rounded once to fp64 then fp32. Control: fp32 sums in
    those orders differ from each other and from the exact sum."""
    g = torch.Generator().manual_seed(1)
    terms = [wide(512, s) * 10.0 ** torch.randint(-4, 3, (1,), generator=g).item() for s in range(40)]
    orders = [list(range(40)), list(reversed(range(40))), torch.randperm(40, generator=g).tolist()]
    sums = []
    for order in orders:
        ranks = [Limbs((512,), "cpu") for _ in range(4)]                           # rank r takes every 4th
        for j, i in enumerate(order):
            ranks[j % 4].add(terms[i])
        total = Limbs((512,), "cpu")
        for r in ranks:
            r.carry()
            total.add_limbs(r.hi, r.lo, terms=4)
        sums.append(total.value())
    assert all(torch.equal(s, sums[0]) for s in sums)
    want = torch.tensor([float(v) for v in exact(terms)], dtype=torch.float64).float()
    assert torch.equal(sums[0], want)
    fp32 = [sum(terms[i] for i in order) for order in orders]
    assert not torch.equal(fp32[0], fp32[1]) and not torch.equal(fp32[0], want)    # the control


def test_carry_keeps_lo_bounded_over_many_terms(monkeypatch):
    monkeypatch.setattr(Limbs, "CARRY_EVERY", 8)
    s = Limbs((3,), "cpu")
    t = torch.tensor([2.0 ** 31, -(2.0 ** -40), 0.75])
    for _ in range(100):
        s.add(t)
        assert int(s.lo.max()) < 9 * 2 ** LIMB_BITS
    assert torch.equal(s.value(), (t.double() * 100).float())


def rows_of(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def with_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def test_norm_is_the_same_whole_sharded_and_split_into_experts():
    """grad_norm over whole tensors, over FSDP2's dim-0 chunks of them and over EP's expert shards: the
    same bits (each dim-0 slice's fp64 sum is the same wherever it lies; the slices' sum is an integer
    one). Control: torch's clip norm over the same pieces, as FSDP2 and EP would sum them, differs."""
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(8, 48, 32, generator=g), torch.randn(50, 32, generator=g) * 1e-3,
             torch.randn(32, generator=g) * 1e2, torch.randn(3, 24, generator=g)]
    whole = with_grads(rows_of(grads), grads)
    ref = grad_norm(whole, ONE, expert_ids=set())
    pieces = [c for t in grads for c in torch.chunk(t, 3)]                          # shards of dim 0, uneven
    assert grad_norm(with_grads(rows_of(pieces), pieces), ONE, expert_ids=set()) == ref
    torch_whole = torch.nn.utils.get_total_norm(grads).item()
    torch_pieces = math.sqrt(sum(torch.nn.utils.get_total_norm(pieces[i::3]).item() ** 2 for i in range(3)))
    assert torch_pieces != torch_whole                                              # the control
    assert ref == pytest.approx(torch_whole, rel=1e-6)


def test_reducer_in_one_process_sums_micro_batches_exactly():
    """Two micro-batches' backwards through the hooks: .grad is the exact sum of their gradients, rounded
    once (the fast path's fp32 accumulation is not, for some element)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    xs = [torch.randn(16, 64) * 10.0 ** k for k in (-3, 0, 2)]
    grads = [torch.autograd.grad(lin(x).square().sum(), list(lin.parameters())) for x in xs]
    red = exact_sum.Reducer(lin, ONE, trained=lin)
    red.start()
    for x in xs:
        lin(x).square().sum().backward()
        assert all(p.grad is None for p in lin.parameters())                      # taken into the sums
    red.finish()
    for i, p in enumerate(lin.parameters()):
        terms = [g[i].reshape(-1) for g in grads]
        want = torch.tensor([float(v) for v in exact(terms)], dtype=torch.float64).float().view_as(p)
        assert torch.equal(p.grad, want)
    fast = [grads[0][i] + grads[1][i] + grads[2][i] for i in range(2)]
    assert any(not torch.equal(p.grad, f) for p, f in zip(lin.parameters(), fast))   # the control


def test_a_sum_of_one_term_has_the_bits_of_its_limbs():
    """Limbs keeps its first term unconverted (on_grid at value()): the same bits, -0.0 and the values
    below 2^-49 included, as the term converted to limbs and back. Control: the term itself differs."""
    x = torch.cat([wide(20000, 3, spread=14.0), torch.tensor([0.0, -0.0, EXACT_FROM, -EXACT_FROM / 3, -2.0 ** -100])])
    lazy, converted = Limbs(x.shape, "cpu"), Limbs(x.shape, "cpu")
    lazy.add(x)
    converted.add(x)
    converted.carry()                                                           # into limbs now
    assert lazy.first is x and converted.first is None
    bits = lambda t: t.view(torch.int32)
    assert torch.equal(bits(lazy.value()), bits(converted.value()))
    assert torch.equal(bits(lazy.value()), bits(from_limbs(*to_limbs(x)[:2])))
    assert not torch.equal(bits(lazy.value()), bits(x))                         # the control
    lazy.add(x)                                                                 # a second term: into limbs
    hi, lo, _ = to_limbs(x)
    assert lazy.first is None and torch.equal(lazy.value(), from_limbs(2 * hi, 2 * lo))
