"""The rollout sampler: paged KV cache, continuous batching, preemption, CUDA graphs, exact recording,
multi-turn sessions (token in, token out), a prefix cache, chunked prefill and speculative decoding.

    from rollout import Sampler
    sampler = Sampler(model)                    # or Sampler(model, RolloutConfig(...)), Sampler(model, num_blocks=64)
    outs = sampler.generate(prompts, max_new_tokens=64, temperature=1.0, n=8, seed=0)
    outs[i].tokens, outs[i].logprobs, outs[i].routes           # see SequenceOutput

    # episodes: after each turn the environment appends token ids to the live sequence, or ends it (None)
    outs = sampler.generate(prompts, max_new_tokens=32, on_turn_end=lambda i, turn: envs[i].step(turn),
                            max_episode_tokens=512)
    outs[i].policy_mask, outs[i].turns                          # which ids the policy sampled; its turns

Output types: per-token values are Python lists (prompt and tokens: ids, logprobs: the fp32 log-probs
exactly, as floats; torch.tensor(o.logprobs) gives back the fp32 bits); routes, 2-D per token, a tensor.
In an episode `tokens` holds every id after the prompt, the policy's and the environment's;
`policy_mask` tells them apart (1: sampled) and an observation id's log-prob is OBSERVATION_LOGPROB.

Vocabulary from vLLM / nano-vllm, and its split: one object decides, one does (the deciding side,
Sequence / BlockManager / Scheduler, lives in scheduler.py). A `Sequence` owns a
`block_table` of KV blocks (pages) of `block_size` positions. The `BlockManager` hands out blocks from
a free list with reference counts, so a GRPO group shares its prompt's full blocks, says how many
members of a group the free blocks admit (`num_admissible`), and keeps the prefix cache. The
`Scheduler` owns the sequence lifecycle: `add()` queues requests, `schedule()` decides the next
`Step`: a prefill (chunks of admitted sequences, then waiting sequences, admitted while batch rows,
blocks and the token budget allow) or a decode (every running sequence, preempting the newest when
blocks run out; the step lists the blocks it handed out), `postprocess()` ends turns and retires
finished sequences. The `ModelRunner` carries a Step out (`run`) and owns the tensors: the KV pages,
the route pages beside them, and per batch row the sequence's tokens and log-probs, all on the
device; a decode step is a fixed set of tensor ops over those buffers (one small read comes back:
which rows finished), replayed as a CUDA graph per batch-size bucket on a GPU. `Sampler` ties them
together for one request at a time; its settings are a `config.RolloutConfig`, which validates them.

One mechanism serves multi-turn episodes, the prefix cache and chunked prefill: a sequence's first
`num_computed` tokens have their KV and routes in its blocks, and a prefill step feeds tokens
[num_computed, end) over them. Attention reads keys by absolute position through the block table and
every op is row-invariant, so a piece of a prefill has the bits of the whole prefill.
* Routes live per KV slot: route pages (RolloutConfig.record_route_detail: also weights and margins)
  beside the KV pages, written at the same slots, so the blocks a group shares or the prefix cache
  serves carry their routes; a sequence's routes are gathered through its block table at its end.
  A position records the routes of the forward that first fed it, the one whose logits drew its next
  token: a preemption or an in-flight recompute frees a sequence's blocks and its next prefill writes
  them again, maybe under new weights, so its fed positions' routes are kept first (Sequence.kept,
  ModelRunner.keep_routes) and spliced over the gathered ones. Without new weights they are the bits
  the recompute writes (the contract), so a plain preemption's outputs do not change.
* Chunked prefill: a prompt or observation longer than max_num_batched_tokens is prefilled in chunks
  of at most that many tokens, a decode step of the running sequences after each chunk; meanwhile
  the sequence holds its row and blocks, and it samples after its last chunk.
* The prefix cache (RolloutConfig.prefix_cache): a full block whose KV is computed and whose tokens
  the host knows is registered under (the previous block's node, its token ids), a chain rooted at
  the weights' version. An admitted sequence reuses its longest run of registered leading blocks
  (never its last token: that one is fed, for the logits). Freed blocks stay registered in the free
  list until allocation takes them, least recently freed first. A block is registered when the host
  learns its tokens: after a prefill, at a turn's end and at a sequence's end (its generated ids are
  read then, never per decode step). `Sampler.weights_version` keys the chain and a new version
  forgets every block, so no block survives a weight update and a hit has a cold run's bits.
  A request's groups arrive together, so a prefix they share (a system prompt, a tool schema) is
  in no block yet: a waiting group whose next block another group's prefill is computing waits until
  that prefill registers it, and takes it as a hit (Scheduler._admit_waiting). The others are admitted
  past it. It does not join that forward, which pads every chunk to the longest. Layers that keep a
  state per sequence instead of pages (hybrids/) serve a hit from a snapshot of their state at a grid
  boundary, kept beside the block that ends there (scheduler.RecurrentBlockManager, RolloutConfig.state_snapshots):
  a hit is cut back to the last such block.
* Speculative decoding (RolloutConfig.speculative_tokens = k; sampling/speculative.py): a decode step becomes
  a verify step. Each running sequence feeds its last token and up to k drafts that an n-gram lookup
  in its own ids proposes (on the device), k + 1 positions in one forward, each sampled with its own
  draw; the drafts that equal the tokens sampled before them are kept, and the first token that does
  not. Kept tokens have plain decoding's bits (the forward is a chunked prefill); a rejected position's
  KV and routes are rewritten by the next step before anything reads them (recurrent layers, hybrids/:
  the drafts stop short of the next grid boundary, so no chunk completes on one and none enters a state).
  The step's read back brings each sequence's count, so a verify step's host work grows with the batch.
* The window pool (a model with sliding-window layers; RolloutConfig.window_blocks): those layers' pages
  are a pool of their own, a block beside each of a sequence's blocks, freed once it lies below the
  window of every query the sequence will still feed (scheduler.WindowPool.release), so a
  long sequence holds its last window's blocks there, not its whole length. A masked key is an exact
  no-op, so a table entry naming a freed block reads nothing that counts: the same bits.
* Sessions: with `on_turn_end`, a turn ends at a stop token or after max_new_tokens; the callback
  gets (index, the turn's ids) and returns the observation's ids to append, or None to end the
  episode. The observation and the turn's last token (sampled, never fed yet, so its route comes
  from this real forward) are prefilled into the sequence's existing KV, and the next turn samples;
  the history is never prefilled again, and other sequences keep decoding meanwhile.

Host work per (plain) decode step does not grow with the batch: the scheduler knows every running
sequence's length from one clock (they all advance together), finds the sequences that start a new
block this step in a table keyed by length mod block_size, and touches Python objects only for
those (1 / block_size of the batch on average) and for sequences that start, end a turn or finish.

The contract: every step calls the same `Transformer.hidden_states`, `compute_logits` and
`kernels.token_logprobs` as `model.score`, so `outs[i].logprobs` are bitwise equal to
`model.score(prompt + tokens)` at the policy's positions and `outs[i].routes` to score's routes,
whatever the batch, the padding, the block layout, sharing, preemption, chunking, cache hits, graph
replay or speculative decoding. The random draw of a token depends only on (seed, the sequence's index in the request, its
position): a uniform from a counter-based hash of those three (`draw_keys`), turned into a token by
inverse CDF (`kernels.sample_tokens`: a few batched torch ops, or on a GPU two Triton kernels).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from tqdm.auto import tqdm

import kernels
from config import RolloutOptions, check_sampling, configs_for
from model import PagedKV, Transformer, expert_group, kv_caches
from scheduler import BlockManager, RecurrentBlockManager, Scheduler, Sequence, Step, WindowBlockManager

if TYPE_CHECKING:                     # a run's class: config.configs_for
    from config import RolloutConfig

CPU_KV_BYTES = 1 << 30            # the KV pool's cap on the CPU, where there is no free-memory query
OBSERVATION_LOGPROB = 0.0         # SequenceOutput.logprobs at the environment's ids (the policy did not sample them)

# on_turn_end(index in the request's outputs, the turn's ids) -> ids to append, or None: the episode ends
TurnEnd = Callable[[int, list], "list[int] | None"]
# Sequence.kept: a sequence's routes at its first fed positions, copied out of its pages before a preemption or
# an in-flight recompute freed them, one tensor per ModelRunner.route_pools, (positions, ...) on the device
KeptRoutes = list[torch.Tensor]


def route_dtype(num_experts: int) -> torch.dtype:
    """Routes take n_moe * top_k ids per position (384 at 48 layers, top-8), so they are stored in the
    smallest type that holds every expert id."""
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass
class SamplingParams:
    """One request's sampling settings, checked where the request enters (Sampler.generate)."""
    temperature: float = 1.0          # 0: greedy (log-probs then at temperature 1)
    top_p: float = 1.0
    top_k: int = 0                    # 0: off
    max_new_tokens: int = 64          # per turn
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    filters: dict = field(default_factory=dict)   # the draw's other filters by name (kernels.SAMPLING_FILTERS)

    def __post_init__(self):
        check_sampling(self.temperature, top_p=self.top_p, top_k=self.top_k, **self.filters)   # as RolloutConfig
        if not kernels.is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: need an integer >= 1")
        if not kernels.is_int(self.seed) or not 0 <= self.seed < 2 ** 64:
            raise ValueError(f"seed={self.seed!r}: need an integer in [0, 2**64)")
        if not all(kernels.is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: need integer token ids")
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        self.top_k, self.max_new_tokens, self.seed = int(self.top_k), int(self.max_new_tokens), int(self.seed)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


@dataclass
class SequenceOutput:
    prompt: list[int]
    tokens: list[int]            # every id after the prompt: generated, and in an episode also the environment's
    logprobs: list[float]        # one per id: the fp32 log softmax(logits / temperature)[token], exactly, where the
                                 # policy sampled it; OBSERVATION_LOGPROB (0.0) where the environment appended it
    routes: torch.Tensor         # (len(prompt) + len(tokens) - 1, n_moe_layers, top_k) int64: every fed position
    finish_reason: str           # "stop": a stop token, or the environment ended the episode; "length": max_new_tokens
                                 # (single turn), max_episode_tokens or the context
    # with RolloutConfig.record_route_detail (model.RouteDetail, at the positions of routes), else None
    route_weights: torch.Tensor | None = None    # (..., n_moe_layers, top_k) fp32 combine weights
    route_margins: torch.Tensor | None = None    # (..., n_moe_layers) fp32 k-th minus (k+1)-th score
    policy_mask: list[int] = field(default_factory=list)   # one per id: 1 sampled by the policy, 0 the environment's
    turns: list[tuple[int, int]] = field(default_factory=list)   # each policy turn's [start, end) in tokens
    weights_version: int = 0     # the Sampler.weights_version that drew the tokens
    # provenance (asynchronous RL), one per id: the policy version that sampled it (generate's `version`,
    # then each in-flight update's) and the oldest version whose KV it was sampled on (older than its own
    # version when an in-flight update kept the KV); an observation's: the version when it was appended
    token_versions: list[int] = field(default_factory=list)
    kv_versions: list[int] = field(default_factory=list)
    finish_time: float = 0.0     # seconds from the generate() call's start until the host saw it finish (its latency)

    @property
    def num_turns(self) -> int:
        return len(self.turns)


class ModelRunner:
    """The device side: carries out the Scheduler's Steps (`run`); KV and route pages, per-row buffers,
    the prefill and decode (or verify: speculative decoding) steps, CUDA graphs.

    The pages: per layer K and V (a sliding-window layer's from the window pool, with a table of its
    own, where there is one), and beside them the routes of every fed position (n_moe, top_k) uint8
    (int16 past 256 experts; with record_route_detail also fp32 combine weights and margins), each
    (num_blocks + 1, block_size, ...), written at the same slots. Rows 0..max_batch_size-1 hold
    sequences; one extra row (`pad_row`) feeds the padding of a batch bucket: it reads and writes only
    the scratch page (the last page of each pool), so padding never touches a real sequence's pages.
    Buffers per row (L = the request's longest sequence, sized by `reserve`): token ids (L), the
    log-probs of the sampled tokens at their positions (L), the block table, and length, max length
    (its turn's end) and sequence index.
    """

    GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

    def __init__(self, model: Transformer, config: RolloutConfig, num_blocks: int, window_blocks: int = 0,
                 drafts=None, grid: int = 0):
        cfg, block_size, max_batch_size = model.config, config.block_size, config.max_batch_size
        p = next(model.parameters())
        self.model, self.device, self.dtype = model, p.device, p.dtype
        self.block_size, self.num_blocks, self.max_batch_size = block_size, num_blocks, max_batch_size
        self.pad_row, self.scratch_page = max_batch_size, num_blocks
        # + the scratch page; sliding-window layers' pages from the window pool where there is one
        self.window_blocks, self.window_scratch = window_blocks, window_blocks
        self.cuda_graphs = config.cuda_graphs
        if self.cuda_graphs is None:                               # graphs are CUDA's: off elsewhere
            self.cuda_graphs = self.device.type == "cuda" and self._graphs_usable("moe_experts" in config.rollout_ops())
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        self.pad_to_buckets = self.cuda_graphs     # tests set it on the CPU: padded steps without graphs
        self.drafts = drafts                       # the draft policy (RolloutConfig.draft_policy): verify steps
        self.speculative_tokens = 0 if drafts is None else drafts.k
        self.grid = grid                                           # recurrent layers' chunk: drafts stay inside one
        self.state_slots = config.state_snapshots if grid and config.prefix_cache else 0   # the prefix cache's
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.warm: set[tuple] = set()                              # buckets run once eagerly (compiled)
        self.pool = None                                           # the captured graphs' shared memory pool
        self.capacity = 0
        self.stop_ids = torch.zeros(0)
        self.route_dtype = route_dtype(cfg.num_experts)
        self.record_detail = config.record_route_detail            # route weights and margins beside them
        self.caches = None
        self.allocate_pages()

    def allocate_pages(self) -> None:
        """The KV pages (the window pool's beside them) and the routes recorded per position, and their
        detail, for num_blocks blocks and the scratch page; nothing where they are there."""
        if self.caches is not None:
            return
        cfg, n_moe, k = self.model.config, self.model.n_moe_layers, self.model.config.num_experts_per_tok
        self.caches = kv_caches(cfg, self.num_blocks + 1, self.block_size, self.dtype, self.device,
                                window_pages=self.window_blocks + 1 if self.window_blocks else 0)
        self.states = self.model.state_pool(self.max_batch_size + 1, self.device, self.state_slots)   # recurrent rows
        pages = (self.num_blocks + 1, self.block_size, n_moe)
        self.route_pages = torch.zeros(*pages, k, dtype=self.route_dtype, device=self.device)
        detail = pages if self.record_detail else (0, self.block_size, n_moe)
        self.weight_pages = torch.zeros(*detail, k, dtype=torch.float32, device=self.device)
        self.margin_pages = torch.zeros(*detail, dtype=torch.float32, device=self.device)

    def release_pages(self) -> None:
        """Free the pages until allocate_pages (the synchronous loop's update reuses their memory); graphs
        captured over them go with them."""
        self.caches = self.route_pages = self.weight_pages = self.margin_pages = self.states = None
        self.graphs.clear()
        self.warm.clear()
        self.pool = None

    def _graphs_usable(self, other_moe: bool) -> bool:
        """Whether decode steps on a CUDA device can be CUDA graphs: not with the torch backend or another op
        set's MoE (the lab's fast one: a host-side expert loop unless kernels.grouped_mm_usable), which read
        the device inside a step. Under expert parallelism the decode step reads nothing back either (fixed
        exchange buffers), but graphs that capture NCCL collectives, replayed by ranks that captured
        different batch buckets, are not yet tested on GPUs: off by default there (cuda_graphs=True turns
        them on)."""
        cfg = self.model.config
        if expert_group(self.model) is not None:
            return False
        return kernels.get_backend() != "torch" and (
            not other_moe or not self.model.n_moe_layers
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
        R, dev = self.max_batch_size + 1, self.device
        W = -(-L // self.block_size)
        self.capacity = L
        self.token_buf = torch.zeros(R, L + 1, dtype=torch.long, device=dev)      # +1: a finished row's last write
        self.logp_buf = torch.zeros(R, L + 1, dtype=torch.float32, device=dev)
        self.block_tables = torch.full((R, W), self.scratch_page, dtype=torch.long, device=dev)
        self.window_tables = torch.full((R, W), self.window_scratch, dtype=torch.long, device=dev) \
            if self.window_blocks else None
        self.num_tokens = torch.ones(R, dtype=torch.long, device=dev)             # pad row: 1 token, position 0
        self.max_len = torch.full((R,), L + 1, dtype=torch.long, device=dev)
        self.seq_id = torch.zeros(R, dtype=torch.long, device=dev)
        self.rows = torch.full((self.max_batch_size,), self.pad_row, dtype=torch.long, device=dev)
        self.seed = torch.zeros(2, dtype=torch.long, device=dev)
        self.stop_ids = torch.full((n_stop,), -1, dtype=torch.long, device=dev)
        self.graphs.clear()                                        # they captured the old buffers
        self.warm.clear()
        self.pool = None                                           # and their pool goes with them

    def start(self, seqs: list[Sequence]) -> None:
        """Write a prefill batch's block tables and per-row scalars (max length: its turn's end) to their
        rows, and the tokens its rows do not hold yet: a new prompt, a session's observation (a
        recomputed sequence's row still holds its tokens)."""
        dev = self.device
        pending = [s for s in seqs if s.num_written < len(s.token_ids)]
        if pending:                                                # one flat write: (row, position) <- id
            rows = [s.row for s in pending for _ in range(s.num_written, len(s.token_ids))]
            positions = [p for s in pending for p in range(s.num_written, len(s.token_ids))]
            ids = [t for s in pending for t in s.token_ids[s.num_written:]]
            self.token_buf[torch.tensor(rows, device=dev), torch.tensor(positions, device=dev)] = \
                torch.tensor(ids, device=dev)
            for s in pending:
                s.num_written = len(s.token_ids)
        rows = torch.tensor([s.row for s in seqs], device=dev)
        scalars = torch.tensor([[s.max_len, s.seq_id] for s in seqs], device=dev)
        self.max_len[rows], self.seq_id[rows] = scalars.unbind(1)
        width = max(len(s.block_table) for s in seqs)
        table = torch.full((len(seqs), width), self.scratch_page, dtype=torch.long)
        for i, s in enumerate(seqs):
            table[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
        self.block_tables[rows, :width] = table.to(dev)
        if self.window_blocks:                                     # a freed window block (-1): the scratch page
            table = torch.tensor([s.window_table + [-1] * (width - len(s.window_table)) for s in seqs])
            self.window_tables[rows, :width] = torch.where(table < 0, self.window_scratch, table).to(dev)

    def write_new_blocks(self, new_blocks: list[tuple[int, int, int]], tables: torch.Tensor) -> None:
        """Enter blocks handed out by a decode step, (row, index in its block table, block), in `tables`."""
        if new_blocks:
            r, i, b = torch.tensor(new_blocks, device=self.device).unbind(1)
            tables[r, i] = b

    def run(self, step: Step, sp: SamplingParams) -> list[bool]:
        """Carry out a scheduled step; -> for each sequence of its batch, whether it finished its turn.
        A verify step (speculative_tokens > 0) also fills in step.kept and step.drafted."""
        if step.is_prefill:
            return self.prefill(step.batch, step.prefill_ends, sp)
        self.write_new_blocks(step.new_blocks, self.block_tables)
        self.write_new_blocks(step.new_window_blocks, self.window_tables)
        if self.speculative_tokens:
            return self.verify(step, sp)
        return self.decode(step.batch, step.rows_changed, sp)

    # ---- the forward, shared by prefill and decode ----
    def _forward(self, rows, tokens, positions, valid, within: bool = False):
        """Forward `tokens` (B, T) at `positions` of `rows`; the KV and routes of valid positions go to
        the rows' pages, the rest to the scratch page. within: every row's tokens lie in its open chunk of
        the recurrent layers' grid (a verify step's, capped so): one fixed set of ops there, no host read.
        -> hidden states (B, T, D)."""
        bs = self.block_size
        bt = self.block_tables[rows]                                           # (B, W)
        slots = bt.gather(1, positions // bs) * bs + positions % bs            # (B, T)
        slots = torch.where(valid, slots, self.scratch_page * bs)
        kv = PagedKV(self.caches, bt, slots, positions)
        if self.states is not None:                                            # recurrent layers: their rows
            kv.states = self.states, rows, valid, within
        if self.window_blocks:                                                 # the sliding layers' pages
            wt = self.window_tables[rows]                                      # (B, W)
            wslots = wt.gather(1, positions // bs) * bs + positions % bs       # (B, T)
            kv.window_table, kv.window_slots = wt, torch.where(valid, wslots, self.window_scratch * bs)
        h, routes, *detail = self.model.hidden_states(tokens, kv=kv, route_detail=self.record_detail)
        flat = slots.reshape(-1)                                               # (B*T,)
        self.route_pages.flatten(0, 1)[flat] = routes.flatten(0, 1).to(self.route_dtype)
        if detail:
            self.weight_pages.flatten(0, 1)[flat] = detail[0].weights.flatten(0, 1)
            self.margin_pages.flatten(0, 1)[flat] = detail[0].margin.flatten(0, 1)
        return h

    def _copy_pages(self, src: torch.Tensor, dst: torch.Tensor, window: tuple | None = None) -> None:
        """Copy whole pages (KV, routes, detail): a group member's own copy of a partly filled block;
        window: the (src, dst) pages of the window pool beside them."""
        for layer, (k_pages, v_pages) in enumerate(self.caches):
            s, d = window if window is not None and self.model.config.window(layer) else (src, dst)
            k_pages[d], v_pages[d] = k_pages[s], v_pages[s]
        self.route_pages[dst] = self.route_pages[src]
        if self.record_detail:
            self.weight_pages[dst], self.margin_pages[dst] = self.weight_pages[src], self.margin_pages[src]

    def _sample(self, logits, rows, positions, sp: SamplingParams):
        """Next tokens (B,) and their log-probs (B,) for logits (B, V) of `rows` at `positions`."""
        if sp.temperature == 0:
            tokens = torch.argmax(logits, dim=-1)                              # first maximum on ties
        else:
            u = draw_keys(self.seed, self.seq_id[rows], positions)
            tokens = kernels.sample_tokens(logits, sp.temperature, sp.top_p, sp.top_k, u, **sp.filters)
        return tokens, kernels.token_logprobs(logits, tokens, sp.temperature)

    def _record(self, rows, n_tok, tokens, logp) -> torch.Tensor:
        """Append the sampled tokens to their rows; -> (B,) bool: its turn ended (a stop token or max_len)."""
        real = rows != self.pad_row
        self.token_buf[rows, n_tok] = tokens
        self.logp_buf[rows, n_tok] = logp
        self.num_tokens[rows] = n_tok + real.long()
        stop = (tokens[:, None] == self.stop_ids[None, :]).any(-1)
        return real & (stop | (n_tok + 1 >= self.max_len[rows]))

    # ---- prefill ----
    def prefill(self, seqs: list[Sequence], ends: list[int], sp: SamplingParams) -> list[bool]:
        """One forward over each group leader's chunk, tokens [num_computed, end); the sequences whose
        chunk reaches their last token then sample their next one (members from their leader's logits)."""
        self.start(seqs)
        dev = self.device
        leaders = [(s, end) for s, end in zip(seqs, ends) if s.parent is None]
        h_last = self._prefill_forward(leaders)                                 # (G, D)
        index = {id(s): i for i, (s, end) in enumerate(leaders)}
        last = [s for s, end in zip(seqs, ends) if end == s.num_tokens]         # they sample
        if not last:
            return [False] * len(seqs)
        copies = [s for s in last if s.parent is not None and s.num_tokens % self.block_size]
        if copies:                      # members share the leader's full blocks; copy the partial one
            n = self.block_size
            pages = [(s.parent.block_table[s.num_tokens // n], s.block_table[-1]) for s in copies]
            window = [(s.parent.window_table[s.num_tokens // n], s.window_table[-1]) for s in copies] \
                if self.window_blocks else None
            self._copy_pages(*torch.tensor(pages, device=dev).unbind(1),
                             window and torch.tensor(window, device=dev).unbind(1))
        if self.states is not None:
            self._copy_states([s for s in last if s.parent is not None])
        rows = torch.tensor([s.row for s in last], device=dev)
        n_tok = torch.tensor([s.num_tokens for s in last], device=dev)
        logits = self.model.compute_logits(h_last[torch.tensor([index[id(s.parent or s)] for s in last], device=dev)])
        tokens, logp = self._sample(logits, rows, n_tok, sp)                    # logits (B, V)
        finished = dict(zip(map(id, last), self._record(rows, n_tok, tokens, logp).tolist()))
        return [finished.get(id(s), False) for s in seqs]

    def copy_states(self, pairs: list[tuple[int, int]], load: bool = False) -> None:
        """The prefix cache's boundary states (scheduler.RecurrentBlockManager): (row, slot) pairs saved, or
        with load (slot, row) pairs restored, in every recurrent layer's pool."""
        a, b = torch.tensor(pairs, device=self.device).unbind(1)
        for pool in self.states.values():
            (pool.load if load else pool.save)(a, b)

    def _copy_states(self, members: list[Sequence]) -> None:
        """Group members sample after their leader's prompt: their rows of the recurrent layers' pools become
        the leader's."""
        if members:
            src, dst = torch.tensor([[s.parent.row, s.row] for s in members], device=self.device).unbind(1)
            for pool in self.states.values():
                pool.copy_rows(src, dst)

    def _prefill_forward(self, leaders: list[tuple[Sequence, int]]) -> torch.Tensor:
        """The leaders' chunks right-padded to the longest (padding repeats a chunk's last position and
        writes to the scratch page) -> each chunk's last hidden state (G, D)."""
        dev = self.device
        rows = torch.tensor([s.row for s, end in leaders], device=dev)
        first = torch.tensor([s.num_computed for s, end in leaders], device=dev)           # (G,)
        n = torch.tensor([end - s.num_computed for s, end in leaders], device=dev)         # (G,) tokens to feed
        t = torch.arange(max(end - s.num_computed for s, end in leaders), device=dev)      # (T,)
        positions = first[:, None] + torch.minimum(t[None, :], n[:, None] - 1)            # (G, T)
        tokens = self.token_buf[rows[:, None], positions]
        h = self._forward(rows, tokens, positions, t[None, :] < n[:, None])
        return h[torch.arange(len(leaders), device=dev), n - 1]

    # ---- decode ----
    def decode(self, seqs: list[Sequence], rows_changed: bool, sp: SamplingParams) -> list[bool]:
        """One decode step of every running sequence -> whether each finished its turn."""
        return self._device_step(self._decode_step, seqs, rows_changed, sp).tolist()

    def verify(self, step: Step, sp: SamplingParams) -> list[bool]:
        """One verify step of every running sequence (speculative decoding) -> whether each finished its
        turn; fills in step.kept and step.drafted (the same read back as decode's flags)."""
        out = self._device_step(self._verify_step, step.batch, step.rows_changed, sp)     # (n, 3)
        finished, step.kept, step.drafted = out.T.tolist()
        return [f == 1 for f in finished]

    def _device_step(self, step_fn: Callable, seqs: list[Sequence], rows_changed: bool,
                     sp: SamplingParams) -> torch.Tensor:
        """step_fn(bucket rows, sp) -> (rows, ...) over every running sequence; graph replay where
        captured. rows_changed: the running set is not the previous decode step's (always so for a
        request's first decode step). -> the real rows' results."""
        n = len(seqs)
        bucket = self.bucket(n)
        if rows_changed:
            self.rows.fill_(self.pad_row)
            self.rows[:n] = torch.tensor([s.row for s in seqs], device=self.device)
        if not self.cuda_graphs or kernels.get_backend() == "torch":   # (the torch backend syncs the host)
            return step_fn(bucket, sp)[:n]
        key = (step_fn.__name__, bucket, sp.temperature, sp.top_p, sp.top_k, *sorted(sp.filters.items()))
        if key not in self.graphs:
            if key not in self.warm:                               # first use runs eagerly: compiles kernels
                self.warm.add(key)
                return step_fn(bucket, sp)[:n]
            self.graphs[key] = self._capture(step_fn, bucket, sp)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:n]

    def _decode_step(self, n: int, sp: SamplingParams) -> torch.Tensor:
        """Feed each row's last token at its position: a fixed set of tensor ops, no host sync."""
        rows = self.rows[:n]
        n_tok = self.num_tokens[rows]                                           # (n,)
        pos = (n_tok - 1)[:, None]                                              # (n, 1)
        tokens = self.token_buf[rows[:, None], pos]                             # (n, 1)
        h = self._forward(rows, tokens, pos, (rows != self.pad_row)[:, None])
        tokens, logp = self._sample(self.model.compute_logits(h[:, 0]), rows, n_tok, sp)
        return self._record(rows, n_tok, tokens, logp)

    def _verify_step(self, n: int, sp: SamplingParams) -> torch.Tensor:
        """Feed each row's last token and up to k n-gram drafts (k + 1 positions; past its drafts,
        padding that repeats its last one and writes to the scratch page), sample every position with
        its own draw, keep what the policy's accept keeps. -> (n, 3): finished, tokens kept, drafts.
        A fixed set of tensor ops like _decode_step (no host read), so graphs capture it the same way."""
        k, rows = self.speculative_tokens, self.rows[:n]
        real = rows != self.pad_row
        n_tok = self.num_tokens[rows]                                           # (n,)
        room = (self.max_len[rows] - n_tok - 1).clamp(min=0) * real             # drafts the turn has room for
        if self.grid:       # recurrent layers: no chunk completes on a draft (its state could not roll back)
            room = torch.minimum(room, (self.grid - 2 - (n_tok - 1) % self.grid).clamp(min=0))
        drafts, n_draft = self.drafts.propose(self.token_buf[rows], n_tok, room)
        t = torch.arange(k + 1, device=self.device)
        pos = (n_tok - 1)[:, None] + torch.minimum(t[None, :], n_draft[:, None])   # (n, k+1)
        tokens = torch.cat([self.token_buf[rows, n_tok - 1][:, None], drafts], 1)  # (n, k+1)
        h = self._forward(rows, tokens, pos, real[:, None] & (t[None, :] <= n_draft[:, None]), self.grid > 0)
        logits = self.model.compute_logits(h).flatten(0, 1)                    # (n*(k+1), V)
        sampled, logp = self._sample(logits, rows.repeat_interleave(k + 1), (pos + 1).flatten(), sp)
        sampled, logp = sampled.view(n, k + 1), logp.view(n, k + 1)
        kept, stopped = self.drafts.accept(drafts, n_draft, sampled, self.stop_ids)   # a padding row: 1, no draft
        # write positions n_tok .. n_tok + kept - 1; the columns past the kept ones repeat the last kept
        # one's value at its position (a duplicate index of equal values: one result on every device)
        j = torch.minimum(t[None, :], (kept - 1)[:, None])                     # (n, k+1)
        at = (rows[:, None], n_tok[:, None] + j)
        self.token_buf[at], self.logp_buf[at] = sampled.gather(1, j), logp.gather(1, j)
        self.num_tokens[rows] = n_tok + kept * real
        finished = real & (stopped | (n_tok + kept >= self.max_len[rows]))
        return torch.stack([finished.long(), kept, n_draft], 1)

    def _capture(self, step_fn: Callable, n: int, sp: SamplingParams):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step_fn(n, sp)
        self.pool = graph.pool()
        return graph, out

    # ---- results ----
    def read_tokens(self, row: int, start: int, end: int) -> list[int]:
        """A row's token ids at positions [start, end) (one copy to the host: a turn's ids)."""
        return self.token_buf[row, start:end].tolist()

    def collect(self, seqs: list[Sequence]) -> list[tuple[list[float], torch.Tensor, torch.Tensor | None,
                                                          torch.Tensor | None]]:
        """Finished sequences' recorded values, one gather each for all of them: per sequence the
        log-probs at positions [len(prompt), n) (the sampled ones; whatever the row held at an
        observation's), and the routes (route weights, margins with record_route_detail) of the fed
        positions [0, n - 1), found through its block table (read to the host once)."""
        if not seqs:
            return []
        bs, dev = self.block_size, self.device
        tables = self.block_tables[[s.row for s in seqs]].tolist()
        rows, positions, slots = [], [], []
        for s, table in zip(seqs, tables):
            n, P = s.num_tokens, len(s.prompt)
            rows += [s.row] * (n - P)
            positions += range(P, n)
            slots += [table[p // bs] * bs + p % bs for p in range(n - 1)]
        flat = self.logp_buf[torch.tensor(rows, device=dev), torch.tensor(positions, device=dev)].tolist()
        cuts = [s.num_tokens - 1 for s in seqs]
        slots = torch.tensor(slots, device=dev)
        values = [pages.flatten(0, 1)[slots] for pages in self.route_pools()]       # (sum of n - 1, ...) each
        at = 0
        for s, cut in zip(seqs, cuts):          # the positions fed before a recompute: the routes that drew there
            for v, kept in zip(values, s.kept or ()):
                v[at:at + len(kept)] = kept
            at += cut
        split = lambda v, dtype=None: [t.clone() for t in v.to("cpu", dtype).split(cuts)]
        routes = split(values[0], torch.long)
        weights, margins = (split(values[1]), split(values[2])) if self.record_detail else \
            ([None] * len(seqs), [None] * len(seqs))
        out, at = [], 0
        for s, r, w, m in zip(seqs, routes, weights, margins):
            k = s.num_tokens - len(s.prompt)
            out.append((flat[at:at + k], r, w, m))
            at += k
        return out

    def route_pools(self) -> list[torch.Tensor]:
        """The pages recorded per fed position: the routes, and with record_route_detail their weights and
        margins."""
        return [self.route_pages, self.weight_pages, self.margin_pages] if self.record_detail else [self.route_pages]

    def keep_routes(self, seq: Sequence, n: int) -> None:
        """Scheduler.keep: before seq's blocks are freed, copy the routes (and detail) of its fed positions
        [0, n) out of its pages into seq.kept (KeptRoutes), on the device. Positions an earlier keep
        holds stay as they are: recorded first, they are the ones that drew the next tokens."""
        have = 0 if seq.kept is None else len(seq.kept[0])
        if n <= have:
            return
        bs = self.block_size
        slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(have, n)], device=self.device)
        new = [pages.flatten(0, 1)[slots] for pages in self.route_pools()]          # (n - have, ...) each
        seq.kept = new if seq.kept is None else [torch.cat(pair) for pair in zip(seq.kept, new)]

    def weights_key(self) -> tuple:
        """Where the weights live: captured graphs read these addresses, so they must not move."""
        return tuple(p.data_ptr() for p in self.model.parameters())


@dataclass
class Request:
    """What the turn-end and step hooks need of one generate() call."""
    sp: SamplingParams
    on_turn_end: TurnEnd | None
    index_offset: int
    bar: tqdm
    on_step: Callable[[], int | None] | None = None
    recompute_kv: bool = False


class Sampler:
    def __init__(self, model: Transformer, config: RolloutConfig | None = None, *, reserve_bytes: int = 0,
                 **overrides):
        """A sampler over `model`'s own weights (no copy: the trainer's updates are seen at once).

        config: a config.RolloutConfig (default: its defaults; its fields are described there), which
            validates them; overrides: any of its fields by name, replacing the config's, e.g.
            `Sampler(model, max_batch_size=8)`. The sampler reads the engine's fields (block_size,
            num_blocks, max_batch_size, max_num_batched_tokens, prefix_cache, kv_memory_fraction,
            cuda_graphs, rollout_mode, router_bf16, record_route_detail, speculative_tokens,
            speculative_ngram); the sampling ones are generate()'s arguments.
        reserve_bytes: on CUDA, what will be allocated after the sampler (e.g. the optimizer's state),
            set aside when the pool is sized from the free memory (num_blocks=0, see _pool_blocks).

        The prefix cache is keyed by `weights_version`, which `weights_updated()` bumps; while
        `track_weights` is True, generate() bumps it too when an in-place write changed a parameter or
        buffer since the last request (torch's version counters: an optimizer step, a copy_ sync,
        load_state_dict; not a write through .data, nor memory written outside torch: call
        weights_updated() then). Counters of the last request: num_preemptions, num_cached_tokens,
        num_prefilled_tokens, prefix_hit_rate; num_drafted_tokens, num_accepted_tokens, spec_accept_rate
        (speculative decoding); all of them as a run logs them: `counters`.
        """
        if config is not None and not isinstance(config, RolloutOptions):
            raise TypeError(f"config must be a config.RolloutConfig, got {type(config).__name__}")
        fields = {} if config is None else vars(config)
        if config is None or not set(overrides) <= set(fields):     # the class of the plug-ins the options name
            config = configs_for([*fields, *overrides])[1](**fields)
        self.config = dataclasses.replace(config, **overrides)
        self.model = model
        self.ops = self.config.rollout_ops()            # the op set its steps run (kernels.op_set): invariant: {}
        self.max_model_len = model.config.max_position_embeddings
        drafts = self.config.draft_policy()
        self.draft_tokens = 0 if drafts is None else drafts.k        # a verify step's drafts (0: plain decoding)
        self.grid = self._linear_engine() if model.config.linear_layers else 0
        window = self._window_blocks() if model.config.sliding_window else 0     # the window pool's, wanted
        self.num_blocks = self.config.num_blocks or self._pool_blocks(reserve_bytes, window)
        self.window_blocks = min(self.num_blocks, window)
        self.runner = ModelRunner(model, self.config, self.num_blocks, self.window_blocks, drafts, self.grid)
        self.block_manager = self._block_manager()
        self.weights_key = self.runner.weights_key()
        self.weights_version = 0
        self.track_weights = True
        self._weights_seen = self._weights_counter()
        self.num_preemptions = self.num_cached_tokens = self.num_prefilled_tokens = 0
        self.num_drafted_tokens = self.num_accepted_tokens = 0

    def _linear_engine(self) -> int:
        """A model with linear-attention layers (hybrids/) -> their grid, the chunk their state moves on by (0: a
        layer decodes recurrently, the lab's fault, whose state moves at every token). Drafts on the grid never
        complete a chunk (ModelRunner._verify_step), so a rejected one is never in a state; a recurrent decode
        has no open chunk to keep one out, and no boundary for the prefix cache's states (off there, and
        with state_snapshots=0)."""
        grid = min(p.grid for p in self.model.state_pool(1, "meta").values())
        if self.draft_tokens and not grid:
            raise ValueError("speculative decoding (speculative_tokens > 0) with a recurrent decode of the linear-"
                             "attention layers (the lab's --rollout_linear_decode=recurrent): a rejected draft cannot "
                             "be rolled back out of their state; set speculative_tokens=0")
        if not grid or not self.config.state_snapshots:
            self.config = dataclasses.replace(self.config, prefix_cache=False)
        return grid

    def _block_manager(self) -> BlockManager:
        """A new one, every block free; the sliding-window layers' pool beside it, or the recurrent layers'
        boundary states kept by the prefix cache."""
        c, cls = self.config, BlockManager
        if self.window_blocks:
            cls = functools.partial(WindowBlockManager, window=self.model.config.sliding_window,
                                    window_blocks=self.window_blocks)
        elif self.grid and c.prefix_cache:
            cls = functools.partial(RecurrentBlockManager, grid=self.grid, slots=c.state_snapshots,
                                    copy=self.runner.copy_states)
        return cls(self.num_blocks, c.block_size, c.prefix_cache)

    def _pool_blocks(self, reserve_bytes: int, window_blocks: int) -> int:
        """The KV pool's size where the config leaves it (num_blocks=0): on CUDA, kv_memory_fraction of
        the free memory left after reserve_bytes; on the CPU, at most CPU_KV_BYTES; never more than
        max_batch_size full-context sequences need. A block's bytes: its K and V pages and its routes
        (and their weights and margins where recorded); the window pool's pages (sliding-window layers)
        are set aside first (window_blocks), and a block of the pool holds only the other layers' K and V."""
        cfg, bs = self.model.config, self.config.block_size
        p = next(self.model.parameters())
        n_moe, k = self.model.n_moe_layers, cfg.num_experts_per_tok
        layer_bytes = cfg.kv_numbers_per_token * p.element_size()              # K and V (MLA: the latent)
        paged = [i for i in range(cfg.num_hidden_layers) if not cfg.is_linear(i)]   # linear: a state per row
        windowed = sum(bool(cfg.window(i)) for i in paged) if window_blocks else 0
        per_slot = (len(paged) - windowed) * layer_bytes
        per_slot += n_moe * k * route_dtype(cfg.num_experts).itemsize
        per_slot += 4 * n_moe * (k + 1) if self.config.record_route_detail else 0
        block_bytes = bs * per_slot
        window_bytes = window_blocks * bs * windowed * layer_bytes
        wanted = self.config.max_batch_size * -(-self.max_model_len // bs)
        if p.device.type == "cuda":
            free = torch.cuda.mem_get_info(p.device)[0]
            aside = reserve_bytes + window_bytes + self._state_bytes()
            return kv_pool_blocks(free, self.config.kv_memory_fraction, aside, block_bytes, wanted)
        return kv_pool_blocks(CPU_KV_BYTES, 1.0, window_bytes, block_bytes, wanted)

    def _state_bytes(self) -> int:
        """The recurrent layers' pools (hybrids/) the runner allocates beside the KV pool: every row's, and the
        prefix cache's snapshots."""
        slots = self.config.state_snapshots if self.config.prefix_cache else 0
        pools = self.model.state_pool(self.config.max_batch_size + 1, "meta", slots) or {}
        return sum(t.numel() * t.element_size() for p in pools.values() for t in vars(p).values())

    def _window_blocks(self) -> int:
        """The window pool's blocks of a model with sliding-window layers, 0 for none (window_blocks=-1);
        the config's, or sized from the batch: each running sequence holds at most the blocks its window
        spans, the one it fills, its drafts' and a spare, and a prefill step adds its tokens' blocks; at
        least a full-context sequence's (one must fit alone, prefilled whole). Never above num_blocks."""
        c, window = self.config, self.model.config.sliding_window
        if c.window_blocks < 0:
            return 0
        if c.window_blocks:
            return c.window_blocks
        bs = c.block_size
        per_sequence = -(-(window - 1) // bs) + 2 + -(-self.draft_tokens // bs)
        batch = c.max_batch_size * per_sequence + -(-c.max_num_batched_tokens // bs)
        return max(batch, -(-self.max_model_len // bs))

    @property
    def caches(self):
        return self.runner.caches

    @property
    def spec_accept_rate(self) -> float:
        """The last request's share of drafted tokens that verify steps kept (0 when none was drafted)."""
        return self.num_accepted_tokens / self.num_drafted_tokens if self.num_drafted_tokens else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """The last request's share of prefilled positions the prefix cache served (0 when none)."""
        total = self.num_cached_tokens + self.num_prefilled_tokens
        return self.num_cached_tokens / total if total else 0.0

    @property
    def counters(self) -> dict:
        """The last request's counters, as a run logs them."""
        out = {"preemptions": self.num_preemptions, "prefix_hit_rate": self.prefix_hit_rate,
               "prefix_cached_tokens": self.num_cached_tokens, "prefilled_tokens": self.num_prefilled_tokens}
        if self.draft_tokens:                                          # a default run's keys stay as they were
            out.update(spec_drafted_tokens=self.num_drafted_tokens, spec_accepted_tokens=self.num_accepted_tokens,
                       spec_accept_rate=self.spec_accept_rate)
        return out

    def weights_updated(self) -> None:
        """The model's weights changed: no prefix-cache block computed before may serve a request after."""
        self.weights_version += 1

    def release_kv(self) -> None:
        """Free the KV pool (and the routes recorded beside it) until the next generate(), which allocates
        it again: between requests nothing lives in it but the prefix cache, which is emptied. The
        synchronous loop calls it after each rollout, so the update's activations take the pool's memory
        (support/hooks.Synchronous). A sampler not tracking its weights (track_weights False: its caller
        says when they change) keeps the pool and its cache, as asked."""
        if not self.track_weights:
            return
        self.runner.release_pages()
        self.block_manager = self._block_manager()

    def _weights_counter(self) -> int:
        """The sum of torch's version counters of the model's tensors: an in-place write raises it."""
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        return sum(t._version for t in tensors if not t.is_inference())

    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int] = 64, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, n: int = 1, stop_token_ids: tuple[int, ...] = (),
                 seed: int = 0, progress: bool = False, index_offset: int = 0,
                 on_turn_end: TurnEnd | None = None, max_episode_tokens: int | None = None, version: int = 0,
                 on_step: Callable[[], int | None] | None = None, recompute_kv: bool = False,
                 **filters) -> list[SequenceOutput]:
        """Sample n continuations of each prompt; returns len(prompts) * n outputs, prompt-major.

        max_new_tokens: an int, or one per prompt (single-turn requests: a partial rollout continues
            each sequence by its own remaining budget, its tokens so far in its prompt).
        temperature 0 is greedy (log-probs then use temperature 1). Identical prompts (repeated, or
        through n) are prefilled once and share their KV blocks. index_offset: the index of this
        request's first sequence in a larger one (a data-parallel rank passes its global offset, so its
        draws equal those of a single process sampling the whole request). progress=True draws a bar.
        filters: the draw's filters besides top_p and top_k, by name (kernels.SAMPLING_FILTERS).

        on_turn_end: makes each sequence an episode. When a turn ends (a stop token, or max_new_tokens,
            which then counts per turn) it is called with (the sequence's index in the returned list,
            the turn's ids, a stop token included) and returns the environment's ids to append to the
            live sequence (prefilled into its KV; then the next turn), or None to end the episode
            ("stop"). A wrong answer (not a list, not int ids of the vocabulary) is a ValueError.
        max_episode_tokens: the most ids an episode adds after its prompt, the policy's and the
            environment's together (None: the context). There, or at the context, the episode ends
            ("length"); an observation after which not one policy token fits is dropped.
        version: the policy version of the weights (the trainer's update count), recorded per token
            (SequenceOutput.token_versions, kv_versions).
        on_step: an in-flight weight update's hook, called after every engine step outside the
            rollout's kernel variant: it may change the model's weights in place and then returns their
            new version (else None). The sequences under way continue on their KV written by the old
            weights, or with recompute_kv every one of them is prefilled again by the new ones. Either
            way a position fed before the update keeps the routes recorded then, which drew its next
            token (beside that token's log-prob); the positions fed after record the new weights'.
        """
        per_prompt = isinstance(max_new_tokens, (list, tuple))                 # (else one int for all)
        budgets = self._budgets(max_new_tokens, prompts, on_turn_end) if per_prompt else None
        sp = SamplingParams(temperature, top_p, top_k, max_new_tokens if budgets is None else max(budgets, default=1),
                            tuple(stop_token_ids), seed, filters)
        self._check_request(n, index_offset, on_turn_end, max_episode_tokens, on_step)
        seqs = self._sequences(prompts, sp, n, index_offset, on_turn_end is not None, max_episode_tokens, budgets)
        if self.runner.weights_key() != self.weights_key:          # e.g. model.to(...) after building
            raise RuntimeError("the model's weights moved to new memory since this Sampler was built (e.g. "
                               "model.to() or load_state_dict(assign=True)); build a new Sampler")
        if self.track_weights and self._weights_counter() != self._weights_seen:
            self._weights_seen = self._weights_counter()
            self.weights_updated()
        self.runner.allocate_pages()                               # released after the last request, if it was
        self.block_manager.set_version((self.weights_version, kernels.get_backend()))
        bar = tqdm(total=sum(s.limit - s.num_tokens for s in seqs), desc="generate", disable=not progress, leave=False)
        cfg, req = self.config, Request(sp, on_turn_end, index_offset, bar, on_step, recompute_kv)
        sched = Scheduler(self.block_manager, cfg.max_batch_size, cfg.max_num_batched_tokens,
                          end_turn=functools.partial(self._end_turn, req), speculative_tokens=self.draft_tokens,
                          keep=self.runner.keep_routes)
        sched.version = version
        for s in seqs:
            s.version_marks.append((s.num_tokens, version))
        groups: dict[tuple, list[Sequence]] = {}
        for s in seqs:
            groups.setdefault(tuple(s.prompt), []).append(s)
        for g in groups.values():
            sched.add(g)
        self.runner.reserve(max(s.limit for s in seqs), sp)
        self._start = time.perf_counter()       # finish_time's origin: read when a step's finished flags come back
        try:
            with kernels.op_set(self.ops):
                self._run(sched, req)
        except BaseException:
            self.block_manager = self._block_manager()   # a request cut short (the callback raised, ^C) holds no block
            raise
        finally:
            bar.close()
        self.num_preemptions, self.num_cached_tokens = sched.num_preemptions, sched.num_cached_tokens
        self.num_prefilled_tokens = sched.num_prefilled_tokens
        self.num_drafted_tokens, self.num_accepted_tokens = sched.num_drafted_tokens, sched.num_accepted_tokens
        return [s.output for s in seqs]

    def _check_request(self, n, index_offset, on_turn_end, max_episode_tokens, on_step) -> None:
        """generate's arguments beyond the prompts and the sampling parameters: one line for a wrong one."""
        if not kernels.is_int(n) or n < 1:
            raise ValueError(f"n={n!r}: need an integer >= 1 (samples per prompt)")
        if not kernels.is_int(index_offset) or index_offset < 0:
            raise ValueError(f"index_offset={index_offset!r}: need an integer >= 0")
        if on_turn_end is not None and not callable(on_turn_end):
            raise TypeError(f"on_turn_end must be a function (index, turn ids) -> ids or None, "
                            f"got {type(on_turn_end).__name__}")
        if max_episode_tokens is not None and (not kernels.is_int(max_episode_tokens) or max_episode_tokens < 1):
            raise ValueError(f"max_episode_tokens={max_episode_tokens!r}: need an integer >= 1, or None")
        if on_step is not None and self.draft_tokens:
            raise ValueError(f"on_step (an in-flight weight update) with speculative_tokens="
                             f"{self.draft_tokens}: the update lands after a number of engine steps "
                             f"and a verify step samples several tokens, so which version samples a token would "
                             f"change; use speculative_tokens=0")

    def _sequences(self, prompts, sp: SamplingParams, n: int, index_offset: int, episodes: bool,
                   max_episode_tokens: int | None, budgets: list[int] | None) -> list[Sequence]:
        """The request's sequences, n per prompt: each turn ends at max_new_tokens (the prompt's own, with
        budgets), the whole at its limit."""
        new = (lambda i: sp.max_new_tokens) if budgets is None else (lambda i: budgets[i])

        def limit(i: int, P: int) -> int:
            end = min(P + max_episode_tokens, self.max_model_len) if max_episode_tokens else self.max_model_len
            return end if episodes else min(end, P + new(i))
        return [Sequence(index_offset + i * n + j, prompt, min(len(prompt) + new(i), limit(i, len(prompt))),
                         num_tokens=len(prompt), limit=limit(i, len(prompt)), max_new_tokens=new(i))
                for i, prompt in enumerate(self._check_prompts(prompts, sp, limit)) for j in range(n)]

    @staticmethod
    def _budgets(max_new_tokens, prompts, on_turn_end) -> list[int]:
        """max_new_tokens given per prompt, checked where it enters -> the list."""
        if on_turn_end is not None:
            raise ValueError("max_new_tokens per prompt is for single-turn requests: give one int with on_turn_end")
        if isinstance(prompts, (list, tuple)) and len(prompts) != len(max_new_tokens):   # (else _check_prompts says)
            raise ValueError(f"max_new_tokens has {len(max_new_tokens)} budgets for {len(prompts)} prompts: give one "
                             "per prompt")
        for i, b in enumerate(max_new_tokens):
            if not kernels.is_int(b) or b < 1:
                raise ValueError(f"max_new_tokens[{i}]={b!r}: need an integer >= 1")
        return [int(b) for b in max_new_tokens]

    def _run(self, sched: Scheduler, req: Request) -> None:
        """The engine loop: schedule, run the step on the device, end turns, retire what finished."""
        runner, ep, sp, bar = self.runner, expert_group(self.model), req.sp, req.bar
        while True:
            done = sched.is_finished()
            step = None if done else sched.schedule()
            if ep is None:
                if done:
                    break
                finished = runner.run(step, sp)
            else:                                # EP (parallel/): the group steps together and ends together
                all_done, finished = ep.sampler_step(self.model, runner, step, sp)
                if all_done:
                    break
                if step is None:                 # nothing left here: the group's exchanges ran, zero rows
                    continue
            bar.update(sum(step.kept) if step.kept else len(step.batch))
            done = sched.postprocess(step, finished)
            for s, record in zip(done, runner.collect(done)):     # before the next step reuses their rows
                s.output = self._output(s, record)
                bar.update(s.limit - s.num_tokens)                  # credit the tokens it will not generate
            if req.on_step is not None:
                self._step_hook(sched, req)

    def _step_hook(self, sched: Scheduler, req: Request) -> None:
        """Between two steps: the in-flight update's hook, under the invariant ops whatever the rollout's (the
        trainer computes invariantly); new weights are a new version for the prefix cache and the
        sequences under way (Scheduler.new_version)."""
        with kernels.op_set(kernels.INVARIANT_OPS if self.ops else {}):
            version = req.on_step()
        if version is None:
            return
        self.weights_updated()
        self._weights_seen = self._weights_counter()
        self.block_manager.set_version((self.weights_version, kernels.get_backend()))
        sched.new_version(version, req.recompute_kv)

    # ---- turns: the host side of an episode ----
    def _end_turn(self, req: Request, seq: Sequence) -> list[int] | None:
        """Scheduler.end_turn: the turn's ids come to the host. Without a session, at the episode's
        budget, or when the environment says so, the sequence finishes (its output is collected after
        the step, from its row and pages, which nothing writes before the next step) -> None; else ->
        the observation's ids."""
        start, end = seq.turns[-1]
        turn = self.runner.read_tokens(seq.row, start, end)
        seq.token_ids += turn
        seq.num_written = len(seq.token_ids)
        stopped = turn[-1] in req.sp.stop_token_ids
        if req.on_turn_end is None or (seq.num_tokens >= seq.limit and not stopped):
            return self._finish(seq, "stop" if stopped else "length")
        index = seq.seq_id - req.index_offset
        ids = req.on_turn_end(index, turn)
        if ids is None:
            return self._finish(seq, "stop")
        ids = self._check_observation(ids, index)
        if seq.num_tokens + len(ids) >= seq.limit:                  # no room for one more policy token
            return self._finish(seq, "length")
        req.bar.update(len(ids))
        return ids

    def _finish(self, seq: Sequence, reason: str) -> None:
        """The sequence is finished (-> None, end_turn's word for it); _run collects its output."""
        seq.finish_reason = reason

    def _output(self, seq: Sequence, record: tuple) -> SequenceOutput:
        """A finished sequence's SequenceOutput: the runner's records, the policy's turns as a mask."""
        logprobs, routes, weights, margins = record
        P = len(seq.prompt)
        mask = [0] * (seq.num_tokens - P)
        for start, end in seq.turns:
            mask[start - P:end - P] = [1] * (end - start)
        logprobs = [lp if m else OBSERVATION_LOGPROB for lp, m in zip(logprobs, mask)]
        positions = range(P, seq.num_tokens)
        return SequenceOutput(list(seq.prompt), seq.token_ids[P:], logprobs, routes, seq.finish_reason, weights,
                              margins, policy_mask=mask, turns=[(a - P, b - P) for a, b in seq.turns],
                              weights_version=self.weights_version, finish_time=time.perf_counter() - self._start,
                              token_versions=marked_range(seq.version_marks, positions),
                              kv_versions=marked_range(seq.kv_marks, positions))

    def _check_observation(self, ids, index: int) -> list[int]:
        """What on_turn_end returned, checked where it enters: a list of token ids of the vocabulary."""
        where = f"on_turn_end for sequence {index}"
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"{where} returned a {type(ids).__name__}: need a list of token ids, or None "
                             f"to end the episode")
        vocab = self.model.config.vocab_size
        for j, t in enumerate(ids):
            if not kernels.is_int(t):
                raise ValueError(f"{where}: item {j} of the observation is {t!r}, not an integer token id")
            if not 0 <= t < vocab:
                raise ValueError(f"{where}: item {j} of the observation, id {t}, is outside [0, vocab_size={vocab})")
        return [int(t) for t in ids]

    def _check_prompts(self, prompts, sp: SamplingParams, limit: Callable[[int, int], int]) -> list[list[int]]:
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
            if not isinstance(prompt, (list, tuple)) or not all(kernels.is_int(t) for t in prompt):
                raise ValueError(f"prompt {i} must be a list of integer token ids")
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"prompt {i} is empty: give at least one token (e.g. a BOS token)")
            if len(prompt) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens but the context is {self.max_model_len} "
                                 f"(max_position_embeddings) with room for at least one new token; shorten it")
            if not all(0 <= t < vocab for t in prompt):
                raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={vocab})")
            max_len = limit(i, len(prompt))
            if -(-max_len // self.config.block_size) > self.num_blocks:
                raise ValueError(f"prompt {i} may grow to {max_len} tokens = {-(-max_len // self.config.block_size)} "
                                 f"blocks, but the pool has {self.num_blocks}; raise num_blocks")
            if self.window_blocks and -(-max_len // self.config.block_size) > self.window_blocks:
                raise ValueError(f"prompt {i} may grow to {max_len} tokens = {-(-max_len // self.config.block_size)} "
                                 f"blocks, but the window pool has {self.window_blocks}; raise window_blocks")
            out.append(prompt)
        return out


def marked(marks: list[tuple[int, int]], position: int) -> int:
    """The version of the last mark (first position, version) at or before `position`."""
    return next(v for p, v in reversed(marks) if p <= position)


def marked_range(marks: list[tuple[int, int]], positions: range) -> list[int]:
    """marked at each of the positions; one mark (no update during the sequence, the common case): its
    version everywhere."""
    if len(marks) == 1:
        return [marks[0][1]] * len(positions)
    return [marked(marks, p) for p in positions]


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
