"""Exact gradient sums (--grad_reduce=exact): fixed-point integers, whose sum has no order.

    reducer = Reducer(masters, d, trained=trainer_module, ...)   # where each micro-batch's gradient enters
    reducer.start()                                                    # a minibatch begins
    ...the micro-batches' backwards: each gradient converted and added to int64 accumulators...
    reducer.finish()                                                   # summed over ranks, fp32 .grad once
    norm = clip_grad_norm(params, max_norm, d, ...)                    # the same norm at every layout

Why: an fp32 sum depends on its order, so a gradient accumulated over micro-batches and all-reduced
over ranks has other bits at another world size, and AdamW makes another run of them. Integers add
exactly in any order: convert every micro-batch's gradient once, add integers everywhere (locally,
then int64 all-reduce / reduce-scatter), convert the sum back once. Each micro-batch's gradient has
the same bits wherever it runs (packing.deal), so the sum, the step and the next rollout are the
same at any world size, DP / EP degree and placement.

The arithmetic (docs/design.md, "Exact gradient sums"). One fixed grid for every tensor, so no rank
ever has to agree on a scale: an element g becomes the integer n = g * 2^72 (rounded), held in two
int64 limbs n = hi * 2^52 + lo with 0 <= lo <= 2^52. For 2^-49 <= |g| < 2^32 the conversion is exact
(g's 24 significant bits all lie on the grid); smaller elements are rounded to the 2^-72 grid. The
limbs add as integers; lo carries into hi before it could pass 2^63 (every 2^10 terms, and before an
all-reduce, which up to 2^11 ranks may then join); hi holds any |sum| < 2^43. The sum is converted
back once: hi * 2^-20 + lo * 2^-72 in fp64 (one rounding), then fp32 (a second): within
(1/2 + 2^-29) fp32 ulp of the exact sum of the fp32 terms. A term outside the range (non-finite, or |g| >= 2^32) marks the sum bad: the
gradient norm is then NaN and the step is stopped or skipped as for any non-finite gradient.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from config import ConfigError

FRAC_BITS = 72                      # n counts units of 2^-72
LIMB_BITS = 52                      # lo holds n's low 52 bits, hi the rest
LIMIT = 2.0 ** (2 * LIMB_BITS - FRAC_BITS)   # |g| < 2^32: hi = floor(g * 2^20) stays below 2^52
MAX_RANKS = 2 ** (63 - LIMB_BITS)            # 2^11 ranks may add their lo limbs in one all-reduce
EXACT_FROM = 2.0 ** (23 - FRAC_BITS)         # |g| >= 2^-49: all 24 bits of g lie on the grid


# ---------------------------------------------------------------------------------------------------
# the conversion
# ---------------------------------------------------------------------------------------------------
def to_limbs(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """g (any float dtype, any shape) -> (hi, lo) int64 with hi * 2^52 + lo = g * 2^72 rounded to an
    integer, 0 <= lo <= 2^52, and a bool (0-d): some element is out of range (non-finite, |g| >= 2^32).
    In fp64: x = g * 2^20 (a power of two: exact), hi = floor(x), lo = (x - hi) * 2^52 rounded. For
    |g| >= 2^-49, x is a multiple of 2^-52 and every step is exact; below, x - hi rounds to fp64 first
    (an error below 2^-72 in g's units, the same on every rank)."""
    x = g.double().mul_(2.0 ** (FRAC_BITS - LIMB_BITS))
    hi = x.floor()
    lo = x.sub_(hi).mul_(2.0 ** LIMB_BITS).round_()
    return hi.long(), lo.long(), out_of_range(g)


def out_of_range(g: torch.Tensor) -> torch.Tensor:
    """A 0-d bool: some element of g is non-finite or |g| >= 2^32."""
    return ~(g.abs().amax() < LIMIT) if g.numel() else torch.zeros((), dtype=torch.bool, device=g.device)


def _carry(hi: torch.Tensor, lo: torch.Tensor) -> None:
    """Move lo's bits above 2^52 into hi (in place): lo back in [0, 2^52)."""
    c = lo >> LIMB_BITS                                             # floor division, also below 0
    hi += c
    lo -= c << LIMB_BITS


def from_limbs(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 value of hi * 2^-20 + lo * 2^-72 (limbs of any carry state; the inputs are not changed)."""
    hi, lo = hi.clone(), lo.clone()
    _carry(hi, lo)
    return _value(hi, lo)


def _value(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """from_limbs of carried limbs: lo in [0, 2^52], so the two fp64 products are exact and their sum is
    the one fp64 rounding."""
    return (hi.double() * 2.0 ** (LIMB_BITS - FRAC_BITS) + lo.double() * 2.0 ** -FRAC_BITS).float()


def on_grid(g: torch.Tensor, tiny: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """from_limbs(to_limbs(g)) without the limbs: the fp32 value of a sum of one term, into out (g
    itself may be out). Elements with |g| >= 2^-49 are exact on the grid and stay as they are (+ 0.0
    makes -0.0 the +0.0 the limbs give); only those below it, if any (tiny), go through the limbs."""
    out = g.float() + 0.0 if out is None else torch.add(g, 0.0, out=out)
    if tiny:
        small = (out.abs() < EXACT_FROM) & (out != 0)
        hi, lo, _ = to_limbs(out[small])
        out[small] = from_limbs(hi, lo)
    return out


def scan_bits(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 g -> 0-d bools (out of range: non-finite or |g| >= 2^32; tiny: some 0 < |g| < 2^-49), from
    |g|'s bits, which order as |g| does (NaN above inf). In place in a reused buffer, with reductions
    only: on a CPU a fresh buffer's first touch, or a comparison into bools, costs several reductions.
    Minus one wraps 0 to the top, out of the min."""
    if not g.numel():
        return torch.zeros((), dtype=torch.bool, device=g.device), torch.zeros((), dtype=torch.bool, device=g.device)
    b = torch.bitwise_and(g.contiguous().view(torch.int32), 0x7FFFFFFF, out=_scratch(g))
    bad = b.amax() >= _LIMIT_BITS
    tiny = b.sub_(1).bitwise_and_(0x7FFFFFFF).amin() < _EXACT_BITS - 1
    return bad, tiny


_LIMIT_BITS = (127 + 2 * LIMB_BITS - FRAC_BITS) << 23         # fp32 bits of 2^32
_EXACT_BITS = (127 + 23 - FRAC_BITS) << 23                   # fp32 bits of 2^-49
_SCRATCH: dict = {}                                           # (CPU device, dtype) -> the buffer scan_bits and _rows reuse


def _scratch(g: torch.Tensor, dtype=torch.int32) -> torch.Tensor:
    """A buffer of g's shape: on a CPU views of one per dtype, grown to the largest asked for (its
    allocator hands back fresh pages, a GPU's caching allocator reuses its own)."""
    if g.device.type != "cpu":
        return torch.empty(g.shape, dtype=dtype, device=g.device)
    buf = _SCRATCH.get((g.device, dtype))
    if buf is None or buf.numel() < g.numel():
        buf = _SCRATCH[(g.device, dtype)] = torch.empty(g.numel(), dtype=dtype, device=g.device)
    return buf[:g.numel()].view(g.shape)


class Limbs:
    """A fixed-point sum of tensors of one shape: int64 hi and lo, and whether a term was out of range.
    Terms add limb by limb; lo (each term's at most 2^52) carries into hi every CARRY_EVERY additions
    and before it leaves (value, all_reduce_limbs), so it never passes 2^63.

    The first term is kept as it came and converted only when a second one (or a rank's limbs) is
    wanted: a minibatch of one micro-batch on one rank, the common case, then costs on_grid alone, with
    the bits the limbs would give."""
    CARRY_EVERY = 2 ** 10

    def __init__(self, shape, device):
        self.shape, self.device = tuple(shape), device
        self._hi = self._lo = None                                    # made when needed (_limbs)
        self.first = None                                             # the only term so far (fp32), not yet converted
        self.tiny = None                                              # whether first has elements below 2^-49
        self.own = False                                              # whether value() may rewrite first
        self.bad = torch.zeros((), dtype=torch.bool, device=device)
        self.terms = 0

    def _limbs(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._hi is None:
            if self.first is not None:
                self._hi, self._lo, _ = to_limbs(self.first)
                self.first = None
            else:
                self._hi = torch.zeros(self.shape, dtype=torch.long, device=self.device)
                self._lo = torch.zeros(self.shape, dtype=torch.long, device=self.device)
        return self._hi, self._lo

    hi = property(lambda self: self._limbs()[0])
    lo = property(lambda self: self._limbs()[1])

    def add(self, g: torch.Tensor, own: bool = False) -> None:
        """Add g. Kept as the first term, g is not to be changed by the caller until value() or zero_();
        own: the sum may take g over (value() may then be g itself, rewritten in place)."""
        if self.terms == 0 and self._hi is None:
            self.first, self.own, self.terms = g.float(), own or g.dtype != torch.float32, 1
            bad, self.tiny = scan_bits(self.first)
            self.bad |= bad
            return
        hi, lo, bad = to_limbs(g)
        self.bad |= bad
        self.add_limbs(hi, lo)

    def add_limbs(self, hi: torch.Tensor, lo: torch.Tensor, terms: int = 1, at: int | None = None) -> None:
        """Add limbs holding the sum of `terms` terms (a reduce-scatter's output: one per rank); at: into the
        flat elements from `at` on (a piece; its terms counted with the last piece)."""
        mine_hi, mine_lo = self._limbs()
        if at is not None:
            mine_hi, mine_lo = (t.view(-1)[at:at + hi.numel()] for t in (mine_hi, mine_lo))
        mine_hi += hi
        mine_lo += lo
        self.terms += terms
        if self.terms >= self.CARRY_EVERY:
            self.carry()

    def carry(self) -> None:
        _carry(*self._limbs())
        self.terms = 1

    def value(self) -> torch.Tensor:
        if self.first is not None:
            return on_grid(self.first, bool(self.tiny), out=self.first if self.own else None)
        self.carry()                                                  # the same value, lo in [0, 2^52]
        return _value(self._hi, self._lo)

    def zero_(self) -> None:
        self._hi = self._lo = self.first = None
        self.bad.zero_()
        self.terms = 0

    @property
    def nbytes(self) -> int:
        return 16 * math.prod(self.shape)


def all_reduce_limbs(sums: list[Limbs], group=None, bucket_bytes: int = 64 << 20, device=None) -> None:
    """Sum each Limbs over the ranks of group, in place (int64 all-reduce: exact, in any order), in
    buckets of about bucket_bytes, each sent from `device` (the limbs may be on the host); every rank
    passes the same list."""
    bucket, size = [], 0
    for i, s in enumerate(sums):
        s.carry()                                                     # lo below 2^52 on every rank
        bucket.append(s)
        size += s.nbytes
        if size >= bucket_bytes or i == len(sums) - 1:
            limbs = [t for b in bucket for t in (b.hi, b.lo)]
            flat = torch.cat([t.reshape(-1) for t in limbs]).to(device)
            dist.all_reduce(flat, group=group)
            for t, part in zip(limbs, flat.split([t.numel() for t in limbs])):
                t.copy_(part.view_as(t))
            for b in bucket:
                b.carry()
            bucket, size = [], 0


# ---------------------------------------------------------------------------------------------------
# where the gradients enter: hooks, EP's per-source pieces, FSDP2's reduce-scatter
# ---------------------------------------------------------------------------------------------------
class Reducer:
    """The exact sum of one policy's gradients over a minibatch's micro-batches and ranks.

    masters  the module whose parameters the optimizer steps (the fp32 masters under mixed precision;
             sharded DTensors under FSDP2; an EP rank's expert shards)
    trained  the module the training backward runs through (the compute copy under mixed precision)
    Gradients enter three ways, each converted the moment it exists: (1) one process / DDP: a
    post-accumulate hook per trained parameter adds the micro-batch's .grad and frees it (no DDP
    wrapper: this is the reduction); (2) expert parallelism: the owner's weight gradient of each
    source rank's rows, kept apart (a subclass: parallel/expert_parallel.ExpertSums); (3) FSDP2: its
    reduce-scatter, replaced by an exact one (a subclass: parallel/fsdp.ShardedSums).
    finish() sums (1) and (2) over the ranks and writes fp32 .grad on every master parameter. The sums
    live where the masters do (offload: on the host, memory/offload.py), each term copied there.
    """

    def __init__(self, masters: nn.Module, d, *, trained: nn.Module, master_of: dict | None = None,
                 experts: set | None = None):
        """master_of: id(trained parameter) -> its master (mixed precision; else itself); experts: ids of
        the masters' expert-shard parameters (EP: parallel/expert_parallel.ExpertSums, this class's own)."""
        if d.world > MAX_RANKS:
            raise ConfigError(f"--grad_reduce=exact sums over at most {MAX_RANKS} ranks ({d.world} here); "
                              "use --grad_reduce=fast")
        self.masters, self.d = masters, d
        self.home = next(masters.parameters()).device                 # offload: the host
        self.experts = experts or set()
        self.sums: dict[int, Limbs] = {}                             # id(master parameter) -> its sum
        self.last = False                                            # the minibatch's last micro-batch step
        self.bad = False
        self._attach(trained, master_of or {})

    def _attach(self, trained: nn.Module, master_of: dict) -> None:
        """Where the gradients enter: a post-accumulate hook on every trained parameter (FSDP2's
        reduce-scatters instead: parallel/fsdp.ShardedSums)."""
        for p in trained.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook(master_of.get(id(p), p)))

    def _hook(self, master: nn.Parameter):
        def take(p):
            if p.grad is not None:                                    # an EP shard's: _Sink passed nothing on
                self.sum_of(master).add(p.grad.to(master.device), own=True)   # .grad is dropped: the sum's now
                p.grad = None
        return take

    def sum_of(self, master: nn.Parameter) -> Limbs:
        s = self.sums.get(id(master))
        if s is None:
            s = self.sums[id(master)] = Limbs(master.shape, master.device)
        return s

    # ---- the minibatch ---------------------------------------------------------------------------
    def accumulators(self) -> list[Limbs]:
        """Every sum this reducer keeps (zeroed at a minibatch's start, checked for range at its finish)."""
        return list(self.sums.values())

    def start(self) -> None:
        for s in self.accumulators():
            s.zero_()
        self.last = False

    @torch.no_grad()
    def finish(self) -> None:
        """The sums over ranks, as fp32 .grad of every master parameter (zeros where nothing arrived);
        self.bad on every rank if any term anywhere was out of range."""
        self._finish_dense([p for p in self.masters.parameters() if id(p) not in self.experts and p.requires_grad])
        bad = [s.bad for s in self.accumulators()] + self._finish_experts()   # EP: the expert shards' own sums
        flag = torch.stack(bad).any().long() if bad else torch.zeros((), dtype=torch.long)
        flag = flag.to(self.d.device)                                 # NCCL reduces device tensors
        if self.d.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.bad = bool(flag)

    def _finish_dense(self, dense: list[nn.Parameter]) -> None:
        """The sums of the whole (not expert) parameters, all-reduced, as their .grad."""
        sums = [self.sum_of(p) for p in dense]
        if self.d.world > 1:
            all_reduce_limbs(sums, device=self.d.device)
        for p, s in zip(dense, sums):
            p.grad = s.value().to(p.dtype)                           # bf16 masters: one more rounding

    def _finish_experts(self) -> list[torch.Tensor]:
        """Whole experts: none (EP's sums of the expert shards: parallel/expert_parallel.ExpertSums)."""
        return []

    def reserve_bytes(self) -> int:
        """The accumulators' bytes on this rank: 16 per element it sums (its shard of an FSDP2 tensor;
        an expert shard whole, also when FSDP2 cuts it over its replicas; EPLB: its slots' too)."""
        return 16 * sum(p.numel() if id(p) in self.experts or not hasattr(p, "to_local") else p.to_local().numel()
                        for p in self.masters.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------------------------------
# the gradient norm, the same at every layout
# ---------------------------------------------------------------------------------------------------
def _rows(g: torch.Tensor) -> torch.Tensor:
    """(rows,) fp64 sums of squares of g's dim-0 slices (a matrix's rows, a stacked tensor's experts,
    a vector's elements): a slice is never split between ranks (FSDP2 and EP cut dim 0), and an fp64
    sum over the last dim does not depend on the number of rows (tests/test_exact_sum.py)."""
    x = _scratch(g, torch.float64).copy_(g.detach()).reshape(g.shape[0] if g.dim() else 1, -1)
    return x.square_().sum(-1)


@torch.no_grad()
def grad_norm(params: list[nn.Parameter], d, *, expert_ids: set, ep=None) -> float:
    """The global gradient norm, the same bits whether a tensor is whole on every rank (DDP), sharded
    (FSDP2) or cut into expert shards (EP): each dim-0 slice's fp64 sum of squares, then those sums in
    fixed point at a scale from their max-reduced maximum M: q = round(s * 2^(62 - e - c)) with
    2^(e-1) <= M < 2^e and c = ceil(log2(rows)), so the int64 sum of every row cannot overflow; its
    error is below rows * 2^(e + c - 63), i.e. 2^(2c - 62) of the squared norm. A replicated tensor's
    rows are added by one rank, a shard's by its holder."""
    every, mine, total_rows = [], [], 0
    for p in params:
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        ss = _rows(g)
        every.append(ss)
        is_expert = id(p) in expert_ids
        if hasattr(p.grad, "to_local") or (d.rank < ep.size if is_expert and ep is not None else d.rank == 0):
            mine.append(ss)
        rows = p.shape[0] if p.dim() else 1                          # a DTensor's shape is the global one
        total_rows += rows * (ep.size if is_expert and ep is not None else 1)   # E/N experts on each of N
    every = torch.cat(every).to(d.device) if every else torch.zeros(0, dtype=torch.float64, device=d.device)
    top = every.max() if every.numel() else torch.zeros((), dtype=torch.float64, device=d.device)
    if d.world > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    if not math.isfinite(top.item()):
        return math.nan
    if top.item() == 0:
        return 0.0
    e, c = math.frexp(top.item())[1], math.ceil(math.log2(max(total_rows, 2)))
    shift = 62 - e - c
    mine = torch.cat(mine).to(d.device) if mine else torch.zeros(0, dtype=torch.float64, device=d.device)
    acc = torch.round(mine * 2.0 ** shift).long().sum()              # integers: exact in any order
    if d.world > 1:
        dist.all_reduce(acc)
    return math.sqrt(math.ldexp(float(acc.item()), -shift))


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float, d, *, expert_ids: set, ep=None) -> float:
    """grad_norm, then every gradient times max_norm / (norm + 1e-6) when that is below 1 (elementwise:
    the same bits on any shard) -> the norm before clipping."""
    norm = grad_norm(params, d, expert_ids=expert_ids, ep=ep)
    scale = max_norm / (norm + 1e-6)
    if scale < 1:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
