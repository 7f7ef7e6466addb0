"""A simulation (not a measurement) of what asynchronous RL gains over the synchronous loop on N GPUs.

    python tools/async_sim.py                        # the Qwen3-30B-A3B-shaped defaults below, 8 and 64 GPUs
    python tools/async_sim.py --gpus 8 --decode-ms 264 --decode-ms-per-seq 0.05 --train-tok-s 4200

One RL step: P prompts x G responses with long-tailed lengths (lognormal, capped at --max-len), then
an update over every token. Synchronous (colocated): every GPU rolls out its share of the sequences,
one decode step per position of its longest one (each step costs decode_ms + decode_ms_per_seq x the
sequences still running, the shape measured on the sampler: nearly flat in the batch), then every GPU
trains on the step's tokens; the step takes the slowest GPU's rollout plus the update. Asynchronous
(`--rollout_ranks=R`, `--max_staleness=1`): R GPUs roll out while N - R train on the batch before, so
a step takes the longer of the two; the best R is reported. Per-phase inputs are measured numbers,
scaled: the defaults are the H200's 4-layer Qwen3-30B-A3B-shaped rows of ../shared/gpu (22 ms per
decode step at 256 sequences, a 49.9k tok/s trainer forward+backward) times 12 for 48 layers. Nothing
here runs a model: the output is what the arithmetic of those numbers gives, stated as simulated.
"""
from __future__ import annotations

import argparse
import math
import random


def lengths(n: int, median: int, sigma: float, cap: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [max(1, min(cap, round(median * math.exp(rng.gauss(0.0, sigma))))) for _ in range(n)]


def rollout_seconds(seqs: list[int], gpus: int, args) -> float:
    """The slowest GPU's decode time for its share (sequences dealt round-robin, longest first): one step
    per position of its longest sequence, each costing decode_ms plus decode_ms_per_seq per sequence
    still running, so sum over steps = decode_ms x longest + decode_ms_per_seq x its tokens."""
    ordered = sorted(seqs, reverse=True)
    shares = [ordered[g::gpus] for g in range(gpus)]
    return max(args.decode_ms * max(s) + args.decode_ms_per_seq * sum(s) for s in shares if s) / 1e3


def simulate(gpus: int, args) -> dict:
    seqs = lengths(args.prompts * args.group, args.median_len, args.sigma, args.max_len, args.seed)
    tokens = sum(seqs)
    sync = rollout_seconds(seqs, gpus, args) + tokens / (gpus * args.train_tok_s)
    best = min((max(rollout_seconds(seqs, r, args), tokens / ((gpus - r) * args.train_tok_s)), r)
               for r in range(1, gpus))
    return {"gpus": gpus, "tokens": tokens, "sync_s": sync, "async_s": best[0], "rollout_gpus": best[1],
            "speedup": sync / best[0]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 64])
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--group", type=int, default=16)
    p.add_argument("--median-len", type=int, default=1024)
    p.add_argument("--sigma", type=float, default=0.8, help="the lognormal spread of the response lengths")
    p.add_argument("--max-len", type=int, default=16384)
    p.add_argument("--decode-ms", type=float, default=264.0, help="a decode step's fixed cost (22 ms x 12 layers' worth)")
    p.add_argument("--decode-ms-per-seq", type=float, default=0.05, help="its cost per running sequence")
    p.add_argument("--train-tok-s", type=float, default=4160.0, help="trainer tokens/s per GPU (49.9k / 12)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print("SIMULATED (tools/async_sim.py: per-phase times in, arithmetic out):")
    for gpus in args.gpus:
        r = simulate(gpus, args)
        print(f"  {gpus} GPUs, {r['tokens']} tokens a step: synchronous {r['sync_s']:.0f} s, asynchronous K=1 "
              f"{r['async_s']:.0f} s with {r['rollout_gpus']} rollout GPUs: {r['speedup']:.2f}x")


if __name__ == "__main__":
    main()
