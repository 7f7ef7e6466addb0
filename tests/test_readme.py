"""README.md's code runs as pasted: every ```python block, and the "Your own task" commands.

    python -m pytest -q tests/test_readme.py
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def section(title: str) -> str:
    return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_has_python_blocks():
    assert len(blocks("python")) >= 1 and blocks("python", "```python\nx\n```") == ["x\n"]   # the extractor works


@pytest.mark.parametrize("i", range(len(blocks("python"))))
def test_python_block_runs_as_pasted(tmp_path, i):
    r = subprocess.run([sys.executable, "-c", blocks("python")[i]], cwd=tmp_path, env=ENV, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"README python block {i} failed:\n{r.stderr[-3000:]}"


def test_your_own_task_commands_run(tmp_path):
    """The section's commands, each as written, with train.py cut to two steps into a temporary out_dir."""
    pytest.importorskip("tokenizers")
    (cmds,) = blocks("bash", section("Your own task"))
    cmds = [c.split("#")[0].strip() for c in cmds.replace("\\\n", " ").splitlines() if c.split("#")[0].strip()]
    assert len(cmds) == 2 and cmds[1].startswith("python train.py --task=jsonl")
    for cmd in cmds:
        argv = shlex.split(cmd)
        assert argv[0] == "python"
        if argv[1] == "train.py":
            argv += ["--steps=2", "--prompts_per_step=4", "--group_size=2", "--minibatch_size=8",
                     f"--out_dir={tmp_path / 'out'}", "--progress=false"]
        r = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{cmd}\n{r.stderr[-3000:]}"
    assert "generation: stop ids [0] ('<|endoftext|>'" in r.stdout and "done: 2 steps" in r.stdout


def test_generate_draws_no_progress_bar_unless_asked(capfd):
    import torch
    sys.path.insert(0, ROOT)
    from config import ModelConfig
    from model import Transformer
    from rollout import Sampler
    torch.manual_seed(0)
    sampler = Sampler(Transformer(ModelConfig.preset("tiny")))
    outs = sampler.generate([[1, 2, 3]], max_new_tokens=3)
    assert "generate" not in capfd.readouterr().err
    assert type(outs[0].tokens) is list and type(outs[0].logprobs) is list and len(outs[0].logprobs) == len(outs[0].tokens)
    sampler.generate([[1, 2, 3]], max_new_tokens=3, progress=True)
    assert "generate" in capfd.readouterr().err                      # control: the bar when asked for


def test_reading_order_names_the_core_files():
    """"Read in this order" lists the core (config -> kernels -> model -> rollout -> replay -> losses ->
    train), each an existing file with a line count; README stays under 300 lines (details go to docs/).
    Whether the counts are current is `python tools/lines.py --check`'s (the project's CI runs it): a fork
    that grows a file keeps a passing suite."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import lines
    listed = lines.reading_order(README)
    assert [f for f, _ in listed] == ["config.py", "kernels.py", "model.py", "rollout.py", "scheduler.py", "replay.py",
                                      "losses.py", "train.py"]
    assert all(os.path.isfile(os.path.join(ROOT, f)) and n > 0 for f, n in listed)
    assert README.count("\n") <= 300


def test_line_count_check_finds_a_stale_count():
    """tools/lines.py --check's comparison: a count 10% off is flagged, --write's README passes."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import lines
    f, said = lines.reading_order(README)[0]
    stale = README.replace(f"`{f}` ({said})", f"`{f}` ({int(lines.count_lines(f) * 1.2)})", 1)
    assert any(abs(s - a) > 0.1 * a for _, s, a in lines.compare(stale))                  # control
    assert all(abs(s - a) <= 0.1 * a for _, s, a in lines.compare(lines.write_counts(stale)))


def test_line_trace_counts_each_function_that_ran_whole():
    """tools/lines.py --trace's rule: a function whose body ran counts from its def to its last line
    (docstring and comments too), one whose body never ran counts nothing (not even its def line, which
    ran at import), a wrapped statement all its lines."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import lines
    source = ('def ran(x):\n    """Doc."""\n    # why\n    return x\n\n\ndef idle():\n    return 0\n\n\n'
              'y = ran(\n    1)\n')
    executed = {1, 4, 7, 11}                        # the defs, ran's body, the call's first line
    assert lines.read_lines(source, executed) == {1, 2, 3, 4, 11, 12}
    assert lines.read_lines(source, {1, 7}) == set()                        # control: no body ran
