"""The trackers plug-in (trackers/): --log_to=tensorboard|wandb copies each metrics.jsonl row, a missing
package is one line before any work, and wandb's run ends with the run's exit code; --log_samples writes
samples.jsonl.

    python -m pytest -q tests/test_trackers.py
"""
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

import train
from support.runlog import TIMINGS
from test_reliability import FAST, cli_error
from test_train import SMALL, _run
from trackers import log
from trackers.log import logged_scalars


@pytest.mark.parametrize("kind, module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_log_to_without_its_package_is_one_line(tmp_path, monkeypatch, kind, module):
    monkeypatch.setitem(sys.modules, module, None)                       # what an absent package looks like
    msg = cli_error(f"--out_dir={tmp_path}", f"--log_to={kind}")
    assert f"--log_to={kind} needs the {kind} package: pip install {kind}" in msg
    assert not os.path.exists(tmp_path / "metrics.jsonl")               # before any work
    assert "--log_to='nope'" in cli_error(f"--out_dir={tmp_path}", "--log_to=nope")


def expected_scalars(row: dict) -> dict:
    """What --log_to keeps of a metrics.jsonl row: its numbers, a list's as key/i; nulls and the step not."""
    out = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
    out.update({f"{k}/{i}": x for k, v in row.items() if isinstance(v, list) for i, x in enumerate(v)})
    return out


def test_logged_scalars_flatten_lists_of_lists():
    """EP's device load (ep_rows: per layer, per rank) reaches the loggers as ep_rows/layer/rank."""
    row = {"step": 3, "a": 1.5, "ep_rows": [[3, 5], [8, 0]], "b": None, "c": [0.5, None]}
    assert logged_scalars(row) == {"a": 1.5, "ep_rows/0/0": 3.0, "ep_rows/0/1": 5.0, "ep_rows/1/0": 8.0,
                                   "ep_rows/1/1": 0.0, "c/0": 0.5}


def test_log_to_tensorboard_holds_every_metrics_row(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    train.cli(FAST + [f"--out_dir={tmp_path}", "--steps=3", "--log_to=tensorboard"])
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep all
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert "route_flip_frac_layer/0" in tags and "reward_mean" in tags
    assert tags == set().union(*(expected_scalars(r) for r in rows))
    for tag in tags:                                   # tensorboard keeps float32
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        f32 = [torch.tensor(expected_scalars(r)[tag], dtype=torch.float32).item() for r in rows]
        assert logged == list(zip([r["step"] for r in rows], f32)), tag


def test_log_to_wandb_offline_holds_every_metrics_row_and_the_stop(tmp_path, monkeypatch):
    """Offline, nothing reaches the network; a run stopped by SIGTERM ends its wandb run with exit code 143."""
    pytest.importorskip("wandb")
    import signal
    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_BASE_URL": "http://127.0.0.1:9",
                 "WANDB_CONFIG_DIR": str(tmp_path / "cfg"), "WANDB_CACHE_DIR": str(tmp_path / "cache"),
                 "WANDB_DATA_DIR": str(tmp_path / "data")}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(log, "network_reachable", lambda host: pytest.fail("WANDB_MODE is set: no probe"))
    calls = iter(range(100))
    monkeypatch.setattr(train, "stop_requested", lambda d: signal.SIGTERM if next(calls) == 1 else 0)
    with pytest.raises(SystemExit) as e:
        train.cli(FAST + [f"--out_dir={tmp_path / 'out'}", "--steps=4", "--log_to=wandb"])
    assert e.value.code == 143
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    run_dir = glob.glob(str(tmp_path / "out" / "wandb" / "offline-run-*"))
    assert len(run_dir) == 1
    # wandb's own reader of the run's .wandb file: one JSON record a line
    cli = [sys.executable, "-m", "wandb", "leet", "inspect", run_dir[0]]
    records = [json.loads(line) for line in subprocess.run(cli + ["--json"], capture_output=True, text=True,
                                                            check=True, timeout=120).stdout.splitlines()]
    history = [r["history"] for r in records if r["type"] == "history"]
    assert [h["step"]["num"] for h in history] == [1, 2]
    for h, row in zip(history, rows):                  # wandb keeps float64: the same values
        assert {k: v for k, v in h["item"].items() if not k.startswith("_")} == expected_scalars(row)
    summary = json.loads(subprocess.run(cli + ["--summary", "--json"], capture_output=True, text=True,
                                        check=True, timeout=120).stdout)
    assert summary["exit_code"] == 143 and summary["config"]["train"]["steps"] == 4, summary


# ---- --log_samples: samples.jsonl -------------------------------------------------------------------
def test_samples_jsonl_rows_console_lines_and_a_resume(tmp_path, capsys):
    """--log_samples=3: 3 rows a step in strict JSON (the prompt and response as text, the answer, the reward), the
    first on the console; a resume drops the rows past its checkpoint (a killed run's) and continues them."""
    argv = ["--task=copy", "--n_digits=2", "--prompts_per_step=2", "--group_size=2", "--minibatch_size=4",
            f"--out_dir={tmp_path}", "--progress=false", "--save_every=2", "--log_every=2", "--log_samples=3"]
    train.cli(argv + ["--steps=4"])
    out = capsys.readouterr().out.splitlines()
    shown = [line for line in out if " sample: " in line]
    assert len(shown) == 4 and shown[0].startswith("step 1 sample: '^")
    rows = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]   # strict JSON, 3 a step
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    assert all(set(r) == {"step", "prompt", "response", "answer", "reward"} and 0 <= r["reward"] <= 1 for r in rows)
    assert all(len(r["answer"]) == 3 and r["answer"][-1] == 12 for r in rows)       # the target: 2 digits and EOS
    assert all(r["prompt"].startswith("^") and r["prompt"].endswith("=") for r in rows)
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "prompt": "lost", "response": "", "reward": 0.0}) + "\n")
    train.cli(argv + ["--steps=6", "--resume=true"])
    rows = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert [r["step"] for r in rows] == [s for s in range(1, 7) for _ in range(3)]
    assert "lost" not in {r["prompt"] for r in rows}


def test_log_samples_changes_no_metric(tmp_path):
    timing = set(TIMINGS)
    a = _run(tmp_path / "a", SMALL + ["--steps=2"])
    b = _run(tmp_path / "b", SMALL + ["--steps=2", "--log_samples=4", "--keep_checkpoints=3"])
    assert [{k: v for k, v in r.items() if k not in timing} for r in a] == \
        [{k: v for k, v in r.items() if k not in timing} for r in b]

