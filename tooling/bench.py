"""Benchmarks, each measured side by side in one run so the ratios mean something on a noisy machine.

    python -m tooling.bench                        # the speed sections, CPU, about 1-3 minutes on 2 cores
    python -m tooling.bench --only rollout,moe     # a comma-separated list of sections
    python -m tooling.bench --only gpu             # on a GPU: the rollout engine at Qwen3-30B-A3B layer shapes
    python -m tooling.bench --only lab             # the mismatch lab: 52 training runs a seed (150 steps; two drift
                                                   # rows 450), ~2.3 hours a seed on a core
    python -m tooling.bench --only lab --lab-seeds=0,1,2   # ... each over three seeds (mean and sd of the reward)
    python -m tooling.bench --prompts 64 --max-new-tokens 96 --repeats 5 --threads 0   # 0: torch's thread default
    python -m tooling.bench --help

What is measured (the tiny preset model, `ModelConfig.preset('tiny')`, random weights, fp32, CPU):
* rollout: the same prompts (random token ids of mixed lengths) decoded three ways; tokens/s counts
  generated tokens only, wall clock around the whole call, median over --repeats after a warm-up:
    ours       rollout.Sampler.generate (paged KV cache, continuous batching, batch-invariant kernels)
    hf         transformers Qwen3MoeForCausalLM.generate on the same weights (saved with
               model.save_pretrained, loaded by transformers), batched with left padding, do_sample=False,
               its default attention/experts implementations
    no-cache   model(tokens) over the whole right-padded, growing batch at every step, greedy
  The three run interleaved within each repeat, so load from other processes hits them alike.
  With --temperature 0 (default) ours and no-cache are both greedy over the same kernels, and the
  script checks that they produced the same tokens.
* forward: model.score on a (batch, seq) = (64, 64) batch of random tokens: tokens/s.
* fast: rollout tokens/s and trainer forward+backward tokens/s with the invariant kernels vs the
  batch-variant ones of lab/fast_ops.py (what the contract costs).
* packing: trainer forward+backward over 32 responses of a long-tailed length mix (lognormal
  quantiles, the longest 10x the median, up to the model's max_position_embeddings): padded micro-batches
  of --pack-micro-batch sequences (slices of one (B, T_max) tensor) vs packed micro-batches of at most
  --micro-batch-tokens tokens (packing.pack); tokens/s of real tokens, and the share of computed
  positions that are padding.
* moe: the invariant MoE layer (sort by expert, fixed tiles) vs a per-expert index_add_ loop.
* ep: the MoE layer under expert parallelism against EP=1 over the same tokens: --ep-procs processes
  (torchrun; gloo on the CPU, NCCL on GPUs), each with --moe-tokens / N of the tokens; EP=1 = every
  rank holds all experts and runs its own tokens, EP=N = each holds E/N and the rows travel
  (all_to_all_single, counts first). Forward and forward+backward, tokens/s per rank, interleaved;
  the worker checks that both give the same bits.
* reduce (`--only reduce`): the gradient sum, --grad_reduce=exact (fixed-point int64 limbs, support/exact_sum.py)
  against fast (fp32 accumulation and all-reduce): (1) the main job's step time and update time under
  --reduce-procs gloo processes (torchrun, DDP), the two modes alternating in one job, at the default
  micro-batch budget and at --reduce-budget tokens; (2) the error of each against the fp64 sum of the
  same micro-batch gradients (the main job's first minibatch at its initial weights, and at a held-out
  checkpoint: 20 steps of --task=reverse --seed=1), fast as 1, 2 and 4 ranks would add them; (3) the
  bytes the sum moves per optimizer step, for the main job and for Qwen3-30B-A3B (tooling/plan.py's shapes).
* decode: one decode step at 16 and at 256 sequences: the torch ops the host dispatches (the same
  count: host work does not grow with the batch) and its time under the profiler.
* sessions (`--only sessions`): --prompts episodes of --turns turns of --turn-tokens tokens, --obs-tokens
  environment ids between two turns, three ways, interleaved; policy tokens/s:
    sessions                    one generate(on_turn_end=...): each observation prefilled into the live KV
    re-prefill                  one generate per turn over each episode's whole history, no prefix cache
    re-prefill + prefix cache   the same, the history's full blocks served by the prefix cache
  then the sessions again, every prompt opened by the same --shared-prefix ids (an agent's system prompt), one
  generate call with the prefix cache and one without (the first episode computes the shared blocks, the
  others take them as hits);
  then long prompts (half the context and up) prefilled whole vs in chunks of --chunk-tokens, prompt +
  new tokens/s. Before each timed call the sampler's weights version is bumped (a new policy: nothing
  cached from the previous repeat). Each comparison checks the contract: the same ids, log-probs and
  routes (a row says DIFFER otherwise).
* gpu (CUDA only; --cpu-smoke runs its code on the CPU): a 4-layer model of Qwen3-30B-A3B's layer
  shapes, bf16, made on the GPU; rollout tok/s at 256, 64, 1024 sequences x 128 new tokens, invariant
  (eager and CUDA graphs) and fast; each decode step's share of the bandwidth limit (every weight and
  the KV cache read once, against a measured device copy); the contract on the generated sequences;
  after the first size, the top kernels of one eager decode step there (torch.profiler, device time),
  invariant and fast, and transformers generate (greedy, same weights) against ours greedy. Rows print
  as they are measured (a GPU run has a hard time limit); --tuning FILE takes the tile configs of
  tools/gpu_check.py's sweep.
* speculative (`--only speculative`): --spec-prompts copy-task prompts of --spec-digits digits decoded
  plain and with --spec-tokens n-gram drafts per step (sampling/speculative.py), interleaved; tokens/s, the
  share of drafts accepted, and a check that both gave the same ids, log-probs and routes.
* window (`--only window`): --prompts prompts of the tiny-gpt-oss preset (a window of 8 on every other
  layer) sampled to --window-new-tokens new tokens with the window pool (the sliding layers' blocks freed
  below the window) and without it, interleaved; tokens/s, the most KV bytes each held at once (blocks
  held x layers), and a check that both gave the same ids, log-probs and routes.
* lora (`--only lora`): the trainer's forward+backward with every weight trained against --lora-rank adapters
  (the base frozen), and the sampler's tokens/s on the base against the base with the adapters unmerged.
* gdn (`--only gdn`): a Gated DeltaNet layer (hybrids/gdn.py): decode on the absolute chunk grid (the
  trainer's bits) against the recurrent decode engines use, and the chunked forward against the recurrent.
* lab: train.py on the same task and seeds, invariant vs a deviating rollout (batch-variant kernels,
  lower-precision weights) without and with each fix; prints one table.

One intra-op thread by default (--threads): steadier on a shared machine; pass --threads 0 for all cores.

Each section prints its table as soon as it finishes. A section that raises prints one line on stderr,
`section NAME failed: TYPE: message` (--traceback adds the traceback), the other sections still run
and report, and the exit status is 1.

A new section is one `bench_<name>` function registered in BENCHMARKS: it gets the parsed args and
returns rows (label, value, note) for the table; note "ratio" prints the value as a ratio.
tests/test_bench.py runs the DEFAULT sections at tiny sizes (a new default section gets its row there).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

# torch.profiler's backend (libkineto) logs every profiler start and stop to stderr ("USDT: ...
# profiler_start", "STAGE: ... Completed Stage"); 6 is above its highest level. Read when the profiler
# first starts; set it yourself to see them.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402

import kernels
from config import ModelConfig
from support.hf import config_to_hf
from lab import fast_ops
from model import Transformer
from rollout import Sampler
from support.packing import pack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository: train.py, the packages


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
def build_model(args) -> Transformer:
    cfg = ModelConfig.preset(args.preset)
    model = Transformer(cfg)
    model.reset_parameters(seed=args.seed)
    return model.eval()


def make_prompts(args, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_prompt_len, args.max_prompt_len + 1, (args.prompts,), generator=g)
    return [torch.randint(0, vocab, (int(L),), generator=g).tolist() for L in lengths]


def timed(fn, warmup: int, repeats: int) -> tuple[float, object]:
    """Median wall seconds of fn() over `repeats` runs after `warmup` runs; also the last result."""
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def interleaved(fns: dict, warmup: int, repeats: int, warmup_fns: dict | None = None) -> dict:
    """Like timed() for several functions, alternating them within each repeat. name -> (median s, out).

    warmup_fns: cheaper stand-ins for the warm-up of some functions (same code path, less work)."""
    outs, warmup_fns = {}, warmup_fns or {}
    for _ in range(warmup):
        for name, fn in fns.items():
            warmup_fns.get(name, fn)()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(times[name]), outs[name]) for name in fns}


# ---------------------------------------------------------------------------------------------------
# rollout: ours vs transformers generate vs a no-cache loop
# ---------------------------------------------------------------------------------------------------
def load_hf(model: Transformer, tmp: str):
    import transformers
    model.save_pretrained(tmp)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    return hf.eval()


def run_ours(sampler: Sampler, prompts, args) -> list[list[int]]:
    outs = sampler.generate(prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            seed=args.seed, progress=False)
    return [o.tokens for o in outs]


def run_hf(hf, prompts, args) -> list[list[int]]:
    return run_hf_on(hf, prompts, args, "cpu")


@torch.no_grad()
def run_hf_on(hf, prompts, args, dev) -> list[list[int]]:
    B, T = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(B, T, dtype=torch.long)              # left padding: (B, T)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p)
        mask[b, T - len(p):] = 1
    kw = dict(do_sample=False) if args.temperature == 0 else dict(do_sample=True, temperature=args.temperature,
                                                                     top_p=1.0, top_k=0)
    out = hf.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=args.max_new_tokens,
                      min_new_tokens=args.max_new_tokens, pad_token_id=0, eos_token_id=None, **kw)
    return out[:, T:].tolist()                            # generated tokens only


@torch.no_grad()
def run_nocache(model: Transformer, prompts, args) -> list[list[int]]:
    """Greedy, recomputing the whole (right-padded) batch every step: what a cache saves."""
    B = len(prompts)
    lens = torch.tensor([len(p) for p in prompts])
    tokens = torch.zeros(B, int(lens.max()) + args.max_new_tokens, dtype=torch.long)   # (B, T_max)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p)
    rows = torch.arange(B)
    for _ in range(args.max_new_tokens):
        logits = model(tokens[:, :int(lens.max())])                                    # (B, T, V)
        nxt = logits[rows, lens - 1].argmax(-1)                                         # (B,)
        tokens[rows, lens] = nxt
        lens = lens + 1
    return [tokens[b, len(p):len(p) + args.max_new_tokens].tolist() for b, p in enumerate(prompts)]


def bench_rollout(args) -> list[tuple[str, float, str]]:
    model = build_model(args)
    prompts = make_prompts(args, model.config.vocab_size)
    n_gen = len(prompts) * args.max_new_tokens
    sampler = Sampler(model, max_batch_size=max(len(prompts), 1))
    fns = {"ours": lambda: run_ours(sampler, prompts, args)}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            hf = load_hf(model, tmp)
            fns["hf"] = lambda: run_hf(hf, prompts, args)
        except ImportError:
            print("transformers is not installed: skipping the transformers generate baseline")
        warm = {}
        if not args.skip_nocache:
            fns["no-cache"] = lambda: run_nocache(model, prompts, args)
            short = argparse.Namespace(**{**vars(args), "max_new_tokens": 2})
            warm["no-cache"] = lambda: run_nocache(model, prompts, short)   # its steps are all alike
        res = interleaved(fns, args.warmup, args.repeats, warm)
    toks = {name: n_gen / t for name, (t, _) in res.items()}
    ours = res["ours"][1]
    assert all(len(t) == args.max_new_tokens for t in ours), "a sequence stopped early"
    notes = {}
    if "no-cache" in res and args.temperature == 0:
        same = ours == res["no-cache"][1]
        notes["no-cache"] = f"tokens {'identical to' if same else 'DIFFER from'} ours"
        if not same:
            print("WARNING: greedy tokens of the sampler and the no-cache loop differ (contract broken?)")
    if "hf" in res and args.temperature == 0:
        agree = sum(a == b for x, y in zip(ours, res["hf"][1]) for a, b in zip(x, y)) / n_gen
        notes["hf"] = f"{agree:.1%} of tokens as ours (fp32 near-ties may flip)"
    rows = [(f"rollout {name}", toks[name], notes.get(name, "")) for name in res]
    for name in res:
        if name != "ours":
            rows.append((f"rollout ours / {name}", toks["ours"] / toks[name], "ratio"))
    print(f"rollout: {len(prompts)} prompts of {args.min_prompt_len}-{args.max_prompt_len} tokens, "
          f"{args.max_new_tokens} new tokens each ({n_gen} generated), temperature {args.temperature}, "
          f"median of {args.repeats} after {args.warmup} warm-up")
    return rows


# ---------------------------------------------------------------------------------------------------
# forward: model.score throughput
# ---------------------------------------------------------------------------------------------------
def bench_forward(args) -> list[tuple[str, float, str]]:
    model = build_model(args)
    B, T = args.score_batch, args.score_len
    tokens = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(args.seed))

    @torch.no_grad()
    def fn():
        return model.score(tokens)

    t, _ = timed(fn, args.warmup, args.repeats)
    return [(f"forward score ({B}, {T})", B * T / t, f"{t * 1e3:.0f} ms per call")]


# ---------------------------------------------------------------------------------------------------
# invariant vs fast (batch-variant) kernels: what the contract costs
# ---------------------------------------------------------------------------------------------------
def bench_fast(args) -> list[tuple[str, float, str]]:
    """Rollout tokens/s and trainer forward+backward tokens/s, invariant vs the lab's fast ops (lab/fast_ops.py)."""
    model = build_model(args)
    prompts = make_prompts(args, model.config.vocab_size)
    n_gen = len(prompts) * args.max_new_tokens
    samplers = {m: Sampler(model, max_batch_size=max(len(prompts), 1), rollout_mode=m)
                for m in ("invariant", "fast")}
    res = interleaved({m: (lambda s=s: run_ours(s, prompts, args)) for m, s in samplers.items()}, args.warmup, args.repeats)
    B, T = args.score_batch, args.score_len
    tokens = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(args.seed))

    def step(batch_variant):
        with kernels.op_set(fast_ops.op_set(batch_variant, router_bf16=False)):
            model.zero_grad(set_to_none=True)
            model.score(tokens)[0].sum().backward()
    tres = interleaved({"invariant": lambda: step(False), "fast": lambda: step(True)}, args.warmup, args.repeats)
    rows = [(f"rollout {m}", n_gen / t, "") for m, (t, _) in res.items()]
    rows.append(("rollout invariant / fast", res["fast"][0] / res["invariant"][0], "ratio"))
    rows += [(f"trainer fwd+bwd {m} ({B}, {T})", B * T / t, f"{t * 1e3:.0f} ms per step") for m, (t, _) in tres.items()]
    rows.append(("trainer invariant / fast", tres["fast"][0] / tres["invariant"][0], "ratio"))
    return rows


# ---------------------------------------------------------------------------------------------------
# activation checkpointing: what recomputing in the backward costs (memory/checkpointing.py)
# ---------------------------------------------------------------------------------------------------
def bench_memory(args) -> list[tuple[str, float, str]]:
    """The trainer's forward+backward with each layer kept (none), each MoE layer recomputed (moe) and
    each block (full), side by side on copies of one model; the gradients are the same bits."""
    import copy

    from memory.checkpointing import checkpoint_layers
    base = build_model(args)
    B, T = args.score_batch, args.score_len
    tokens = torch.randint(0, base.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(args.seed))
    models = {"none": base}
    for kind in ("moe", "full"):
        models[kind] = copy.deepcopy(base)
        checkpoint_layers(models[kind], kind)

    def step(model):
        model.zero_grad(set_to_none=True)
        model.score(tokens)[0].sum().backward()
    res = interleaved({k: (lambda m=m: step(m)) for k, m in models.items()}, args.warmup, args.repeats)
    same = all(torch.equal(p.grad, q.grad) for kind in ("moe", "full")
               for p, q in zip(base.parameters(), models[kind].parameters()))
    rows = [(f"trainer fwd+bwd, {k} recomputed ({B}, {T})", B * T / t, f"{t * 1e3:.0f} ms per step")
            for k, (t, _) in res.items()]
    rows += [(f"{k} / none", res[k][0] / res["none"][0], "ratio" + ("" if same else "; GRADIENTS DIFFER"))
             for k in ("moe", "full")]
    return rows


def bench_lora(args) -> list[tuple[str, float, str]]:
    """LoRA (lora/): the trainer's forward+backward with every weight trained against rank --lora-rank adapters
    on attention, dense MLPs and experts (the base frozen), and the sampler's tokens/s on the base against
    the same base with the adapters unmerged; interleaved on one model's copies."""
    import copy

    from lora.adapters import adapt
    base = build_model(args)
    lora = copy.deepcopy(base)
    adapt(lora, args.lora_rank, 32.0, {"attention", "mlp", "experts"}, False, args.seed, torch.float32, torch.float32)
    with torch.no_grad():                                              # trained adapters: B away from zero
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    B, T = args.score_batch, args.score_len
    tokens = torch.randint(0, base.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(args.seed))

    def step(model):
        model.zero_grad(set_to_none=True)
        model.score(tokens)[0].sum().backward()
    train = interleaved({"full": lambda: step(base), "lora": lambda: step(lora)}, args.warmup, args.repeats)
    prompts = make_prompts(args, base.config.vocab_size)
    samplers = {"base": Sampler(base, max_batch_size=len(prompts)), "lora": Sampler(lora, max_batch_size=len(prompts))}
    roll = interleaved({k: (lambda s=s: run_ours(s, prompts, args)) for k, s in samplers.items()}, args.warmup,
                       args.repeats)
    n_gen = len(prompts) * args.max_new_tokens
    n = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    return [(f"trainer fwd+bwd, every weight trained ({B}, {T})", B * T / train["full"][0], "tokens/s"),
            (f"trainer fwd+bwd, LoRA r{args.lora_rank} ({n:,} adapter parameters)", B * T / train["lora"][0], "tokens/s"),
            ("LoRA / full, trainer step time", train["lora"][0] / train["full"][0], "ratio"),
            ("rollout, the base", n_gen / roll["base"][0], "tokens/s"),
            (f"rollout, LoRA r{args.lora_rank} unmerged", n_gen / roll["lora"][0], "tokens/s"),
            ("LoRA / base, rollout time", roll["lora"][0] / roll["base"][0], "ratio")]


def bench_gdn(args) -> list[tuple[str, float, str]]:
    """A linear-attention hybrid (tiny-hybrid at width 256: three Gated DeltaNet layers, then gated
    attention) in the sampler: its decode on the absolute grid (each token recomputes its open chunk from
    the last boundary's state: the trainer's bits) against the same weights decoding their GDN layers by the
    recurrent form (the lab's --rollout_linear_decode=recurrent: what engines run, one state step a token),
    --prompts sequences of --max-prompt-len then --max-new-tokens each; and one layer's forward, chunked
    (the trainer's) against recurrent. Interleaved, so the grid's cost is a ratio measured side by side."""
    import dataclasses

    from hybrids import gdn
    from lab.faults import recurrent_decode_copy
    torch.manual_seed(args.seed)
    cfg = dataclasses.replace(ModelConfig.preset("tiny-hybrid"), hidden_size=256,
                              max_position_embeddings=max(256, args.max_prompt_len + args.max_new_tokens + 1))
    model = Transformer(cfg)
    model.reset_parameters(seed=args.seed)
    model.eval()
    engine, _ = recurrent_decode_copy(model, model, lambda: None)
    prompts = make_prompts(args, cfg.vocab_size)
    n, N = len(prompts), args.max_new_tokens
    samplers = {"grid": Sampler(model, max_batch_size=n), "recurrent": Sampler(engine, max_batch_size=n)}
    dec = interleaved({k: (lambda s=s: run_ours(s, prompts, args)) for k, s in samplers.items()}, args.warmup,
                      args.repeats)
    layer = model.layers[0].linear_attn
    x = torch.randn(n, args.max_prompt_len + N, cfg.hidden_size)
    K = layer.conv_taps.shape[1]
    with torch.no_grad():
        fwd = interleaved({"chunked": lambda: layer(x), "recurrent": lambda: gdn.recurrent(
            *layer.rule_inputs(x, x.new_zeros(n, K - 1, layer.conv_dim))[0])}, args.warmup, args.repeats)
    L = x.shape[1]
    return [(f"hybrid rollout on the grid, {n} x {N} tokens after {args.max_prompt_len}", n * N / dec["grid"][0],
             "tokens/s"),
            ("hybrid rollout, GDN decoded recurrently (engines)", n * N / dec["recurrent"][0], "tokens/s"),
            ("grid / recurrent, rollout time", dec["grid"][0] / dec["recurrent"][0], "ratio"),
            (f"GDN layer forward, chunked ({n}, {L})", n * L / fwd["chunked"][0], "tokens/s"),
            ("GDN layer forward, recurrent", n * L / fwd["recurrent"][0], "tokens/s")]


# ---------------------------------------------------------------------------------------------------
# packed vs padded micro-batches: the trainer's forward+backward on a long-tailed length mix
# ---------------------------------------------------------------------------------------------------
def long_tail_lengths(n: int, longest: int, spread: float = 10.0) -> list[int]:
    """n lengths at the quantiles (i + 0.5) / n of a lognormal whose longest is `spread` x the median."""
    normal = torch.distributions.Normal(0.0, 1.0)
    z = normal.icdf((torch.arange(n, dtype=torch.float64) + 0.5) / n)
    sigma = torch.log(torch.tensor(spread, dtype=torch.float64)) / z.max()
    return [max(2, round(longest / spread * float(torch.exp(sigma * q)))) for q in z.tolist()]


def bench_packing(args) -> list[tuple[str, float, str]]:
    """Trainer fwd+bwd over one rollout batch, padded micro-batches (slices of one (B, T_max) tensor, as
    train.make_batch) vs packed ones (packing.pack by token budget); tokens/s counts real tokens only."""
    model = build_model(args)
    model.train()
    g = torch.Generator().manual_seed(args.seed)
    lengths = long_tail_lengths(args.pack_seqs, model.config.max_position_embeddings)
    lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=g).tolist()]   # rollout order
    S, T = len(lengths), max(lengths)
    tokens = torch.randint(0, model.config.vocab_size, (S, T), generator=g)
    mask = torch.arange(T - 1)[None] < torch.tensor(lengths)[:, None] - 1        # (S, T-1) real targets
    real = sum(lengths)
    mbs = pack(lengths, args.micro_batch_tokens)
    packed = [(mb.packing, mb.packing.from_padded(tokens[mb.rows]),
               mask[mb.rows, :max(mb.packing.lengths) - 1]) for mb in mbs]              # mask (k, L_max - 1)
    k = args.pack_micro_batch

    def padded_step():
        model.zero_grad(set_to_none=True)
        for lo in range(0, S, k):
            lp, _ = model.score(tokens[lo:lo + k])
            (lp * mask[lo:lo + k]).sum().backward()

    def packed_step():
        model.zero_grad(set_to_none=True)
        for pk, tok, m in packed:
            lp, _ = model.score(tok, packing=pk)
            (pk.to_padded(lp)[:, :-1] * m).sum().backward()
    res = interleaved({"padded": padded_step, "packed": packed_step}, args.warmup, args.repeats)
    computed = {"padded": S * T, "packed": sum(pk.shape[0] * pk.shape[1] for pk, _, _ in packed)}
    block = kernels.packed_block(tokens)
    slots = sum(-(-n // block) * block for n in lengths)
    mix = f"{S} seqs, lengths {min(lengths)}..{statistics.median(lengths):.0f}..{T}, {real} tokens"
    rows = [(f"trainer fwd+bwd padded ({mix}, micro-batches of {k})", real / res["padded"][0],
             f"{1 - real / computed['padded']:.0%} of computed positions are padding"),
            (f"trainer fwd+bwd packed ({len(mbs)} micro-batches <= {args.micro_batch_tokens} tokens)", real / res["packed"][0],
             f"{1 - real / computed['packed']:.0%} padding ({1 - real / slots:.0%} of the attention's query slots)"),
            ("trainer packed / padded", res["padded"][0] / res["packed"][0], "ratio")]
    return rows


# ---------------------------------------------------------------------------------------------------
# fused MoE vs a per-expert loop (index_add_, as transformers does)
# ---------------------------------------------------------------------------------------------------
def bench_moe(args) -> list[tuple[str, float, str]]:
    cfg = ModelConfig.preset(args.preset)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    M, E, D, I, k = args.moe_tokens, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    x = torch.randn(M, D, generator=g).to(dev)
    w13 = (torch.randn(E, 2 * I, D, generator=g) * 0.05).to(dev)
    w2 = (torch.randn(E, D, I, generator=g) * 0.05).to(dev)
    ids, weights, _ = kernels.route(torch.randn(M, E, generator=g).to(dev), k, True)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def fused():
        kernels.moe_experts(x, w13, w2, ids, weights)
        sync()

    def loop():
        fast_ops.moe_experts(x, w13, w2, ids, weights)
        sync()
    res = interleaved({"fused": fused, "loop": loop}, args.warmup, args.repeats)
    return [(f"moe {n} ({M} tokens, {E} experts, top-{k}, {dev})", M / t, "") for n, (t, _) in res.items()] + \
           [("moe fused / per-expert loop", res["loop"][0] / res["fused"][0], "ratio")]


# ---------------------------------------------------------------------------------------------------
# ep: the MoE layer at EP=N vs EP=1 on torch.distributed (a torchrun job of --ep-procs processes)
# ---------------------------------------------------------------------------------------------------
def bench_ep(args) -> list[tuple[str, float, str]]:
    n = args.ep_procs
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           "-m", "tooling.bench",
           "--ep-worker", f"--preset={args.preset}", f"--moe-tokens={args.moe_tokens}", f"--warmup={args.warmup}",
           f"--repeats={args.repeats}", f"--seed={args.seed}", f"--threads={args.threads}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": str(args.threads or 1)})
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode or not lines:
        raise SystemExit(f"bench ep: the torchrun job failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    res = json.loads(lines[-1])
    what = f"{res['tokens']} tokens/rank, {res['experts']} experts, top-{res['k']}, {n} ranks, {res['backend']}"
    return [(f"ep moe forward EP=1 ({what})", res["fwd1"], ""), (f"ep moe forward EP={n}", res["fwdN"], ""),
            (f"ep moe forward EP={n} / EP=1", res["fwdN"] / res["fwd1"], "ratio"),
            ("ep moe forward+backward EP=1", res["bwd1"], ""), (f"ep moe forward+backward EP={n}", res["bwdN"], ""),
            (f"ep moe forward+backward EP={n} / EP=1", res["bwdN"] / res["bwd1"], "ratio")]


def ep_worker(args) -> None:
    """One rank of bench_ep's job: prints rank 0's tokens/s (median over ranks' medians) as one JSON line."""
    import torch.distributed as dist
    from parallel import expert_parallel
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world, dev = dist.get_rank(), dist.get_world_size(), "cuda" if cuda else "cpu"
    cfg = ModelConfig.preset(args.preset)
    torch.manual_seed(args.seed)
    moe = Transformer(cfg).layers[cfg.moe_layers[0]].mlp.to(dev)
    M = args.moe_tokens // world
    x = torch.randn(1, M, cfg.hidden_size, generator=torch.Generator().manual_seed(args.seed + rank)).to(dev)
    sharded = expert_parallel.shard_experts(copy.deepcopy(moe), expert_parallel.init_expert_parallel(world, n_experts=cfg.num_experts))

    def step(layer, backward):
        def fn():
            dist.barrier()                                  # the ranks start together: the exchange waits on the slowest
            xi = x.clone().requires_grad_(backward)
            out = layer(xi)[0]
            if backward:
                out.float().sum().backward()
            if cuda:
                torch.cuda.synchronize()
            return out.detach()
        return fn
    res = interleaved({"fwd1": step(moe, False), "fwdN": step(sharded, False), "bwd1": step(moe, True),
                       "bwdN": step(sharded, True)}, args.warmup, max(1, args.repeats))
    if not torch.equal(res["fwd1"][1], res["fwdN"][1]):
        raise SystemExit("bench ep: EP=N and EP=1 outputs differ")
    times = torch.tensor([res[k][0] for k in ("fwd1", "fwdN", "bwd1", "bwdN")], dtype=torch.float64, device=dev)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)           # a step takes as long as its slowest rank
    if rank == 0:
        print(json.dumps({"tokens": M, "experts": cfg.num_experts, "k": cfg.num_experts_per_tok,
                          "backend": dist.get_backend(), **{k: M / t for k, t in zip(("fwd1", "fwdN", "bwd1", "bwdN"),
                                                                                     times.tolist())}}))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# the gradient sum: exact (fixed-point limbs) vs fast (fp32)
# ---------------------------------------------------------------------------------------------------
def bench_reduce(args) -> list[tuple[str, float, str]]:
    n = args.reduce_procs
    rows = []
    for budget in (4096, args.reduce_budget):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
               "-m", "tooling.bench", "--reduce-worker", f"--reduce-budget={budget}", f"--repeats={args.repeats}",
               f"--reduce-steps={args.reduce_steps}", f"--threads={args.threads}"]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": str(args.threads or 1)})
        lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
        if r.returncode or not lines:
            raise SystemExit(f"bench reduce: the torchrun job failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
        res = json.loads(lines[-1])
        what = f"{n} gloo ranks, DDP, --micro_batch_tokens={budget} ({res['micro']} micro-batches a minibatch)"
        rows += [(f"reduce step time exact / fast ({what})", res["step_exact"] / res["step_fast"], "ratio"),
                 (f"reduce update time exact / fast ({what})", res["update_exact"] / res["update_fast"], "ratio")]
    rows += reduce_error_rows(args)
    return rows + reduce_byte_rows(n)


def reduce_worker(args) -> None:
    """One rank of bench_reduce's job: the main job under fast and exact, alternating; prints the median
    step and update seconds of each (the first step of a run warms up) as one JSON line."""
    import torch.distributed as dist
    import train
    from config import RolloutConfig, TrainConfig
    from support.distributed import Dist
    dist.init_process_group("gloo")
    d = Dist(dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    update, cut, spent, micro = train.update, train.trainer_micro_batches, [], []

    def timed_update(*a, **kw):
        t0 = time.perf_counter()
        train.trainer_micro_batches = counted
        out = update(*a, **kw)
        train.trainer_micro_batches = cut
        spent.append(time.perf_counter() - t0)
        return out

    def counted(*a, **kw):                           # how many micro-batches a minibatch was cut into
        out = cut(*a, **kw)
        micro.append(len(out))
        return out
    train.update = timed_update
    times = {f"{k}_{m}": [] for k in ("step", "update") for m in ("fast", "exact")}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(max(1, args.repeats)):
            for mode in ("fast", "exact"):
                tcfg = TrainConfig(device="cpu", steps=args.reduce_steps, progress=False, grad_reduce=mode,
                                   micro_batch_tokens=args.reduce_budget, out_dir=f"{tmp}/{mode}", overwrite=True,
                                   save_every=10 ** 6)
                spent.clear()
                rows = train._train(tcfg, RolloutConfig(), d)
                times[f"step_{mode}"] += [r["step_time"] for r in rows[1:]]
                times[f"update_{mode}"] += spent[1:]
    if d.rank == 0:
        print(json.dumps({"micro": statistics.median(micro), **{k: statistics.median(v) for k, v in times.items()}}))
    dist.destroy_process_group()


def micro_batch_grads(init_from: str, task: str, seed: int, budget: int) -> list[list[torch.Tensor]]:
    """The gradients of each micro-batch of the first minibatch of step 1 (one process, the fast path's
    backward, one micro-batch at a time): what a gradient sum adds up."""
    import train
    from config import RolloutConfig, TrainConfig
    from losses import Normalisers
    from support.distributed import Dist
    with tempfile.TemporaryDirectory() as tmp:
        tcfg = TrainConfig(device="cpu", init_from=init_from, task=task, seed=seed, grad_reduce="fast", progress=False,
                           micro_batch_tokens=budget, out_dir=tmp, steps=1)
        run = train.setup(tcfg, RolloutConfig(), Dist(0, 1, torch.device("cpu")))
        examples, outs = train.rollout(run, 0)
        rewards = torch.tensor(train.compute_rewards(run.task, examples, outs, tcfg.group_size, 1))
        batch = train.make_batch(outs, train.group_advantages(rewards, tcfg.group_size))
        old = train.old_policy(run, batch)
        idx = torch.randperm(len(outs), generator=torch.Generator().manual_seed(0))[:tcfg.minibatch_size]
        norm = Normalisers(float(old.loss_mask[idx].sum()), len(idx), train.max_new_tokens(run))
        params, grads = list(run.policy.master.parameters()), []
        run.policy.master.train()
        for micro in train.trainer_micro_batches(run, idx, batch.lengths):
            train.micro_step(run, batch, old, micro, norm, run.tcfg.replay, counted=True)
            grads.append([p.grad.detach().clone() for p in params])
            for p in params:
                p.grad = None
    return grads


def sum_errors(grads: list[list[torch.Tensor]]) -> dict:
    """Each way of summing the micro-batch gradients against their fp64 sum -> name: (the error's norm
    over the gradient's, the worst element's error in fp32 ulps of the sum, the elements on which exact's
    error is larger than this way's)."""
    from support import exact_sum
    from support.packing import deal
    flat = [torch.cat([g.reshape(-1) for g in mb]) for mb in grads]
    ref = torch.stack(flat).double().sum(0)
    ulp = (torch.nextafter(ref.float().abs(), torch.tensor(float("inf"))) - ref.float().abs()).double()
    limbs = exact_sum.Limbs(ref.shape, "cpu")
    for f in flat:
        limbs.add(f)
    ways = {"exact": limbs.value()}
    for world in (1, 2, 4):                          # each rank adds its micro-batches in fp32, then the ranks
        partial = [sum((flat[i] for i in deal(len(flat), world, r) if i is not None), torch.zeros_like(flat[0]))
                   for r in range(world)]
        ways[f"fast {world} rank{'s' if world > 1 else ''}"] = sum(partial[1:], partial[0])
    out, exact = {}, (ways["exact"].double() - ref).abs()
    for name, got in ways.items():
        err = (got.double() - ref).abs()
        out[name] = ((err.norm() / ref.norm()).item(), (err / ulp.clamp(min=1e-300))[ref != 0].max().item(),
                     int((exact > err).sum()))
    return out


def reduce_error_rows(args) -> list[tuple[str, float, str]]:
    import train
    from config import RolloutConfig, TrainConfig
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        held = TrainConfig(device="cpu", task="reverse", seed=1, steps=20, progress=False, out_dir=tmp, overwrite=True)
        train.train(held, RolloutConfig())
        ckpt = os.path.join(tmp, open(os.path.join(tmp, "latest")).read().strip())
        for what, init, task in (("main job, initial weights", "tiny", "copy"),
                                 ("held-out checkpoint (reverse, seed 1, step 20)", ckpt, "reverse")):
            grads = micro_batch_grads(init, task, 0, args.reduce_budget)
            n = sum(g.numel() for g in grads[0])
            for name, (rel, ulps, worse) in sum_errors(grads).items():
                rows += [(f"reduce error vs fp64, {what}, {len(grads)} micro-batches: {name}, |err| / |g|", rel, "relative"),
                         (f"reduce error vs fp64, {what}: {name}, worst element", ulps, "fp32 ulps")]
                if name != "exact":
                    rows.append((f"reduce error vs fp64, {what}: elements where exact's error > {name}'s", worse,
                                 f"of {n}"))
    return rows


def reduce_byte_rows(world: int) -> list[tuple[str, float, str]]:
    """Bytes the gradient sum sends per rank (a ring all-reduce sends 2 (n-1)/n of the buffer, a
    reduce-scatter (n-1)/n): fast sums fp32 (4 bytes an element) once a minibatch; exact two int64 limbs
    (16), once a minibatch under DDP, every micro-batch step under FSDP2. Experts are summed over their
    replicas only: at EP = world none leave their rank. And exact's accumulators, 16 bytes an element a
    rank sums (FSDP2: its shard of the dense ones; an EP rank's expert shard whole)."""
    from tooling import plan
    rows = []
    for preset, n, ep, parallel in (("tiny", world, 1, "ddp"), ("qwen3-30b-a3b", 8, 1, "ddp"),
                                    ("qwen3-30b-a3b", 8, 8, "ddp"), ("qwen3-30b-a3b", 8, 8, "fsdp")):
        shapes = plan.parameter_shapes(ModelConfig.preset(preset))
        dense = sum(math.prod(s) for s, e in shapes if not e)
        expert = sum(math.prod(s) for s, e in shapes if e)
        replicas, ring = n // ep, (1 if parallel == "fsdp" else 2)
        moved = ring * (n - 1) / n * dense + (ring * (replicas - 1) / replicas * expert / ep if replicas > 1 else 0)
        held = (dense / n if parallel == "fsdp" else dense) + expert / ep
        what = f"{preset} on {n} ranks, EP={ep}, {parallel} ({dense / 1e6:.1f}M dense, {expert / 1e6:.1f}M expert parameters)"
        when = "a micro-batch step" if parallel == "fsdp" else "a minibatch"
        rows += [(f"reduce bytes sent, {what}: fast (a minibatch)", 4 * moved / 1e9, "GB a rank"),
                 (f"reduce bytes sent, {what}: exact ({when})", 16 * moved / 1e9, "GB a rank"),
                 (f"reduce accumulators, {what}: exact", 16 * held / 1e9, "GB a rank")]
    return rows


# ---------------------------------------------------------------------------------------------------
# decode step: host work per step at a small and a large batch (any device; tiny model by default)
# ---------------------------------------------------------------------------------------------------
def decode_step_profile(sampler: Sampler, prompts, max_new: int, step: int = 3) -> tuple[int, float]:
    """(top-level torch ops, wall ms) of one decode step (the step-th) of a generate() call."""
    runner, seen, out = sampler.runner, [], {}
    decode = runner.decode

    def profiled(*a):
        seen.append(None)
        if len(seen) - 1 != step:
            return decode(*a)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            res = decode(*a)
            out["ms"] = 1e3 * (time.perf_counter() - t0)
        out["ops"] = sum(1 for e in prof.events() if e.name.startswith("aten::") and not (
            e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))
        return res
    runner.decode = profiled
    try:
        sampler.generate(prompts, max_new_tokens=max_new, temperature=1.0, progress=False)
    finally:
        runner.decode = decode
    return out["ops"], out["ms"]


def bench_decode(args) -> list[tuple[str, float, str]]:
    model = build_model(args)
    rows, res = [], {}
    for n in (16, 256):
        prompts = make_prompts(argparse.Namespace(**{**vars(args), "prompts": n}), model.config.vocab_size)
        sampler = Sampler(model, max_batch_size=n)
        decode_step_profile(sampler, prompts, 8)                           # warm-up
        res[n] = min(decode_step_profile(sampler, prompts, 8) for _ in range(3))
        rows.append((f"decode step, {n} sequences: torch ops", res[n][0], f"{res[n][1]:.1f} ms (under the profiler)"))
    rows.append(("decode step ms, 256 / 16 sequences", res[256][1] / res[16][1], "ratio"))
    return rows


# ---------------------------------------------------------------------------------------------------
# sessions: multi-turn episodes token in / token out vs re-prefilling each turn's history; chunked
# prefill vs whole
# ---------------------------------------------------------------------------------------------------
class BenchEnv:
    """--turns turns per episode; after each but the last, --obs-tokens ids drawn from (sequence, turn)."""

    def __init__(self, args, vocab: int):
        self.turns, self.n_obs, self.vocab, self.seed, self.calls = args.turns, args.obs_tokens, vocab, args.seed, {}

    def __call__(self, index: int, turn: list[int]) -> list[int] | None:
        k = self.calls[index] = self.calls.get(index, 0) + 1
        if k >= self.turns:
            return None
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index * 101 + k)
        return torch.randint(0, self.vocab, (self.n_obs,), generator=g).tolist()


def sessions_live(sampler: Sampler, prompts, args):
    """One generate call: each observation is prefilled into the live sequence's KV."""
    sampler.weights_updated()                 # a new policy each rollout: nothing cached from the last repeat
    return sampler.generate(prompts, max_new_tokens=args.turn_tokens, temperature=1.0, seed=args.seed,
                            on_turn_end=BenchEnv(args, sampler.model.config.vocab_size))


def sessions_reprefill(sampler: Sampler, prompts, args):
    """One generate call per turn over each episode's whole history so far (what a stateless engine
    serves); with the prefix cache the history's full blocks are hits. -> (history, logprobs, routes)."""
    sampler.weights_updated()
    env, histories = BenchEnv(args, sampler.model.config.vocab_size), [list(p) for p in prompts]
    logprobs = [[] for _ in prompts]
    for _ in range(args.turns):
        outs = sampler.generate(histories, max_new_tokens=args.turn_tokens, temperature=1.0, seed=args.seed)
        for i, o in enumerate(outs):
            obs = env(i, o.tokens) or []
            histories[i] += o.tokens + obs
            logprobs[i] += o.logprobs + [0.0] * len(obs)
    return [(h, lp, o.routes) for h, lp, o in zip(histories, logprobs, outs)]


def same_episodes(live, reprefill) -> bool:
    """The contract across the two ways: the same ids, the policy's log-probs and every route."""
    return all(o.prompt + o.tokens == h and o.logprobs == lp and torch.equal(o.routes, r)
               for o, (h, lp, r) in zip(live, reprefill))


def bench_sessions(args) -> list[tuple[str, float, str]]:
    model = build_model(args)
    prompts = make_prompts(args, model.config.vocab_size)
    B = max(len(prompts), 1)
    samplers = {"sessions": Sampler(model, max_batch_size=B),
                "re-prefill": Sampler(model, max_batch_size=B, prefix_cache=False),
                "re-prefill + prefix cache": Sampler(model, max_batch_size=B)}
    fns = {name: (lambda s=s, f=(sessions_live if name == "sessions" else sessions_reprefill): f(s, prompts, args))
           for name, s in samplers.items()}
    res = interleaved(fns, args.warmup, args.repeats)
    n_gen = len(prompts) * args.turns * args.turn_tokens
    live = res["sessions"][1]
    rows = []
    for name, (t, out) in res.items():
        ok = name == "sessions" or same_episodes(live, out)
        rows.append((f"sessions: {name}", n_gen / t, "policy tok/s" + ("" if ok else ", outputs DIFFER from sessions")))
    hit = samplers["re-prefill + prefix cache"].prefix_hit_rate
    for name in ("re-prefill", "re-prefill + prefix cache"):
        rows.append((f"sessions / {name}", res[name][0] / res["sessions"][0], "ratio"))
    print(f"sessions: {len(prompts)} episodes of {args.turns} turns x {args.turn_tokens} tokens, {args.obs_tokens} "
          f"observation ids between turns; re-prefill + cache: last turn's hit rate {hit:.0%}")
    return rows + bench_shared_prefix(model, prompts, args) + bench_chunked(model, args)


def bench_shared_prefix(model: Transformer, prompts, args) -> list[tuple[str, float, str]]:
    """The sessions above, each prompt opened by the same --shared-prefix ids (an agent's system prompt),
    in one generate call with the prefix cache and without."""
    g = torch.Generator().manual_seed(args.seed + 1)
    opening = torch.randint(0, model.config.vocab_size, (args.shared_prefix,), generator=g).tolist()
    prompts = [opening + p for p in prompts]
    B = max(len(prompts), 1)
    samplers = {"prefix cache": Sampler(model, max_batch_size=B),
                "no cache": Sampler(model, max_batch_size=B, prefix_cache=False)}
    res = interleaved({name: (lambda s=s: sessions_live(s, prompts, args)) for name, s in samplers.items()},
                      args.warmup, args.repeats)
    (t_hit, hit), (t_cold, cold) = res.values()
    same = all(a.tokens == b.tokens and a.logprobs == b.logprobs and torch.equal(a.routes, b.routes)
               for a, b in zip(hit, cold))
    warm, n_gen = samplers["prefix cache"], len(prompts) * args.turns * args.turn_tokens
    print(f"shared prefix: the sessions' prompts opened by the same {args.shared_prefix} ids; prefix cache: hit rate "
          f"{warm.prefix_hit_rate:.0%}, {warm.num_cached_tokens} prefill tokens served, "
          f"{warm.num_prefilled_tokens} fed (no cache: {samplers['no cache'].num_prefilled_tokens} fed)")
    return [(f"shared {args.shared_prefix}-id prefix: {name}", n_gen / t,
             "policy tok/s" + ("" if same else ", outputs DIFFER")) for name, (t, _) in res.items()] + \
        [("shared prefix: cache / no cache", t_cold / t_hit, "ratio")]


def bench_chunked(model: Transformer, args) -> list[tuple[str, float, str]]:
    """Long prompts prefilled whole vs in chunks of --chunk-tokens (a decode step between chunks)."""
    ctx = model.config.max_position_embeddings
    lo, hi = max(1, ctx // 2), ctx - args.turn_tokens
    prompts = make_prompts(argparse.Namespace(**{**vars(args), "min_prompt_len": lo, "max_prompt_len": hi}),
                           model.config.vocab_size)
    B = max(len(prompts), 1)
    samplers = {"whole": Sampler(model, max_batch_size=B, max_num_batched_tokens=B * hi),
                f"chunks of {args.chunk_tokens}": Sampler(model, max_batch_size=B,
                                                          max_num_batched_tokens=args.chunk_tokens)}

    def run(s):
        s.weights_updated()
        return s.generate(prompts, max_new_tokens=args.turn_tokens, temperature=1.0, seed=args.seed)
    res = interleaved({name: (lambda s=s: run(s)) for name, s in samplers.items()}, args.warmup, args.repeats)
    n_tok = sum(len(p) for p in prompts) + len(prompts) * args.turn_tokens
    (tw, whole), (tc, chunked) = res.values()
    same = all(a.tokens == b.tokens and a.logprobs == b.logprobs and torch.equal(a.routes, b.routes)
               for a, b in zip(whole, chunked))
    print(f"chunked prefill: {len(prompts)} prompts of {lo}-{hi} tokens, {args.turn_tokens} new tokens each")
    return [(f"prefill {name}", n_tok / t, "prompt + new tok/s" + ("" if same else ", outputs DIFFER"))
            for name, (t, _) in res.items()] + [(f"chunks of {args.chunk_tokens} / whole", tw / tc, "ratio")]


# ---------------------------------------------------------------------------------------------------
# speculative: plain decoding vs n-gram drafts verified in one forward, on the copy task
# ---------------------------------------------------------------------------------------------------
def bench_speculative(args) -> list[tuple[str, float, str]]:
    """--spec-prompts copy-task prompts of --spec-digits digits (the answer repeats the prompt), their
    answers' length in new tokens, plain and with --spec-tokens drafts, interleaved."""
    from support.tasks import DigitTask
    model = build_model(args)
    prompts = [ex.prompt for ex in DigitTask("copy", n_digits=args.spec_digits, seed=args.seed).sample(args.spec_prompts)]
    B, new = len(prompts), args.spec_digits + 1
    samplers = {"plain": Sampler(model, max_batch_size=B),
                f"speculative k={args.spec_tokens}": Sampler(model, max_batch_size=B, speculative_tokens=args.spec_tokens)}

    def run(s):
        return s.generate(prompts, max_new_tokens=new, temperature=args.temperature, seed=args.seed)
    res = interleaved({name: (lambda s=s: run(s)) for name, s in samplers.items()}, args.warmup, args.repeats)
    (t_plain, plain), (t_spec, spec) = res.values()
    same = all(a.tokens == b.tokens and a.logprobs == b.logprobs and torch.equal(a.routes, b.routes)
               for a, b in zip(plain, spec))
    spec_sampler = samplers[f"speculative k={args.spec_tokens}"]
    n_gen = sum(len(o.tokens) for o in plain)
    print(f"speculative: {B} copy prompts of {args.spec_digits} digits, up to {new} new tokens, temperature "
          f"{args.temperature:g}; the preset's random weights do not copy, their text falls into loops the drafts find")
    return [(f"speculative: {name}", n_gen / t, "tok/s" + ("" if same else ", outputs DIFFER from plain"))
            for name, (t, _) in res.items()] + [
        ("speculative: drafts accepted", spec_sampler.spec_accept_rate,
         f"of {spec_sampler.num_drafted_tokens} drafted (share)"),
        (f"speculative k={args.spec_tokens} / plain", t_plain / t_spec, "ratio")]


# ---------------------------------------------------------------------------------------------------
# window: the sliding layers' window pool against none (gpt-oss's attention at tiny sizes)
# ---------------------------------------------------------------------------------------------------
def bench_window(args) -> list[tuple[str, float, str]]:
    """--prompts prompts of the tiny-gpt-oss preset (a window of 8 keys on every other layer), up to
    --window-new-tokens new tokens each, with the window pool and without (window_blocks=-1), interleaved."""
    cfg = ModelConfig.preset("tiny-gpt-oss")
    model = Transformer(cfg)
    model.reset_parameters(seed=args.seed)
    model.eval()
    prompts = make_prompts(args, cfg.vocab_size)
    new = min(args.window_new_tokens, cfg.max_position_embeddings - args.max_prompt_len)
    B = len(prompts)
    samplers = {"window pool": Sampler(model, max_batch_size=B),
                "no window pool": Sampler(model, max_batch_size=B, window_blocks=-1)}

    def run(s):
        s.block_manager.peak_held = 0
        if s.block_manager.window_pool:
            s.block_manager.window_pool.peak_held = 0
        return s.generate(prompts, max_new_tokens=new, temperature=1.0, seed=args.seed)
    res = interleaved({name: (lambda s=s: run(s)) for name, s in samplers.items()}, args.warmup, args.repeats)
    (t_pool, pool), (t_none, none) = res.values()
    same = all(a.tokens == b.tokens and a.logprobs == b.logprobs and torch.equal(a.routes, b.routes)
               for a, b in zip(pool, none))
    sliding = sum(bool(cfg.window(i)) for i in range(cfg.num_hidden_layers))
    nbytes = next(model.parameters()).element_size()
    layer = samplers["window pool"].config.block_size * cfg.kv_numbers_per_token * nbytes      # a block of a layer
    held = {}
    for name, s in samplers.items():
        bm = s.block_manager
        wp = bm.window_pool
        full_layers = cfg.num_hidden_layers - (sliding if wp else 0)
        held[name] = bm.peak_held * full_layers * layer + (wp.peak_held * sliding * layer if wp else 0)
    n_gen = sum(len(o.tokens) for o in pool)
    bm = samplers["window pool"].block_manager
    print(f"window: tiny-gpt-oss, {B} prompts of {args.min_prompt_len}-{args.max_prompt_len} tokens, up to {new} new; "
          f"{sliding} of {cfg.num_hidden_layers} layers slide over {cfg.sliding_window} keys, {bm.block_size}-position "
          f"blocks; at most {bm.peak_held} blocks held in the full pool, {bm.window_pool.peak_held} in the window pool")
    return [(f"window: {name}", n_gen / t, "tok/s" + ("" if same else ", outputs DIFFER from no pool"))
            for name, (t, _) in res.items()] + [
        (f"window: {name}, KV held at most", held[name] / 2**20, "MiB (fp32 K and V)") for name in held] + [
        ("window: KV held, no pool / pool", held["no window pool"] / held["window pool"], "ratio"),
        ("window: pool / no pool", t_none / t_pool, "ratio")]


# ---------------------------------------------------------------------------------------------------
# GPU: the rollout engine at Qwen3-30B-A3B layer shapes
# ---------------------------------------------------------------------------------------------------
def gpu_model(layers: int, tiny: bool) -> Transformer:
    """A model of Qwen3-30B-A3B's layer shapes with `layers` layers, bf16 random weights made directly
    on the device (no CPU init of billions of weights). tiny: the tiny preset (a CPU smoke run)."""
    cfg = ModelConfig.preset("tiny") if tiny else ModelConfig(**{**vars(ModelConfig.preset("qwen3-30b-a3b")),
                                                                "num_hidden_layers": layers})
    dev, dtype = ("cpu", torch.float32) if tiny else ("cuda", torch.bfloat16)
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to(dtype).to_empty(device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, cfg.initializer_range, generator=g)
    return model.eval()


def bench_gpu(args) -> list[tuple[str, float, str]]:
    """Rollout tok/s at 256/64/1024 sequences for invariant (eager, graphs) and fast; each decode
    step's share of the bandwidth limit; transformers generate (greedy, same weights); the contract.
    Each row is printed as soon as it is measured (the GPU run has a hard time limit), the goal's
    batch (the first size) first, then where its decode step spends its time, then the rest."""
    tiny = args.cpu_smoke
    if not tiny and not torch.cuda.is_available():
        print("gpu: no CUDA device, skipped (--cpu-smoke runs this code on the CPU at tiny sizes)")
        return []
    model = gpu_model(args.gpu_layers, tiny)
    sizes = [4, 8] if tiny else [int(x) for x in args.gpu_batches.split(",")]
    new = 6 if tiny else args.max_new_tokens_gpu
    lo, hi = (3, 9) if tiny else (32, 96)
    rows, peak = Rows(), copy_bandwidth(tiny)
    rows.add("weights GB", sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9, "")
    rows.add("device copy bandwidth GB/s", peak / 1e9, "")
    pool = dict(max_batch_size=max(sizes), num_blocks=max(sizes) * -(-(hi + new) // 16) + 64)   # what it needs
    samplers = {"invariant eager": Sampler(model, cuda_graphs=False, **pool)}
    if not tiny:
        samplers["invariant graphs"] = Sampler(model, **pool)
    samplers["fast"] = Sampler(model, rollout_mode="fast", **pool)
    for i, B in enumerate(sizes):
        prompts = make_prompts(argparse.Namespace(**{**vars(args), "prompts": B, "min_prompt_len": lo,
                                                     "max_prompt_len": hi}), model.config.vocab_size)
        rollout_rows(rows, samplers, prompts, new, tiny, peak)
        if i == 0:
            for name in ("invariant eager", "fast"):   # fast: which SDPA backend, and what it costs
                step_kernels(samplers[name], name, B, new, lo, hi, args, tiny)
            hf_generate_rows(rows, model, args, tiny, min(sizes), new, lo, hi)
    return list(rows)


def row_text(label: str, value: float, note: str, width: int) -> str:
    """One line of the results table; note "ratio" prints the value as a ratio."""
    val = f"{value:10.2f}x  " if note == "ratio" else f"{value:12.3g}" if 0 < abs(value) < 10 else f"{value:12.1f}"
    return f"{label:<{width}}  {val:>12}  {'' if note == 'ratio' else note}"


class Rows(list):
    """Benchmark rows (label, value, note) that are also printed as they come."""

    def add(self, label: str, value: float, note: str) -> None:
        self.append((label, value, note))
        print(row_text(label, value, note, len(label)), flush=True)


def rollout_rows(rows: Rows, samplers: dict, prompts, new: int, tiny: bool, peak: float) -> None:
    """Each sampler's tok/s on these prompts, its median decode step against the bandwidth limit (the
    weights and the mean context's KV read once per step), and the contract for the invariant ones."""
    B, model = len(prompts), samplers["fast"].runner.model
    cfg, sync = model.config, (lambda: None) if tiny else torch.cuda.synchronize
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    ctx = sum(len(p) for p in prompts) / B + new / 2                         # mean context of a decode step
    step_bytes = weight_bytes + kv_per_token * ctx * B
    tok = {}
    for name, sampler in samplers.items():
        steps = []
        run = lambda: sampler.generate(prompts, max_new_tokens=new, temperature=1.0, seed=1, progress=False)
        run()                                                                # warm-up: compiles, captures
        t, outs = timed_decode(sampler, run, steps, sync)
        tok[name] = B * new / t
        step = sorted(steps)[len(steps) // 2]
        rows.add(f"rollout {name}, {B} seqs x {new}", tok[name],
                 f"{t:.2f} s; decode step {step * 1e3:.2f} ms = {step_bytes / step / peak:.0%} of the bandwidth limit")
        if name.startswith("invariant"):
            bad = contract_mismatches(model, outs, chunk=8 if tiny else 32)
            rows.add(f"  contract, {name}, {B} seqs: mismatching sequences", bad, "must be 0")
    if "invariant graphs" in tok:
        rows.add(f"invariant graphs / fast, {B} seqs", tok["invariant graphs"] / tok["fast"], "ratio")
    rows.add(f"invariant {'graphs' if not tiny else 'eager'} / eager, {B} seqs",
             tok.get("invariant graphs", tok["invariant eager"]) / tok["invariant eager"], "ratio")


def step_kernels(sampler: Sampler, name: str, B: int, new: int, lo: int, hi: int, args, tiny: bool) -> None:
    """Where one decode step of B sequences spends its device time: the top kernels (a graph replay
    shows as one event, so an eager step is profiled; its kernels are the graph's)."""
    prompts = make_prompts(argparse.Namespace(**{**vars(args), "prompts": B, "min_prompt_len": lo,
                                                 "max_prompt_len": hi}), sampler.runner.model.config.vocab_size)
    runner, calls = sampler.runner, []
    decode = runner.decode
    acts = [torch.profiler.ProfilerActivity.CPU] + ([] if tiny else [torch.profiler.ProfilerActivity.CUDA])

    def profiled(*a):
        calls.append(None)
        if len(calls) != 4:
            return decode(*a)
        with torch.profiler.profile(activities=acts) as prof:
            res = decode(*a)
        key = "self_cpu_time_total" if tiny else "self_device_time_total"
        print(f"\none {name} decode step, {B} sequences: top kernels by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60))
        return res
    runner.decode, graphs = profiled, runner.cuda_graphs
    runner.cuda_graphs = False                       # eager: the step's kernels, not one graph launch
    try:
        sampler.generate(prompts, max_new_tokens=min(new, 8), temperature=1.0, progress=False)
    finally:
        runner.decode, runner.cuda_graphs = decode, graphs


def copy_bandwidth(tiny: bool) -> float:
    """Bytes per second of a large device copy (read + write)."""
    dev = "cpu" if tiny else "cuda"
    src = torch.empty(1 << (20 if tiny else 30), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    sync = (lambda: None) if tiny else torch.cuda.synchronize
    t, _ = timed(lambda: (dst.copy_(src), sync()), 2, 5)
    return 2 * src.numel() / t


def timed_decode(sampler: Sampler, run, steps: list, sync) -> tuple[float, object]:
    """Wall seconds of run() and, in `steps`, the seconds of each decode step (each ends in a read of
    the finished flags, so its wall time is the device's)."""
    runner = sampler.runner
    decode = runner.decode

    def clocked(*a):
        t0 = time.perf_counter()
        out = decode(*a)
        steps.append(time.perf_counter() - t0)
        return out
    runner.decode = clocked
    try:
        sync()
        t0 = time.perf_counter()
        outs = run()
        sync()
        return time.perf_counter() - t0, outs
    finally:
        runner.decode = decode


@torch.no_grad()
def contract_mismatches(model: Transformer, outs, chunk: int) -> int:
    """Sequences whose recorded log-probs or routes differ (torch.equal) from model.score's, scored in
    right-padded chunks as the trainer does."""
    dev, bad = next(model.parameters()).device, 0
    for i in range(0, len(outs), chunk):
        part = outs[i:i + chunk]
        T = max(len(o.prompt) + len(o.tokens) for o in part)
        tokens = torch.zeros(len(part), T, dtype=torch.long)
        for b, o in enumerate(part):
            tokens[b, :len(o.prompt) + len(o.tokens)] = torch.tensor(o.prompt + o.tokens)
        logp, routes = model.score(tokens.to(dev))
        for b, o in enumerate(part):
            P, G = len(o.prompt), len(o.tokens)
            bad += not (torch.equal(logp[b, P - 1:P - 1 + G].cpu(), torch.tensor(o.logprobs))
                        and torch.equal(routes[b, :P + G - 1].cpu(), o.routes))
    return bad


def hf_generate_rows(rows: Rows, model, args, tiny, B, new, lo, hi) -> None:
    """transformers generate, greedy, on the same weights (loaded from our state dict), vs ours greedy."""
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: skipping its generate baseline")
        return
    sync = (lambda: None) if tiny else torch.cuda.synchronize
    p = next(model.parameters())
    hf_cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in config_to_hf(model.config).items() if k != "architectures"})
    with torch.device(p.device):                     # made on the device, then our weights copied in
        hf = transformers.Qwen3MoeForCausalLM._from_config(hf_cfg, dtype=p.dtype).eval()
    # transformers 5 stacks experts as ours: gate_up_proj (E, 2I, D) = w13, down_proj (E, D, I) = w2
    names = {"mlp.w13": "mlp.experts.gate_up_proj", "mlp.w2": "mlp.experts.down_proj"}
    state = {}
    for k, v in model.state_dict().items():
        for ours, theirs in names.items():
            k = k.replace(ours, theirs)
        state[k if k.startswith("lm_head") else "model." + k] = v
    hf.load_state_dict(state, strict=True)
    prompts = make_prompts(argparse.Namespace(**{**vars(args), "prompts": B, "min_prompt_len": lo,
                                                 "max_prompt_len": hi}), model.config.vocab_size)
    greedy = argparse.Namespace(max_new_tokens=new, temperature=0.0, seed=0)
    sampler = Sampler(model, max_batch_size=B, num_blocks=B * -(-(hi + new) // 16) + 64)
    run_ours(sampler, prompts, greedy)
    t_ours, ours = timed(lambda: (run_ours(sampler, prompts, greedy), sync())[0], 0, 1)
    dev = next(model.parameters()).device
    t_hf, theirs = timed(lambda: (run_hf_on(hf, prompts, greedy, dev), sync())[0], 0, 1)
    agree = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y)) / (B * new)
    rows.add(f"greedy ours, {B} seqs x {new}", B * new / t_ours, "")
    rows.add(f"greedy transformers generate, {B} seqs x {new}", B * new / t_hf, f"{agree:.1%} of tokens as ours")
    rows.add("greedy ours / transformers", t_hf / t_ours, "ratio")


# ---------------------------------------------------------------------------------------------------
# the mismatch lab: the same task and seeds, the rollout made to differ, each fix against it
# ---------------------------------------------------------------------------------------------------
LAB = {   # name -> train.py overrides; "fast" = batch-variant rollout kernels in a lower precision
    "invariant": [],
    "fast": ["--recompute_old_logp=true"],
    "fast+tis": ["--recompute_old_logp=true", "--correction=tis"],
    "fast+reject": ["--recompute_old_logp=true", "--correction=reject"],
    "fast+icepop": ["--recompute_old_logp=true", "--correction=icepop"],
    "fast+r3": ["--recompute_old_logp=true", "--replay=r3"],
    "fast+route_filter": ["--recompute_old_logp=true", "--route_filter=mask"],
    "fast+gspo": ["--recompute_old_logp=true", "--loss=gspo"],
    # another router: sigmoid scores, a score-correction bias (balanced during RL), a shared expert, 2 groups
    "fast+sigmoid": ["--recompute_old_logp=true", "--init_from=tiny-sigmoid", "--expert_bias_update_rate=1e-3"],
    # more remedies against the fast rollout: SAPO's soft gate, old-policy routing replay, a frozen router;
    # a dense control
    "fast+sapo": ["--recompute_old_logp=true", "--loss=sapo"],     # a soft gate in place of the hard clip
    "fast+replay_old": ["--recompute_old_logp=true", "--replay=old"],
    "fast+r3 bounded": ["--recompute_old_logp=true", "--replay=r3", "--replay_steps=1"],   # R3 on the first update only
    "fast+frozen_router": ["--recompute_old_logp=true", "--router_lr_scale=0"],
    "dense fast": ["--recompute_old_logp=true", "--init_from=tiny-dense"],
    # speculative decoding on the fast rollout: a verify step's k + 1 query rows change a batch-variant row's bits
    "fast+speculative": ["--recompute_old_logp=true", "--speculative_tokens=4"],
    # late-training drift: LAB_LONGER x --lab-steps at a constant lr, and halving it every --lab-steps
    "fast drift constant lr": ["--recompute_old_logp=true", "--lr_schedule=constant"],
    "fast drift halving": ["--recompute_old_logp=true", "--lr_schedule=halving", "--lr_decay_period={steps}"],
    # the rows below keep the invariant kernels: their one deviation is named in the row
    "int8": ["--recompute_old_logp=true", "--rollout_dtype=int8"],
    "int8+is": ["--recompute_old_logp=true", "--rollout_dtype=int8", "--correction=is"],
    "int8+tis": ["--recompute_old_logp=true", "--rollout_dtype=int8", "--correction=tis"],
    "int8+tis cap 5": ["--recompute_old_logp=true", "--rollout_dtype=int8", "--correction=tis", "--tis_cap=5"],
    "int8 fp32 router": ["--recompute_old_logp=true", "--rollout_dtype=int8", "--rollout_quant_router=false"],
    "fp8": ["--recompute_old_logp=true", "--rollout_dtype=fp8_e4m3"],
    "fp8+is": ["--recompute_old_logp=true", "--rollout_dtype=fp8_e4m3", "--correction=is"],
    "fp8+tis": ["--recompute_old_logp=true", "--rollout_dtype=fp8_e4m3", "--correction=tis"],
    "train capacity 1.25": ["--recompute_old_logp=true", "--train_capacity_factor=1.25"],
    "expert map fault": ["--recompute_old_logp=true", "--rollout_router_fault=expert_map"],   # experts 0, E-1 swapped
    **{f"sigmoid fault {f}": ["--recompute_old_logp=true", "--init_from=tiny-sigmoid", "--expert_bias_update_rate=1e-3",
                              f"--rollout_router_fault={f}"]
       for f in ("no_bias", "bias_sign", "bias_in_weights", "no_renorm", "shared_in_topk")},
    # multi-turn episodes (--task=lookup: a tool call, its answer, the answer), each with one of the ways
    # shipped systems break an episode's consistency (--rollout_episode_fault, lab.episode_fault)
    "lookup": ["--recompute_old_logp=true", "--task=lookup", "--n_digits=3"],
    **{f"lookup {f}": ["--recompute_old_logp=true", "--task=lookup", "--n_digits=3", f"--rollout_episode_fault={f}"]
       for f in ("retokenize", "dummy_last_route", "stale_prefix_kv")},
    "lookup dummy_last_route+r3": ["--recompute_old_logp=true", "--task=lookup", "--n_digits=3",
                                   "--rollout_episode_fault=dummy_last_route", "--replay=r3"],
    # asynchronous RL (asynchrony/pipeline.py) on the invariant rollout: batch j generated by version j - K and
    # trained at step j, so the train-rollout gap is staleness alone (the numerics are exactly zero); in flight, the next
    # batch takes the new version halfway through its decode steps, on the old KV or recomputing it
    **{f"stale K={k}": [f"--max_staleness={k}"] for k in (1, 2, 4)},
    **{f"stale K=2 {m}": ["--max_staleness=2", f"--inflight_update={m}"] for m in ("keep_kv", "recompute_kv")},
    "stale K=4 decoupled": ["--max_staleness=4", "--recompute_old_logp=true"],   # the clip around the current policy
    "stale K=4 decoupled+tis": ["--max_staleness=4", "--recompute_old_logp=true", "--correction=tis"],
    "lookup K=2": ["--recompute_old_logp=true", "--task=lookup", "--n_digits=3", "--max_staleness=2"],
    # partial rollouts: a response unfinished after max_new_tokens // 2 tokens continues in the next batch
    "stale K=1 partial": ["--max_staleness=1", "--partial_rollout=true"],
    # LoRA (lora/) in a bf16 trainer: the adapter run unmerged by the sampler, and merged into the bf16 weights
    # after each update as engines refit (--lora_rollout=merged); LoRA at three times full fine-tuning's learning rate (ten times collapses here: docs/results.md)
    "lora bf16": ["--recompute_old_logp=true", "--dtype=bfloat16", "--lora_rank=16", "--lr=3e-3"],
    "lora bf16 merged": ["--recompute_old_logp=true", "--dtype=bfloat16", "--lora_rank=16", "--lr=3e-3",
                         "--lora_rollout=merged"],
    # the 2026 families' attention at tiny sizes: gpt-oss (sinks, a sliding window) and MLA (a latent KV cache),
    # invariant and on the fast rollout (SDPA with the sink as an extra key / the expanded MLA, in bf16)
    **{f"{family}{fast}": ["--recompute_old_logp=true", f"--init_from=tiny-{preset}"]
       for family, preset in (("gpt-oss", "gpt-oss"), ("mla", "mla")) for fast in ("", " fast")},
    # the linear-attention hybrid (hybrids/: Gated DeltaNet layers on the grid), and its rollout decoding them
    # recurrently as engines do (--rollout_linear_decode=recurrent), the invariant kernels otherwise
    "hybrid": ["--recompute_old_logp=true", "--init_from=tiny-hybrid"],
    "hybrid recurrent decode": ["--recompute_old_logp=true", "--init_from=tiny-hybrid", "--rollout_linear_decode=recurrent"],
}
LAB_FAST = [name for name in LAB if name == "fast" or name.startswith(("fast+", "fast drift")) or name.endswith(" fast")]
LAB_LONGER = {"fast drift constant lr": 3, "fast drift halving": 3}    # these rows run 3 x --lab-steps


def bench_lab(args) -> list[tuple[str, float, str]]:
    import train
    from config import RolloutConfig, TrainConfig, apply_overrides, parse_args
    fast = ["--rollout_mode=fast", f"--rollout_dtype={args.lab_rollout_dtype}"] + \
        (["--router_bf16=true"] if args.lab_router_bf16 else [])
    runs = [r.strip() for r in args.lab_runs.split(",") if r.strip()] or list(LAB)
    unknown = [r for r in runs if r not in LAB]
    if unknown:
        raise SystemExit(f"--lab-runs: unknown {unknown}; choose from {list(LAB)}")
    seeds = list(dict.fromkeys(int(x) for x in args.lab_seeds.split(",") if x.strip())) or [args.seed]
    starts = lab_sft_starts(args, runs, seeds[0]) if args.lab_sft_steps else {}
    results = {name: [] for name in runs}                                # name -> [(history, wall s)] per seed
    for seed in seeds:
        for name in runs:
            row = [a.format(steps=args.lab_steps) for a in LAB[name]]
            row += [f"--init_from={starts[lab_preset(row)]}"] if starts else []
            argv = [f"--steps={args.lab_steps * LAB_LONGER.get(name, 1)}", f"--seed={seed}",
                    f"--out_dir={args.lab_out}/{name}/seed{seed}", "--progress=false", "--save_every=1000000",
                    "--overwrite=true"] + row + (fast if name in LAB_FAST else [])
            tcfg, rcfg = TrainConfig(), RolloutConfig()
            apply_overrides(parse_args(argv + args.lab_args.split()), tcfg, rcfg)
            t0 = time.perf_counter()
            results[name].append((train.train(tcfg, rcfg), time.perf_counter() - t0))
            print(f"lab: {name} seed {seed} done in {results[name][-1][1]:.0f} s", flush=True)
    print(f"\nmismatch lab: {args.lab_steps} steps each, seeds {seeds}; fast = batch-variant rollout kernels, "
          f"rollout weights in {args.lab_rollout_dtype}{', router logits in bf16' if args.lab_router_bf16 else ''}; "
          f"the trainer is invariant fp32 in every run. Reward: mean of the last tenth of each run, then mean "
          f"(and sample sd) over seeds; the other columns pool all steps of all seeds.")
    head = ("run", "final reward", "per seed", "mean k3 KL", "max k3 KL", "max |dlogp|", "extreme tok",
            "route flips", "wall s")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, per_seed in results.items():
        finals = []
        for hist, _ in per_seed:
            n = max(1, len(hist) // 10)
            finals.append(sum(h["reward_mean"] for h in hist[-n:]) / n)
        mean = sum(finals) / len(finals)
        sd = (sum((f - mean) ** 2 for f in finals) / (len(finals) - 1)) ** 0.5 if len(finals) > 1 else 0.0
        steps = [h for hist, _ in per_seed for h in hist]
        kl = [h["train_rollout_k3"] for h in steps]
        cells = (name, f"{mean:.3f}" + (f" ± {sd:.3f}" if len(finals) > 1 else ""), " ".join(f"{f:.2f}" for f in finals),
                 f"{sum(kl) / len(kl):.2e}", f"{max(kl):.2e}", f"{max(h['logp_max_abs_diff'] for h in steps):.2e}",
                 f"{sum(h['extreme_token_frac'] for h in steps) / len(steps):.2e}",
                 f"{sum(h.get('route_flip_frac') or 0.0 for h in steps) / len(steps):.2e}",
                 f"{sum(w for _, w in per_seed):.0f}")
        print("| " + " | ".join(cells) + " |")
    lab_figure(results, args.lab_out, seeds[0])
    return []


def lab_preset(row: list[str]) -> str:
    """The model preset a lab row starts from: its own --init_from, else train.py's default."""
    from config import TrainConfig
    return next((a.split("=", 1)[1] for a in row if a.startswith("--init_from=")), TrainConfig().init_from)


def lab_sft_starts(args, runs: list[str], seed: int) -> dict[str, str]:
    """--lab-sft-steps=N: the rows start from supervised weights, as post-training does, not from random
    ones (a frozen router is then a trained router frozen). One checkpoint per model preset among the rows,
    --lab-sft-steps steps of tooling/sft.py at the first seed (then one RL step, whose checkpoint is not used):
    preset -> the folder of its ckpt-000000, which every row and seed of that preset starts from."""
    import train
    from config import RolloutConfig, TrainConfig, apply_overrides, parse_args
    from tooling.options import supervised_tasks
    rows = {name: [a.format(steps=args.lab_steps) for a in LAB[name]] for name in runs}
    unsupervised = [name for name, row in rows.items()
                    if next((a.split("=", 1)[1] for a in row if a.startswith("--task=")), "copy") not in supervised_tasks()]
    if unsupervised:
        raise SystemExit(f"--lab-sft-steps: {unsupervised} train a task without reference answers "
                         f"(those with them: {', '.join(supervised_tasks())}); leave them out of --lab-runs")
    starts = {}
    for preset in dict.fromkeys(lab_preset(row) for row in rows.values()):
        out = f"{args.lab_out}/sft-{preset}"
        argv = ["--steps=1", f"--sft_steps={args.lab_sft_steps}", f"--init_from={preset}", f"--seed={seed}",
                f"--out_dir={out}", "--progress=false", "--save_every=1000000", "--overwrite=true"]
        tcfg, rcfg = TrainConfig(), RolloutConfig()
        apply_overrides(parse_args(argv + args.lab_args.split()), tcfg, rcfg)
        hist = train.train(tcfg, rcfg)
        print(f"lab: {args.lab_sft_steps} supervised steps on {preset}: the RL step after them earns "
              f"{hist[-1]['reward_mean']:.3f}; the rows of {preset} start from {out}/ckpt-000000", flush=True)
        starts[preset] = f"{out}/ckpt-000000"
    return starts


def lab_figure(results: dict, out: str, seed: int) -> None:
    """The lab's runs (first seed) in one figure next to the table; skipped, with a note, without matplotlib."""
    from tooling import plot
    try:
        path = plot.plot_runs({name: runs[0][0] for name, runs in results.items()}, os.path.join(out, "lab.png"),
                              f"mismatch lab, seed {seed}")
        print(f"figure: {path}")
    except SystemExit as e:                                          # matplotlib missing: the table stands alone
        print(f"no figure: {e}")


# ---------------------------------------------------------------------------------------------------
# asynchronous RL: the synchronous loop against rollout ranks, 2 gloo processes each
# ---------------------------------------------------------------------------------------------------
ASYNC_RUNS = {"synchronous, 2 ranks": [], "rollout_ranks=1, K=1": ["--rollout_ranks=1", "--max_staleness=1"]}




def bench_async(args) -> list[tuple[str, float, str]]:
    """Tokens/s of `train.py` on 2 processes: both ranks rolling out then training in turn (DDP), against
    one rank generating while the other trains (--rollout_ranks=1, K=1). A long-tailed response mix: the
    tiny model at its start stops at its rare EOS, so lengths run from 1 to --async-max-new; --lr=0 keeps
    that mix over the steps. The runs take turns (A B A B); a run's rate is its policy tokens over the
    trainer's step times, its first step (start-up) left out."""
    import subprocess
    import tempfile
    common = ["--device=cpu", "--task=copy", "--n_digits=4", f"--max_new_tokens={args.async_max_new}",
              "--prompts_per_step=16", "--group_size=4", "--minibatch_size=64", "--lr=0", f"--steps={args.async_steps}",
              "--save_every=1000000", "--progress=false", "--overwrite=true"]
    rates = {name: [] for name in ASYNC_RUNS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for name, extra in ASYNC_RUNS.items():
                out = os.path.join(tmp, f"run{len(rates[name])}")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                       os.path.join(ROOT, "train.py"), *common, f"--out_dir={out}", *extra]
                r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                   env=dict(os.environ, OMP_NUM_THREADS="1"))
                if r.returncode:
                    raise SystemExit(f"bench async: {name} failed:\n{r.stderr[-2000:]}")
                rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))][1:]
                tokens = sum(row["response_len"] * 16 * 4 for row in rows)
                rates[name].append(tokens / sum(row["step_time"] for row in rows))
    med = {name: sorted(v)[len(v) // 2] for name, v in rates.items()}
    sync, split = med.values()
    print(f"async: {args.async_steps} steps of 16 prompts x 4, responses of 1..{args.async_max_new} tokens (EOS "
          f"at random), 2 gloo processes, {args.repeats} runs each, medians")
    return [(f"async: {name}", v, "policy tok/s") for name, v in med.items()] + \
        [("async: rollout_ranks=1 K=1 / synchronous", split / sync, "ratio")]


BENCHMARKS = {"rollout": bench_rollout, "forward": bench_forward, "fast": bench_fast, "packing": bench_packing, "moe": bench_moe,
              "decode": bench_decode, "sessions": bench_sessions, "async": bench_async, "ep": bench_ep, "reduce": bench_reduce,
              "speculative": bench_speculative, "window": bench_window, "gpu": bench_gpu,
              "lab": bench_lab, "memory": bench_memory, "lora": bench_lora, "gdn": bench_gdn}
DEFAULT = "rollout,forward,fast,packing,moe,ep,decode"


# ---------------------------------------------------------------------------------------------------
def worker_options(p: argparse.ArgumentParser) -> None:
    """The options of the sections that launch a torchrun job (ep, reduce), and their workers' flags."""
    p.add_argument("--ep-worker", action="store_true", help=argparse.SUPPRESS)   # one rank of the ep section's job
    p.add_argument("--reduce-procs", type=int, default=2, help="reduce: gloo processes of the timed torchrun job")
    p.add_argument("--reduce-budget", type=int, default=256, help="reduce: a --micro_batch_tokens with several "
                   "micro-batches a rank (the main job's minibatch is ~1400 tokens)")
    p.add_argument("--reduce-steps", type=int, default=4, help="reduce: train.py steps per timed run")
    p.add_argument("--reduce-worker", action="store_true", help=argparse.SUPPRESS)


def lab_options(p) -> None:
    """The lab section's options (tooling/bench.py --only lab)."""
    p.add_argument("--lab-steps", type=int, default=150, help="train.py steps per mismatch-lab run")
    p.add_argument("--lab-rollout-dtype", default="bfloat16", help="the fast rollout's weight dtype")
    p.add_argument("--lab-router-bf16", action="store_true", help="also round the fast rollout's router logits to bf16")
    p.add_argument("--lab-out", default="out/lab", help="where the lab runs write their metrics")
    p.add_argument("--lab-runs", default="", help=f"comma-separated subset of the lab runs (default all: {','.join(LAB)})")
    p.add_argument("--lab-args", default="", help="extra train.py overrides for every lab run, space-separated")
    p.add_argument("--lab-sft-steps", type=int, default=0, help="start every row from one supervised checkpoint "
                   "per model preset, this many tooling/sft.py steps (0: from the preset's random weights)")
    p.add_argument("--lab-seeds", default="", help="comma-separated seeds, each lab run repeated per seed "
                   "(default: --seed alone); the table gives the reward's mean and sd over seeds")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--only", default=DEFAULT,
                   help=f"comma-separated sections to run, from: {', '.join(BENCHMARKS)} (lab is long: run it alone)")
    p.add_argument("--preset", default="tiny", help="config.ModelConfig preset")
    p.add_argument("--prompts", type=int, default=32, help="number of prompts")
    p.add_argument("--min-prompt-len", type=int, default=8)
    p.add_argument("--max-prompt-len", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (then tokens are cross-checked)")
    p.add_argument("--score-batch", type=int, default=64)
    p.add_argument("--lora-rank", type=int, default=16, help="lora: the adapters' rank")
    p.add_argument("--score-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--traceback", action="store_true", help="a failing section prints its traceback too")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (0: torch's default). 1 by default: on a shared CPU, "
                        "multi-threaded runs slowed down unevenly, by up to 10x, and skewed the ratios")
    p.add_argument("--skip-nocache", action="store_true", help="leave out the (slow) no-cache loop")
    p.add_argument("--pack-seqs", type=int, default=32, help="packing: responses in the long-tailed mix")
    p.add_argument("--pack-micro-batch", type=int, default=8, help="packing: sequences per padded micro-batch")
    p.add_argument("--micro-batch-tokens", type=int, default=1024, help="packing: token budget per packed micro-batch")
    p.add_argument("--turns", type=int, default=4, help="sessions: policy turns per episode")
    p.add_argument("--turn-tokens", type=int, default=16, help="sessions: new tokens per turn (and per chunked prompt)")
    p.add_argument("--obs-tokens", type=int, default=16, help="sessions: observation ids between two turns")
    p.add_argument("--chunk-tokens", type=int, default=64, help="sessions: the chunked prefill's max_num_batched_tokens")
    p.add_argument("--shared-prefix", type=int, default=64, help="sessions: ids that open every prompt of the "
                   "shared-prefix rows (an agent's system prompt)")
    p.add_argument("--spec-prompts", type=int, default=4, help="speculative: copy-task prompts (a small batch: "
                   "on a CPU a verify step's k + 1 rows cost what one does only while they fit a matmul tile)")
    p.add_argument("--spec-digits", type=int, default=48, help="speculative: digits per copy prompt (and its answer)")
    p.add_argument("--spec-tokens", type=int, default=4, help="speculative: drafts per verify step (speculative_tokens)")
    p.add_argument("--window-new-tokens", type=int, default=200, help="window: new tokens per sequence (at most the "
                   "preset's context less --max-prompt-len)")
    p.add_argument("--moe-tokens", type=int, default=2048, help="tokens through the MoE layer in the moe section")
    p.add_argument("--ep-procs", type=int, default=2, help="ep: processes (ranks) of the torchrun job, the EP degree")
    worker_options(p)                                  # the ep and reduce sections' options, their workers' flags
    p.add_argument("--gpu-layers", type=int, default=4, help="gpu: layers of the Qwen3-30B-A3B-shaped model")
    p.add_argument("--gpu-batches", default="256,64,1024",
                   help="gpu: sequences per rollout, comma-separated (the first is also profiled)")
    p.add_argument("--max-new-tokens-gpu", type=int, default=128, help="gpu: new tokens per sequence")
    p.add_argument("--cpu-smoke", action="store_true", help="gpu: run its code once on the CPU at tiny sizes")
    p.add_argument("--tuning", default="", help="Triton tile configs from this file (tools/gpu_check.py "
                   "--tuning-out writes it; kernels_triton/tuning.py)")
    p.add_argument("--async-steps", type=int, default=6, help="train.py steps per async run (the first is start-up)")
    p.add_argument("--async-max-new", type=int, default=48, help="async: the longest response (most end at random EOS)")
    lab_options(p)
    args = p.parse_args(argv)
    if args.ep_worker or args.reduce_worker:
        if args.threads:
            torch.set_num_threads(args.threads)
        return ep_worker(args) if args.ep_worker else reduce_worker(args)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in sections if s not in BENCHMARKS]
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {list(BENCHMARKS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        p.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    if args.tuning:
        from kernels_triton.tuning import load_tuning
        try:
            print(f"tile configs from {args.tuning}: {load_tuning(args.tuning)}")
        except ValueError as e:
            p.error(str(e))

    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cores} cores, "
          f"load average {load:.1f}, preset {args.preset!r}, fp32 CPU")
    if torch.get_num_threads() > 1 and load > 0.5 * cores:
        print("note: the machine is busy; multi-threaded CPU runs then slow down unevenly (OpenMP "
              "threads wait on each other), which skews ratios. --threads 1 gives steadier numbers.")
    failed = run_sections(sections, args)
    if failed:
        raise SystemExit(1)


def run_sections(sections: list[str], args) -> list[str]:
    """Run each section and print its rows as soon as it finishes, so a later section that fails (or
    a run stopped midway) keeps what was measured. A section that raises is one line on stderr (its
    traceback with --traceback) and the rest still run. Returns the names of the failed sections."""
    failed, t0 = [], time.perf_counter()
    for name in sections:
        t = time.perf_counter()
        try:
            rows = BENCHMARKS[name](args)
        except (Exception, SystemExit) as e:              # SystemExit: a section's bad input or failed job
            sys.stdout.flush()
            if args.traceback:
                traceback.print_exc()
            print(f"section {name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            failed.append(name)
            continue
        print_rows(name, rows, time.perf_counter() - t)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if failed:
        print(f"{len(failed)} of {len(sections)} sections failed: {', '.join(failed)}", file=sys.stderr)
    return failed


def print_rows(name: str, rows: list[tuple[str, float, str]], seconds: float) -> None:
    """One section's table: a line naming it, then its rows under the column heads."""
    if not rows:                                         # a section that printed its own table (lab) or skipped
        return
    width = max(len(r[0]) for r in rows)
    print(f"\n{name} section, {seconds:.0f} s:\n{'benchmark':<{width}}  {'tokens/s':>12}  note")
    for row in rows:
        print(row_text(*row, width))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
