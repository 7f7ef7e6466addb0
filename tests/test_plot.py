"""tooling/plot.py: figures from metrics.jsonl, and its one-line errors.

    python -m pytest -q tests/test_plot.py
"""
from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tooling import plot  # noqa: E402


def write_run(path, n=12, nan_at=None):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for s in range(1, n + 1):
            row = {"step": s, "reward_mean": s / n, "train_rollout_k3": 0.0 if nan_at is None else 1e-4 * s,
                   "logp_max_abs_diff": 0.0, "route_flip_frac": 0.01, "is_ratio_min": 0.9, "is_ratio_max": 1.1,
                   "grad_norm": 1.0 / s, "entropy": 2.0 - s / n,
                   "route_flip_frac_by_margin": [0.004, 0.003, 0.002, None if s == nan_at else 0.001]}
            if s == nan_at:
                row["entropy"] = None                                  # strict JSON: a NaN is logged as null
            f.write(json.dumps(row) + "\n")
    return str(path)


def test_plot_writes_a_png_per_call(tmp_path):
    pytest.importorskip("matplotlib")
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b", nan_at=3)
    r = subprocess.run([sys.executable, "-m", "tooling.plot", a, b, "--labels", "invariant,fast"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    png = os.path.join(a, "plots", "metrics.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 10_000
    assert plot.series(plot.read_metrics(b), "entropy")[0] == [s for s in range(1, 13) if s != 3]
    assert plot.bin_series(plot.read_metrics(b), "route_flip_frac_by_margin", 3)[0] == [s for s in range(1, 13) if s != 3]
    assert plot.bin_series(plot.read_metrics(b), "route_flip_frac_by_margin", 0)[1] == [0.004] * 12


@pytest.mark.parametrize("case, message", [
    ("missing", "not found"),
    ("bad_json", "line 2: not JSON"),
    ("labels", "one per run"),
])
def test_plot_errors_are_one_line(tmp_path, case, message):
    run = write_run(tmp_path / "r")
    argv = [run]
    if case == "missing":
        argv = [str(tmp_path / "nope")]
    elif case == "bad_json":
        with open(os.path.join(run, "metrics.jsonl"), "a") as f:
            f.write("{not json\n")
        with open(os.path.join(run, "metrics.jsonl")) as f:
            lines = f.readlines()
        with open(os.path.join(run, "metrics.jsonl"), "w") as f:
            f.writelines([lines[0], lines[-1]])
    elif case == "labels":
        argv = [run, "--labels", "a,b"]
    r = subprocess.run([sys.executable, "-m", "tooling.plot", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("error:") and message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        plot.plot_runs({"a": plot.read_metrics(write_run(tmp_path / "a"))}, str(tmp_path / "x.png"))


def test_log_axes_only_for_positive_values():
    assert plot.y_scale("log", [1e-6, 0.5]) == "log"
    assert plot.y_scale("log", [0.0, 1e-3]) == "linear" and plot.y_scale("log", [-1.0, 2.0]) == "linear"
    assert plot.y_scale("linear", [1.0, 2.0]) == "linear" and plot.y_scale("log", []) == "linear"


def test_constant_panel_is_said_in_words(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes
    said, drawn, real_text, real_plot = [], [], matplotlib.axes.Axes.text, matplotlib.axes.Axes.plot

    def text(ax, *a, **kw):
        said.append((ax.get_title(), a[2]))
        return real_text(ax, *a, **kw)

    def line(ax, *a, **kw):
        drawn.append(ax.get_title())
        return real_plot(ax, *a, **kw)
    monkeypatch.setattr(matplotlib.axes.Axes, "text", text)
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", line)
    runs = {"a": plot.read_metrics(write_run(tmp_path / "a")), "b": plot.read_metrics(write_run(tmp_path / "b"))}
    plot.plot_runs(runs, str(tmp_path / "x.png"))
    titles = {name: key for key, name, _ in plot.PANELS}
    assert dict(said) == {"train-rollout KL (k3, per token)": "0 at every step in every run",
                          "max |logp train - logp rollout|": "0 at every step in every run",
                          "route flips (token, layer decisions)": "0.01 at every step in every run"}
    assert not {t for t, _ in said} & set(drawn) and "reward (mean)" in drawn and "IS ratio pi_old / mu (min..max)" in drawn
    assert {"reward_std", "response_len", "loss", "clip_frac"} <= set(titles.values())


def test_the_runs_key_covers_no_panel(tmp_path, monkeypatch):
    """The runs' legend belongs to the figure: the last panel (the margin bins) keeps its own key."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    runs = {"inv": plot.read_metrics(write_run(tmp_path / "a")), "fast": plot.read_metrics(write_run(tmp_path / "b"))}
    plot.plot_runs(runs, str(tmp_path / "x.png"))
    (fig,) = figs
    assert [[t.get_text() for t in lg.get_texts()] for lg in fig.legends] == [["inv", "fast"]]
    last = fig.axes[len(plot.PANELS) - 1]
    assert last.get_title() == "route flips by trainer margin"
    assert [t.get_text() for t in last.get_legend().get_texts()][0] == "margin < 1e-4"
    plt.close(fig)


def test_eval_expert_load_and_latency_panels_whenever_their_keys_exist(tmp_path, monkeypatch):
    """A run that logged them gets the held-out eval panels (greedy and sampled; pass@1 and pass@k, marked
    at the eval steps), the expert load and the rollout latency; one that did not gets none of them."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    path = tmp_path / "e"
    rows = [json.loads(line) for line in open(os.path.join(write_run(path), "metrics.jsonl"))]
    for r in rows:
        r.update(expert_load_max=2 + r["step"] / 10, load_imbalance_layer=[1.5, 2.5], rollout_latency_p50=0.1 * r["step"],
                 rollout_latency_p95=0.2 * r["step"], rollout_latency_p99=0.3 * r["step"])
        if r["step"] % 4 == 0:
            r.update({"eval_greedy_reward": 0.1 * r["step"], "eval_sampled_reward": 0.05 * r["step"],
                      "eval_greedy_pass": 0.0, "eval_pass@8": 0.02 * r["step"]})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = {"e": plot.read_metrics(str(path))}
    assert [p[1] for p in plot.panels(runs)[len(plot.PANELS):]] == [
        "held-out reward (--eval_data)", "held-out pass rate", "expert load (busiest / mean)",
        "rollout latency per sequence (s)"]
    assert plot.set_series(runs["e"], "eval_pass@") == ([4, 8, 12], [0.08, 0.16, 0.24], "eval_pass@8")
    assert plot.set_series(runs["e"], "load_imbalance_layer")[1] == [2.0] * 12          # the layers' mean
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    plot.plot_runs(runs, str(tmp_path / "x.png"))
    axes = {ax.get_title(): ax for ax in figs[0].axes}
    passes = axes["held-out pass rate"]
    assert [t.get_text() for t in passes.get_legend().get_texts()] == ["pass@1 (greedy)", "pass@8 (sampled)"]
    assert [line.get_marker() for line in passes.get_lines() if len(line.get_xdata())][1] == "o"   # sparse: marked
    assert len(axes["rollout latency per sequence (s)"].get_lines()) == 6                  # 3 lines + their key
    plt.close(figs[0])
    bare = {"a": plot.read_metrics(write_run(tmp_path / "a"))}                             # control: no such keys
    assert plot.panels(bare) == plot.PANELS


def test_observations_figure_has_reward_length_latency_tail_and_load(tmp_path, monkeypatch):
    """tooling/plot.py --observations writes one PNG of four panels: reward, response length (the run's detected
    surge marked at its step), rollout latency p95 and p99, expert load."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    path = tmp_path / "o"
    rows = [json.loads(line) for line in open(os.path.join(write_run(path), "metrics.jsonl"))]
    for r in rows:
        r.update(response_len=3.0 + (r["step"] > 6) * r["step"], length_surge=int(r["step"] == 8),
                 rollout_latency_p95=0.2 * r["step"], rollout_latency_p99=0.3 * r["step"],
                 expert_load_max=2.0 + r["step"] / 10, load_imbalance_layer=[1.5, 2.5])
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = subprocess.run([sys.executable, "-m", "tooling.plot", str(path), "--observations"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    with open(path / "plots" / "observations.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not (path / "plots" / "metrics.png").exists()
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    plot.plot_observations({"o": plot.read_metrics(str(path))}, str(tmp_path / "x.png"))
    axes = {ax.get_title(): ax for ax in figs[0].axes if ax.get_title()}
    assert list(axes) == ["reward (mean)", "response length (tokens)", "rollout latency tail per sequence (s)",
                          "expert load (busiest / mean)"]
    tail = axes["rollout latency tail per sequence (s)"]
    assert [t.get_text() for t in tail.get_legend().get_texts()] == ["p95", "p99"] and tail.get_yscale() == "log"
    marks = [line for line in axes["response length (tokens)"].get_lines() if list(line.get_xdata()) == [8, 8]]
    assert len(marks) == 1 and marks[0].get_linestyle() == ":"              # the surge, at its step
    plt.close(figs[0])


def test_observations_add_per_request_hotness_where_logged(tmp_path, monkeypatch):
    """--log_hotness's quantiles (request_hot_frac_*) add a panel beside reward and load, one line style each;
    a run without them keeps the four panels (the test above)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    path = tmp_path / "h"
    rows = [json.loads(line) for line in open(os.path.join(write_run(path), "metrics.jsonl"))]
    for r in rows:
        r.update(request_hot_frac_p50=0.3, request_hot_frac_p90=0.3 + r["step"] / 100, request_hot_frac_max=0.5)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    plot.plot_observations({"h": plot.read_metrics(str(path))}, str(tmp_path / "x.png"))
    axes = {ax.get_title(): ax for ax in figs[0].axes if ax.get_title()}
    hot = axes["per-request hotness (busiest expert's share)"]
    assert list(axes)[:4] == ["reward (mean)", "response length (tokens)", "rollout latency tail per sequence (s)",
                              "expert load (busiest / mean)"]
    assert [t.get_text() for t in hot.get_legend().get_texts()] == ["p50", "p90", "max"]
    plt.close(figs[0])
