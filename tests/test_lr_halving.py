"""The lr-halving plug-in (lr_halving/): --lr_schedule=halving every --lr_decay_period steps after the
warmup or from a response-length surge (--halving_start=surge), its checks, and resumes that keep its lr.

    python -m pytest -q tests/test_lr_halving.py
"""
import dataclasses
import shutil

import pytest

import config
from config import ConfigError, RolloutConfig, TrainConfig, apply_overrides
from lr_halving.lr_schedules import Halving
from support import runlog
from support.distributed import lr_at
from test_reliability import cli_error
from test_train import SMALL, TINY_RUN, _run


def cfg(**kw) -> TrainConfig:
    return TrainConfig(**kw)


def halving(surge=None) -> list[Halving]:
    """The plug-in's hook as a run holds it, with a surge seen at step `surge` (1-based) or none."""
    hook = Halving()
    hook.surge = runlog.LengthSurge(step=surge)
    return [hook]


def test_halving_lr_by_hand():
    c = cfg(lr=1.0, warmup_steps=2, lr_schedule="halving", lr_decay_period=3, min_lr_ratio=0.1)
    expected = [0.5, 1.0] + [1.0] * 3 + [0.5] * 3 + [0.25] * 3 + [0.125] * 3 + [0.1] * 2     # warmup 2, period 3
    assert [lr_at(s, c, halving()) for s in range(16)] == expected
    assert lr_at(10_000, c, halving()) == 0.1                             # the floor, for good
    for bad, needle in ((dict(lr_schedule="halving"), "--lr_decay_period=0"),
                        (dict(lr_decay_period=5), "only --lr_schedule=halving uses it"),
                        (dict(lr_schedule="halving", lr_decay_period=5, min_lr_ratio=2.0), "--min_lr_ratio=2.0"),
                        (dict(lr_schedule="step"), "--lr_schedule='step'")):
        with pytest.raises(ConfigError, match=needle):
            cfg(**bad)


def test_halving_resume_continues_the_same_lr_sequence(tmp_path, capsys):
    timing = set(runlog.TIMINGS)
    halving = ["--lr_schedule=halving", "--lr_decay_period=2", "--warmup_steps=1"]
    full = _run(tmp_path / "a", SMALL + halving + ["--steps=6", "--save_every=3"])
    assert [h["lr"] for h in full] == [1e-2 * f for f in (1, 1, 1, 0.5, 0.5, 0.25)]   # warmup 1, then halvings
    _run(tmp_path / "b", SMALL + halving + ["--steps=3", "--save_every=3"])       # a 3-step run, then extended
    resumed = _run(tmp_path / "b", SMALL + halving + ["--steps=6", "--resume=true"])
    for a, b in zip(full[3:], resumed):
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
    assert "re-planned" not in capsys.readouterr().out
    _run(tmp_path / "b", SMALL + ["--lr_schedule=halving", "--lr_decay_period=1", "--steps=7", "--resume=true"])
    assert "re-planned from step 7" in capsys.readouterr().out       # another period is a new plan, and says so


def test_halving_from_a_surge_by_hand():
    """--halving_start=surge: lr holds (after the warmup) until the step a surge was detected on, halves on
    the step after it, then every period, down to the floor; no surge: it holds for good. The default
    (warmup) ignores the surge."""
    c = cfg(lr=1.0, warmup_steps=2, lr_schedule="halving", lr_decay_period=3, min_lr_ratio=0.1, halving_start="surge")
    expected = [0.5, 1.0] + [1.0] * 4 + [0.5] * 3 + [0.25] * 3 + [0.125] * 3 + [0.1] * 2   # surge on step 6 (1-based)
    assert [lr_at(s, c, halving(6)) for s in range(17)] == expected
    assert [lr_at(s, c, halving(None)) for s in range(17)] == [0.5] + [1.0] * 16
    assert lr_at(10_000, c, halving(6)) == 0.1 and lr_at(1, c, halving(1)) == 1.0    # the floor; warmup first
    plain = dataclasses.replace(c, halving_start="warmup")
    assert [lr_at(s, plain, halving(6)) for s in range(16)] == [lr_at(s, plain, halving()) for s in range(16)]


def test_a_length_surge_starts_the_halving_and_a_resume_keeps_it(tmp_path, capsys):
    """A surge made on purpose: 3 steps of 1-token responses, then a resume that allows 3 tokens. The
    window spans the resume (the checkpoint keeps the lengths), so the surge is detected at step 4, said in
    one line, logged as length_surge; lr holds until then and halves every step after. A run that
    resumes again after the surge gives the same rows and says nothing more."""
    surge = ["--surge_window=2", "--surge_ratio=0.2", "--lr_schedule=halving", "--lr_decay_period=1",
             "--halving_start=surge", "--save_every=1"]
    first = _run(tmp_path / "a", TINY_RUN + surge + ["--steps=3", "--max_new_tokens=1"])
    assert [h["response_len"] for h in first] == [1.0] * 3 and [h["length_surge"] for h in first] == [0] * 3
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    capsys.readouterr()
    longer = ["--max_new_tokens=3", "--resume=true", "--resume_changes=allow"]
    rest = _run(tmp_path / "a", TINY_RUN + surge + longer + ["--steps=7"])
    assert (1.0 + rest[0]["response_len"]) / 2 > 1.2 * 1.0                   # the surge the test builds: steps 3-4
    assert [h["length_surge"] for h in rest] == [1, 0, 0, 0]                  # steps 4..7
    assert [h["lr"] for h in first + rest] == [1e-3] * 4 + [5e-4, 2.5e-4, 1.25e-4]
    warned = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and warned[0].startswith("warning: step 4: response length surged to")
    assert "lr halves from the next step" in warned[0]
    _run(tmp_path / "b", TINY_RUN + surge + longer + ["--steps=6"])            # again, in legs across the surge
    legs = _run(tmp_path / "b", TINY_RUN + surge + ["--steps=7", "--resume=true"])
    timing = set(runlog.TIMINGS)
    assert [{k: v for k, v in h.items() if k not in timing} for h in legs] == \
        [{k: v for k, v in h.items() if k not in timing} for h in rest[-1:]]
    assert sum(line.startswith("warning:") for line in capsys.readouterr().out.splitlines()) == 1   # leg 2's


@pytest.mark.parametrize("overrides, needle", [
    ({"lr_schedule": "halving"}, "--lr_decay_period=0: --lr_schedule=halving needs a period of >= 1 steps"),
    ({"lr_schedule": "halving", "lr_decay_period": "-2"}, "--lr_decay_period=-2"),
    ({"lr_decay_period": "10"}, "--lr_decay_period=10: only --lr_schedule=halving uses it"),
    ({"halving_start": "peak"}, "--halving_start='peak': warmup or surge"),
    ({"halving_start": "surge"}, "--halving_start=surge: only --lr_schedule=halving uses it (this run's is cosine)"),
    ({"lr_schedule": "halving", "lr_decay_period": "2", "halving_start": "surge", "surge_window": "0"},
     "--halving_start=surge waits for a response-length surge: it needs --surge_window >= 1"),
])
def test_halving_options_name_the_bad_field(overrides, needle):
    with pytest.raises(ConfigError) as e:
        apply_overrides(overrides, TrainConfig(), RolloutConfig())
    assert needle in str(e.value)


def test_halving_alone_brings_its_plugin_and_asks_for_a_period(tmp_path):
    """--lr_schedule=halving names none of lr_halving/'s options, yet brings the plug-in (its LR_SCHEDULES:
    config.configs_for), whose check asks for the period; a config built without the plug-in refuses it."""
    assert "--lr_decay_period=0: --lr_schedule=halving needs a period of >= 1 steps" \
        in cli_error(f"--out_dir={tmp_path}", "--lr_schedule=halving")
    tcls, _ = config.configs(set())                                  # the core's options only
    with pytest.raises(ConfigError, match="lr_halving/'s, whose options this config lacks"):
        tcls(lr_schedule="halving")
