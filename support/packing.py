"""Packed micro-batches: several sequences in one row, each with positions from 0, attending only to itself.

    from support.packing import Packing, pack, micro_batches
    mbs = pack(lengths, micro_batch_tokens=4096)           # first fit decreasing: [MicroBatch(rows, packing)]
    logp, routes = model.score(tokens, packing=mbs[0].packing)   # tokens (1, sum of its lengths)
    logp = mbs[0].packing.to_padded(logp)                  # back to (S, max length) right-padded

Every kernel is row-invariant, so a packed forward gives each token the bits of the padded forward
(tests/test_packing.py). Packing says where the sequences lie; PackedPages is the attention layout
the forward builds from it (each sequence its own run of pages), packed_attention runs it through
the same paged-attention kernel the sampler uses. The trainer's batch is laid out here too: the
rollout's sequences right-padded (`make_batch`, `Batch`), then cut into micro-batches (`micro_batches`:
packed by a token budget, or padded slices; `unpack`) and dealt to ranks (`deal`, `lockstep`),
so the layout of a training forward has one home.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

import kernels
from replay import pack_routes


@dataclass(frozen=True)
class Packing:
    """Where the sequences of a packed (R, N) token tensor lie.

    Sequence i is tokens[rows[i], starts[i]:starts[i] + lengths[i]]: its positions count from 0 and it
    attends only to itself. Tokens no sequence covers (a row's tail) are padding: position 0, attention
    output 0, values the caller masks. `Packing.concat(lengths)` puts them back to back in one row.
    """
    rows: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    shape: tuple[int, int]          # (R, N) of the packed token tensor

    def __post_init__(self):
        R, N = self.shape
        if not (len(self.rows) == len(self.starts) == len(self.lengths) >= 1):
            raise ValueError("a Packing needs one row, start and length per sequence, and at least one sequence")
        spans = sorted(zip(self.rows, self.starts, self.lengths))
        for (r, s, n), nxt in zip(spans, spans[1:] + [(R, 0, 0)]):
            if not (0 <= r < R and n >= 1 and s >= 0 and s + n <= N):
                raise ValueError(f"packed sequence (row {r}, start {s}, length {n}) does not fit tokens of shape {self.shape}")
            if nxt[0] == r and nxt[1] < s + n:
                raise ValueError(f"packed sequences overlap in row {r} at position {nxt[1]}")

    @classmethod
    def concat(cls, lengths) -> "Packing":
        """The sequences back to back in one row, in the given order."""
        lengths = tuple(int(n) for n in lengths)
        starts = tuple(sum(lengths[:i]) for i in range(len(lengths)))
        return cls((0,) * len(lengths), starts, lengths, (1, sum(lengths)))

    # The index tensors are built on the host (their sizes come from the lengths) and then moved, so
    # a packed forward on a GPU does not sync on them.
    def token_index(self, device=None) -> torch.Tensor:
        """(n,) flat index into the R*N packed tokens of every sequence token, sequence by sequence."""
        return self._token_index().to(device)

    def _token_index(self) -> torch.Tensor:
        L = torch.tensor(self.lengths)
        base = torch.tensor([r * self.shape[1] + s for r, s in zip(self.rows, self.starts)])
        return torch.repeat_interleave(base, L, output_size=sum(self.lengths)) + _local_positions(self.lengths)

    def _padded_index(self, T: int) -> torch.Tensor:
        """(n,) flat index into a right-padded (S, T) tensor of every sequence token, in the same order."""
        L = torch.tensor(self.lengths)
        return torch.repeat_interleave(torch.arange(len(self.lengths)) * T, L, output_size=sum(self.lengths)) \
            + _local_positions(self.lengths)

    def positions(self, device=None) -> torch.Tensor:
        """(R, N) position of each token inside its sequence (0 on padding)."""
        pos = torch.zeros(self.shape[0] * self.shape[1], dtype=torch.long)
        return pos.index_copy(0, self._token_index(), _local_positions(self.lengths)).view(self.shape).to(device)

    def from_padded(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """(S, T, ...) right-padded, sequence i in row i -> (R, N, ...) packed; padding gets `fill`."""
        S, T = x.shape[:2]
        src = x.reshape(S * T, *x.shape[2:])[self._padded_index(T).to(x.device)]
        out = x.new_full((self.shape[0] * self.shape[1], *x.shape[2:]), fill)
        return out.index_copy(0, self.token_index(x.device), src).view(*self.shape, *x.shape[2:])

    def to_padded(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """(R, N, ...) or (R, N - 1, ...) packed (score's log-probs) -> (S, max length, ...) right-padded.

        A log-prob at a sequence's last position predicts the next sequence's first token: it lands in
        the padded tensor's masked region (column length - 1), as in the padded forward."""
        R, N = self.shape
        if x.shape[1] == N - 1:
            x = torch.cat([x, x.new_full((R, 1, *x.shape[2:]), fill)], dim=1)
        S, T = len(self.lengths), max(self.lengths)
        src = x.reshape(R * N, *x.shape[2:])[self.token_index(x.device)]
        out = x.new_full((S * T, *x.shape[2:]), fill)
        return out.index_copy(0, self._padded_index(T).to(x.device), src).view(S, T, *x.shape[2:])

    def pages(self, block: int, device=None) -> "PackedPages":
        """The attention layout of the packed sequences with query blocks / pages of `block` positions."""
        L = torch.tensor(self.lengths)
        blocks = [-(-n // block) for n in self.lengths]                # blocks per sequence (sizes: no tensor read)
        nb = torch.tensor(blocks)                                      # (S,)
        first = torch.cumsum(nb, 0) - nb                               # (S,) first block of each
        seq = torch.repeat_interleave(torch.arange(len(blocks)), nb, output_size=sum(blocks))   # (n_blocks,) its sequence
        j = torch.arange(seq.shape[0]) - first[seq]                    # block index inside its sequence
        # entries past a sequence's last block repeat it: never read (masked), but valid page ids
        table = first[seq, None] + torch.minimum(torch.arange(max(blocks))[None], nb[seq, None] - 1)
        positions = j[:, None] * block + torch.arange(block)[None]
        slots = torch.repeat_interleave(first * block, L, output_size=sum(self.lengths)) + _local_positions(self.lengths)
        return PackedPages(*(t.to(device) for t in (self._token_index(), slots, table, positions)), self)


def _local_positions(lengths: tuple[int, ...]) -> torch.Tensor:
    """0..L_i-1 for each length, concatenated: (sum L,). Sizes from the Python lengths: no tensor read."""
    L, total = torch.tensor(lengths), sum(lengths)
    return torch.arange(total) - torch.repeat_interleave(torch.cumsum(L, 0) - L, L, output_size=total)


@dataclass
class PackedPages:
    """The trainer's attention metadata for a packed batch (Packing.pages).

    Each sequence gets its own run of blocks of `block` positions: its queries go into query blocks,
    its keys and values into pages, both at slot = first block * block + position. A query block is a
    row of the paged-attention call, with its sequence's block table and its own positions, so a
    query sees its own sequence's keys at the positions it would see them padded, and attention
    costs what the real tokens need (a block only walks its sequence's keys up to its own position).
    tokens (n,): flat index into the R*N packed tokens; slots (n,); block_table (n_blocks, width);
    positions (n_blocks, block); packing: the Packing (a layer that runs whole sequences unpacks them with it).
    """
    tokens: torch.Tensor
    slots: torch.Tensor
    block_table: torch.Tensor
    positions: torch.Tensor
    packing: Packing


def packed_attention(q, k, v, pages: PackedPages, scale: float, **attn) -> torch.Tensor:
    """Attention of packed (B, T, H, D) queries over their own sequence's keys: (B, T, H, D), 0 on padding.
    attn: kernels.paged_attention's sinks and window."""
    B, T, H, D = q.shape
    n_blocks, block = pages.positions.shape

    def to_blocks(x):                                              # (B, T, h, D) -> (n_blocks, block, h, D)
        flat = x.reshape(B * T, *x.shape[2:])[pages.tokens]
        return flat.new_zeros(n_blocks * block, *x.shape[2:]).index_copy(0, pages.slots, flat).view(n_blocks, block, *x.shape[2:])
    o = kernels.paged_attention(to_blocks(q), to_blocks(k), to_blocks(v), pages.block_table, pages.positions, scale,
                                **attn)
    o = o.reshape(n_blocks * block, H, D)[pages.slots]              # (n, H, D)
    return o.new_zeros(B * T, H, D).index_copy(0, pages.tokens, o).view(B, T, H, D)


@dataclass(eq=False)
class MicroBatch:
    """One forward/backward: rows of the batch, in the forward's order, and, packed, where their
    sequences lie (Packing.concat of their lengths, in that order)."""
    rows: torch.Tensor               # (k,) int64
    packing: Packing | None          # None: the rows' right-padded (k, T) tokens


def pack(lengths, micro_batch_tokens: int) -> list[MicroBatch]:
    """Assign sequences to micro-batches of at most micro_batch_tokens tokens, one packed row each.

    The rule (deterministic, so the same lengths give the same micro-batches on every run and rank
    count): sequences by length descending, ties by index; each goes into the first micro-batch with
    room for it, else opens a new one (first fit decreasing). A sequence longer than the budget gets a
    micro-batch of its own. First fit leaves at most one micro-batch half full or less. Inside a
    micro-batch the sequences keep ascending index order; rows are indices into `lengths`.
    """
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens={micro_batch_tokens}: need at least 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    used: list[int] = []
    for i in order:
        n = lengths[i]
        for b in range(len(bins)):
            if used[b] + n <= micro_batch_tokens:
                bins[b].append(i)
                used[b] += n
                break
        else:
            bins.append([i])
            used.append(n)
    return [MicroBatch(torch.tensor(sorted(b)), Packing.concat([lengths[i] for i in sorted(b)])) for b in bins]


# ---- the trainer's batch: the rollout's sequences, right-padded ------------------------------------
@dataclass
class Batch:
    """The trainer's batch: the rollout's sequences right-padded, one a row."""
    tokens: torch.Tensor          # (B, T) prompt + response (an episode: its turns and observations), right-padded
    mask: torch.Tensor            # (B, T-1) 1 where logp[:, j] scores a token the policy sampled
    rollout_logp: torch.Tensor    # (B, T-1)
    routes: torch.Tensor          # (B, T, n_moe, k), -1 where unrecorded
    route_mask: torch.Tensor      # (B, T) positions whose routes the rollout recorded
    adv: torch.Tensor             # (B,)
    lengths: torch.Tensor         # (B,) prompt + response tokens of each sequence
    observed: torch.Tensor        # (B, T) positions of the environment's tokens (in the forward, out of the loss)
    versions: torch.Tensor        # (B, T-1) int64 by logp column: the policy version that drew the token
    kv_versions: torch.Tensor     # (B, T-1) int64: the oldest version whose KV it was drawn on

    def select(self, idx):
        return Batch(*(getattr(self, f.name)[idx] for f in fields(self)))

    def widen(self, T: int) -> "Batch":
        """This batch right-padded to width T: tokens (B, T), every per-position field (dim 1 of width T or
        T - 1) padded as make_batch pads (routes with -1, the rest with 0), so the result has the bits
        make_batch gives when the longest sequence of the batch is T long."""
        grow = T - self.tokens.shape[1]
        if grow == 0:
            return self

        def wide(name, t):
            if t.dim() < 2:                                           # per sequence: adv, lengths
                return t
            fill = -1 if name == "routes" else 0
            return torch.cat([t, t.new_full((t.shape[0], grow, *t.shape[2:]), fill)], dim=1)
        return Batch(*(wide(f.name, getattr(self, f.name)) for f in fields(self)))


def make_batch(outs, adv: torch.Tensor) -> Batch:
    """The sampler's outputs (rollout.SequenceOutput) as one right-padded batch: where the trainer's data
    enters. Its tokens are the sampler's, token in, token out (prompts checked there, ids drawn from the
    model's vocabulary or checked as the environment's), and replay.pack_routes checks that the routes
    fit them, so the trainer's forwards run without checks that read tensors back. An episode's
    environment tokens are in the forward (their routes too) but out of `mask`: out of the loss, the
    corrections, the route filter's counts and the mismatch metrics' denominators."""
    lengths = [len(o.prompt) + len(o.tokens) for o in outs]
    T = max(lengths)

    def rows(fill, parts):                                            # each sequence's response part -> (B, T - 1)
        return torch.tensor([[fill] * (len(o.prompt) - 1) + part + [fill] * (T - L)
                             for o, L, part in zip(outs, lengths, parts)])
    policy = [list(o.policy_mask) or [1] * len(o.tokens) for o in outs]   # logp[:, j] scores tokens[:, j + 1]
    tokens = torch.tensor([o.prompt + o.tokens + [0] * (T - L) for o, L in zip(outs, lengths)])
    mask = rows(0.0, [[float(m) for m in pm] for pm in policy])
    rollout_logp = rows(0.0, [[lp if m else 0.0 for lp, m in zip(o.logprobs, pm)] for o, pm in zip(outs, policy)])
    observed = torch.cat([torch.zeros(len(outs), 1, dtype=torch.bool),                 # (B, T): by token position
                          rows(False, [[m == 0 for m in pm] for pm in policy])], dim=1)
    versions = rows(0, [list(o.token_versions or ()) or [0] * len(o.tokens) for o in outs])   # provenance
    kv_versions = rows(0, [list(o.kv_versions or ()) or [0] * len(o.tokens) for o in outs])   # (asynchrony/pipeline.py)
    route_mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None] - 1
    routes = pack_routes([o.routes for o in outs], lengths, T)
    return Batch(tokens, mask, rollout_logp, routes, route_mask, adv, torch.tensor(lengths), observed, versions,
                 kv_versions)


# ---- the trainer's micro-batches: whole sequences packed by a token budget, or padded slices ---------
# A packed micro-batch puts its sequences back to back in one row, each with its own positions and
# attending only to itself, so no position is padding and every token gets the padded forward's bits.
# Its results are laid back per sequence, right-padded to the batch's width (unpack), so the loss math
# (losses.token_objective with the minibatch's global normalisers) is the padded path's, unchanged.
def micro_batches(rows: torch.Tensor, lengths: torch.Tensor, micro_batch_tokens: int, micro_batch_size: int,
                  padded_rows: int) -> list[MicroBatch]:
    """rows (of a batch whose sequence lengths (B,) are given) as micro-batches.

    Packed (micro_batch_tokens=N > 0): pack's first fit decreasing, each micro-batch at most N tokens (a
    longer sequence alone) and, with micro_batch_size=S, at most S sequences. A function of the rows'
    lengths and the config alone: the same micro-batches on every run, rank and rank count; under
    torchrun they are cut from the global minibatch, then dealt to ranks (deal).
    Padded (micro_batch_tokens=0): consecutive slices of micro_batch_size rows, or of padded_rows if 0."""
    if micro_batch_tokens == 0:
        k = micro_batch_size or padded_rows
        return [MicroBatch(rows[lo:lo + k], None) for lo in range(0, len(rows), k)]
    n = lengths[rows].tolist()                                        # host tensors
    out = []
    for mb in pack(n, micro_batch_tokens):
        ix = mb.rows.tolist()
        cap = micro_batch_size or len(ix)                             # cut into pieces of at most S sequences
        for lo in range(0, len(ix), cap):
            part = ix[lo:lo + cap]
            out.append(MicroBatch(rows[part], Packing.concat([n[i] for i in part])))
    return out


def deal(n_micros: int, world: int, rank: int) -> list[int | None]:
    """The micro-batches of a global list that `rank` runs, one per lockstep: micro-batch s * world + rank
    at step s (round robin), None where the list has run out. Every rank runs as many steps (FSDP2's
    gathers and EP's exchanges are collectives); a None step runs a null micro-batch. The list is cut
    from the global minibatch the same way at every world size, so each micro-batch has the same bits
    wherever it runs, and an exact gradient sum does not care which rank ran it."""
    steps = -(-n_micros // world)
    return [s * world + rank if s * world + rank < n_micros else None for s in range(steps)]


def lockstep(micros: list[MicroBatch], lengths: torch.Tensor, d) -> list[tuple[int | None, MicroBatch]]:
    """Rank d.rank's steps over the global micro-batches (deal): (index, micro-batch), index None for a
    null step (null_micro_batch of the batch's lengths), which keeps the rank in its collectives' step."""
    packed = any(m.packing is not None for m in micros)
    return [(i, micros[i] if i is not None else null_micro_batch(lengths, packed))
            for i in deal(len(micros), d.world, d.rank)]


def null_micro_batch(lengths: torch.Tensor, packed: bool) -> MicroBatch:
    """A rank's forward for a step the deal left it without a micro-batch: the batch's shortest sequence
    (the first of equals), whose loss the trainer multiplies by 0 and whose results it discards."""
    row = int(torch.argmin(lengths))
    return MicroBatch(torch.tensor([row]), Packing.concat([int(lengths[row])]) if packed else None)


def unpack(packing: Packing, x: torch.Tensor, width: int, fill=0) -> torch.Tensor:
    """A packed result (1, N - 1 or N, ...) laid out per sequence as the padded forward's: (k, width, ...),
    `fill` past each sequence (a log-prob column a sequence does not own is masked, as padded)."""
    y = packing.to_padded(x, fill)                                    # (k, longest, ...)
    if y.shape[1] >= width:
        return y[:, :width]
    return torch.cat([y, y.new_full((y.shape[0], width - y.shape[1], *y.shape[2:]), fill)], dim=1)


# ---- the trainer's forwards over rows of the batch ----------------------------------------------------
@dataclass
class Scored:
    """A trainer forward over some rows of the rollout batch."""
    logp: torch.Tensor               # (N, T-1) log-probs of tokens[:, 1:]
    routes: torch.Tensor             # (N, T, n_moe, k) the router's own choice (also under R3 replay)
    entropy: torch.Tensor | None     # (N, T-1) when asked for (detached, unless a hook asks its gradient: entropy_bonus/)
    rows: torch.Tensor               # (N,) which rows of the rollout batch
    detail: object = None            # model.RouteDetail (N, T, ...): the routes' weights, margins, router entropy

    def select(self, keep: torch.Tensor, rows: torch.Tensor | None = None) -> "Scored":
        """The forward's rows `keep` (a mask or indices), entropy dropped; rows renumbered if given."""
        detail = None if self.detail is None else self.detail.map(lambda x: x[keep])
        return Scored(self.logp[keep], self.routes[keep], None, self.rows[keep] if rows is None else rows, detail)


def this_ranks(batch: Batch, audited: Scored, rank: int, n: int) -> tuple[Batch, Scored]:
    """Rank `rank`'s n sequences of the global batch, and their rows of an audit over it (renumbered from
    0): what runlog.log_routes writes per rank and sums over the ranks."""
    lo = rank * n
    keep = (audited.rows >= lo) & (audited.rows < lo + n)
    return batch.select(slice(lo, lo + n)), audited.select(keep, audited.rows[keep] - lo)


def in_row_order(s: Scored) -> Scored:
    """s with its rows ascending: forwards over the whole rollout batch, as (B, ...) tensors."""
    return s.select(torch.argsort(s.rows))
