"""The rollout sampler: paged KV cache, continuous batching, preemption, CUDA graphs, exact recording.

    from rollout import Sampler
    sampler = Sampler(model)                    # or Sampler(model, RolloutConfig(...)), Sampler(model, num_blocks=64)
    outs = sampler.generate(prompts, max_new_tokens=64, temperature=1.0, n=8, seed=0)
    outs[i].tokens, outs[i].logprobs, outs[i].routes           # see SequenceOutput

Output types: per-token values are Python lists (prompt and tokens: ids, logprobs: the fp32 log-probs
exactly, as floats; torch.tensor(o.logprobs) gives back the fp32 bits); routes, 2-D per token, a tensor.

Vocabulary from vLLM / nano-vllm, and its split: one object decides, one does. A `Sequence` owns a
`block_table` of KV blocks (pages) of `block_size` positions. The `BlockManager` hands out blocks from
a free list with reference counts, so a GRPO group shares its prompt's full blocks, and says how many
members of a group the free blocks admit (`num_admissible`). The `Scheduler` owns the sequence
lifecycle: `add()` queues requests, `schedule()` decides the next `Step`: a prefill (waiting
sequences, admitted while batch rows, blocks and the token budget allow) or a decode (every running
sequence, preempting the newest when blocks run out; the step lists the blocks it handed out),
`postprocess()` retires finished sequences. The `ModelRunner` carries a Step out (`run`) and owns the
tensors: the KV pages and, per batch row, the sequence's tokens, log-probs and routes, all on the
device; a decode step is a fixed set of tensor ops over those buffers (one small read comes back:
which rows finished), replayed as a CUDA graph per batch-size bucket on a GPU. `Sampler` ties them
together for one request at a time; its settings are a `config.RolloutConfig`, which validates them.

Host work per decode step does not grow with the batch: the scheduler knows every running
sequence's length from one clock (they all advance together), finds the sequences that start a new
block this step in a table keyed by length mod block_size, and touches Python objects only for
those (1 / block_size of the batch on average) and for sequences that start or finish.

The contract: every step calls the same `Transformer.hidden_states`, `compute_logits` and
`kernels.token_logprobs` as `model.score`, so `outs[i].logprobs` are bitwise equal to
`model.score(prompt + tokens)` at the generated positions and `outs[i].routes` to score's routes,
whatever the batch, the padding, the block layout, sharing, preemption or graph replay. The random
draw of a token depends only on (seed, the sequence's index in the request, its position): a uniform
from a counter-based hash of those three (`draw_keys`), turned into a token by inverse CDF
(`kernels.sample_tokens`: a few batched torch ops, or on a GPU two Triton kernels).
"""
from __future__ import annotations

import dataclasses
import numbers
from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

import expert_parallel
import kernels
from config import RolloutConfig, check_sampling
from model import PagedKV, Transformer, kv_caches

CPU_KV_BYTES = 1 << 30            # the KV pool's cap on the CPU, where there is no free-memory query


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """One request's sampling settings, checked where the request enters (Sampler.generate)."""
    temperature: float = 1.0          # 0: greedy (log-probs then at temperature 1)
    top_p: float = 1.0
    top_k: int = 0                    # 0: off
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.top_k)     # the ranges RolloutConfig checks too
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: need an integer >= 1")
        if not _is_int(self.seed) or not 0 <= self.seed < 2 ** 64:
            raise ValueError(f"seed={self.seed!r}: need an integer in [0, 2**64)")
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: need integer token ids")
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        self.top_k, self.max_new_tokens, self.seed = int(self.top_k), int(self.max_new_tokens), int(self.seed)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


@dataclass
class SequenceOutput:
    prompt: list[int]
    tokens: list[int]            # generated ids
    logprobs: list[float]        # one per generated id: the fp32 log softmax(logits / temperature)[token], exactly
    routes: torch.Tensor         # (len(prompt) + n_generated - 1, n_moe_layers, top_k) int64
    finish_reason: str           # "stop" (a stop token), "length" (max_new_tokens or the context)
    # with RolloutConfig.record_route_detail (model.RouteDetail, at the positions of routes), else None
    route_weights: torch.Tensor | None = None    # (..., n_moe_layers, top_k) fp32 combine weights
    route_margins: torch.Tensor | None = None    # (..., n_moe_layers) fp32 k-th minus (k+1)-th score


@dataclass(eq=False)             # compared and hashed by identity: the scheduler keys dicts by sequence
class Sequence:
    seq_id: int                  # index in the request (plus the caller's offset): keys the sampling noise
    prompt: list[int]
    max_len: int                 # finishes ("length") when it holds this many tokens
    num_tokens: int = 0          # tokens in its row (prompt + generated); while running, see Scheduler.length
    row: int = -1                # its row of the ModelRunner's buffers; held from admission to finish
    block_table: list[int] = field(default_factory=list)
    parent: "Sequence | None" = None   # in a prefill batch: the group member whose forward it shares
    finish_reason: str | None = None
    output: SequenceOutput | None = None


@dataclass
class Step:
    """One engine step as the Scheduler decided it; the ModelRunner carries it out."""
    batch: list[Sequence]        # prefill: each group's leader, then its members; decode: `running` itself
    is_prefill: bool
    # decode only: the blocks handed out this step, (row, index in its block table, block id), and
    # whether the running set changed since the previous decode step (the runner then rewrites its rows)
    new_blocks: list[tuple[int, int, int]] = field(default_factory=list)
    rows_changed: bool = False


class BlockManager:
    """Blocks (pages) of `block_size` KV positions, a free list, and reference counts for sharing."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def num_admissible(self, num_tokens: int, group_size: int, num_running: int) -> int:
        """How many members of a group of num_tokens-token sequences the free blocks admit now.

        The leader takes its blocks and each other member a copy of a partly filled last block. While
        others run (num_running: running, or admitted earlier in this step), each of them and each new
        member keeps one spare block, so that the next decode step need not preempt at once; with nothing
        else running, the pool only has to hold this group.
        """
        base, partial = -(-num_tokens // self.block_size), int(num_tokens % self.block_size != 0)
        spare = int(num_running > 0)
        avail = self.num_free - spare * num_running
        if partial + spare == 0:                                    # members share every block
            return group_size if base <= avail else 0
        # m members need base + partial * (m - 1) + spare * m <= avail
        return max(0, min(group_size, (avail - base + partial) // (partial + spare)))

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq.block_table to hold positions [0, num_tokens)."""
        n = self.blocks_needed(seq, num_tokens)
        if n > self.num_free:
            raise RuntimeError(f"BlockManager: need {n} blocks, {self.num_free} free (caller must preempt first)")
        for _ in range(n):
            b = self.free_block_ids.popleft()
            self.ref_counts[b] = 1
            seq.block_table.append(b)

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> tuple[int, int] | None:
        """Share the parent's full blocks of positions [0, num_tokens) with child.

        A partly filled last block is not shared (both would write into it): the child gets a fresh
        block and the returned (src, dst) pair tells the caller to copy its KV contents.
        """
        n_full = num_tokens // self.block_size
        for b in parent.block_table[:n_full]:
            self.ref_counts[b] += 1
            child.block_table.append(b)
        if num_tokens % self.block_size:
            if self.num_free == 0:
                raise RuntimeError("BlockManager: no free block for a forked partial block")
            dst = self.free_block_ids.popleft()
            self.ref_counts[dst] = 1
            child.block_table.append(dst)
            return parent.block_table[n_full], dst
        return None

    def free(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_block_ids.append(b)
        seq.block_table = []


class Scheduler:
    """Owns the sequence lifecycle: waiting groups -> running -> finished (or preempted -> waiting)."""

    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[list[Sequence]] = deque()   # groups of sequences with identical tokens
        self.running: list[Sequence] = []               # in admission order: the newest is preempted first
        self.free_rows = list(range(max_batch_size - 1, -1, -1))   # pop() hands out the lowest row
        self.clock = 0                                  # decode steps taken; length = offset + clock
        self.offset: dict[Sequence, int] = {}           # running sequence -> num_tokens - clock
        self.by_phase = [dict() for _ in range(block_manager.block_size)]   # offset % bs -> {seq: None}
        self.running_changed = True                     # since the last decode step was handed out
        self.num_preemptions = 0

    # ---- lifecycle ----
    def add(self, group: list[Sequence]) -> None:
        """Queue sequences with identical tokens; they are prefilled once and share full blocks."""
        self.waiting.append(group)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def length(self, seq: Sequence) -> int:
        """Tokens in a sequence's row: every running sequence gains one per decode step."""
        return self.offset[seq] + self.clock if seq in self.offset else seq.num_tokens

    def schedule(self) -> Step:
        """The next step: a prefill of admitted waiting groups (each group's members after their leader,
        member.parent = leader), else a decode step of every running sequence."""
        batch = self._schedule_prefill()
        if batch:
            return Step(batch, is_prefill=True)
        return self._schedule_decode()

    def postprocess(self, step: Step, finished: list[bool]) -> list[Sequence]:
        """After a step: admitted sequences start running, the clock ticks, finished ones leave.
        Returns the finished sequences (their rows still hold their data until the next schedule)."""
        batch = step.batch
        if step.is_prefill:
            for s in batch:
                s.num_tokens += 1                                    # the token the prefill sampled
                self._start(s)
        else:
            self.clock += 1
        done = [s for s, f in zip(batch, finished) if f]
        for s in done:
            s.num_tokens = self.length(s)
            self._stop(s)
            self.bm.free(s)
            self.free_rows.append(s.row)
        return done

    # ---- prefill: admit waiting groups ----
    def _schedule_prefill(self) -> list[Sequence]:
        batch, n_leaders, longest = [], 0, 0
        while self.waiting:
            group = self.waiting[0]
            L = group[0].num_tokens
            # the prefill forward runs every leader right-padded to the longest: that many tokens
            if batch and (n_leaders + 1) * max(longest, L) > self.max_num_batched_tokens:
                break
            rows = len(group) if group[0].row >= 0 else len(self.free_rows)   # a preempted one kept its row
            # (_admit has already taken the blocks of the sequences in this batch)
            take = group[:min(rows, self.bm.num_admissible(L, len(group), len(self.running) + len(batch)))]
            if not take:
                break
            if len(take) == len(group):
                self.waiting.popleft()
            else:
                self.waiting[0] = group[len(take):]
            self._admit(take)
            batch += take
            n_leaders, longest = n_leaders + 1, max(longest, L)
        return batch

    def _admit(self, group: list[Sequence]) -> None:
        leader = group[0]
        if leader.row < 0:
            for s in group:
                s.row = self.free_rows.pop()
        leader.parent = None
        self.bm.allocate(leader, leader.num_tokens)
        for s in group[1:]:             # the runner copies the partial block's KV after the forward
            s.parent = leader
            self.bm.fork(leader, s, leader.num_tokens)

    # ---- decode: one more position for every running sequence ----
    def _schedule_decode(self) -> Step:
        """Give a new block to each running sequence whose next position starts one, preempting the
        newest sequences while the free blocks do not suffice."""
        need = self.by_phase[(1 - self.clock) % self.bm.block_size]    # (offset + clock - 1) % bs == 0
        while len(need) > self.bm.num_free:
            self._preempt(self.running[-1])
        new_blocks = []
        for s in need:
            self.bm.allocate(s, len(s.block_table) * self.bm.block_size + 1)
            new_blocks.append((s.row, len(s.block_table) - 1, s.block_table[-1]))
        changed, self.running_changed = self.running_changed, False
        return Step(self.running, is_prefill=False, new_blocks=new_blocks, rows_changed=changed)

    def _preempt(self, seq: Sequence) -> None:
        """Free a sequence's blocks and queue it first for recompute (a prefill of all its tokens); it
        keeps its row, which holds its tokens, log-probs and routes so far."""
        seq.num_tokens = self.length(seq)
        self._stop(seq)
        self.bm.free(seq)
        self.waiting.appendleft([seq])
        self.num_preemptions += 1

    def _start(self, seq: Sequence) -> None:
        self.running.append(seq)
        self.offset[seq] = seq.num_tokens - self.clock
        self.by_phase[self.offset[seq] % self.bm.block_size][seq] = None
        self.running_changed = True

    def _stop(self, seq: Sequence) -> None:
        self.running.remove(seq)
        del self.by_phase[self.offset.pop(seq) % self.bm.block_size][seq]
        self.running_changed = True


class ModelRunner:
    """The device side: carries out the Scheduler's Steps (`run`); KV pages, per-row buffers, the prefill
    and decode steps, CUDA graphs.

    Rows 0..max_batch_size-1 hold sequences; one extra row (`pad_row`) feeds the padding of a batch
    bucket: it reads and writes only the scratch page (the last page of each pool), so padding never
    touches a real sequence's KV. Buffers per row (L = the request's longest sequence, sized by
    `reserve`): token ids (L), log-probs of the generated tokens (L), routes of every fed position
    (L, n_moe, top_k) uint8 (int16 past 256 experts), the block table, and length, prompt length, max
    length, sequence index.
    """

    GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

    def __init__(self, model: Transformer, config: RolloutConfig, num_blocks: int):
        cfg, block_size, max_batch_size = model.config, config.block_size, config.max_batch_size
        p = next(model.parameters())
        self.model, self.device, self.dtype = model, p.device, p.dtype
        self.block_size, self.num_blocks, self.max_batch_size = block_size, num_blocks, max_batch_size
        self.pad_row, self.scratch_page = max_batch_size, num_blocks
        self.caches = kv_caches(cfg, num_blocks + 1, block_size, self.dtype, self.device)   # + the scratch page
        self.cuda_graphs = config.cuda_graphs
        if self.cuda_graphs is None:
            self.cuda_graphs = self._graphs_usable(config.rollout_mode)
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        self.pad_to_buckets = self.cuda_graphs     # tests set it on the CPU: padded steps without graphs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.warm: set[tuple] = set()                              # buckets run once eagerly (compiled)
        self.pool = None                                           # the captured graphs' shared memory pool
        self.capacity = 0
        self.stop_ids = torch.zeros(0)
        # routes are most of a row's bytes (n_moe * top_k per position: 384 at 48 layers, top-8), so
        # they take the smallest type that holds every expert id
        self.route_dtype = torch.uint8 if cfg.num_experts <= 256 else torch.int16
        self.record_detail = config.record_route_detail            # route weights and margins beside them

    def _graphs_usable(self, mode: str) -> bool:
        """Whether decode steps can be CUDA graphs: not with the torch backend or the fast MoE's host-side
        expert loop (kernels.grouped_mm_usable), which read the device inside a step. Under expert
        parallelism the decode step reads nothing back either (fixed exchange buffers), but graphs that
        capture NCCL collectives, replayed by ranks that captured different batch buckets, are not yet
        tested on GPUs: off by default there (cuda_graphs=True turns them on)."""
        cfg = self.model.config
        if expert_parallel.of(self.model) is not None:
            return False
        return self.device.type == "cuda" and kernels.get_backend() != "torch" and (
            mode == "invariant" or not self.model.n_moe_layers
            or kernels.grouped_mm_usable(self.device, self.dtype, cfg.hidden_size, cfg.moe_intermediate_size))

    def bucket(self, n: int) -> int:
        """Rows a decode step of n sequences runs (padded up, so a few graphs serve every n)."""
        if not (self.cuda_graphs or self.pad_to_buckets):
            return n
        b = next((b for b in self.GRAPH_BUCKETS if b >= n), -(-n // 128) * 128)
        return min(b, self.max_batch_size)

    # ---- buffers ----
    def reserve(self, max_len: int, sp: SamplingParams) -> None:
        """Size the per-row buffers for sequences of up to max_len tokens and set the request's seed
        and stop tokens (device tensors, so that captured graphs serve every request)."""
        if max_len > self.capacity or len(sp.stop_token_ids) > self.stop_ids.numel():
            self._allocate(max(max_len, self.capacity), max(8, len(sp.stop_token_ids)))
        self.seed.copy_(torch.tensor([sp.seed & 0xFFFFFFFF, (sp.seed >> 32) & 0xFFFFFFFF]))
        stop = list(sp.stop_token_ids) + [-1] * (self.stop_ids.numel() - len(sp.stop_token_ids))
        self.stop_ids.copy_(torch.tensor(stop))

    def _allocate(self, L: int, n_stop: int) -> None:
        R, dev, n_moe, k = self.max_batch_size + 1, self.device, self.model.n_moe_layers, self.model.config.num_experts_per_tok
        W = -(-L // self.block_size)
        self.capacity = L
        self.token_buf = torch.zeros(R, L + 1, dtype=torch.long, device=dev)      # +1: a finished row's last write
        self.logp_buf = torch.zeros(R, L + 1, dtype=torch.float32, device=dev)
        self.route_buf = torch.zeros(R, L, n_moe, k, dtype=self.route_dtype, device=dev)
        self._allocate_detail(R, L)
        self.block_tables = torch.full((R, W), self.scratch_page, dtype=torch.long, device=dev)
        self.num_tokens = torch.ones(R, dtype=torch.long, device=dev)             # pad row: 1 token, position 0
        self.prompt_len = torch.zeros(R, dtype=torch.long, device=dev)
        self.max_len = torch.full((R,), L + 1, dtype=torch.long, device=dev)
        self.seq_id = torch.zeros(R, dtype=torch.long, device=dev)
        self.rows = torch.full((self.max_batch_size,), self.pad_row, dtype=torch.long, device=dev)
        self.seed = torch.zeros(2, dtype=torch.long, device=dev)
        self.stop_ids = torch.full((n_stop,), -1, dtype=torch.long, device=dev)
        self.graphs.clear()                                        # they captured the old buffers
        self.warm.clear()
        self.pool = None                                           # and their pool goes with them

    def start(self, seqs: list[Sequence]) -> None:
        """Write admitted sequences' block tables, and new ones' prompts and per-row scalars, to their
        rows (a recomputed sequence's row still holds its tokens)."""
        dev = self.device
        fresh = [s for s in seqs if s.num_tokens == len(s.prompt)]
        if fresh:
            P = max(len(s.prompt) for s in fresh)
            prompts = torch.zeros(len(fresh), P, dtype=torch.long)
            for i, s in enumerate(fresh):
                prompts[i, :len(s.prompt)] = torch.tensor(s.prompt)
            rows = torch.tensor([s.row for s in fresh], device=dev)
            self.token_buf[rows, :P] = prompts.to(dev)
            scalars = torch.tensor([[len(s.prompt), s.max_len, s.seq_id] for s in fresh], device=dev)
            self.prompt_len[rows], self.max_len[rows], self.seq_id[rows] = scalars.unbind(1)
        width = max(len(s.block_table) for s in seqs)
        table = torch.full((len(seqs), width), self.scratch_page, dtype=torch.long)
        for i, s in enumerate(seqs):
            table[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
        self.block_tables[torch.tensor([s.row for s in seqs], device=dev), :width] = table.to(dev)

    def write_new_blocks(self, new_blocks: list[tuple[int, int, int]]) -> None:
        """Enter blocks handed out by a decode step, (row, index in its block table, block), in the tables."""
        if new_blocks:
            r, i, b = torch.tensor(new_blocks, device=self.device).unbind(1)
            self.block_tables[r, i] = b

    def run(self, step: Step, sp: SamplingParams) -> list[bool]:
        """Carry out a scheduled step; -> for each sequence of its batch, whether it finished."""
        if step.is_prefill:
            return self.prefill(step.batch, sp)
        self.write_new_blocks(step.new_blocks)
        return self.decode(step.batch, step.rows_changed, sp)

    # ---- the forward, shared by prefill and decode ----
    def _forward(self, rows, tokens, positions, valid):
        """Forward `tokens` (B, T) at `positions` of `rows`; KV of valid positions goes to the rows'
        pages, the rest to the scratch page. -> hidden states (B, T, D), routes (B, T, n_moe, k)."""
        bs = self.block_size
        bt = self.block_tables[rows]                                           # (B, W)
        slots = bt.gather(1, positions // bs) * bs + positions % bs            # (B, T)
        slots = torch.where(valid, slots, self.scratch_page * bs)
        h, routes, *detail = self.model.hidden_states(tokens, kv=PagedKV(self.caches, bt, slots, positions),
                                                      route_detail=self.record_detail)
        if detail:
            self._store_detail(rows, positions, detail[0])
        return h, routes

    def _sample(self, logits, rows, positions, sp: SamplingParams):
        """Next tokens (B,) and their log-probs (B,) for logits (B, V) of `rows` at `positions`."""
        if sp.temperature == 0:
            tokens = torch.argmax(logits, dim=-1)                              # first maximum on ties
        else:
            u = draw_keys(self.seed, self.seq_id[rows], positions)
            tokens = kernels.sample_tokens(logits, sp.temperature, sp.top_p, sp.top_k, u)
        return tokens, kernels.token_logprobs(logits, tokens, sp.temperature)

    def _record(self, rows, n_tok, tokens, logp) -> torch.Tensor:
        """Append the sampled tokens to their rows; -> (B,) bool: finished (a stop token or max_len)."""
        real = rows != self.pad_row
        self.token_buf[rows, n_tok] = tokens
        self.logp_buf[rows, n_tok - self.prompt_len[rows]] = logp
        self.num_tokens[rows] = n_tok + real.long()
        stop = (tokens[:, None] == self.stop_ids[None, :]).any(-1)
        return real & (stop | (n_tok + 1 >= self.max_len[rows]))

    # ---- prefill ----
    def prefill(self, seqs: list[Sequence], sp: SamplingParams) -> list[bool]:
        """One forward over each group leader's tokens, then every member samples its next token."""
        self.start(seqs)
        dev, bs = self.device, self.block_size
        leaders = [s for s in seqs if s.parent is None]
        index = {id(s): i for i, s in enumerate(leaders)}
        rows_l = torch.tensor([s.row for s in leaders], device=dev)
        m = torch.tensor([s.num_tokens for s in leaders], device=dev)               # tokens to feed
        T = max(s.num_tokens for s in leaders)
        positions = torch.arange(T, device=dev).expand(len(leaders), T)            # (G, T)
        tokens = self.token_buf[rows_l, :T]
        h, routes = self._forward(rows_l, tokens, positions, positions < m[:, None])
        self.route_buf[rows_l, :T] = routes.to(self.route_dtype)
        logits = self.model.compute_logits(h[torch.arange(len(leaders), device=dev), m - 1])   # (G, V)
        children = [s for s in seqs if s.parent is not None]
        if children:                    # members share the leader's full blocks; copy the partial one
            src = torch.tensor([s.parent.row for s in children], device=dev)
            dst = torch.tensor([s.row for s in children], device=dev)
            self.route_buf[dst, :T] = self.route_buf[src, :T]
            self._copy_detail(src, dst, T)
            pages = [(s.parent.block_table[s.num_tokens // bs], s.block_table[-1]) for s in children
                     if s.num_tokens % bs]
            if pages:
                ps, pd = torch.tensor(pages, device=dev).unbind(1)
                for k_pages, v_pages in self.caches:
                    k_pages[pd], v_pages[pd] = k_pages[ps], v_pages[ps]
        rows = torch.tensor([s.row for s in seqs], device=dev)
        n_tok = torch.tensor([s.num_tokens for s in seqs], device=dev)
        logits = logits[torch.tensor([index[id(s.parent or s)] for s in seqs], device=dev)]    # (B, V)
        tokens, logp = self._sample(logits, rows, n_tok, sp)
        return self._record(rows, n_tok, tokens, logp).tolist()

    # ---- decode ----
    def decode(self, seqs: list[Sequence], rows_changed: bool, sp: SamplingParams) -> list[bool]:
        """One decode step of every running sequence; graph replay where captured. rows_changed: the
        running set is not the previous decode step's (always so for a request's first decode step)."""
        n = len(seqs)
        bucket = self.bucket(n)
        if rows_changed:
            self.rows.fill_(self.pad_row)
            self.rows[:n] = torch.tensor([s.row for s in seqs], device=self.device)
        if not self.cuda_graphs or kernels.get_backend() == "torch":   # (the torch backend syncs the host)
            return self._decode_step(bucket, sp)[:n].tolist()
        key = (bucket, sp.temperature, sp.top_p, sp.top_k)
        if key not in self.graphs:
            if key not in self.warm:                               # first use runs eagerly: compiles kernels
                self.warm.add(key)
                return self._decode_step(bucket, sp)[:n].tolist()
            self.graphs[key] = self._capture(bucket, sp)
        graph, finished = self.graphs[key]
        graph.replay()
        return finished[:n].tolist()

    def _decode_step(self, n: int, sp: SamplingParams) -> torch.Tensor:
        """Feed each row's last token at its position: a fixed set of tensor ops, no host sync."""
        rows = self.rows[:n]
        n_tok = self.num_tokens[rows]                                           # (n,)
        pos = (n_tok - 1)[:, None]                                              # (n, 1)
        tokens = self.token_buf[rows[:, None], pos]                             # (n, 1)
        h, routes = self._forward(rows, tokens, pos, (rows != self.pad_row)[:, None])
        self.route_buf[rows, pos[:, 0]] = routes[:, 0].to(self.route_dtype)
        tokens, logp = self._sample(self.model.compute_logits(h[:, 0]), rows, n_tok, sp)
        return self._record(rows, n_tok, tokens, logp)

    def _capture(self, n: int, sp: SamplingParams):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            finished = self._decode_step(n, sp)
        self.pool = graph.pool()
        return graph, finished

    # ---- results ----
    def collect(self, seq: Sequence) -> SequenceOutput:
        """Copy a finished sequence's tokens, log-probs and routes out of its row (one copy each)."""
        n, P = seq.num_tokens, len(seq.prompt)
        tokens = self.token_buf[seq.row, P:n].tolist()
        logprobs = self.logp_buf[seq.row, :n - P].tolist()
        routes = self.route_buf[seq.row, :n - 1].to("cpu", torch.long, copy=True)
        return SequenceOutput(list(seq.prompt), tokens, logprobs, routes, seq.finish_reason,
                              *self._collect_detail(seq.row, n - 1))

    # ---- route detail (RolloutConfig.record_route_detail): weights and margins beside the routes ----
    def _allocate_detail(self, R: int, L: int) -> None:
        """fp32 buffers, per row (L, n_moe, k) weights and (L, n_moe) margins: 4 (k + 1) bytes per
        position and MoE layer on top of the routes' ids; none when not recorded."""
        n_moe, k = self.model.n_moe_layers, self.model.config.num_experts_per_tok
        shape = (R, L, n_moe) if self.record_detail else (0, 0, n_moe)
        self.weight_buf = torch.zeros(*shape, k, dtype=torch.float32, device=self.device)
        self.margin_buf = torch.zeros(*shape, dtype=torch.float32, device=self.device)

    def _store_detail(self, rows, positions, detail) -> None:
        """Write a forward's RouteDetail (B, T, ...) at (rows, positions), as the routes are written."""
        self.weight_buf[rows[:, None], positions] = detail.weights
        self.margin_buf[rows[:, None], positions] = detail.margin

    def _copy_detail(self, src, dst, T: int) -> None:
        if self.record_detail:
            self.weight_buf[dst, :T] = self.weight_buf[src, :T]
            self.margin_buf[dst, :T] = self.margin_buf[src, :T]

    def _collect_detail(self, row: int, n: int) -> tuple:
        if not self.record_detail:
            return None, None
        return self.weight_buf[row, :n].to("cpu", copy=True), self.margin_buf[row, :n].to("cpu", copy=True)

    def weights_key(self) -> tuple:
        """Where the weights live: captured graphs read these addresses, so they must not move."""
        return tuple(p.data_ptr() for p in self.model.parameters())


class Sampler:
    def __init__(self, model: Transformer, config: RolloutConfig | None = None, *, reserve_bytes: int = 0,
                 **overrides):
        """A sampler over `model`'s own weights (no copy: the trainer's updates are seen at once).

        config: a config.RolloutConfig (default: its defaults; its fields are described there), which
            validates them; overrides: any of its fields by name, replacing the config's, e.g.
            `Sampler(model, max_batch_size=8)`. The sampler reads the engine's fields (block_size,
            num_blocks, max_batch_size, max_num_batched_tokens, kv_memory_fraction, cuda_graphs,
            rollout_mode, router_bf16); the sampling ones are generate()'s arguments.
        reserve_bytes: on CUDA, what will be allocated after the sampler (e.g. the optimizer's state),
            set aside when the pool is sized from the free memory (num_blocks=0, see _pool_blocks).
        """
        if config is not None and not isinstance(config, RolloutConfig):
            raise TypeError(f"config must be a config.RolloutConfig, got {type(config).__name__}")
        self.config = RolloutConfig(**overrides) if config is None else dataclasses.replace(config, **overrides)
        self.model = model
        self.variant = dict(batch_variant=self.config.rollout_mode == "fast", router_bf16=self.config.router_bf16)
        self.max_model_len = model.config.max_position_embeddings
        self.num_blocks = self.config.num_blocks or self._pool_blocks(reserve_bytes)
        self.runner = ModelRunner(model, self.config, self.num_blocks)
        self.weights_key = self.runner.weights_key()
        self.num_preemptions = 0

    def _pool_blocks(self, reserve_bytes: int) -> int:
        """The KV pool's size where the config leaves it (num_blocks=0): on CUDA, kv_memory_fraction of
        the free memory left after reserve_bytes; on the CPU, at most CPU_KV_BYTES; never more than
        max_batch_size full-context sequences need."""
        cfg, bs = self.model.config, self.config.block_size
        p = next(self.model.parameters())
        block_bytes = cfg.num_hidden_layers * bs * cfg.kv_numbers_per_token * p.element_size()
        wanted = self.config.max_batch_size * -(-self.max_model_len // bs)
        if p.device.type == "cuda":
            free = torch.cuda.mem_get_info(p.device)[0]
            return kv_pool_blocks(free, self.config.kv_memory_fraction, reserve_bytes, block_bytes, wanted)
        return kv_pool_blocks(CPU_KV_BYTES, 1.0, 0, block_bytes, wanted)

    @property
    def caches(self):
        return self.runner.caches

    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, n: int = 1, stop_token_ids: tuple[int, ...] = (),
                 seed: int = 0, progress: bool = False, index_offset: int = 0) -> list[SequenceOutput]:
        """Sample n continuations of each prompt; returns len(prompts) * n outputs, prompt-major.

        temperature 0 is greedy (log-probs then use temperature 1). Identical prompts (repeated, or
        through n) are prefilled once and share their KV blocks. index_offset: the index of this
        request's first sequence in a larger one (a data-parallel rank passes its global offset, so its
        draws equal those of a single process sampling the whole request). progress=True draws a bar.
        """
        sp = SamplingParams(temperature, top_p, top_k, max_new_tokens, tuple(stop_token_ids), seed)
        if not _is_int(n) or n < 1:
            raise ValueError(f"n={n!r}: need an integer >= 1 (samples per prompt)")
        if not _is_int(index_offset) or index_offset < 0:
            raise ValueError(f"index_offset={index_offset!r}: need an integer >= 0")
        seqs = [Sequence(index_offset + i * n + j, prompt, min(len(prompt) + sp.max_new_tokens, self.max_model_len),
                         num_tokens=len(prompt))
                for i, prompt in enumerate(self._check_prompts(prompts, sp)) for j in range(n)]
        if self.runner.weights_key() != self.weights_key:          # e.g. model.to(...) after building
            raise RuntimeError("the model's weights moved to new memory since this Sampler was built (e.g. "
                               "model.to() or load_state_dict(assign=True)); build a new Sampler")
        cfg = self.config
        sched = Scheduler(BlockManager(self.num_blocks, cfg.block_size), cfg.max_batch_size, cfg.max_num_batched_tokens)
        groups: dict[tuple, list[Sequence]] = {}
        for s in seqs:
            groups.setdefault(tuple(s.prompt), []).append(s)
        for g in groups.values():
            sched.add(g)
        self.runner.reserve(max(s.max_len for s in seqs), sp)
        bar = tqdm(total=sum(s.max_len - s.num_tokens for s in seqs), desc="generate",
                   disable=not progress, leave=False)
        with kernels.variant(**self.variant):
            self._run(sched, sp, bar)
        bar.close()
        self.num_preemptions = sched.num_preemptions
        return [s.output for s in seqs]

    def _run(self, sched: Scheduler, sp: SamplingParams, bar) -> None:
        """The engine loop: schedule, run the step on the device, retire what finished."""
        runner, ep = self.runner, expert_parallel.of(self.model)
        while True:
            done = sched.is_finished()
            step = None if done else sched.schedule()
            if ep is None:
                if done:
                    break
                finished = runner.run(step, sp)
            else:                                # the EP group steps together and ends together
                all_done, prefill = expert_parallel.group_step(done, step is not None and step.is_prefill, ep)
                if all_done:
                    break
                # decode: fixed-size exchange buffers (no counts); a step with a prefill in the group: counted
                ep.capacity = 0 if prefill else runner.max_batch_size * self.model.config.num_experts_per_tok
                try:
                    if done:                     # nothing left here: the group's exchanges, zero rows
                        expert_parallel.idle_step(self.model)
                        continue
                    finished = runner.run(step, sp)
                finally:
                    ep.capacity = 0
            bar.update(len(step.batch))
            for s in sched.postprocess(step, finished):
                s.output = runner.collect(s)
                # a stop token ends a sequence as "stop" even when it is also the last allowed one
                stopped = s.output.tokens[-1] in sp.stop_token_ids
                s.finish_reason = s.output.finish_reason = "stop" if stopped else "length"
                bar.update(s.max_len - s.num_tokens)                # credit the tokens it will not generate

    def _check_prompts(self, prompts, sp: SamplingParams) -> list[list[int]]:
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of lists of token ids, got {type(prompts).__name__}")
        vocab, out = self.model.config.vocab_size, []
        if not all(0 <= t < vocab for t in sp.stop_token_ids):
            raise ValueError(f"stop_token_ids={sp.stop_token_ids}: ids must be in [0, vocab_size={vocab})")
        for i, prompt in enumerate(prompts):
            if torch.is_tensor(prompt):
                if prompt.dim() != 1 or prompt.is_floating_point() or prompt.dtype == torch.bool:
                    raise ValueError(f"prompt {i} must be a 1-D integer tensor or a list of integer token ids")
                prompt = prompt.tolist()
            if not isinstance(prompt, (list, tuple)) or not all(_is_int(t) for t in prompt):
                raise ValueError(f"prompt {i} must be a list of integer token ids")
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"prompt {i} is empty: give at least one token (e.g. a BOS token)")
            if len(prompt) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens but the context is {self.max_model_len} "
                                 f"(max_position_embeddings) with room for at least one new token; shorten it")
            if not all(0 <= t < vocab for t in prompt):
                raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={vocab})")
            max_len = min(len(prompt) + sp.max_new_tokens, self.max_model_len)
            if -(-max_len // self.config.block_size) > self.num_blocks:
                raise ValueError(f"prompt {i} may grow to {max_len} tokens = {-(-max_len // self.config.block_size)} "
                                 f"blocks, but the pool has {self.num_blocks}; raise num_blocks")
            out.append(prompt)
        return out


def kv_pool_blocks(free_bytes: int, fraction: float, reserve_bytes: int, block_bytes: int, wanted: int) -> int:
    """KV blocks to allocate: `fraction` of the memory left once `reserve_bytes` are set aside, at most
    `wanted` (full-context sequences for the whole batch), at least 1 (the scheduler then preempts).
    RolloutConfig checks the fraction (kv_memory_fraction)."""
    budget = int(max(0, free_bytes - reserve_bytes) * fraction)
    return max(1, min(wanted, budget // block_bytes))


# ---------------------------------------------------------------------------------------------------
# the random stream: one uniform per (seed, sequence, position), for the whole batch in a few ops;
# kernels.sample_tokens turns it into a token (inverse CDF)
# ---------------------------------------------------------------------------------------------------
M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), in two 16-bit halves of c (no int64 overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (the 'lowbias32' xorshift-multiply finalizer) of int64 tensors, elementwise.
    Integer ops only: the same bits on every device and for every batch shape."""
    x = x & M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def draw_keys(seed: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform draw per row in (0, 1), float64 with 53 random bits: a hash of (seed, sequence index,
    position) only. seed (2,) int64: the request seed's low and high 32-bit words; seq_ids, positions (B,)."""
    k1 = mix32(seed[0] ^ mix32(seed[1] ^ 0x3C6EF372))
    k2 = mix32(k1 ^ (seq_ids & M32))
    hi = mix32(k2 ^ mix32(positions ^ 0x1B873593))                         # (B,) 32-bit words
    lo = mix32(hi ^ k2)
    return ((hi >> 6) * (1 << 27) + (lo >> 5)).double().add(0.5).mul(2.0 ** -53)
