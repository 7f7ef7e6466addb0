"""torchrun with gloo on CPU: data-parallel rollout + DDP / FSDP2 training, checkpoints and resume; one run at
any world size (tests/world_check.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--device=cpu", "--task=copy", "--n_digits=2", "--prompts_per_step=8", "--group_size=4",
        "--minibatch_size=32", "--micro_batch_size=8", "--progress=false", "--lr=1e-2", "--warmup_steps=1",
        "--logits_chunk=24"]       # micro-batches of 8 x ~10 positions: DDP / FSDP2 through the chunked LM head

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")


def run(out, nproc, *extra):
    if nproc == 1:
        cmd = [sys.executable, "train.py"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd + ARGS + [f"--out_dir={out}", *extra], cwd=ROOT, capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def test_ddp_two_ranks_logs_once_stays_in_sync_and_resumes(tmp_path):
    out = str(tmp_path / "ddp")
    stdout = run(out, 2, "--steps=2", "--save_every=1")
    assert "weights identical on 2 ranks" in stdout                     # checked by all-gathering digests
    assert [r["step"] for r in metrics(out)] == [1, 2]                   # every step logged once, by rank 0
    for r in metrics(out):
        assert r["train_rollout_kl"] == 0 and r["logp_max_abs_diff"] == 0 and r["route_flip_frac"] == 0
    stdout = run(out, 2, "--steps=3", "--resume=true")
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    assert "step 3: weights identical on 2 ranks" in stdout


def launch(nproc, out):
    """tests/world_check.py at nproc ranks (one process: no torchrun)."""
    cmd = [sys.executable, "tests/world_check.py", str(out)]
    if nproc > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.load(open(os.path.join(out, f"world{nproc}.json")))


def test_one_run_at_1_2_and_4_ranks(tmp_path):
    """4 steps of each run at every layout of tests/world_check.py (DDP, FSDP2, EP=2 with one and two EP
    groups; fp32 packed, bf16 compute over fp32 masters padded, LoRA at EP=2): the same metrics.jsonl but for the
    per-layout keys, and the same weights and masters, as one process; a 2-rank EP=2 checkpoint resumed by
    1 rank and by 4 (DDP, EP=2 in two groups), and LoRA's by 1 rank, continues the run bit for bit. Control: --grad_reduce=fast
    (fp32 accumulation and all-reduce) gives another run at 2 ranks."""
    found = {n: launch(n, tmp_path) for n in (2, 1, 4)}               # 2 ranks write the checkpoint the others resume
    ref = {key.split("/")[0]: got for key, got in found[1].items() if key.endswith("/one")}
    compared = 0
    for n in (2, 4):
        for key, got in found[n].items():
            name, layout = key.split("/")
            if name != "fast" and layout != "resumed":
                assert got["metrics"] == ref[name]["metrics"], (n, key)
                assert got["digest"] == ref[name]["digest"], (n, key)
                compared += 1
    assert compared == 5
    for n, name in ((1, "fp32"), (4, "fp32"), (1, "lora")):
        got = found[n][f"{name}/resumed"]
        assert got["metrics"] == ref[name]["metrics"][2:] and got["digest"] == ref[name]["digest"], (n, name)
    for rows in [ref["fp32"]["metrics"], ref["bf16"]["metrics"]]:
        assert len(rows) == 4 and all(r["train_rollout_kl"] == 0 and r["route_flip_frac"] == 0 for r in rows)
    fast, fast2 = ref["fast"]["metrics"], found[2]["fast/ddp"]["metrics"]
    assert fast[0]["reward_mean"] == fast2[0]["reward_mean"]            # the same samples at step 1
    assert fast != fast2 and ref["fast"]["digest"] != found[2]["fast/ddp"]["digest"]


def test_diagnostics_holdout_is_the_same_at_1_and_2_ranks(tmp_path):
    """--diagnostics_holdout chooses over the global batch: under a router fault of the rollout the same
    sequences are held out at 1 and 2 ranks, each row written once by the rank that owns the sequence
    (rows of both ranks' halves here), diagnostics.jsonl is the same file and so is the update."""
    hold = ["--steps=2", "--rollout_router_fault=no_renorm", "--recompute_old_logp=true", "--diagnostics=6",
            "--diagnostics_holdout=true"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run(one, 1, *hold)
    run(two, 2, *hold)
    text = open(os.path.join(one, "diagnostics.jsonl")).read()
    assert text == open(os.path.join(two, "diagnostics.jsonl")).read()
    rows = [json.loads(line) for line in text.splitlines()]
    assert {r["sequence"] < 16 for r in rows} == {True, False}          # 32 sequences a step, 16 per rank
    assert len({(r["step"], r["sequence"]) for r in rows}) == len(rows) and all(r["held_out"] for r in rows)
    keys = ("diagnostics_held_out", "loss", "grad_norm", "clip_frac", "train_rollout_kl", "route_flip_frac")
    a, b = metrics(one), metrics(two)
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    assert [r["diagnostics_held_out"] for r in a] == [sum(x["step"] == r["step"] for x in rows) for r in a]
