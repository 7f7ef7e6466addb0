"""Does the train-rollout gap grow with a response's length and an episode's turns? The lab's answer at this
scale: the fast rollout (batch-variant kernels, bf16 weights) and the int8 rollout, on the copy task at three
response lengths and on the multi-turn tasks (lookup, fix), several seeds, each step's gap split by a token's
index in its response and by its turn (--mismatch_split, lab/observe.MismatchSplit).

    python -m lab.lengths                              # 30 steps, seeds 0,1,2 -> out/lab-lengths/
    python -m lab.lengths --steps 2 --seeds 0 --runs "fast copy 8,fast lookup"
    python -m lab.lengths --report                     # the tables and figure of the runs already in --out

Prints one table by position and one by turn (the mean over steps and seeds of each bucket's k3 KL,
extreme-token fraction and route-flip fraction; "-" where no token fell in it) and draws lab-lengths.png.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROLLOUTS = {"fast": ["--rollout_mode=fast", "--rollout_dtype=bfloat16"], "int8": ["--rollout_dtype=int8"]}
LENGTHS = (8, 32, 128)                 # copy: digits in the prompt, the response one more (its EOS)
EPISODES = ("lookup", "fix")           # a tool call and its answer; attempts and the environment's feedback
RUNS = {**{f"{r} copy {n}": ROLLOUTS[r] + [f"--n_digits={n}"] for r in ROLLOUTS for n in LENGTHS},
        **{f"{r} {task}": ROLLOUTS[r] + [f"--task={task}", "--n_digits=3"] for r in ROLLOUTS for task in EPISODES}}
COMMON = ["--recompute_old_logp=true", "--mismatch_split=true", "--max_position_embeddings=320",   # 128 + 129 fit
          "--save_every=1000000", "--progress=false", "--overwrite=true"]
POSITION_NAMES = ("1-8", "9-32", "33-128", ">128")
TURN_NAMES = ("turn 1", "turn 2", "turn 3", "turn 4+")
MEASURES = (("kl", "k3 KL"), ("extreme", "extreme tokens"), ("flips", "route flips"))


def run_all(runs: list[str], seeds: list[int], steps: int, prompts: int, group: int, out: str) -> dict:
    """{run: [metrics rows of every step of every seed]}."""
    import train
    from config import RolloutConfig, TrainConfig, apply_command_line, parse_args
    rows = {name: [] for name in runs}
    for seed in seeds:
        for name in runs:
            argv = RUNS[name] + COMMON + [f"--steps={steps}", f"--seed={seed}", f"--prompts_per_step={prompts}",
                                          f"--group_size={group}", f"--minibatch_size={prompts * group}",
                                          f"--out_dir={out}/{name.replace(' ', '_')}/seed{seed}"]
            tcfg, rcfg = TrainConfig(), RolloutConfig()
            apply_command_line(parse_args(argv), tcfg, rcfg)
            t0 = time.perf_counter()
            rows[name] += train.train(tcfg, rcfg)
            print(f"lab.lengths: {name} seed {seed} done in {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def read_runs(runs: list[str], seeds: list[int], out: str) -> dict:
    """{run: rows} of the runs --out already holds (a run's seeds that are missing are left out)."""
    import json
    rows = {}
    for name in runs:
        for seed in seeds:
            path = os.path.join(out, name.replace(" ", "_"), f"seed{seed}", "metrics.jsonl")
            if os.path.isfile(path):
                with open(path) as f:
                    rows.setdefault(name, []).extend(json.loads(line) for line in f if line.strip())
    if not rows:
        raise SystemExit(f"error: no run of {runs} under {out}: run python -m lab.lengths first")
    return rows


def bucket_means(rows: list[dict], key: str) -> list[float | None]:
    """Each bucket's mean over the steps that had a token in it (None: no step did)."""
    lists = [r[key] for r in rows if isinstance(r.get(key), list)]
    out = []
    for b in range(max((len(v) for v in lists), default=0)):
        vals = [v[b] for v in lists if v[b] is not None]
        out.append(sum(vals) / len(vals) if vals else None)
    return out


def table(results: dict, split: str, names: tuple[str, ...]) -> str:
    """A markdown table: a row per run, a column per (measure, bucket)."""
    head = ["run"] + [f"{label} {b}" for _, label in MEASURES for b in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rows in results.items():
        cells = [name]
        for key, _ in MEASURES:
            means = bucket_means(rows, f"{key}_by_{split}") + [None] * len(names)
            cells += ["-" if v is None else f"{v:.2e}" for v in means[:len(names)]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(results: dict, path: str) -> str | None:
    """Three panels by position, three by turn: a line per run that has tokens there."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no figure: plotting needs matplotlib (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for row, (split, names) in enumerate((("position", POSITION_NAMES), ("turn", TURN_NAMES))):
        for ax, (key, label) in zip(axes[row], MEASURES):
            drawn = []
            for i, (name, rows) in enumerate(results.items()):
                means = bucket_means(rows, f"{key}_by_{split}")
                pts = [(b, v) for b, v in enumerate(means) if v is not None]
                if split == "turn" and len(pts) < 2:                  # single-turn runs: one point, all of it
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i % 10}",
                        ls="-" if name.startswith("fast") else "--", label=name)
                drawn += [p[1] for p in pts]
            ax.set_xticks(range(len(names)), names, fontsize=8)
            ax.set_title(f"{label} by {split}", fontsize=10)
            if drawn and not any(drawn):                                  # a flat zero line would hide that it is exact
                ax.text(0.5, 0.75, "0 in every bucket of every run", ha="center", va="center", transform=ax.transAxes)
            ax.set_yscale("log" if drawn and min(drawn) > 0 else "linear")
            ax.grid(alpha=0.3)
    for ax in (axes[0][0], axes[1][0]):
        if ax.get_legend_handles_labels()[0]:                         # the by-turn row: multi-turn runs only
            ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", default="", help=f"comma-separated subset (default all: {', '.join(RUNS)})")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=30, help="train.py steps per run")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="responses per prompt")
    p.add_argument("--out", default="out/lab-lengths")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--report", action="store_true", help="only the tables and figure of the runs in --out")
    args = p.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()] or list(RUNS)
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        raise SystemExit(f"error: --runs: unknown {unknown}; choose from {list(RUNS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    results = (read_runs(runs, seeds, args.out) if args.report else
               run_all(runs, seeds, args.steps, args.prompts, args.group, args.out))
    print(f"\nthe gap by a token's index in its response ({args.steps} steps x seeds {seeds}; mean over steps):")
    print(table(results, "position", POSITION_NAMES))
    print("\nthe gap by turn (a single-turn response is all turn 1):")
    print(table(results, "turn", TURN_NAMES))
    path = figure(results, os.path.join(args.out, "lab-lengths.png"))
    if path:
        print(f"figure: {path}")
    finite = [v for rows in results.values() for r in rows for v in [r.get("train_rollout_k3")]
              if isinstance(v, float) and math.isfinite(v)]
    print(f"({len(finite)} steps in all)")


if __name__ == "__main__":
    main(sys.argv[1:])
