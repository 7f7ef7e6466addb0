"""The sampler's host side: sequences, KV blocks and the prefix cache, the scheduler.

    from scheduler import BlockManager, Scheduler, Sequence
    sched = Scheduler(BlockManager(num_blocks, block_size, prefix_cache=True), max_batch_size, max_num_batched_tokens)
    sched.add(group)                        # sequences with identical tokens, prefilled once
    step = sched.schedule()                 # a Step: a prefill (chunks of it) or a decode of every running one
    done = sched.postprocess(step, finished)   # turns end, finished sequences leave

One object decides, one does (nano-vllm's split): this file decides, rollout.ModelRunner carries a Step
out on the device and rollout.Sampler ties the two together (rollout.py's docstring tells the whole
engine: sessions, the prefix cache, chunked prefill). A `Sequence` owns a `block_table` of KV blocks
(pages) of `block_size` positions; the `BlockManager` hands them out from a free list with reference
counts (a GRPO group shares its prompt's full blocks) and keeps the prefix cache; the `Scheduler` owns
the sequence lifecycle. Nothing here touches a tensor: host work per decode step does not grow with
the batch (Scheduler's clock and phase table). With speculative decoding (sampling/speculative.py) a decode
step is a verify step: each running sequence holds blocks for its drafts too and moves on by the
tokens it kept, which come back with the step (`Step.kept`), so that step's host work is per sequence.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable


@dataclass(eq=False)             # compared and hashed by identity: the scheduler keys dicts by sequence
class Sequence:
    seq_id: int                  # index in the request (plus the caller's offset): keys the sampling noise
    prompt: list[int]
    max_len: int                 # its turn ends ("length") when it holds this many tokens
    num_tokens: int = 0          # tokens in its row (prompt + generated); while running, see Scheduler.length
    limit: int | None = None     # its episode ends at this many tokens (None: max_len, a single turn)
    max_new_tokens: int = 0      # per turn: the next turn's max_len is num_tokens + this, at most limit
    row: int = -1                # its row of the ModelRunner's buffers; held from admission to finish
    block_table: list[int] = field(default_factory=list)
    parent: "Sequence | None" = None   # in a prefill batch: the group member whose forward it shares
    finish_reason: str | None = None
    output: object = None        # its rollout.SequenceOutput, once collected
    # prefill and the prefix cache
    num_computed: int = 0        # its first tokens whose KV and routes are in its blocks (set when it stops running)
    token_ids: list[int] | None = None   # the host's copy of its tokens: the prompt, then each ended turn, observation
    num_written: int = 0         # how many of token_ids its device row holds
    num_hashed: int = 0          # its leading blocks entered in the prefix cache (or found there) ...
    last_node: object = None     # ... and the last one's node (BlockManager.register)
    # sessions: the policy's turns, [start, end) positions
    turn_start: int = -1
    turns: list[tuple[int, int]] = field(default_factory=list)
    # provenance (asynchronous RL): (first position, policy version) from which its tokens are sampled by
    # that version, and from which the oldest KV they read is that version's (a (re)prefill from position 0)
    version_marks: list[tuple[int, int]] = field(default_factory=list)
    kv_marks: list[tuple[int, int]] = field(default_factory=list)
    # the routes of its first fed positions, kept when its blocks were freed before its end (a preemption, an
    # in-flight recompute): the prefill that recomputes them may run under other weights, and these drew its
    # tokens (Scheduler.keep; rollout.KeptRoutes)
    kept: object = None
    # its blocks hold KV that weights older than the sampler's version wrote (an in-flight keep_kv update):
    # the prefix cache must not serve them as that version's (BlockManager.register), until a recompute
    stale_kv: bool = False
    # the window pool (sliding-window layers): one block per block of block_table, -1 once freed (wholly
    # below the window of every query to come); the entries below window_start are all -1
    window_table: list[int] = field(default_factory=list)
    window_start: int = 0

    def __post_init__(self):
        self.limit = self.max_len if self.limit is None else self.limit
        self.token_ids = list(self.prompt) if self.token_ids is None else self.token_ids
        self.turn_start = len(self.prompt) if self.turn_start < 0 else self.turn_start


@dataclass
class Step:
    """One engine step as the Scheduler decided it; the ModelRunner carries it out."""
    batch: list[Sequence]        # prefill: each group's leader, then its members; decode: `running` itself
    is_prefill: bool
    # prefill only, one per sequence of batch (a member: its leader's): the KV is computed up to there after
    # the step, from seq.num_computed; a sequence whose end is its num_tokens samples its next token
    prefill_ends: list[int] = field(default_factory=list)
    # decode only: the blocks handed out this step, (row, index in its block table, block id), the window
    # pool's beside them, and whether the running set changed since the previous decode step (the runner
    # then rewrites its rows)
    new_blocks: list[tuple[int, int, int]] = field(default_factory=list)
    new_window_blocks: list[tuple[int, int, int]] = field(default_factory=list)
    rows_changed: bool = False
    # a verify step (speculative decoding), filled in by the runner, one per sequence of batch: the
    # tokens it kept (1 .. k + 1) and the drafts it checked
    kept: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)


class WindowPool:
    """The sliding-window layers' blocks (WindowBlockManager's window pool): a free list in the order they were
    freed, reference counts, and the window block each registered block of the prefix cache kept (`of`,
    while neither is evicted). A sequence's `window_table` has one beside each block of its block_table;
    `release` frees those that lie wholly below the window of every query the sequence will feed."""

    def __init__(self, window: int, num_blocks: int, block_size: int):
        self.window, self.num_blocks, self.block_size = window, num_blocks, block_size
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))   # an ordered set
        self.refs = [0] * num_blocks
        self.of: dict[int, int] = {}                     # registered block -> its window block
        self.owner: list[int | None] = [None] * num_blocks
        self.peak_held = self.released = 0               # (tooling/bench.py reads them)

    def first_block(self, position: int) -> int:
        """The first block the window of a query at `position` reaches."""
        return max(0, position - self.window + 1) // self.block_size

    def take(self) -> int:
        """The least recently freed window block, no longer any registered block's."""
        w, _ = self.free.popitem(last=False)
        if self.owner[w] is not None:
            del self.of[self.owner[w]]
            self.owner[w] = None
        self.refs[w] = 1
        self.peak_held = max(self.peak_held, self.num_blocks - len(self.free))
        return w

    def hold(self, w: int) -> None:
        """One more holder of window block w (a prefix hit, a forked sequence); -1 (freed) holds nothing."""
        if w >= 0:
            if self.refs[w] == 0:
                del self.free[w]
            self.refs[w] += 1

    def drop(self, w: int) -> None:
        if w >= 0:
            self.refs[w] -= 1
            if self.refs[w] == 0:
                self.free[w] = None

    def release(self, seq: Sequence, first_query: int) -> None:
        """Free seq's window blocks that lie wholly below the window of a query at first_query, the lowest
        position it will feed: no query of it reads them again. (The runner's table may keep naming
        them: a key outside a query's window is masked, and any page holds finite values.)"""
        upto = min(self.first_block(first_query), len(seq.window_table))
        for i in range(seq.window_start, upto):
            if seq.window_table[i] >= 0:
                self.drop(seq.window_table[i])
                seq.window_table[i] = -1
                self.released += 1
        seq.window_start = max(seq.window_start, upto)

    def hits(self, cached: list[int]) -> tuple[int, list[int]]:
        """For prefix-cache hits: the first one a prefill after them reads through its window, and the
        window blocks of the hits from there on."""
        live = self.first_block(len(cached) * self.block_size)
        return live, [self.of[b] for b in cached[live:]]

    def kept(self, hits: list[int]) -> bool:
        """Whether the window blocks a prefill after these hits reads are all kept."""
        return all(b in self.of for b in hits[self.first_block(len(hits) * self.block_size):])

    def keep(self, block: int, w: int) -> None:
        """Registered `block` keeps its window block w (if w is still held and kept by no other)."""
        if w >= 0 and self.owner[w] is None:
            self.of[block], self.owner[w] = w, block

    def forget(self, block: int) -> None:
        """`block` left the prefix cache: its window block is no longer kept for it."""
        w = self.of.pop(block, None)
        if w is not None:
            self.owner[w] = None

    def forget_all(self) -> None:
        """The prefix cache forgot every block (new weights)."""
        self.of.clear()
        self.owner = [None] * self.num_blocks


class BlockManager:
    """Blocks (pages) of `block_size` KV positions, a free list, reference counts for sharing, and the
    prefix cache.

    `free_block_ids` holds the free blocks in the order they were freed; allocation takes the least
    recently freed. With prefix_cache, `register` enters a sequence's computed full blocks under a key
    (parent node, the block's token ids): the parent is the previous block's node, or for a first block
    the root, which names the weights' version (`set_version`). A key is exact (the dict compares the
    ids, and node ids are never reused), so a hit holds the KV and routes of exactly that token prefix.
    A registered block stays registered while free, until allocation takes it (eviction, LRU).

    A sampler memory beside the pages is a subclass: WindowBlockManager (sliding-window layers' own pool),
    RecurrentBlockManager (the boundary states of layers that keep a state per sequence).
    """
    window_pool: WindowPool | None = None                # WindowBlockManager's

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = False):
        self.block_size = block_size
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))   # an ordered set
        self.ref_counts = [0] * num_blocks
        self.prefix_cache = prefix_cache
        self.root: tuple = ("version", None)
        self.cached: dict[tuple, tuple[int, int]] = {}   # (parent node, token ids) -> (block, node)
        self.key_of: list[tuple | None] = [None] * num_blocks
        self.nodes = itertools.count()
        self.peak_held = 0                               # the most blocks held at once (tooling/bench.py reads it)

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take now."""
        return len(self.free_block_ids)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def num_admissible(self, num_tokens: int, group_size: int, num_running: int, shared: int = 0) -> int:
        """How many members of a group of num_tokens-token sequences the free blocks admit now.

        The leader takes its blocks (less `shared`: prefix-cache hits that others hold already) and each
        other member a copy of a partly filled last block. While others run (num_running: running,
        admitted, or admitted earlier in this step), each of them and each new member keeps one spare
        block, so that the next decode step need not preempt at once; with nothing else running, the
        pool only has to hold this group.
        """
        base, partial = -(-num_tokens // self.block_size) - shared, int(num_tokens % self.block_size != 0)
        spare = int(num_running > 0)
        avail = self.num_free - spare * num_running
        if partial + spare == 0:                                    # members share every block
            return group_size if base <= avail else 0
        # m members need base + partial * (m - 1) + spare * m <= avail
        return max(0, min(group_size, (avail - base + partial) // (partial + spare)))

    def allocate(self, seq: Sequence, num_tokens: int, cached: list[int] = ()) -> None:
        """Grow seq.block_table to hold positions [0, num_tokens): first the `cached` blocks (prefix-cache
        hits, shared), then fresh ones."""
        n = self.blocks_needed(seq, num_tokens) - len(cached)
        if n + sum(self.ref_counts[b] == 0 for b in cached) > len(self.free_block_ids):
            raise RuntimeError(f"BlockManager: need {n} blocks, {self.num_free} free (caller must preempt first)")
        for b in cached:
            if self.ref_counts[b] == 0:
                del self.free_block_ids[b]
            self.ref_counts[b] += 1
            seq.block_table.append(b)
        for _ in range(n):
            seq.block_table.append(self._take_free())

    def _take_free(self) -> int:
        """The least recently freed block, evicted from the prefix cache if it was registered."""
        b, _ = self.free_block_ids.popitem(last=False)
        if self.key_of[b] is not None:
            del self.cached[self.key_of[b]]
            self.key_of[b] = None
        self.ref_counts[b] = 1
        self.peak_held = max(self.peak_held, len(self.ref_counts) - len(self.free_block_ids))
        return b

    def release_window(self, seq: Sequence, first_query: int) -> None:
        """The window pool's (WindowBlockManager): nothing to free here."""

    def num_shared(self, hits: list[int]) -> int:
        """Prefix-cache hits that take no free block: held by another sequence now."""
        return sum(self.ref_counts[b] > 0 for b in hits)

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> tuple[int, int] | None:
        """Share the parent's full blocks of positions [0, num_tokens) with child.

        A partly filled last block is not shared (both would write into it): the child gets a fresh
        block and the returned (src, dst) pair tells the caller to copy its contents (KV and routes).
        """
        n_full = num_tokens // self.block_size
        for b in parent.block_table[:n_full]:
            self.ref_counts[b] += 1
            child.block_table.append(b)
        if parent.num_hashed <= n_full:                  # the child's chain in the prefix cache starts as the parent's
            child.num_hashed, child.last_node = parent.num_hashed, parent.last_node
        if num_tokens % self.block_size:
            if self.num_free == 0:
                raise RuntimeError("BlockManager: no free block for a forked partial block")
            dst = self._take_free()
            child.block_table.append(dst)
            return parent.block_table[n_full], dst
        return None

    def free(self, seq: Sequence) -> None:
        # last block first: a sequence's first blocks, which every longer prefix needs, are evicted last
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_block_ids[b] = None
        seq.block_table = []

    # ---- the prefix cache ----
    def set_version(self, version) -> None:
        """Root the cache at a new weights version: every registered block is forgotten (call it between
        requests, when no block is in use)."""
        if ("version", version) != self.root:
            self.root = ("version", version)
            self.cached.clear()
            self.key_of = [None] * len(self.key_of)

    def _key(self, seq: Sequence, b: int, node) -> tuple:
        """The cache key of seq's block b: the node of its block b - 1 (the root for the first), its ids."""
        return node, tuple(seq.token_ids[b * self.block_size:(b + 1) * self.block_size])

    def _matchable(self, seq: Sequence) -> int:
        """seq's leading full blocks a match may serve: those before its last token (always fed, for the
        logits) whose ids the host knows."""
        return min(len(seq.token_ids), seq.num_tokens - 1) // self.block_size

    def match(self, seq: Sequence) -> tuple[list[int], object]:
        """The longest run of seq's leading full blocks registered in the cache, up to its next-to-last
        token (the last one is always fed, for the logits) -> (their blocks, the last one's node)."""
        hits, nodes = [], [self.root]
        if self.prefix_cache:
            for b in range(self._matchable(seq)):
                entry = self.cached.get(self._key(seq, b, nodes[-1]))
                if entry is None:
                    break
                hits.append(entry[0])
                nodes.append(entry[1])
        return hits, nodes[-1]

    def next_miss(self, seq: Sequence, hits: list[int], node) -> tuple | None:
        """The key of the block a match of seq would serve after its `hits` (the last one's node), were it
        registered; None where seq has no further block to match."""
        if not self.prefix_cache or len(hits) >= self._matchable(seq):
            return None
        return self._key(seq, len(hits), node)

    def next_registered(self, seq: Sequence) -> tuple | None:
        """The key under which the prefill of seq (a leader) will register its next block, once that block
        is computed; None where it will register none (no further full block whose ids the host knows, or
        KV that older weights wrote)."""
        b = seq.num_hashed
        known = min(len(seq.token_ids), seq.num_tokens)         # (a running sequence's ids come at its turn's end)
        if not self.prefix_cache or seq.stale_kv or (b + 1) * self.block_size > known:
            return None
        return self._key(seq, b, seq.last_node if b else self.root)

    def register(self, seq: Sequence, num_computed: int) -> None:
        """Enter seq's full blocks whose KV is computed (positions < num_computed) and whose tokens the
        host knows. A block whose key another block holds already (the same tokens, computed twice)
        stays out; the chain goes on through the registered one."""
        if not self.prefix_cache or seq.stale_kv:
            return
        node = seq.last_node if seq.num_hashed else self.root
        for b in range(seq.num_hashed, min(num_computed, len(seq.token_ids)) // self.block_size):
            key = self._key(seq, b, node)
            if key not in self.cached:
                block = seq.block_table[b]
                if self.key_of[block] is not None:      # registered under another chain: stop here
                    break
                self.cached[key], self.key_of[block] = (block, next(self.nodes)), key
                if self.window_pool:                    # its window block, while still held
                    self.window_pool.keep(block, seq.window_table[b])
            node = self.cached[key][1]
            seq.num_hashed, seq.last_node = b + 1, node


class WindowBlockManager(BlockManager):
    """The BlockManager of a model with sliding-window layers whose pages are a pool of their own (`window_pool`,
    a WindowPool of window_blocks; RolloutConfig.window_blocks): each block of a sequence's block_table has one
    beside it in its window_table, handed out and shared alike, and freed early (WindowPool.release).
    Full-attention layers and the routes keep every block. A registered block keeps the window block it
    had then; a prefix hit needs the window blocks of its last `window` positions, so `match` shortens a
    hit to the longest run that has them."""

    def __init__(self, *args, window: int, window_blocks: int):
        super().__init__(*args)
        self.window_pool = WindowPool(window, window_blocks, self.block_size)

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take now: each takes a window block beside it."""
        return min(len(self.free_block_ids), len(self.window_pool.free))

    def allocate(self, seq: Sequence, num_tokens: int, cached: list[int] = ()) -> None:
        """BlockManager.allocate, and the window table beside it: a hit's window blocks from the first one its
        window needs (-1 below), then one for each fresh block."""
        pool, n = self.window_pool, self.blocks_needed(seq, num_tokens) - len(cached)
        live, window_hits = pool.hits(cached)
        if n + sum(pool.refs[w] == 0 for w in window_hits) > len(pool.free):
            raise RuntimeError(f"BlockManager: need {n} blocks, {self.num_free} free (caller must preempt first)")
        super().allocate(seq, num_tokens, cached)
        if cached:
            seq.window_table, seq.window_start = [-1] * live + window_hits, live
            for w in window_hits:
                pool.hold(w)
        seq.window_table += [pool.take() for _ in range(n)]

    def _take_free(self) -> int:
        self.window_pool.forget(next(iter(self.free_block_ids)))     # the block BlockManager takes leaves the cache
        return super()._take_free()

    def release_window(self, seq: Sequence, first_query: int) -> None:
        """The window blocks of seq below every window it will read, from first_query on, freed."""
        self.window_pool.release(seq, first_query)

    def num_shared(self, hits: list[int]) -> int:
        """Prefix-cache hits that take no free block: held by another sequence now, and so is the window
        block beside it where the hit needs one."""
        pool = self.window_pool
        live = pool.first_block(len(hits) * self.block_size)
        return sum(self.ref_counts[b] > 0 and (i < live or pool.refs[pool.of[b]] > 0) for i, b in enumerate(hits))

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> tuple[int, int] | None:
        n_full = num_tokens // self.block_size
        child.window_table, child.window_start = parent.window_table[:n_full], parent.window_start
        for w in child.window_table:
            self.window_pool.hold(w)
        pair = super().fork(parent, child, num_tokens)
        if pair is not None:                              # a partial block: the runner copies its window pages too
            child.window_table.append(self.window_pool.take())
        return pair

    def free(self, seq: Sequence) -> None:
        for w in reversed(seq.window_table):
            self.window_pool.drop(w)
        super().free(seq)
        seq.window_table, seq.window_start = [], 0

    def set_version(self, version) -> None:
        if ("version", version) != self.root:
            self.window_pool.forget_all()
        super().set_version(version)

    def match(self, seq: Sequence) -> tuple[list[int], object]:
        """BlockManager.match, the run ending where the window blocks of its last positions are not all kept
        (a prefill from there reads them)."""
        hits, node = super().match(seq)
        if hits and not self.window_pool.kept(hits):
            while hits and not self.window_pool.kept(hits):
                hits.pop()
            node = self.cached[self.key_of[hits[-1]]][1] if hits else self.root
        return hits, node


class RecurrentBlockManager(BlockManager):
    """The BlockManager of a model whose layers keep a state per sequence instead of pages (linear attention,
    hybrids/). Such a state moves on at each multiple of `grid`, so a prefill after a prefix hit starts from
    the state at the hit's end, a boundary, which no page holds: this keeps `slots` snapshots of a row's
    states (every such layer's, on the device: GDNPool.saved_*), each beside the registered block that ends
    on the boundary its sequence's state is at when it registers, the least recently used evicted, and a
    block's freed when it leaves the cache; `match` cuts a hit back to its last block with one. The runner's
    `copy(pairs, load)` moves them as the host decides, (row, slot) when a block registers (after the step
    that put the row there) and (slot, row) when a hit is admitted (before its prefill). A state at a
    boundary is a function of the tokens before it alone (the grid's rule): a snapshot is the recompute's bits."""

    def __init__(self, *args, grid: int, slots: int, copy: Callable[..., None]):
        super().__init__(*args)
        self.grid, self.slots, self.copy = grid, slots, copy
        self.free_slots = list(range(slots - 1, -1, -1))          # pop() hands out the lowest
        self.slot_of: OrderedDict[int, int] = OrderedDict()       # block -> its snapshot, least recently used first

    def match(self, seq: Sequence) -> tuple[list[int], object]:
        hits, node = super().match(seq)
        if hits and hits[-1] not in self.slot_of:
            while hits and hits[-1] not in self.slot_of:
                hits.pop()
            node = self.cached[self.key_of[hits[-1]]][1] if hits else self.root
        return hits, node

    def next_miss(self, seq: Sequence, hits: list[int], node) -> tuple | None:
        """BlockManager.next_miss where seq reaches a boundary past its hits (a shorter shared prefix, such as
        a 16-token instruction, could never serve it: nothing to wait for)."""
        boundary = (len(hits) * self.block_size // self.grid + 1) * self.grid
        return super().next_miss(seq, hits, node) if boundary <= self._matchable(seq) * self.block_size else None

    def allocate(self, seq: Sequence, num_tokens: int, cached: list[int] = ()) -> None:
        super().allocate(seq, num_tokens, cached)
        if cached:                                                # its row starts from the hit's boundary
            self.slot_of.move_to_end(cached[-1])
            self.copy([(self.slot_of[cached[-1]], seq.row)], load=True)

    def register(self, seq: Sequence, num_computed: int) -> None:
        """BlockManager.register, then a snapshot of seq's row for the block that ends at its state (its last
        boundary, num_computed fed) where that block is registered and has none."""
        super().register(seq, num_computed)
        boundary = num_computed // self.grid * self.grid
        b = boundary // self.block_size - 1
        if seq.stale_kv or boundary % self.block_size or not 0 <= b < len(seq.block_table) or \
                self.key_of[seq.block_table[b]] is None:
            return
        block = seq.block_table[b]
        if block not in self.slot_of:
            self.slot_of[block] = self.free_slots.pop() if self.free_slots else self.slot_of.popitem(last=False)[1]
            self.copy([(seq.row, self.slot_of[block])])
        self.slot_of.move_to_end(block)

    def _take_free(self) -> int:
        b = next(iter(self.free_block_ids))                       # the block BlockManager takes: its snapshot goes
        if b in self.slot_of:
            self.free_slots.append(self.slot_of.pop(b))
        return super()._take_free()

    def set_version(self, version) -> None:
        if ("version", version) != self.root:
            self.free_slots, self.slot_of = list(range(self.slots - 1, -1, -1)), OrderedDict()
        super().set_version(version)


class Scheduler:
    """Owns the sequence lifecycle: waiting groups -> admitted (prefilled, in chunks if long) -> running ->
    a turn ends -> finished, or (a session) its observation prefilled -> running again; preempted
    sequences go back to waiting.

    end_turn(seq), when given, is called when a sequence's turn has ended, before its blocks and row are
    released: it brings seq.token_ids up to date (the turn's ids) and returns the ids to append (the
    session goes on) or None (the sequence is finished; its output must be collected by then).
    keep(seq, n), when given, is called before the blocks of a sequence whose first n positions are fed
    are freed ahead of its end (a preemption, an in-flight recompute), while they still hold its routes:
    it keeps them in seq.kept, which the sequence's members share while they have the same tokens.
    """

    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_num_batched_tokens: int,
                 end_turn: Callable[[Sequence], list[int] | None] | None = None, speculative_tokens: int = 0,
                 keep: Callable[[Sequence, int], None] | None = None):
        self.bm = block_manager
        self.keep = keep
        self.speculative_tokens = speculative_tokens    # k > 0: decode steps are verify steps of k drafts
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.end_turn = end_turn
        self.waiting: deque[list[Sequence]] = deque()   # groups of sequences with identical tokens, no blocks
        self.prefilling: deque[list[Sequence]] = deque()   # admitted groups whose leader has tokens to prefill
        self.running: list[Sequence] = []               # in admission order: the newest is preempted first
        self.free_rows = list(range(max_batch_size - 1, -1, -1))   # pop() hands out the lowest row
        self.clock = 0                                  # decode steps taken; length = offset + clock
        self.offset: dict[Sequence, int] = {}           # running sequence -> num_tokens - clock
        self.by_phase = [dict() for _ in range(block_manager.block_size)]   # offset % bs -> {seq: None}
        self.running_changed = True                     # since the last decode step was handed out
        self.chunked = False                            # the last prefill left a sequence partly prefilled
        self.num_preemptions = 0
        self.num_cached_tokens = 0                      # tokens served by the prefix cache at admission
        self.num_prefilled_tokens = 0                   # tokens fed by prefill forwards (padding not counted)
        self.num_drafted_tokens = 0                     # verify steps: drafts checked ...
        self.num_accepted_tokens = 0                    # ... and kept
        self.version = 0                                # the policy version of the weights (Sampler.generate)

    # ---- lifecycle ----
    def add(self, group: list[Sequence]) -> None:
        """Queue sequences with identical tokens; they are prefilled once and share full blocks."""
        self.waiting.append(group)

    def is_finished(self) -> bool:
        return not self.waiting and not self.prefilling and not self.running

    def length(self, seq: Sequence) -> int:
        """Tokens in a sequence's row: every running sequence gains one per decode step."""
        return self.offset[seq] + self.clock if seq in self.offset else seq.num_tokens

    def schedule(self) -> Step:
        """The next step: a prefill (chunks of admitted groups, then admitted waiting groups; a group's
        members after their leader, member.parent = leader), else a decode step of every running
        sequence. A prefill that left a sequence partly prefilled is followed by a decode step, so the
        running sequences go on between the chunks of a long prompt."""
        if not (self.chunked and self.running):
            batch, ends = self._schedule_prefill()
            if batch:
                self.chunked = any(end < s.num_tokens for s, end in zip(batch, ends))
                return Step(batch, is_prefill=True, prefill_ends=ends)
        self.chunked = False
        return self._schedule_decode()

    def postprocess(self, step: Step, finished: list[bool]) -> list[Sequence]:
        """After a step: fully prefilled sequences start running, the clock ticks, and the sequences whose
        turn ended go on (a session's observation, queued for prefill) or leave. Returns the finished
        sequences (their rows still hold their data until the next schedule)."""
        if step.is_prefill:
            for s, end in zip(step.batch, step.prefill_ends):
                s.num_computed = end
                if s.parent is None:
                    self.bm.register(s, end)
                self.bm.release_window(s, end)                  # its next query is at end
                if end == s.num_tokens:
                    s.num_tokens += 1                            # the token the prefill sampled
                    self._start(s)
        else:
            self.clock += 1
        if step.kept:                                           # a verify step's sequences move on by their own
            self._advance(step)
        done = []
        for s in [s for s, f in zip(step.batch, finished) if f]:
            s.num_tokens = self.length(s)
            self._stop(s)
            s.num_computed = s.num_tokens - 1                    # its last token is sampled, not fed yet
            s.turns.append((s.turn_start, s.num_tokens))
            ids = self.end_turn(s) if self.end_turn is not None else None
            if ids is None:
                self.bm.register(s, s.num_computed)
                self.bm.free(s)
                self.free_rows.append(s.row)
                done.append(s)
            else:
                self._continue(s, ids)
        return done

    def _continue(self, seq: Sequence, ids: list[int]) -> None:
        """A session goes on: the observation is appended and queued for prefill, together with the turn's
        last token, over the KV the sequence holds; its next turn starts after it."""
        self.bm.register(seq, seq.num_computed)
        seq.token_ids += ids
        seq.num_tokens += len(ids)
        seq.max_len = min(seq.num_tokens + seq.max_new_tokens, seq.limit)
        seq.turn_start, seq.parent = seq.num_tokens, None
        self.prefilling.append([seq])

    # ---- prefill: chunks of admitted groups, then waiting groups ----
    def _schedule_prefill(self) -> tuple[list[Sequence], list[int]]:
        """The groups that hold rows and blocks first (the next chunk of a long prompt, a session's
        observation), in order, then waiting groups (new, or preempted: the prefix cache may serve
        their first blocks), while the budget, rows and blocks allow -> (batch, prefill ends)."""
        batch, ends, n, width = [], [], 0, 0           # n leaders so far, the longest chunk
        for group in list(self.prefilling):
            leader = group[0]
            chunk = self._chunk(leader.num_tokens - leader.num_computed, n, width)
            if not chunk:
                break
            if not self._grow(group):                  # preempted: no blocks for its observation
                continue
            if self._add(batch, ends, group, chunk):
                self.prefilling.remove(group)
            n, width = n + 1, max(width, chunk)
        self._admit_waiting(batch, ends, n, width)
        return batch, ends

    def _admit_waiting(self, batch: list[Sequence], ends: list[int], n: int, width: int) -> None:
        """Admit waiting groups, in order, into the prefill batch while the budget, rows and blocks allow.

        A group whose next block (after its prefix-cache hits) another group is computing, in this
        prefill or in one under way, waits: that group registers the block after its chunk, and this one
        then takes it as a hit instead of computing it again (an agent's system prompt, shared by every
        episode). It does not join the same forward, which pads every chunk to the longest: a group
        that shares a prefix would pay the whole prompt's width there. Only such groups wait, and only
        until the blocks they share are computed; the others are admitted past them."""
        leaders = [g[0] for g in self.prefilling] + [s for s in batch if s.parent is None]
        computing = {self.bm.next_registered(s) for s in leaders}     # (None: a leader that registers none)
        i = 0
        while i < len(self.waiting):
            group = self.waiting[i]
            leader = group[0]
            hits, node = self.bm.match(leader)
            miss = self.bm.next_miss(leader, hits, node)
            if miss is not None and miss in computing:     # it waits for that block; the next group may go
                i += 1
                continue
            chunk = self._chunk(leader.num_tokens - len(hits) * self.bm.block_size, n, width)
            if not chunk:
                break
            rows = len(group) if leader.row >= 0 else len(self.free_rows)   # a preempted one kept its row
            # (_admit has already taken the blocks of the sequences in this batch)
            holding = len(self.running) + sum(map(len, self.prefilling)) + len(batch)
            shared = self.bm.num_shared(hits)
            take = group[:min(rows, self.bm.num_admissible(leader.num_tokens, len(group), holding, shared))]
            if not take:
                break
            if len(take) == len(group):
                del self.waiting[i]
            else:
                self.waiting[i] = group[len(take):]
            self._admit(take, hits, node)
            computing.add(self.bm.next_registered(leader))
            if not self._add(batch, ends, take, chunk):
                self.prefilling.append(take)
            n, width = n + 1, max(width, chunk)

    def _chunk(self, remaining: int, n_leaders: int, width: int) -> int:
        """Tokens a leader with `remaining` left to prefill feeds this step. The forward runs every
        leader right-padded to the longest chunk, n_leaders x width tokens, within max_num_batched_tokens:
        the first leader feeds up to that many (a longer prefill goes in chunks), a later one all it has
        left if the padded forward stays within the budget, else none (the step is full)."""
        budget = self.max_num_batched_tokens
        if n_leaders == 0:
            return min(remaining, budget)
        return remaining if (n_leaders + 1) * max(width, remaining) <= budget else 0

    def _add(self, batch: list[Sequence], ends: list[int], group: list[Sequence], chunk: int) -> bool:
        """Put a group's next chunk in the batch; its members join only their leader's last chunk.
        -> whether this is the last one."""
        leader = group[0]
        end = leader.num_computed + chunk
        last = end == leader.num_tokens
        members = group if last else group[:1]
        batch += members
        ends += [end] * len(members)
        self.num_prefilled_tokens += chunk
        return last

    def _grow(self, group: list[Sequence]) -> bool:
        """Blocks for the new tokens of an admitted group (a session's observation), preempting the newest
        running sequences while they do not fit; if they still do not, nothing runs and the session is
        preempted itself (then False)."""
        seq = group[0]
        need = self.bm.blocks_needed(seq, seq.num_tokens)
        while need > self.bm.num_free and self.running:
            self._preempt(self.running[-1])
        if need > self.bm.num_free:
            self.prefilling.remove(group)
            self._preempt(seq)
            return False
        self.bm.allocate(seq, seq.num_tokens)
        return True

    def _admit(self, group: list[Sequence], hits: list[int], node) -> None:
        """Rows and blocks for a waiting group: the leader's prefix-cache hits, fresh blocks for the rest,
        the members sharing the leader's full blocks."""
        leader = group[0]
        if leader.row < 0:
            for s in group:
                s.row = self.free_rows.pop()
        leader.parent = None
        self.bm.allocate(leader, leader.num_tokens, cached=hits)
        leader.num_computed = len(hits) * self.bm.block_size
        leader.num_hashed, leader.last_node = len(hits), node
        self.num_cached_tokens += leader.num_computed
        for s in group:                  # its KV is (re)computed from position 0 by the current weights
            s.kv_marks.append((s.num_tokens, self.version))
        for s in group[1:]:             # the runner copies the partial block's KV after the last chunk
            s.parent = leader
            self.bm.fork(leader, s, leader.num_tokens)
            s.num_computed = leader.num_computed

    # ---- decode: one more position for every running sequence ----
    def _schedule_decode(self) -> Step:
        """Give a new block to each running sequence whose next position starts one, preempting the
        newest sequences while the free blocks do not suffice."""
        if self.speculative_tokens:
            new_blocks, new_window = self._verify_blocks()
            changed, self.running_changed = self.running_changed, False
            return Step(self.running, is_prefill=False, new_blocks=new_blocks, new_window_blocks=new_window,
                        rows_changed=changed)
        need = self.by_phase[(1 - self.clock) % self.bm.block_size]    # (offset + clock - 1) % bs == 0
        while len(need) > self.bm.num_free:
            self._preempt(self.running[-1])
        new_blocks, new_window = [], []
        for s in need:
            self.bm.allocate(s, len(s.block_table) * self.bm.block_size + 1)
            new_blocks.append((s.row, len(s.block_table) - 1, s.block_table[-1]))
            if self.bm.window_pool:              # (so the window pool frees once per block, like it takes)
                new_window.append((s.row, len(s.window_table) - 1, s.window_table[-1]))
                self.bm.release_window(s, self.length(s) - 1)
        changed, self.running_changed = self.running_changed, False
        return Step(self.running, is_prefill=False, new_blocks=new_blocks, new_window_blocks=new_window,
                    rows_changed=changed)

    def _verify_blocks(self) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """Blocks for a verify step (speculative decoding): a running sequence of n tokens feeds
        positions n - 1 .. n - 1 + k at most, never past its turn's end (the runner drafts no more than
        that), so it holds min(n + k, max_len - 1) positions; the newest sequences are preempted while
        the free blocks do not suffice. -> the blocks handed out, and the window pool's. Host work grows
        with the batch here: each sequence advanced by its own count."""
        k = self.speculative_tokens
        upto = [min(self.length(s) + k, s.max_len - 1) for s in self.running]
        needs = [self.bm.blocks_needed(s, n) for s, n in zip(self.running, upto)]
        while sum(needs) > self.bm.num_free:
            self._preempt(self.running[-1])
            needs.pop()
        new_blocks, new_window = [], []
        for s, n, need in zip(self.running, upto, needs):
            if need:
                self.bm.allocate(s, n)
                fresh = range(len(s.block_table) - need, len(s.block_table))
                new_blocks += [(s.row, i, s.block_table[i]) for i in fresh]
                if self.bm.window_pool:
                    new_window += [(s.row, i, s.window_table[i]) for i in fresh]
                    self.bm.release_window(s, self.length(s) - 1)
        return new_blocks, new_window

    def _advance(self, step: Step) -> None:
        """After a verify step: each sequence moves on by the tokens it kept, the clock's one and the
        accepted drafts (its phase moves with it); the counters take the step's drafts."""
        bs = self.bm.block_size
        for s, kept in zip(step.batch, step.kept):
            if kept > 1:
                del self.by_phase[self.offset[s] % bs][s]
                self.offset[s] += kept - 1
                self.by_phase[self.offset[s] % bs][s] = None
        self.num_drafted_tokens += sum(step.drafted)
        self.num_accepted_tokens += sum(step.kept) - len(step.kept)

    def _preempt(self, seq: Sequence) -> None:
        """Free a sequence's blocks and queue it first for recompute (a prefill of all its tokens, of which
        the prefix cache may still hold the first); it keeps its row, which holds its tokens and
        log-probs so far."""
        fed = seq.num_computed
        if seq in self.offset:
            seq.num_tokens = self.length(seq)
            self._stop(seq)
            fed = seq.num_tokens - 1                     # running: its last token is sampled, not fed yet
        self._release([seq], fed)
        self.waiting.appendleft([seq])
        self.num_preemptions += 1

    def new_version(self, version: int, recompute_kv: bool) -> None:
        """The weights changed between two steps (an in-flight update): every sequence's next tokens are
        sampled by `version`; with recompute_kv every sequence holding KV goes back to waiting, to be
        prefilled again by the new weights (the KV of the old ones is dropped), else it keeps its KV."""
        self.version = version
        alive = [s for group in (*self.waiting, *self.prefilling) for s in group] + self.running
        for s in alive:
            s.version_marks.append((self.length(s), version))
        if not recompute_kv:             # the KV they hold stays, older than the cache's new chain
            for s in self.running + [s for group in self.prefilling for s in group if s.num_computed]:
                s.stale_kv = True
            return
        for s in list(reversed(self.running)):
            self._preempt(s)
        for group in list(reversed(self.prefilling)):
            self.prefilling.remove(group)
            self._release(group, group[0].num_computed)
            self.waiting.appendleft(group)
            self.num_preemptions += len(group)

    def _release(self, group: list[Sequence], fed: int) -> None:
        """Free the blocks of a group (sequences with identical tokens) before its end, the routes of the
        leader's first `fed` positions kept first: a recompute writes those positions again, maybe under
        new weights, and the routes that drew their next tokens are these. The members, whose tokens are
        the leader's, share what it keeps."""
        leader = group[0]
        if self.keep is not None and fed > 0:
            self.keep(leader, fed)
        for s in group:
            s.kept = leader.kept
            self.bm.free(s)
            s.num_computed, s.stale_kv = 0, False      # recomputed from position 0 by the weights then

    def _start(self, seq: Sequence) -> None:
        self.running.append(seq)
        self.offset[seq] = seq.num_tokens - self.clock
        self.by_phase[self.offset[seq] % self.bm.block_size][seq] = None
        self.running_changed = True

    def _stop(self, seq: Sequence) -> None:
        self.running.remove(seq)
        del self.by_phase[self.offset.pop(seq) % self.bm.block_size][seq]
        self.running_changed = True
