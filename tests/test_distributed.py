"""torchrun with gloo on CPU: data-parallel rollout + DDP / FSDP2 training, checkpoints and resume."""
import json
import os
import subprocess
import sys

import pytest
import torch

from config import ModelConfig
from model import Transformer

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


def weights(out):
    with open(os.path.join(out, "latest")) as f:
        m = Transformer.from_pretrained(os.path.join(out, f.read().strip()))
    return {k: v.clone() for k, v in m.state_dict().items()}


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


def first_update_gap(a, b):
    """(relative norm gap, max element gap) between the first updates of runs a and b from the same init."""
    torch.manual_seed(0)                                                 # train.build_model's initial weights
    init = Transformer(ModelConfig.preset("tiny")).state_dict()
    wa, wb = weights(a), weights(b)
    da = torch.cat([(wa[k] - init[k]).flatten() for k in wa])
    db = torch.cat([(wb[k] - init[k]).flatten() for k in wa])
    return ((da - db).norm() / da.norm()).item(), (da - db).abs().max().item()


# The first update agrees in norm to 1e-4 relative. Element-wise, Adam's first step is ~lr * sign(g), so
# an element whose gradient is a near-total cancellation can move by a visible fraction of lr when the
# reduction adds in another order; bound that by 5% of lr (lr = 1e-2, reached at step 1).
LR = 1e-2


def test_two_ranks_match_one_rank_on_the_first_step(tmp_path):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run(one, 1, "--steps=1")
    run(two, 2, "--steps=1")
    m1, m2 = metrics(one)[0], metrics(two)[0]
    assert m1["reward_mean"] == m2["reward_mean"]                         # the same samples: seeds are global
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5, abs=1e-7)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    rel, worst = first_update_gap(one, two)
    assert rel < 1e-4 and worst < 0.05 * LR, (rel, worst)


def test_fsdp2_trains_saves_and_resumes(tmp_path):
    out, ddp = str(tmp_path / "fsdp"), str(tmp_path / "ddp")
    stdout = run(out, 2, "--steps=1", "--parallel=fsdp")
    assert "step 1: weights identical on 2 ranks" in stdout
    run(ddp, 2, "--steps=1")
    assert metrics(out)[0]["grad_norm"] == pytest.approx(metrics(ddp)[0]["grad_norm"], rel=1e-5)
    rel, worst = first_update_gap(out, ddp)                              # the same math as DDP
    assert rel < 1e-4 and worst < 0.05 * LR, (rel, worst)
    stdout = run(out, 2, "--steps=3", "--resume=true", "--parallel=fsdp")
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    assert "step 3: weights identical on 2 ranks" in stdout
    for r in metrics(out):
        assert r["train_rollout_kl"] == 0 and r["logp_max_abs_diff"] == 0 and r["route_flip_frac"] == 0
