"""hybrids/gdn.py: the Gated DeltaNet on an absolute chunk grid. Against transformers' torch forms (chunked
and recurrent) within fp32's reach of them; bitwise: a row's output does not depend on how many rows follow
it (a prompt's prefix, each decode step's open chunk from the last boundary's state) or on the batch beside
it; control: the recurrent form, what engines decode with, gives other bits. Gradients against autograd of
the recurrence in fp64.

    python -m pytest -q tests/test_gdn.py
"""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton's own @jit helpers (tl.sum's) are made
from hybrids import gdn  # noqa: E402


def inputs(B=2, L=150, H=2, dk=8, dv=8, seed=0, dtype=torch.float32):
    """What the layer hands the rule: q, k l2-normalised (q scaled by dk^-0.5), g = -exp(A) softplus(a) < 0,
    beta = sigmoid(b)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)            # noqa: E731
    q, k = (torch.nn.functional.normalize(r(B, L, H, dk), dim=-1) for _ in range(2))
    g = -r(H).exp() * torch.nn.functional.softplus(r(B, L, H))
    return q * dk ** -0.5, k, r(B, L, H, dv), g, torch.sigmoid(r(B, L, H))


def test_both_forms_match_transformers_torch_gdn():
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta = inputs()
    ref_c, ref_s = mod.torch_chunk_gated_delta_rule(q * 8 ** 0.5, k, v, g, beta, output_final_state=True)
    ref_r, _ = mod.torch_recurrent_gated_delta_rule(q * 8 ** 0.5, k, v, g, beta)
    out, boundary, covered = gdn.chunked(q, k, v, g, beta)
    rec, _ = gdn.recurrent(q, k, v, g, beta)
    assert covered == 128 and out.shape == v.shape
    assert (out - ref_c).abs().max() < 2e-5 and (out - ref_r).abs().max() < 2e-5
    assert (rec - ref_r).abs().max() < 2e-5
    full, _, _ = gdn.chunked(q[:, :128], k[:, :128], v[:, :128], g[:, :128], beta[:, :128])
    _, end = gdn.recurrent(q[:, :128], k[:, :128], v[:, :128], g[:, :128], beta[:, :128])
    assert (boundary - end).abs().max() < 2e-5                            # the state at the boundary


def decode_rows(q, k, v, g, beta, start: int, C: int = gdn.CHUNK):
    """The sampler's view: positions from `start` on, one at a time, each from the state at the last
    boundary before it and the open chunk's rows so far (recomputed every step)."""
    _, state, covered = gdn.chunked(q[:, :start], k[:, :start], v[:, :start], g[:, :start], beta[:, :start])
    rows = []
    for t in range(start, q.shape[1]):
        if t - covered == C:                                              # a boundary: the complete chunk's state
            _, state, _ = gdn.chunked(*(x[:, covered:t] for x in (q, k, v, g, beta)), state=state)
            covered = t
        out, _, _ = gdn.chunked(*(x[:, covered:t + 1] for x in (q, k, v, g, beta)), state=state)
        rows.append(out[:, -1])
    return torch.stack(rows, dim=1)


@pytest.mark.parametrize("prompt", [1, 63, 64, 65, 130])
def test_a_row_is_the_same_bits_in_a_prefill_a_prefix_and_each_decode_step(prompt):
    q, k, v, g, beta = inputs(L=140)
    full, _, _ = gdn.chunked(q, k, v, g, beta)
    part, _, _ = gdn.chunked(q[:, :prompt], k[:, :prompt], v[:, :prompt], g[:, :prompt], beta[:, :prompt])
    assert torch.equal(part, full[:, :prompt])
    assert torch.equal(decode_rows(q, k, v, g, beta, prompt), full[:, prompt:])


def test_a_sequence_is_the_same_bits_alone_and_in_a_padded_batch():
    q, k, v, g, beta = inputs(B=3, L=150, seed=1)
    batch, _, _ = gdn.chunked(q, k, v, g, beta)
    alone, _, _ = gdn.chunked(*(x[1:2, :100] for x in (q, k, v, g, beta)))
    assert torch.equal(alone, batch[1:2, :100])


def test_control_the_recurrent_form_gives_other_bits():
    """What engines decode with: close to the chunked form, not equal to it (and it compounds)."""
    q, k, v, g, beta = inputs(L=140)
    full, _, _ = gdn.chunked(q, k, v, g, beta)
    rec, _ = gdn.recurrent(q, k, v, g, beta)
    assert not torch.equal(rec, full) and (rec - full).abs().max() < 2e-5


def test_gradients_through_the_chunks_are_the_recurrences():
    q, k, v, g, beta = (x.requires_grad_() for x in inputs(B=1, L=70, dtype=torch.float64))
    w = torch.randn(1, 70, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = []
    for form in (lambda: gdn.chunked(q, k, v, g, beta)[0], lambda: gdn.recurrent(q, k, v, g, beta)[0]):
        grads.append(torch.autograd.grad((form() * w).sum(), (q, k, v, g, beta)))
    for a, b in zip(*grads):
        assert (a - b).abs().max() < 1e-10 * (1 + b.abs().max())


def tiny_layer(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    layer = gdn.GatedDeltaNet(hidden=32, key_heads=2, value_heads=4, key_dim=8, value_dim=8, dtype=dtype)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "proj" in name or "conv1d" in name else 0.5))
    return layer


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_the_layer_matches_transformers(family):
    """Our layer with a transformers layer's weights (Qwen3-Next's fused projections split, Qwen3.5's as
    they are: the same names): outputs within 2e-5 in fp32 at 140 positions (three chunks, the last partial)."""
    tf = pytest.importorskip("transformers")
    if family == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet as Ref
        cfg = tf.Qwen3NextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                 linear_key_head_dim=8, linear_value_head_dim=8, num_hidden_layers=1)
    else:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet as Ref
        cfg = tf.Qwen3_5MoeTextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                      linear_key_head_dim=8, linear_value_head_dim=8, num_hidden_layers=1)
    torch.manual_seed(0)
    ref = Ref(cfg, 0).float()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    state = {n: p.detach() for n, p in ref.named_parameters()}
    if family == "qwen3_next":
        split = gdn.split_qwen3_next(state.pop("in_proj_qkvz.weight"), state.pop("in_proj_ba.weight"), 2, 4, 8, 8)
        state.update({f"{k}.weight": v for k, v in split.items()})
    ours = gdn.GatedDeltaNet(32, 2, 4, 8, 8)
    ours.load_state_dict(state)                                           # strict: every name is transformers'
    x = torch.randn(2, 140, 32)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max() < 2e-5 * (1 + ref(x).abs().max())


def test_qwen3_next_fused_projections_round_trip():
    qkvz, ba = torch.randn(2 * (2 * 8 + 2 * 2 * 8), 32), torch.randn(2 * 2 * 2, 32)
    parts = gdn.split_qwen3_next(qkvz, ba, 2, 4, 8, 8)
    back = gdn.fuse_qwen3_next({k.removeprefix("in_proj_"): v for k, v in parts.items()}, 2, 4, 8, 8)
    assert torch.equal(back[0], qkvz) and torch.equal(back[1], ba)


def feed(layer, pool, x, pieces, row=0):
    """The sampler's calls for one sequence in pool row `row`: x (1, L, D) fed in pieces (prefill chunks,
    then decode tokens) through `step` -> the outputs (1, L, D)."""
    out, at = [], 0
    for n in pieces:
        piece = x[:, at:at + n]
        positions = torch.arange(at, at + n)[None]
        out.append(layer.step(piece, positions, torch.ones(1, n, dtype=torch.bool), torch.tensor([row]), pool))
        at += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("prompt, dtype", [(5, torch.float32), (64, torch.float32), (65, torch.float32),
                                           (65, torch.bfloat16)])
def test_the_samplers_steps_are_the_trainers_forward_bitwise(prompt, dtype):
    """A prompt prefilled in two pieces (off the grid), then one token at a time through `step` on a pool row
    (the sampler), against one forward of the whole sequence in a batch of three (the trainer): every row
    torch.equal, fp32 and bf16 weights. Control: the recurrent form (what engines do) gives other bits."""
    layer = tiny_layer(dtype=dtype)
    x = torch.randn(3, 140, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        full = layer(x)
        pool = layer.new_pool(2, dtype, None)
        got = feed(layer, pool, x[1:2], [prompt // 2, prompt - prompt // 2] + [1] * (140 - prompt), row=1)
        assert torch.equal(got, full[1:2])
        rule, _ = layer.rule_inputs(x[1:2], torch.zeros(1, 3, layer.conv_dim, dtype=dtype))
        engine, _ = gdn.recurrent(*rule)                                  # the rule's fp32 output: bf16's
        assert not torch.equal(engine, gdn.chunked(*rule)[0])             # rounding of the layer's can hide it here


def test_a_batched_decode_step_is_each_sequences_own_bits():
    """Three sequences of different prompt lengths (3, 64, 100) prefilled together in one padded call, then
    decoded together a token a step through 70 steps (each crosses a boundary; one step, one chunk call)
    -> every row torch.equal to the trainer's forward; the padding tokens of the prefill change nothing."""
    layer = tiny_layer(dtype=torch.float32)
    x = torch.randn(3, 170, 32, generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([3, 64, 100])
    rows = torch.tensor([2, 0, 1])
    with torch.no_grad():
        pool = layer.new_pool(3, torch.float32, None)
        t = torch.arange(100)
        valid = t[None] < lengths[:, None]
        positions = torch.minimum(t[None], lengths[:, None] - 1)
        layer.step(x[:, :100], positions, valid, rows, pool)
        steps = [layer.step(x[torch.arange(3), lengths + s][:, None], (lengths + s)[:, None],
                            torch.ones(3, 1, dtype=torch.bool), rows, pool) for s in range(70)]
        full = layer(x)
    for i, p in enumerate(lengths.tolist()):
        assert torch.equal(torch.cat([s[i] for s in steps]), full[i, p:p + 70])


def test_the_layers_gradients_match_the_recurrences():
    """Every parameter's and the input's gradient through the chunks against the same layer with the
    recurrent rule (the projections compute in fp32 either way: within 3e-5 of the largest, the conv taps' sums
    over every position the loosest at 1.7e-5); the rule's own
    backward is checked in fp64 above."""
    layer = tiny_layer(dtype=torch.float32)
    x = torch.randn(2, 70, 32, requires_grad=True)
    grads = []
    for form in ("chunked", "recurrent"):
        rule, _ = layer.rule_inputs(x, x.new_zeros(2, 3, layer.conv_dim))
        core = gdn.chunked(*rule)[0] if form == "chunked" else gdn.recurrent(*rule)[0]
        out = layer.output(core, x)
        grads.append(torch.autograd.grad(out.pow(2).sum(), [x, *layer.parameters()]))
    for a, b in zip(*grads):
        assert (a - b).abs().max() <= 3e-5 * (1 + b.abs().max())


def test_bench_gdn_section_times_both_decodes(capsys):
    from tooling import bench
    bench.main(["--only", "gdn", "--prompts=2", "--max-prompt-len=8", "--max-new-tokens=3", "--repeats=1",
                "--warmup=0", "--threads=1"])
    out = capsys.readouterr().out
    assert "grid / recurrent, rollout time" in out and "GDN layer forward, recurrent" in out


# ---------------------------------------------------------------------------------------------------
# the triton backend's kernel (hybrids/gdn_triton.py), under the interpreter on the CPU: its rows the
# same bits however many follow them and whatever the batch (the chunk's rows sit at their grid
# positions in the trainer and the sampler alike, so BLAS's position-dependent bits cannot part them)
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def triton_backend():
    pytest.importorskip("triton")
    import kernels
    with kernels.set_backend("triton"):
        yield


def test_the_triton_chunk_is_the_torch_chunk_within_fp32(triton_backend):
    """Dims that are not powers of two (12 keys, 20 values: padded tiles, three value blocks), a complete and
    a partial chunk: output and end state within 1e-5 relative of the torch form's."""
    q, k, v, g, beta = (gdn._to_chunks(x, 1, gdn.CHUNK)[:, :, 0] for x in inputs(L=64, dk=12, dv=20))
    state = torch.randn(2, 2, 12, 20, generator=torch.Generator().manual_seed(4)) * 0.3
    for n in (64, 37):
        part = [x.clone() for x in (q, k, v, g, beta)]
        for x in part:
            x[:, :, n:] = 0
        got, want = gdn.chunk(*part, state), gdn.chunk_torch(*part, state)
        for a, b in zip(got, want):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max(), n


def test_triton_rows_are_the_same_bits_in_a_prefix_each_decode_step_and_a_batch(triton_backend):
    """A batch of three sequences of 70 positions; the middle one alone as prefixes of 5, 64 and 65 positions
    and decoded a token at a time from 60 (across the boundary): every row torch.equal to the batch's.
    Control: the recurrent form differs."""
    q, k, v, g, beta = inputs(B=3, L=70, dk=16, dv=16, seed=2)
    full, _, _ = gdn.chunked(q, k, v, g, beta)
    one = [x[1:2] for x in (q, k, v, g, beta)]
    for prompt in (5, 64, 65):
        part, _, _ = gdn.chunked(*(x[:, :prompt] for x in one))
        assert torch.equal(part, full[1:2, :prompt]), prompt
    assert torch.equal(decode_rows(*one, 60), full[1:2, 60:])
    assert not torch.equal(gdn.recurrent(*one)[0], full[1:2])


def test_triton_chunk_gradients_are_the_torch_forms(triton_backend):
    """The kernel's backward (autograd through the torch form, recomputed from the kernel's inputs): every
    input's gradient through `chunked` (two chunks, the state carried: the second chunk starts from the
    kernel's end state, within fp32 of the torch form's) within 1e-5 of the torch backend's for the same
    upstream gradient, and so is the forward."""
    import kernels
    ins = inputs(B=1, L=70, dk=16, dv=16, seed=3)
    w = torch.randn(1, 70, 2, 16, generator=torch.Generator().manual_seed(5))
    found = []
    for backend in ("triton", "torch"):
        with kernels.set_backend(backend):
            xs = [x.clone().requires_grad_() for x in ins]
            out = gdn.chunked(*xs)[0]
            found.append((out.detach(), torch.autograd.grad((out * w).sum(), xs)))
    (out_t, grads_t), (out_p, grads_p) = found
    assert (out_t - out_p).abs().max() <= 1e-5 * out_p.abs().max()
    assert all((a - b).abs().max() <= 1e-5 * b.abs().max() for a, b in zip(grads_t, grads_p))
