"""Figures of one or more runs' metrics (out_dir/metrics.jsonl), one line per run.

    python -m tooling.plot out                         # -> out/plots/metrics.png
    python -m tooling.plot out/lab/invariant/seed0 out/lab/fast/seed0 --labels invariant,fast
    python -m tooling.plot RUN [RUN ...] --out fig.png
    python -m tooling.plot out --observations          # -> out/plots/observations.png (OBSERVATIONS)

Panels against the training step: reward (mean, and its std within the batch), response length, loss,
clip fraction, train-rollout KL (k3), max |logp diff|, route flips, the IS ratio range (min and max,
shaded), grad norm, entropy, and the route flips binned by the trainer's margin (one line style per bin);
then, whenever a run logged them, the held-out eval (greedy and sampled reward; pass@1 and pass@k, at the
eval steps), the expert load (the busiest expert over the mean: the worst layer's and the layers' mean) and
the rollout latency (p50 / p95 / p99 of the seconds a sequence took to finish within its step). A panel
asking for a log axis gets one only when every value drawn in
it is positive (else linear); a panel whose values are one constant in every run (zero mismatch in the
invariant mode) says so in words instead of drawing a flat line. A metric a run did not log (or logged
as null) is left out of that run's line. Needs matplotlib (`pip install matplotlib`); plotting is the only
thing in the project that does.
Multi-turn runs add turns per episode, each turn's reward, the environment's share of the tokens and the
prefix cache's hits (EPISODE_PANELS). A response-length surge (length_surge, --surge_window) is marked on
the response length panel by a dotted vertical line in the run's color.
--observations draws one figure of what a long run is watched for instead: reward, response length, the
rollout latency's tail (p95 / p99) and the expert load, side by side (OBSERVATIONS), and with --log_hotness
the per-request hotness's p50 / p90 / max beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# (metric key, panel title, y scale): "log" where the values span decades (used only if all are > 0)
PANELS = [
    ("reward_mean", "reward (mean)", "linear"),
    ("reward_std", "reward std (within the batch)", "linear"),
    ("response_len", "response length (tokens)", "linear"),
    ("loss", "loss", "linear"),
    ("clip_frac", "clip fraction", "linear"),
    ("train_rollout_k3", "train-rollout KL (k3, per token)", "log"),
    ("logp_max_abs_diff", "max |logp train - logp rollout|", "log"),
    ("route_flip_frac", "route flips (token, layer decisions)", "log"),
    (("is_ratio_min", "is_ratio_max"), "IS ratio pi_old / mu (min..max)", "linear"),
    ("grad_norm", "grad norm (before clipping)", "log"),
    ("entropy", "entropy of softmax(logits / T)", "linear"),
    ("route_flip_frac_by_margin", "route flips by trainer margin", "symlog"),
]
# a list metric: one line per bin, told apart by line style (replay.MARGIN_BINS)
BIN_STYLES = {"route_flip_frac_by_margin": (("-", "< 1e-4"), ("--", "< 1e-3"), (":", "< 1e-2"), ("-.", ">= 1e-2")),
              "turn_reward": (("-", "turn 1"), ("--", "turn 2"), (":", "turn 3"), ("-.", "turn 4"))}
# panels of several metrics, one line style each: (metric, or the start of its name, style, label); a list
# metric (one value per layer) is drawn as its mean. Drawn only when a run logged one of their metrics.
LINE_SETS = {
    "eval_reward": (("eval_greedy_reward", "-", "greedy"), ("eval_sampled_reward", "--", "sampled")),
    "eval_pass": (("eval_greedy_pass", "-", "pass@1 (greedy)"), ("eval_pass@", "--", "pass@k (sampled)")),
    "expert_load": (("expert_load_max", "-", "worst layer"), ("load_imbalance_layer", ":", "mean over layers")),
    "rollout_latency": (("rollout_latency_p50", "-", "p50"), ("rollout_latency_p95", "--", "p95"),
                        ("rollout_latency_p99", ":", "p99")),
    "rollout_tail": (("rollout_latency_p95", "--", "p95"), ("rollout_latency_p99", ":", "p99")),
    "request_hot_frac": (("request_hot_frac_p50", "-", "p50"), ("request_hot_frac_p90", "--", "p90"),
                         ("request_hot_frac_max", ":", "max")),
}
OPTIONAL = [("eval_reward", "held-out reward (--eval_data)", "linear"),
            ("eval_pass", "held-out pass rate", "linear"),
            ("expert_load", "expert load (busiest / mean)", "linear"),
            ("rollout_latency", "rollout latency per sequence (s)", "log")]
# --observations: one figure of what a long run is watched for (docs/design.md, "What the routes say")
OBSERVATIONS = [("reward_mean", "reward (mean)", "linear"),
                ("response_len", "response length (tokens)", "linear"),
                ("rollout_tail", "rollout latency tail per sequence (s)", "log"),
                ("expert_load", "expert load (busiest / mean)", "linear")]
# beside them when a run logged it (--log_hotness): the spread of its requests' hotness, step by step
OBSERVED_REQUESTS = [("request_hot_frac", "per-request hotness (busiest expert's share)", "linear")]
# single metrics drawn when a run logged them: multi-turn episodes (runlog.episode_metrics), the prefix cache
EPISODE_PANELS = [("episode_turns", "turns per episode", "linear"),
                  ("turn_reward", "reward of each turn (mean)", "linear"),
                  ("observation_token_frac", "environment's share of the tokens", "linear"),
                  ("prefix_hit_rate", "prefix-cache hit rate (tokens served)", "linear"),
                  ("prefilled_tokens", "tokens prefilled (the cache's hits not)", "linear")]


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of run_dir/metrics.jsonl; one line per error naming the file and line."""
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"error: {path} not found; pass the out_dir of a run (it holds metrics.jsonl)")
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {path}, line {i}: not JSON ({e.msg}); fix or remove that line") from None
    rows = [r for r in rows if r.get("phase") != "sft"]             # --sft_steps' rows (step 0): the panels are RL's
    if not rows:
        raise SystemExit(f"error: {path} has no rows yet")
    return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that hold a number for key."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def set_series(rows: list[dict], metric: str) -> tuple[list[int], list[float], str]:
    """(steps, values, the key) of a LINE_SETS metric: its name, or the first logged key it starts (eval_pass@k);
    a list (per layer) as its mean."""
    key = metric if not metric.endswith("@") else next((k for r in rows for k in r if k.startswith(metric)), metric)
    pts = [(r["step"], sum(v) / len(v) if isinstance(v, list) else v) for r in rows
           if isinstance(v := r.get(key), (int, float)) or (isinstance(v, list) and v and
                                                           all(isinstance(x, (int, float)) for x in v))]
    return [p[0] for p in pts], [p[1] for p in pts], key


def panels(runs: dict[str, list[dict]]) -> list[tuple]:
    """PANELS, then each OPTIONAL or EPISODE panel some run logged a metric of."""
    return PANELS + [p for p in OPTIONAL + EPISODE_PANELS if panel_values(runs, p[0])]


def panel_values(runs: dict[str, list[dict]], key) -> list[float]:
    """Every value a panel would draw, over all runs (both ends of a range)."""
    if key in LINE_SETS:
        return [v for rows in runs.values() for m, _, _ in LINE_SETS[key] for v in set_series(rows, m)[1]]
    if key in BIN_STYLES:                                              # a list metric: every bin's values
        return [v for rows in runs.values() for b in range(len(BIN_STYLES[key])) for v in bin_series(rows, key, b)[1]]
    keys = key if isinstance(key, tuple) else (key,)
    return [v for rows in runs.values() for k in keys for v in series(rows, k)[1]]


def constant_value(values: list[float]) -> float | None:
    """The one value of a panel that never changes (None if it does, or holds nothing)."""
    return values[0] if values and all(v == values[0] for v in values) else None


def y_scale(requested: str, values: list[float]) -> str:
    """A log axis only for positive quantities: anything <= 0 in the panel makes it linear."""
    if requested == "symlog":                                          # zero and small positive values together
        return "symlog"
    return "log" if requested == "log" and values and min(values) > 0 else "linear"


def bin_series(rows: list[dict], key: str, i: int) -> tuple[list[int], list[float]]:
    """(steps, values) of bin i of a list metric, from the rows that logged it (and that many bins)."""
    pts = [(r["step"], r[key][i]) for r in rows
           if isinstance(r.get(key), list) and len(r[key]) > i and isinstance(r[key][i], (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_runs(runs: dict[str, list[dict]], out_path: str, title: str = "", shown: list[tuple] | None = None) -> str:
    """Draw every panel (shown, else panels(runs)) for every run into one PNG; returns its path."""
    try:
        import matplotlib
        matplotlib.use("Agg")                                          # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: plotting needs matplotlib: pip install matplotlib") from None
    cols, shown = 4, panels(runs) if shown is None else shown
    n_rows = -(-len(shown) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(4.2 * cols, 3.2 * n_rows), squeeze=False)
    for ax, (key, name, scale) in zip(axes.flat, shown):
        draw_panel(ax, runs, key, name, scale)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:                                                        # the runs' key, below every panel
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.03 * -(-len(labels) // 4) if handles else 0, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def plot_observations(runs: dict[str, list[dict]], out_path: str, title: str = "") -> str:
    """The OBSERVATIONS panels (and OBSERVED_REQUESTS' where logged) for every run into one PNG (tooling/plot.py
    --observations); returns its path."""
    return plot_runs(runs, out_path, title, OBSERVATIONS + [p for p in OBSERVED_REQUESTS if panel_values(runs, p[0])])


def draw_panel(ax, runs: dict[str, list[dict]], key, name: str, scale: str) -> None:
    """One panel: every run's line(s), or the one value it held at every step, in words."""
    ax.set_title(name, fontsize=10)
    values = panel_values(runs, key)
    const = constant_value(values)
    if const is not None:                                              # a flat line would hide that it is exact
        where = "in every run" if len(runs) > 1 else ""
        ax.text(0.5, 0.5, f"{const:g} at every step {where}".strip(), ha="center", va="center",
                transform=ax.transAxes, fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    for i, (label, rows) in enumerate(runs.items()):
        draw_run(ax, key, rows, f"C{i % 10}", label, first=i == 0)
    if key in BIN_STYLES or key in LINE_SETS:                          # the key to the line styles
        ax.legend(fontsize=6, frameon=False)
    ax.set_xlabel("step", fontsize=8)
    yscale = y_scale(scale, values)
    ax.set_yscale(yscale, **({"linthresh": 1e-6} if yscale == "symlog" else {}))
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=8)


def draw_run(ax, key, rows: list[dict], color: str, label: str, first: bool) -> None:
    """One run's lines in a panel: a range shaded, a line per bin or per metric of a set, or one line.
    The styles' key (gray, no data) is drawn once, with the first run; the run's label goes on panel 0."""
    if isinstance(key, tuple):                                         # a range: shade between min and max
        s_lo, lo = series(rows, key[0])
        s_hi, hi = series(rows, key[1])
        if lo and s_lo == s_hi:
            ax.fill_between(s_lo, lo, hi, color=color, alpha=0.25)
            ax.plot(s_lo, lo, color=color, lw=1, label=label)
            ax.plot(s_hi, hi, color=color, lw=1)
    elif key in BIN_STYLES:                                            # one line per bin
        for b, (style, name) in enumerate(BIN_STYLES[key]):
            steps, vals = bin_series(rows, key, b)
            if vals:
                ax.plot(steps, vals, color=color, ls=style, lw=1.2)
            if first:
                ax.plot([], [], color="gray", ls=style, label=name if key == "turn_reward" else f"margin {name}")
    elif key in LINE_SETS:                                             # one line per metric of the set
        for metric, style, name in LINE_SETS[key]:
            steps, vals, logged = set_series(rows, metric)
            sparse = 0 < len(vals) < len(rows) / 2                     # every --eval_every steps: mark the points
            if vals:
                ax.plot(steps, vals, color=color, ls=style, lw=1.2, marker="o" if sparse else None, ms=3)
            if first:
                ax.plot([], [], color="gray", ls=style, label=name.replace("pass@k", logged.removeprefix("eval_"))
                        if metric.endswith("@") and vals else name)
    else:
        steps, vals = series(rows, key)
        if vals:
            ax.plot(steps, vals, color=color, lw=1.2, label=label)
        if key == "response_len":                                      # where the run detected a surge
            for step, surged in zip(*series(rows, "length_surge")):
                if surged:
                    ax.axvline(step, color=color, ls=":", lw=1)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description="Plot runs' metrics.jsonl: one line per run, one panel per metric.")
    p.add_argument("runs", nargs="+", help="run folders (each holds metrics.jsonl)")
    p.add_argument("--labels", default="", help="comma-separated labels, one per run (default: the folders)")
    p.add_argument("--out", default="", help="the PNG to write (default: FIRST_RUN/plots/metrics.png)")
    p.add_argument("--title", default="")
    p.add_argument("--observations", action="store_true",
                   help="one figure of reward, response length, rollout latency p95 / p99 and expert load instead "
                        "(default --out: FIRST_RUN/plots/observations.png)")
    args = p.parse_args(argv)
    labels = [x.strip() for x in args.labels.split(",")] if args.labels else [os.path.normpath(r) for r in args.runs]
    if len(labels) != len(args.runs):
        raise SystemExit(f"error: --labels has {len(labels)} names for {len(args.runs)} runs; give one per run")
    runs = {label: read_metrics(r) for label, r in zip(labels, args.runs)}
    out = args.out or os.path.join(args.runs[0], "plots", "observations.png" if args.observations else "metrics.png")
    print(f"wrote {(plot_observations if args.observations else plot_runs)(runs, out, args.title)}")


if __name__ == "__main__":
    main(sys.argv[1:])
