"""The core and its plug-ins (docs/design.md, "The core and its plug-ins"): a plug-in folder deleted from a
scratch copy leaves a default run with the same metrics; what the core still imports of the plug-ins, and
which plug-in options train.py still reads, may only shrink.

    python -m pytest -q tests/test_layout.py
"""
import ast
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ["config.py", "kernels.py", "model.py", "rollout.py", "scheduler.py", "replay.py", "losses.py", "train.py"]
PLUGINS = sorted(n for n in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, n, "__init__.py")) and n != "support")
# what the core imports of a plug-in: lazily, where an option or a device asks for it (docs/design.md)
CORE_IMPORTS = {"tooling": {"train.py"},                             # lazily: --plan, --help's plan keys
                "kernels_triton": {"kernels.py"}}                    # lazily, for CUDA tensors (or the interpreter)
DELETABLE = ["asynchrony", "diagnostics", "families", "hybrids", "kernels_triton", "lab", "lora", "memory", "multi_turn",
             "parallel", "route_filter", "router_training", "sampling", "tooling", "trackers"]                # the default run on the CPU imports none


def core_files() -> list[str]:
    support = sorted(f"support/{n}" for n in os.listdir(os.path.join(ROOT, "support")) if n.endswith(".py"))
    return CORE + support


def imported_packages(path: str) -> set[str]:
    """The top-level names a file imports, at its top or inside functions (a lazy import is an import)."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


def test_the_core_imports_no_more_of_the_plugins_than_listed():
    """A new import of a plug-in from the core fails here: it would take the plug-in's folder out of the
    deletable ones. One that goes away fails too, so the list (and DELETABLE) keeps up."""
    found = {}
    for path in core_files():
        for p in imported_packages(path) & set(PLUGINS):
            found.setdefault(p, set()).add(path)
    assert found == CORE_IMPORTS


def test_train_reads_no_more_plugin_options_than_listed():
    """train.py's reads of a plug-in's options (`cfg.<field>` of a plug-in folder's options.py): only those
    still waiting for their seam. Everything else a plug-in does in a step comes through support/hooks.py."""
    import config
    plugin_fields = {f for m in config.plugin_modules() for g in m.TRAIN + m.ROLLOUT for f in g.__dataclass_fields__}
    tree = ast.parse(open(os.path.join(ROOT, "train.py")).read())
    read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in plugin_fields}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "getattr"]
    read |= {c.args[1].value for c in calls if isinstance(c.args[1], ast.Constant) and c.args[1].value in plugin_fields}
    assert read == set()


def run_default(cwd, out) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "train.py", "--steps=2", "--prompts_per_step=4", "--group_size=4",
                        "--minibatch_size=8", f"--out_dir={out}", "--progress=false"], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_default(ROOT, tmp_path_factory.mktemp("whole") / "out")


def test_the_deleted_plugins_leave_the_default_run_and_its_bits(reference, tmp_path):
    """The repository without every deletable folder, in a scratch copy: the default run works and its metrics
    equal the whole repository's on every key but the timings. One copy serves each folder alone as well: the
    default run imports none of them (test_a_default_run_imports_no_plugin_...), and config.plugin_folders
    reads the folders' options.py without importing them, so no subset can matter where all of them do not."""
    from support.runlog import TIMINGS
    copy = tmp_path / "repo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "out", "tests", "docs", "__pycache__"))
    for plugin in DELETABLE:
        shutil.rmtree(copy / plugin)
    rows = run_default(copy, tmp_path / "out")
    strip = [{k: v for k, v in row.items() if k not in TIMINGS} for row in rows]
    assert strip == [{k: v for k, v in row.items() if k not in TIMINGS} for row in reference]
    assert len(rows) == 2 and all(r["train_rollout_kl"] == 0 for r in rows)


def test_a_default_step_runs_no_more_lines_than_its_budget(tmp_path):
    """tools/lines.py --trace on a default two-step run: the distinct project lines it executes (a function
    that ran counts whole) and their files stay within tools/lines.BUDGET, which may only go down."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import lines
    r = subprocess.run([sys.executable, "tools/lines.py", "--trace", "--", f"--out_dir={tmp_path / 'out'}"], cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    _, files, _, total, _ = r.stdout.splitlines()[-1].split()          # "total: N files  lines  width"
    assert 0 < int(total) <= lines.BUDGET[0] and int(files) <= lines.BUDGET[1], r.stdout[-1500:]


def test_a_default_run_imports_no_plugin_and_a_named_option_brings_its_own(tmp_path):
    """The configs carry the plug-ins whose options a run names (config.configs_for): a default run imports
    no module of a deletable plug-in, options included (the core imports none at all but lazily:
    CORE_IMPORTS); --lora_rank brings lora/ alone, and a typo of a plug-in's option gets its nearest name."""
    probe = ("import sys, train\ntrain.main(sys.argv[1:])\n"
             f"print(sorted(m for m in sys.modules if m.split('.')[0] in {DELETABLE!r}))")
    lora = "['lora', 'lora.adapters', 'lora.export', 'lora.hooks', 'lora.options']"
    for extra, expect in (([], "[]"), (["--lora_rank=2"], lora)):
        r = subprocess.run([sys.executable, "-c", probe, "--steps=1", "--prompts_per_step=2", "--group_size=2",
                            "--minibatch_size=4", "--progress=false", f"--out_dir={tmp_path / str(len(extra))}",
                            *extra], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0 and r.stdout.splitlines()[-1] == expect, r.stdout[-800:] + r.stderr[-2000:]
    r = subprocess.run([sys.executable, "train.py", "--lora_rnk=2"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "did you mean --lora_rank?" in r.stderr and "Traceback" not in r.stderr, r.stderr
