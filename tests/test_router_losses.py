"""The router's training losses (router_training/router.py: load_balancing_loss, router_z_loss, router_objective):
their values against the papers' formulas written out and against transformers' load_balancing_loss_func
(the held-out reference), their gradients against autograd of plain references, the model's opt-in router
logits (model.score(router_logits=True)), and the trainer's --router_aux_loss_coef / --router_z_loss_coef.

    python -m pytest -q tests/test_router_losses.py
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import train
from config import ModelConfig, RolloutConfig, TrainConfig, apply_command_line, parse_args
from losses import Normalisers, token_objective
from router_training import router
from router_training.router import load_balancing_loss, router_objective, router_probs, router_z_loss
from model import Transformer
from rollout import Sampler
from support.packing import pack, unpack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E, K = 6, 2


def _random(seed=0, N=3, T=7, L=3, lengths=(7, 4, 1), dtype=torch.float32):
    """Random router logits (N, T, L, E), their top-k (N, T, L, K) and a valid mask (N, T) of right padding."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, T, L, E, generator=g) * 2).to(dtype)
    chosen = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :K]
    valid = torch.arange(T) < torch.tensor(lengths)[:, None]
    return logits, chosen, valid


def _hand_balance(logits, chosen, valid, probs):
    """Switch's E sum_i f_i P_i per layer, averaged over layers, per row: loops over the tokens, in float64."""
    N, T, L, E_ = logits.shape
    out = []
    for r in range(N):
        toks = [t for t in range(T) if valid[r, t]]
        per_layer = []
        for layer in range(L):
            f = [sum(int(chosen[r, t, layer, j]) == i for t in toks for j in range(K)) / (K * len(toks)) for i in range(E_)]
            P = [sum(float(probs[r, t, layer, i]) for t in toks) / len(toks) for i in range(E_)]
            per_layer.append(E_ * sum(fi * pi for fi, pi in zip(f, P)))
        out.append(sum(per_layer) / L)
    return torch.tensor(out, dtype=torch.float64)


# ---- values -------------------------------------------------------------------------------------------
def test_load_balancing_loss_is_the_papers_formula_and_transformers_over_k():
    """Against the formula written out (fp32 vs fp64 loops: 1e-6), and against transformers'
    load_balancing_loss_func, one layer at a time (it is k times ours: it counts per token, not per
    slot) and each row's real tokens alone: agreement to 1e-6 relative."""
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    logits, chosen, valid = _random()
    ours = load_balancing_loss(logits, chosen, valid)
    assert ours.dtype == torch.float32 and ours.shape == (3,)
    torch.testing.assert_close(ours.double(), _hand_balance(logits, chosen, valid, torch.softmax(logits.double(), -1)),
                               rtol=1e-6, atol=1e-6)
    for r in range(3):
        n = int(valid[r].sum())
        hf = [float(load_balancing_loss_func((logits[r, :n, layer],), E, K)) / K for layer in range(3)]
        assert abs(sum(hf) / 3 - float(ours[r])) < 1e-6 * float(ours[r]), (r, hf, float(ours[r]))
    # transformers' padded form (attention_mask over a whole padded batch) is one group of all the rows'
    # tokens: our loss over one row that concatenates them
    flat = logits[valid][None]                                       # (1, sum n, L, E)
    one = load_balancing_loss(flat, chosen[valid][None], torch.ones(flat.shape[:2], dtype=torch.bool))
    hf = sum(float(load_balancing_loss_func((logits[:, :, layer].reshape(-1, E),), E, K, attention_mask=valid))
             for layer in range(3)) / (3 * K)
    assert abs(hf - float(one)) < 1e-6 * hf
    # given all layers at once, transformers pools them into one f and one P: not the mean of the layers'
    pooled = float(load_balancing_loss_func(tuple(logits[0, :, layer] for layer in range(3)), E, K)) / K
    assert abs(pooled - float(ours[0])) > 1e-4


def test_load_balancing_loss_at_balance_uniform_and_collapse():
    logits, chosen, valid = _random()
    uniform = torch.zeros_like(logits)                               # P = 1/E whatever the choice: exactly 1
    assert torch.allclose(load_balancing_loss(uniform, chosen, valid), torch.ones(3), atol=1e-6)
    T = 6                                                            # each expert chosen once per slot: f = 1/E
    balanced = torch.stack([torch.arange(T), (torch.arange(T) + 1) % T], -1)[None, :, None]   # (1, T, 1, K)
    assert torch.allclose(load_balancing_loss(torch.randn(1, T, 1, E), balanced, torch.ones(1, T, dtype=torch.bool)),
                          torch.ones(1), atol=1e-6)
    one_hot = torch.full((1, T, 1, E), -30.0)                         # every token on expert 0 (k = 1): E
    one_hot[..., 0] = 30.0
    assert torch.allclose(load_balancing_loss(one_hot, torch.zeros(1, T, 1, 1, dtype=torch.long),
                                              torch.ones(1, T, dtype=torch.bool)), torch.full((1,), float(E)))
    # padding does not count, whatever its logits and routes hold
    logits2, chosen2 = logits.clone(), chosen.clone()
    logits2[~valid], chosen2[~valid] = float("nan"), -1
    assert torch.equal(load_balancing_loss(logits2, chosen2, valid), load_balancing_loss(logits, chosen, valid))
    assert torch.equal(router_z_loss(logits2, valid), router_z_loss(logits, valid))


def test_sigmoid_routers_balance_their_normalised_scores():
    """DeepSeek-V3's sequence-wise form: P of s_i / sum_j s_j of the sigmoid scores (not a softmax)."""
    logits, chosen, valid = _random(seed=1)
    s = torch.sigmoid(logits.double())
    torch.testing.assert_close(load_balancing_loss(logits, chosen, valid, "sigmoid").double(),
                               _hand_balance(logits, chosen, valid, s / s.sum(-1, keepdim=True)), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(router_probs(logits, "topk_softmax"), torch.softmax(logits, -1))


def test_router_z_loss_is_the_papers_formula():
    """ST-MoE eq. 5 per layer, averaged over layers: the mean over a row's tokens of (log sum_j exp x_j)^2."""
    logits, _, valid = _random(seed=2)
    ours = router_z_loss(logits, valid)
    for r in range(3):
        toks = [t for t in range(7) if valid[r, t]]
        want = sum(math.log(sum(math.exp(float(x)) for x in logits[r, t, layer])) ** 2
                   for t in toks for layer in range(3)) / (3 * len(toks))
        assert abs(float(ours[r]) - want) < 1e-5 * want
    assert torch.allclose(router_z_loss(torch.zeros(1, 4, 2, E), torch.ones(1, 4, dtype=torch.bool)),
                          torch.full((1,), math.log(E) ** 2))        # a uniform router: (ln E)^2


# ---- gradients ----------------------------------------------------------------------------------------
def test_gradients_against_autograd_of_plain_references():
    """torch.autograd.gradcheck in float64 (f is a count: constant for fixed routes), and the fp32 gradients
    against autograd of straightforward one-token-at-a-time references (2e-6)."""
    logits, chosen, valid = _random(seed=3, dtype=torch.float64)
    x = logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda y: load_balancing_loss(y, chosen, valid), (x,))
    assert torch.autograd.gradcheck(lambda y: load_balancing_loss(y, chosen, valid, "sigmoid"), (x,))
    assert torch.autograd.gradcheck(lambda y: router_z_loss(y, valid), (x,))

    def reference(y):                                                # (aux, z) summed over rows, token by token
        aux, z = 0.0, 0.0
        for r in range(y.shape[0]):
            toks = [t for t in range(y.shape[1]) if valid[r, t]]
            for layer in range(y.shape[2]):
                P = sum(torch.softmax(y[r, t, layer], -1) for t in toks) / len(toks)
                f = torch.zeros(E, dtype=y.dtype)
                for t in toks:
                    f[chosen[r, t, layer]] += 1 / (K * len(toks))
                aux = aux + E * (f * P).sum() / y.shape[2]
                z = z + sum(torch.logsumexp(y[r, t, layer], -1) ** 2 for t in toks) / (len(toks) * y.shape[2])
        return aux, z
    y32 = logits.float().requires_grad_()
    ref32 = logits.float().requires_grad_()
    for ours, ref in zip((load_balancing_loss(y32, chosen, valid).sum(), router_z_loss(y32, valid).sum()),
                         reference(ref32)):
        g, = torch.autograd.grad(ours, y32)
        g_ref, = torch.autograd.grad(ref, ref32)
        torch.testing.assert_close(g, g_ref, rtol=2e-6, atol=2e-6)
        assert float(g.abs().sum()) > 0


def test_micro_batches_add_up_to_the_minibatch():
    """router_objective's shares of any split of the rows sum to the whole's values and gradients."""
    logits, chosen, valid = _random(seed=4, N=4, lengths=(7, 3, 5, 2))
    lengths = valid.sum(1)
    cfg = TrainConfig(router_aux_loss_coef=0.5, router_z_loss_coef=0.25)
    norm = Normalisers(1.0, 4, 7, float(lengths.sum()))

    def run(parts):
        x = logits.clone().requires_grad_()
        total, values = 0.0, torch.zeros(2)
        for rows in parts:
            loss, v = router_objective(torch.zeros(()), x[rows], chosen[rows], lengths[rows], cfg, norm)
            total, values = total + loss, values + v
        total.backward()
        return total.detach(), values, x.grad
    whole = run([torch.arange(4)])
    split = run([torch.tensor([2]), torch.tensor([0, 3]), torch.tensor([1])])
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    aux, z = whole[1]
    torch.testing.assert_close(whole[0], 0.5 * aux + 0.25 * z)
    n = lengths.float()                                              # token-weighted over the sequences
    torch.testing.assert_close(aux, (n * load_balancing_loss(logits, chosen, valid)).sum() / n.sum())
    torch.testing.assert_close(z, (n * router_z_loss(logits, valid)).sum() / n.sum())


# ---- through the model --------------------------------------------------------------------------------
def _model(seed=0):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=24, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, num_experts=E, num_experts_per_tok=K,
                                   moe_intermediate_size=16, intermediate_size=32, max_position_embeddings=64,
                                   initializer_range=0.3))


def _batch(model):
    outs = Sampler(model).generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=6, n=2, progress=False, seed=0)
    return train.make_batch(outs, torch.tensor([1.0, -1.0, 0.5, -0.5]))


def test_router_logits_are_the_gates_and_change_no_bit():
    model = _model()
    batch = _batch(model)
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, args, out: seen.append(out))
             for layer in model.layers if layer.is_moe]
    plain = model.score(batch.tokens, route_detail=True, with_entropy=True)
    kept = model.score(batch.tokens, route_detail=True, with_entropy=True, router_logits=True)
    for h in hooks:
        h.remove()
    assert plain[-1].logits is None
    for a, b in zip(plain[:3], kept[:3]):                            # logp, routes, entropy
        assert torch.equal(a, b)
    for f in ("weights", "margin", "entropy"):
        assert torch.equal(getattr(plain[-1], f), getattr(kept[-1], f))
    B, T = batch.tokens.shape
    logits = kept[-1].logits
    assert logits.shape == (B, T, 2, E) and logits.requires_grad
    assert torch.equal(logits, torch.stack([g.view(B, T, E) for g in seen[2:]], 2))   # the second call's gates
    with pytest.raises(ValueError, match="route_detail=True"):
        model.score(batch.tokens, router_logits=True)
    # packed: the sequences' tokens get the padded forward's logits, bit for bit, and the same losses
    mb = pack(batch.lengths.tolist(), micro_batch_tokens=64)[0]
    pk = mb.packing
    _, routes_pk, detail_pk = model.score(pk.from_padded(batch.tokens[mb.rows]), packing=pk, route_detail=True,
                                          router_logits=True)
    logits_pk, routes_pk = unpack(pk, detail_pk.logits, T), unpack(pk, routes_pk, T, fill=-1)
    valid = torch.arange(T) < batch.lengths[mb.rows][:, None]
    assert torch.equal(logits_pk[valid], logits[mb.rows][valid])
    cfg, norm = TrainConfig(router_aux_loss_coef=1.0, router_z_loss_coef=1.0), Normalisers(1.0, B, 6, float(valid.sum()))
    _, padded_values = router_objective(torch.zeros(()), logits[mb.rows], kept[1][mb.rows], batch.lengths[mb.rows], cfg, norm)
    _, packed_values = router_objective(torch.zeros(()), logits_pk, routes_pk, batch.lengths[mb.rows], cfg, norm)
    assert torch.equal(padded_values, packed_values)


def _grads(model, batch, cfg, router_logits):
    model.zero_grad(set_to_none=True)
    logp, routes, detail = model.score(batch.tokens, route_detail=True, router_logits=router_logits)
    mask = batch.mask
    norm = Normalisers(float(mask.sum()), mask.shape[0], 6, float(batch.lengths.sum()))
    loss, _ = token_objective(logp, batch.rollout_logp.detach(), batch.adv, mask, cfg, norm)
    if router_logits:
        loss, _ = router_objective(loss, detail.logits, routes, batch.lengths, cfg, norm)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_aux_loss_alone_trains_the_router_and_zero_coefs_change_no_bit():
    model = _model()
    batch = _batch(model)
    # the coefficients at 0: the gradients of the feature's path are the plain path's, bit for bit
    plain = _grads(model, batch, TrainConfig(), router_logits=False)
    zero = _grads(model, batch, TrainConfig(), router_logits=True)
    assert plain.keys() == zero.keys() and all(torch.equal(plain[n], zero[n]) for n in plain)
    assert float(plain["lm_head.weight"].abs().sum()) > 0
    # advantages 0: no policy gradient; each router loss alone reaches every router's weight, and nothing
    # after the last router (its layer's experts, the final norm, the LM head)
    batch.adv.zero_()
    assert all(float(g.abs().sum()) == 0 for g in _grads(model, batch, TrainConfig(), router_logits=True).values())
    last = len(model.layers) - 1
    for coefs in (dict(router_aux_loss_coef=1e-2), dict(router_z_loss_coef=1e-2)):
        g = _grads(model, batch, TrainConfig(**coefs), router_logits=True)
        for i, layer in enumerate(model.layers):
            if layer.is_moe:
                assert float(g[f"layers.{i}.mlp.gate.weight"].abs().sum()) > 0, (coefs, i)
        for name in (f"layers.{last}.mlp.w13", f"layers.{last}.mlp.w2", "norm.weight", "lm_head.weight"):
            assert float(g[name].abs().sum()) == 0, (coefs, name)
    # a step down the aux loss's gradient on the routers' weights lowers it (toward balance)
    @torch.no_grad()
    def aux_value():
        logp, routes, detail = model.score(batch.tokens, route_detail=True, router_logits=True)
        valid = torch.arange(batch.tokens.shape[1]) < batch.lengths[:, None]
        return float(load_balancing_loss(detail.logits, routes, valid).mean())
    before = aux_value()
    g = _grads(model, batch, TrainConfig(router_aux_loss_coef=1.0), router_logits=True)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            if layer.is_moe:
                layer.mlp.gate.weight -= 0.05 * g[f"layers.{i}.mlp.gate.weight"]
    assert aux_value() < before - 1e-3, (before, aux_value())


# ---- the trainer --------------------------------------------------------------------------------------
FAST = ["--task=copy", "--n_digits=2", "--prompts_per_step=2", "--group_size=2", "--minibatch_size=2",
        "--warmup_steps=1", "--progress=false", "--steps=2", "--save_every=100"]


def _train(out, *argv):
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    apply_command_line(parse_args(FAST + [f"--out_dir={out}", *argv]), tcfg, rcfg)
    return train.train(tcfg, rcfg)


def test_training_logs_the_router_losses(tmp_path):
    """Two steps of the tiny preset (8 experts, top-2) at init std 0.002, a near-uniform router (logits of
    std ~0.02), two minibatches a step, padded micro-batches of one sequence: aux in [0.99, 1.05] (1 when
    balanced or uniform), z within 2% of (ln 8)^2. (At the preset's std 0.02 the logits' std is ~0.22 and
    a sequence's aux ~1.2: the top-k a few tokens choose are the experts with the larger P.)"""
    hist = _train(tmp_path / "on", "--router_aux_loss_coef=0.01", "--router_z_loss_coef=0.001",
                  "--micro_batch_tokens=0", "--micro_batch_size=1", "--initializer_range=0.002")
    rows = [json.loads(line) for line in open(os.path.join(tmp_path / "on", "metrics.jsonl"))]
    assert len(rows) == 2 and [r["router_aux_loss"] for r in rows] == [h["router_aux_loss"] for h in hist]
    for r in rows:
        assert 0.99 <= r["router_aux_loss"] <= 1.05, r["router_aux_loss"]
        assert abs(r["router_z_loss"] / math.log(8) ** 2 - 1) < 0.02, r["router_z_loss"]
        assert math.isfinite(r["loss"])
    off = _train(tmp_path / "off", "--router_z_loss_coef=0.001", "--steps=1")
    assert "router_z_loss" in off[0] and "router_aux_loss" not in off[0]
    assert not any(k.startswith("router_") and k.endswith("_loss") for k in _train(tmp_path / "none", "--steps=1")[0])


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_the_same_values_at_two_ranks_under_fsdp(tmp_path):
    """One step in one process and at 2 ranks under FSDP2 (gloo; each rank's micro-batches are dealt from
    the global batch): the same loss, router losses and gradient norm, bit for bit. FSDP2 rebuilds a
    block's list arguments that hold tensors with a gradient: the logits travel in model.KeptLogits."""
    args = ["train.py", "--device=cpu", "--task=copy", "--n_digits=2", "--prompts_per_step=4", "--group_size=2",
            "--minibatch_size=8", "--micro_batch_tokens=40", "--progress=false", "--steps=1", "--save_every=100",
            "--router_aux_loss_coef=0.1", "--router_z_loss_coef=0.01"]
    rows = []
    for n, out in ((1, tmp_path / "one"), (2, tmp_path / "two")):
        cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if n > 1 else [])
        r = subprocess.run(cmd + args + [f"--out_dir={out}", "--parallel=fsdp"], cwd=ROOT, capture_output=True,
                           text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        rows.append(json.loads(open(out / "metrics.jsonl").readline()))
    keys = ("loss", "grad_norm", "router_aux_loss", "router_z_loss")
    assert [rows[0][k] for k in keys] == [rows[1][k] for k in keys], rows


@pytest.mark.parametrize("option", ["--router_aux_loss_coef=-1", "--router_z_loss_coef=-1"])
def test_a_negative_coefficient_is_one_error_line(option):
    with pytest.raises(SystemExit) as e:
        train.cli(FAST + [option])
    msg = str(e.value.code)
    assert msg == f"error: {option}: must be >= 0 (0: off)", msg


def test_a_model_without_a_router_refuses_them(tmp_path):
    with pytest.raises(SystemExit) as e:
        train.cli(FAST + [f"--out_dir={tmp_path}", "--num_experts=0", "--router_aux_loss_coef=0.01"])
    msg = str(e.value.code)
    assert msg.startswith("error: --router_aux_loss_coef=0.01: the model has no MoE layer") and "\n" not in msg, msg


def test_help_lists_them(capsys):
    train.cli(["--help"])
    out = capsys.readouterr().out
    assert "--router_aux_loss_coef=0.0" in out and "--router_z_loss_coef=0.0" in out
    assert router.ROUTER_LOSSES == {"router_aux_loss": "router_aux_loss_coef", "router_z_loss": "router_z_loss_coef"}
