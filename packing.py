"""Packed micro-batches: several sequences in one row, each with positions from 0, attending only to itself.

    from packing import Packing, pack
    mbs = pack(lengths, micro_batch_tokens=4096)           # first fit decreasing: [MicroBatch(indices, packing)]
    logp, routes = model.score(tokens, packing=mbs[0].packing)   # tokens (1, sum of its lengths)
    logp = mbs[0].packing.to_padded(logp)                  # back to (S, max length) right-padded

Every kernel is row-invariant, so a packed forward gives each token the bits of the padded forward
(tests/test_packing.py). Packing says where the sequences lie; PackedPages is the attention layout
the forward builds from it (each sequence its own run of pages), packed_attention runs it through
the same paged-attention kernel the sampler uses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels


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
        return PackedPages(*(t.to(device) for t in (self._token_index(), slots, table, positions)))


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
    positions (n_blocks, block).
    """
    tokens: torch.Tensor
    slots: torch.Tensor
    block_table: torch.Tensor
    positions: torch.Tensor


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


@dataclass(frozen=True)
class MicroBatch:
    """One packed micro-batch: which sequences (indices into the batch, in packed order) and where."""
    indices: tuple[int, ...]
    packing: Packing


def pack(lengths, micro_batch_tokens: int) -> list[MicroBatch]:
    """Assign sequences to micro-batches of at most micro_batch_tokens tokens, one packed row each.

    The rule (deterministic, so the same lengths give the same micro-batches on every run and rank
    count): sequences by length descending, ties by index; each goes into the first micro-batch with
    room for it, else opens a new one (first fit decreasing). A sequence longer than the budget gets a
    micro-batch of its own. First fit leaves at most one micro-batch half full or less. Inside a
    micro-batch the sequences keep ascending index order.
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
    out = []
    for b in bins:
        b = sorted(b)
        out.append(MicroBatch(tuple(b), Packing.concat([lengths[i] for i in b])))
    return out
