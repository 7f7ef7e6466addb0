"""The rollout sampler: paged KV cache, continuous batching, preemption, and exact recording.

    from rollout import Sampler
    sampler = Sampler(model)                                   # pool sizes from the device; see __init__
    outs = sampler.generate(prompts, max_new_tokens=64, temperature=1.0, n=8, seed=0)
    outs[i].tokens, outs[i].logprobs, outs[i].routes           # see SequenceOutput

Vocabulary from vLLM / nano-vllm: a `Sequence` owns a `block_table` of KV blocks (pages) of
`block_size` positions; the `BlockManager` hands out blocks from a free list with reference counts so a
GRPO group shares its prompt's full blocks; the `Scheduler` runs batched prefill of waiting
sequences, then batched decode of running ones, and preempts (frees, later recomputes) the newest
sequence when blocks run out. `slot_mapping` tells the forward where each new token's K/V goes.

The contract: every step calls the same `Transformer.hidden_states` and kernels as `model.score`,
so `outs[i].logprobs` are bitwise equal to `model.score(prompt + tokens)` at the generated positions and
`outs[i].routes` to score's routes, whatever the batch, the block layout, sharing or preemption. The
random draw of a token depends only on (seed, the sequence's index in the request, its position).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

import kernels
from model import PagedKV, Transformer


@dataclass
class SequenceOutput:
    prompt: list[int]
    tokens: list[int]            # generated ids
    logprobs: torch.Tensor       # (n_generated,) fp32: log softmax(logits / temperature)[token]
    routes: torch.Tensor         # (len(prompt) + n_generated - 1, n_moe_layers, top_k) int64
    finish_reason: str           # "stop" (a stop token), "length" (max_new_tokens or the context)


@dataclass
class Sequence:
    seq_id: int                  # index in the request: the sampling seed depends on it
    token_ids: list[int]         # prompt + generated
    num_prompt_tokens: int
    max_len: int                 # stop when len(token_ids) reaches this
    block_table: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)   # per recorded position (n_moe, k)
    finish_reason: str | None = None

    def __len__(self):
        return len(self.token_ids)


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
    """Waiting groups (same prompt, same pending work) and running sequences; picks each step's batch."""

    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[list[Sequence]] = deque()   # each entry: sequences with identical token_ids
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def schedule_prefill(self) -> list[list[Sequence]]:
        """Admit waiting groups while batch slots, blocks and the token budget allow.

        A group is prefilled once; its members beyond the first share the prompt's full blocks. A
        group larger than the free batch slots is split: the rest stays waiting (and recomputes).
        """
        batch, tokens, reserved = [], 0, 0
        while self.waiting:
            group = self.waiting[0]
            slots = self.max_batch_size - len(self.running) - sum(len(g) for g in batch)
            L = len(group[0])
            if slots <= 0 or (batch and tokens + L > self.max_num_batched_tokens):
                break
            # blocks: the leader's, plus one copied partial block per extra member; keep one free block
            # per running sequence so the next decode step does not have to preempt at once
            free = self.bm.num_free - reserved - (self.max_batch_size - slots)
            base = self.bm.blocks_needed(group[0], L)
            partial = 1 if L % self.bm.block_size else 0
            fits = len(group) if not partial else 1 + (free - base) // partial
            take = group[:min(slots, fits)]
            if base > free or not take:
                break
            if len(take) == len(group):
                self.waiting.popleft()
            else:
                self.waiting[0] = group[len(take):]
            batch.append(take)
            tokens += L
            reserved += base + partial * (len(take) - 1)
        return batch

    def schedule_decode(self) -> list[Sequence]:
        """Make room for one more position in every running sequence, preempting the newest if needed."""
        while True:
            need = sum(self.bm.blocks_needed(s, len(s)) for s in self.running)
            if need <= self.bm.num_free:
                break
            self.preempt(self.running.pop())
        for s in self.running:
            self.bm.allocate(s, len(s))
        return list(self.running)

    def preempt(self, seq: Sequence) -> None:
        """Free a sequence's blocks and queue it first for recompute (prefill of all its tokens)."""
        self.bm.free(seq)
        self.waiting.appendleft([seq])
        self.num_preemptions += 1


class Sampler:
    def __init__(self, model: Transformer, block_size: int = 16, num_blocks: int | None = None,
                 max_batch_size: int = 256, max_num_batched_tokens: int = 4096,
                 kv_memory_fraction: float = 0.5, cpu_kv_bytes: int = 1 << 30, mode: str = "invariant",
                 router_bf16: bool = False, reserve_bytes: int = 0):
        """A sampler over `model`'s own weights (no copy: the trainer's updates are seen at once).

        block_size: KV positions per block (page); a multiple of kernels.KV_BLOCK.
        num_blocks: the pool size. Default: on CUDA, kv_memory_fraction of the free memory left after
            reserve_bytes (what will be allocated later, e.g. the optimizer's state); on CPU, enough
            for max_batch_size full-context sequences, capped at cpu_kv_bytes.
        max_batch_size: running sequences at most; max_num_batched_tokens: tokens per prefill step.
        mode: "invariant" (the contract) or "fast" (batch-variant ops, see kernels.variant: the mismatch
            lab); router_bf16: round router logits to bf16 here, on the rollout side only.
        """
        if mode not in ("invariant", "fast"):
            raise ValueError(f"mode={mode!r}: choose invariant or fast")
        self.variant = dict(batch_variant=mode == "fast", router_bf16=router_bf16)
        if max_batch_size < 1 or max_num_batched_tokens < 1 or (num_blocks is not None and num_blocks < 1):
            raise ValueError("max_batch_size, max_num_batched_tokens and num_blocks must be >= 1")
        if block_size % kernels.KV_BLOCK:
            raise ValueError(f"block_size={block_size} must be a multiple of kernels.KV_BLOCK={kernels.KV_BLOCK}")
        self.model, cfg = model, model.config
        self.block_size, self.max_batch_size = block_size, max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = cfg.max_position_embeddings
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        kv_shape = (block_size, cfg.num_key_value_heads, cfg.head_dim)
        block_bytes = 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * p.element_size()
        if num_blocks is None:
            wanted = max_batch_size * -(-self.max_model_len // block_size)
            if self.device.type == "cuda":
                free = torch.cuda.mem_get_info(self.device)[0]
                num_blocks = kv_pool_blocks(free, kv_memory_fraction, reserve_bytes, block_bytes, wanted)
            else:
                num_blocks = kv_pool_blocks(cpu_kv_bytes, 1.0, 0, block_bytes, wanted)
        self.num_blocks = num_blocks
        self.caches = [(torch.zeros(num_blocks, *kv_shape, dtype=self.dtype, device=self.device),
                        torch.zeros(num_blocks, *kv_shape, dtype=self.dtype, device=self.device))
                       for _ in range(cfg.num_hidden_layers)]

    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, n: int = 1, stop_token_ids: tuple[int, ...] = (),
                 seed: int = 0, progress: bool = True, index_offset: int = 0) -> list[SequenceOutput]:
        """Sample n continuations of each prompt; returns len(prompts) * n outputs, prompt-major.

        temperature 0 is greedy (log-probs then use temperature 1). Identical prompts (repeated, or
        through n) are prefilled once and share their KV blocks. index_offset: the index of this
        request's first sequence in a larger one (a data-parallel rank passes its global offset, so its
        draws equal those of a single process sampling the whole request).
        """
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or max_new_tokens < 1 or n < 1:
            raise ValueError("need temperature >= 0, 0 < top_p <= 1, top_k >= 0, max_new_tokens >= 1, n >= 1")
        seqs: list[Sequence] = []
        for i, prompt in enumerate(prompts):
            if not all(isinstance(t, int) or (torch.is_tensor(t) and not t.is_floating_point()) for t in prompt):
                raise ValueError(f"prompt {i} must be a list of integer token ids")
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"prompt {i} is empty: give at least one token (e.g. a BOS token)")
            if len(prompt) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens but the context is {self.max_model_len} "
                                 f"(max_position_embeddings) with room for at least one new token; shorten it")
            if not all(0 <= t < self.model.config.vocab_size for t in prompt):
                raise ValueError(f"prompt {i} has token ids outside [0, vocab_size={self.model.config.vocab_size})")
            max_len = min(len(prompt) + max_new_tokens, self.max_model_len)
            if -(-max_len // self.block_size) > self.num_blocks:
                raise ValueError(f"prompt {i} may grow to {max_len} tokens = {-(-max_len // self.block_size)} "
                                 f"blocks, but the pool has {self.num_blocks}; raise num_blocks")
            for _ in range(n):
                seqs.append(Sequence(index_offset + len(seqs), list(prompt), len(prompt), max_len))
        sp = dict(temperature=temperature, top_p=top_p, top_k=top_k, stop=set(stop_token_ids), seed=seed)

        bm = BlockManager(self.num_blocks, self.block_size)
        sched = Scheduler(bm, self.max_batch_size, self.max_num_batched_tokens)
        groups: dict[tuple, list[Sequence]] = {}
        for s in seqs:
            groups.setdefault(tuple(s.token_ids), []).append(s)
        sched.waiting.extend(groups.values())

        bar = tqdm(total=sum(s.max_len - s.num_prompt_tokens for s in seqs), desc="generate",
                   disable=not progress, leave=False)
        with kernels.variant(**self.variant):
            self._run(sched, bm, sp, bar)
        bar.close()
        self.num_preemptions = sched.num_preemptions
        return [SequenceOutput(s.token_ids[:s.num_prompt_tokens], s.token_ids[s.num_prompt_tokens:],
                               torch.tensor(s.logprobs, dtype=torch.float32),
                               torch.stack(s.routes), s.finish_reason) for s in seqs]

    def _run(self, sched: Scheduler, bm: BlockManager, sp: dict, bar) -> None:
        """The engine loop: prefill what can be admitted, else decode every running sequence."""
        while sched.waiting or sched.running:
            prefill = sched.schedule_prefill()
            if prefill:
                self._prefill(prefill, bm, sp)
                for g in prefill:
                    sched.running.extend(g)
                bar.update(sum(len(g) for g in prefill))
            else:
                decode = sched.schedule_decode()
                self._decode(decode, sp)
                bar.update(len(decode))
            for s in [s for s in sched.running if s.finish_reason]:
                sched.running.remove(s)
                bm.free(s)
                bar.update(s.max_len - len(s))    # credit the tokens it will not generate

    # ------------------------------------------------------------------------------------------------
    def _prefill(self, groups: list[list[Sequence]], bm: BlockManager, sp: dict) -> None:
        """One forward over the first sequence of each group; the others fork from it."""
        leaders = [g[0] for g in groups]
        for s in leaders:
            bm.allocate(s, len(s))
        T = max(len(s) for s in leaders)
        tokens = torch.zeros(len(leaders), T, dtype=torch.long)
        slot_mapping = torch.full((len(leaders), T), -1, dtype=torch.long)
        for b, s in enumerate(leaders):
            L = len(s)
            tokens[b, :L] = torch.tensor(s.token_ids)
            pos = torch.arange(L)
            slot_mapping[b, :L] = torch.tensor(s.block_table)[pos // self.block_size] * self.block_size + pos % self.block_size
        positions = torch.arange(T).expand(len(leaders), T)
        last = torch.tensor([len(s) - 1 for s in leaders])
        logits, routes = self._forward(tokens, positions, slot_mapping, leaders, last)
        for b, group in enumerate(groups):
            leader = group[0]
            for child in group[1:]:
                copy = bm.fork(leader, child, len(leader))
                if copy is not None:
                    for k_pages, v_pages in self.caches:
                        k_pages[copy[1]] = k_pages[copy[0]]
                        v_pages[copy[1]] = v_pages[copy[0]]
            for s in group:
                self._record_routes(s, routes[b, :len(s)])
        self._append_tokens([s for g in groups for s in g], [b for b, g in enumerate(groups) for _ in g], logits, sp)

    def _decode(self, seqs: list[Sequence], sp: dict) -> None:
        """Feed each sequence's last token at its position; the blocks were allocated by the scheduler."""
        tokens = torch.tensor([[s.token_ids[-1]] for s in seqs])
        positions = torch.tensor([[len(s) - 1] for s in seqs])
        slot_mapping = torch.tensor([[s.block_table[(len(s) - 1) // self.block_size] * self.block_size
                                      + (len(s) - 1) % self.block_size] for s in seqs])
        logits, routes = self._forward(tokens, positions, slot_mapping, seqs, torch.zeros(len(seqs), dtype=torch.long))
        for b, s in enumerate(seqs):
            self._record_routes(s, routes[b, :1], first_pos=len(s) - 1)
        self._append_tokens(seqs, list(range(len(seqs))), logits, sp)

    def _forward(self, tokens, positions, slot_mapping, seqs, last):
        """Run the model over a padded batch: logits (B, V) at index `last` of each row, on the device,
        and routes (B, T, n_moe, k) on the CPU."""
        width = max(len(s.block_table) for s in seqs)
        block_table = torch.zeros(len(seqs), width, dtype=torch.long)
        for b, s in enumerate(seqs):
            block_table[b, :len(s.block_table)] = torch.tensor(s.block_table)
        dev = self.device
        kv = PagedKV(self.caches, block_table.to(dev), slot_mapping.to(dev), positions.to(dev))
        h, routes = self.model.hidden_states(tokens.to(dev), kv=kv)          # (B, T, D), (B, T, n_moe, k)
        h_last = h[torch.arange(len(seqs), device=dev), last.to(dev)]       # (B, D)
        logits = kernels.linear(h_last, self.model.lm_weight())              # (B, V)
        return logits, routes.cpu()

    @staticmethod
    def _record_routes(seq: Sequence, routes: torch.Tensor, first_pos: int = 0) -> None:
        """Keep the routes of positions not yet recorded (a recompute after preemption repeats some)."""
        for j in range(len(seq.routes) - first_pos, routes.shape[0]):
            seq.routes.append(routes[j].clone())

    def _append_tokens(self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor, sp: dict) -> None:
        """Sample the next token of seqs[i] from logits[rows[i]] and record its log-prob.

        Sampling and log-probs stay on the logits' device (only the chosen ids and their log-probs
        come back); the log-probs come from kernels.token_logprobs, the op score() uses.
        """
        temperature = sp["temperature"]
        chosen = logits[torch.tensor(rows, device=logits.device)]           # (n, V)
        if temperature == 0:
            tokens = torch.argmax(chosen, dim=-1)                           # first maximum on ties
        else:
            seeds = [draw_seed(sp["seed"], seq.seq_id, len(seq)) for seq in seqs]
            tokens = sample_tokens(chosen, temperature, sp["top_p"], sp["top_k"], seeds)
        logprobs = kernels.token_logprobs(chosen, tokens, temperature)
        for seq, token, lp in zip(seqs, tokens.tolist(), logprobs.cpu().tolist()):
            seq.logprobs.append(lp)
            seq.token_ids.append(token)
            if token in sp["stop"]:
                seq.finish_reason = "stop"
            elif len(seq) >= seq.max_len:
                seq.finish_reason = "length"


def kv_pool_blocks(free_bytes: int, fraction: float, reserve_bytes: int, block_bytes: int, wanted: int) -> int:
    """KV blocks to allocate: `fraction` of the memory left once `reserve_bytes` are set aside, at most
    `wanted` (full-context sequences for the whole batch), at least 1 (the scheduler then preempts)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"kv_memory_fraction={fraction} must be in (0, 1]")
    budget = int(max(0, free_bytes - reserve_bytes) * fraction)
    return max(1, min(wanted, budget // block_bytes))


def draw_seed(seed: int, seq_id: int, position: int) -> int:
    """A seed for one draw, a function of (request seed, sequence index, position) only."""
    x = (seed * 0x9E3779B97F4A7C15 + seq_id * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) % (1 << 64)
    x ^= x >> 31
    return x % (1 << 63)


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                  seeds: list[int]) -> torch.Tensor:
    """Draw one token per row from softmax(logits / temperature), restricted by top-k and top-p.

    logits (B, V) on any device, seeds[b] the seed of row b; returns (B,) int64 on that device.
    Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i. Each row's
    noise comes from its own generator seeded with seeds[b], and every other op works along the row
    (softmax, sort, cumsum, division), so a row's draw depends on its logits and its seed alone, not
    on the other rows. Everything stays on the device: one generator launch per row, no host copy.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)            # (B, V)
    if top_k > 0 or top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
        keep = torch.ones_like(sorted_p, dtype=torch.bool)
        if top_k > 0:
            keep[:, top_k:] = False
        if top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (the top token is always kept)
            # CUDA's cumsum takes another algorithm (another summation order) for a single row: scan
            # at least two rows so that a row's cutoff does not depend on how many rows there are
            B = sorted_p.shape[0]
            cum = torch.cumsum(sorted_p if B > 1 else sorted_p.repeat(2, 1), dim=-1)[:B]
            keep &= (cum - sorted_p) < top_p
        probs = torch.zeros_like(probs).scatter(-1, idx, torch.where(keep, sorted_p, 0.0))
    noise = torch.empty_like(probs)
    for b, seed in enumerate(seeds):
        noise[b].exponential_(generator=torch.Generator(device=probs.device).manual_seed(seed))
    return torch.argmax(probs / noise, dim=-1)


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, seed: int) -> int:
    """sample_tokens for one row: logits (V,) -> the drawn id."""
    return int(sample_tokens(logits[None], temperature, top_p, top_k, [seed])[0])
