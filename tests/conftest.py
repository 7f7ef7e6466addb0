"""Shared helpers for the tests: tiny configs, random models, random Hugging Face checkpoints.

Everything here is CPU-only and tiny (hidden 32, 3 layers, vocab 50). The suite runs as README
says, `python -m pytest -q -n auto tests` (pytest-xdist: one worker per core, one torch thread each). transformers is only needed by the tests that compare against it;
they call `pytest.importorskip("transformers")` (see `hf_classes`).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from config import ModelConfig  # noqa: E402
from model import Transformer   # noqa: E402

def pytest_addoption(parser):
    parser.addoption("--kernels-tuning", default="", metavar="FILE",
                     help="Triton tile configs from this file (tools/gpu_check.py --tuning-out; kernels_triton/tuning.py)")


def pytest_configure(config):
    if getattr(config.option, "dist", "no") == "load":     # -n: an idle worker takes a busy one's queued tests
        config.option.dist = "worksteal"                   # (the minutes-long tests otherwise end on one worker)
    if config.getoption("--kernels-tuning"):       # the GPU run tests the tables its sweep chose
        from kernels_triton.tuning import load_tuning
        try:
            load_tuning(config.getoption("--kernels-tuning"))
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None


# Under pytest-xdist every worker (and what it launches: torchrun, train.py) runs one thread: more
# threads than cores slow torch's CPU ops down by 50-200x.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# A deterministic CPU: no TF32 anywhere, fixed thread count for the whole run.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

TINY = dict(
    vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16,                       # explicit head_dim: 4 heads * 16 != hidden 32, as in Qwen3
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=48,
    norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1, rope_theta=10000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=256, initializer_range=0.2,
)


def tiny_config(**overrides) -> ModelConfig:
    """A very small ModelConfig (3 layers: 1 dense + 2 MoE with 8 experts, top-2); fields overridable."""
    kw = dict(TINY)
    kw.update(overrides)
    return ModelConfig(**kw)


def randomize_(module: torch.nn.Module, seed: int, std: float = 0.15) -> torch.nn.Module:
    """Large random weights so that any semantic error is visible: N(0, std) everywhere, and norm
    weights in [0.5, 1.5] (not 1.0, so swapped or missing norms change the output)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((torch.rand(p.shape, generator=g) + 0.5).to(p.dtype))
            else:
                p.copy_((torch.randn(p.shape, generator=g) * std).to(p.dtype))
    return module


def make_model(cfg: ModelConfig | None = None, seed: int = 0, std: float | None = None) -> Transformer:
    """A random Transformer: N(0, std) weights (std defaults to cfg.initializer_range) and random
    norm weights in [0.5, 1.5]."""
    cfg = cfg or tiny_config()
    model = Transformer(cfg)
    return randomize_(model, seed, cfg.initializer_range if std is None else std)


def hf_classes():
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM


def hf_config(**overrides):
    """A transformers Qwen3MoeConfig built directly (not through hf.config_to_hf), new-style field names."""
    Qwen3MoeConfig, _ = hf_classes()
    kw = dict(TINY)
    kw.update(overrides)
    theta = kw.pop("rope_theta")
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return Qwen3MoeConfig(**kw, attn_implementation="eager", experts_implementation="eager")


def make_hf_model(seed: int = 0, std: float = 0.15, **overrides):
    """A random transformers Qwen3MoeForCausalLM in fp32 eval mode, eager attention and experts."""
    _, Qwen3MoeForCausalLM = hf_classes()
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(hf_config(**overrides)).eval()
    return randomize_(model, seed, std)


def load_hf(path: str, dtype=torch.float32):
    """transformers' Qwen3MoeForCausalLM from a directory; fails if any weight was missing or unused."""
    _, Qwen3MoeForCausalLM = hf_classes()
    model, info = Qwen3MoeForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    return model.eval()


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: hf_checkpoint(seed=..., **config_overrides) -> (hf_model, directory) with the random
    transformers model saved by its own save_pretrained."""
    counter = iter(range(1000))

    def make(seed: int = 0, std: float = 0.15, **overrides):
        hf = make_hf_model(seed=seed, std=std, **overrides)
        path = str(tmp_path / f"hf{next(counter)}")
        hf.save_pretrained(path)
        return hf, path

    return make


@pytest.fixture
def tables(monkeypatch):
    """The Triton tile tables, restored after the test (load_tuning and gpu_check's sweep change
    them for the process). For tests that already imported kernels_triton (under the interpreter)."""
    from kernels_triton import ops as kt
    from kernels_triton import moe as ktm
    for module, names in ((kt, ("MM_TABLE", "ATTN_TABLE")), (ktm, ("MOE_TILES",))):
        for name in names:
            monkeypatch.setattr(module, name, dict(getattr(module, name)))
    for name in ("ATTN_KEYS", "ATTN_SPLIT_BELOW"):
        monkeypatch.setattr(kt, name, getattr(kt, name))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| in fp64."""
    a, ref = a.double(), ref.double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def assert_same_weights(a: Transformer, b: Transformer):
    """The same state_dict keys, dtypes and bits."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def assert_contract(model: Transformer, outs, temperature: float = 1.0) -> None:
    """Each sampler output's log-probs and routes are bitwise what model.score computes for prompt +
    tokens (on the model's device; the outputs live on the CPU)."""
    score_t = 1.0 if temperature == 0 else temperature      # greedy records log-probs at temperature 1
    dev = next(model.parameters()).device
    for i, o in enumerate(outs):
        P, G = len(o.prompt), len(o.tokens)
        assert G >= 1 and len(o.logprobs) == G and all(type(x) is float for x in o.logprobs), i
        assert o.routes.shape == (P + G - 1, model.n_moe_layers, model.config.num_experts_per_tok), i
        logp, routes = model.score(torch.tensor([o.prompt + o.tokens], device=dev), temperature=score_t)
        logp, routes = logp[0, P - 1:].cpu(), routes[0, :P + G - 1].cpu()
        lp = torch.tensor(o.logprobs)                            # fp32: the Python floats hold its bits exactly
        assert torch.equal(lp, logp), f"output {i}: logprobs differ from score by {(lp - logp).abs().max()}"
        assert torch.equal(o.routes, routes), f"output {i}: routes differ from score"


# ---------------------------------------------------------------------------------------------------
# other model families (tests/test_hf.py): tiny random transformers models of each model_type
# ---------------------------------------------------------------------------------------------------
FAMILY_DIMS = dict(vocab_size=50, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=48, num_experts_per_tok=2, rms_norm_eps=1e-6, max_position_embeddings=256,
                   tie_word_embeddings=False, initializer_range=0.2, pad_token_id=None, bos_token_id=None,
                   eos_token_id=None)   # no padding_idx: its embedding row would get no gradient
# model_type -> (transformers class prefix, what the family sets beyond FAMILY_DIMS). Each switches on
# the family's own knobs: biases, shared experts, sigmoid + bias + groups, partial RoPE, dense layers.
FAMILY_HF = {
    "qwen3_moe": ("Qwen3Moe", dict(head_dim=16, num_experts=8, moe_intermediate_size=24, mlp_only_layers=[0],
                                   norm_topk_prob=True, attention_bias=True)),
    "qwen3": ("Qwen3", dict(head_dim=16, attention_bias=True)),        # dense
    "qwen2_moe": ("Qwen2Moe", dict(num_experts=8, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                   mlp_only_layers=[1], norm_topk_prob=False)),
    "olmoe": ("Olmoe", dict(num_experts=8, intermediate_size=24, norm_topk_prob=False, attention_bias=True)),
    "mixtral": ("Mixtral", dict(num_local_experts=8, intermediate_size=24)),
    "glm4_moe": ("Glm4Moe", dict(head_dim=16, n_routed_experts=8, moe_intermediate_size=24, num_experts_per_tok=3,
                                 n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                 first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=True,
                                 attention_bias=True, partial_rotary_factor=0.5)),
    # sinks (random, non-zero), a window of 12 on layers 0 and 2 (shorter than most prompts, not a whole
    # key tile), YaRN, biased router and experts, the clamped SwiGLU at a limit the activations reach
    "gpt_oss": ("GptOss", dict(head_dim=16, num_local_experts=8, intermediate_size=24, sliding_window=12,
                               swiglu_limit=1.0, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                               "original_max_position_embeddings": 64})),
    # dots.llm1: a window of 10 (no sinks) from layer 1 on; MiniMax-M2: half the head's dims rotated
    "dots1": ("Dots1", dict(head_dim=16, n_routed_experts=8, moe_intermediate_size=24, num_experts_per_tok=3,
                            n_shared_experts=2, n_group=2, topk_group=1, routed_scaling_factor=2.0,
                            first_k_dense_replace=1, norm_topk_prob=True, attention_bias=True, sliding_window=10,
                            max_window_layers=1)),
    "minimax_m2": ("MiniMaxM2", dict(head_dim=16, num_local_experts=8, intermediate_size=24, partial_rotary_factor=0.5)),
    # MLA: q through its low-rank path (V3, GLM) or q_proj (V2), RoPE pairs interleaved, YaRN's softmax
    # scale (V3, V2); V3's router as GLM's, V2's softmax with best-group-limited top-k, GLM-4.7-Flash's
    # mlp_layer_types
    "deepseek_v3": ("DeepseekV3", dict(num_key_value_heads=4, n_routed_experts=8, moe_intermediate_size=24,
                                       num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2,
                                       routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
                                       kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                       v_head_dim=12, rope_interleave=True, attention_bias=True,
                                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 64})),
    "deepseek_v2": ("DeepseekV2", dict(num_key_value_heads=4, n_routed_experts=8, moe_intermediate_size=24,
                                       num_experts_per_tok=2, n_shared_experts=2, n_group=4, topk_group=2,
                                       topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                                       first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
                                       qk_rope_head_dim=8, v_head_dim=12,
                                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 0.707,
                                                        "mscale_all_dim": 0.707, "original_max_position_embeddings": 64})),
    "glm4_moe_lite": ("Glm4MoeLite", dict(num_key_value_heads=4, n_routed_experts=8, moe_intermediate_size=24,
                                          num_experts_per_tok=3, n_shared_experts=1, n_group=2, topk_group=1,
                                          routed_scaling_factor=1.8, kv_lora_rank=16, q_lora_rank=12,
                                          qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16,
                                          mlp_layer_types=["dense", "sparse", "sparse"])),
}
# The linear-attention hybrids (the hybrids/ plug-in): 3 Gated DeltaNet layers of 2 key / 4 value heads of 8, then
# gated attention; a shared expert. Qwen3.5's config class is its text model's.
if os.path.isdir(os.path.join(ROOT, "hybrids")):
    _LINEAR = dict(head_dim=16, num_hidden_layers=4, num_experts=8, moe_intermediate_size=24,
                   shared_expert_intermediate_size=40, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=8, linear_value_head_dim=8, partial_rotary_factor=0.25)
    FAMILY_HF["qwen3_5_moe_text"] = (("Qwen3_5MoeText", "Qwen3_5Moe"), dict(_LINEAR))
    FAMILY_HF["qwen3_next"] = ("Qwen3Next", dict(_LINEAR, norm_topk_prob=False, mlp_only_layers=[1]))


def make_hf_family(model_type: str, seed: int = 0, std: float = 0.15, **overrides):
    """A random transformers model of a family in fp32 eval mode (eager attention and experts), with
    random norm weights and, where the family has one, a random score-correction bias."""
    transformers = pytest.importorskip("transformers")
    prefix, kw = FAMILY_HF[model_type]
    kw = {**FAMILY_DIMS, **kw, **overrides}
    theta = kw.pop("rope_theta", 10000.0)
    kw["rope_parameters"] = {"rope_type": "default", **kw.pop("rope_parameters", {}), "rope_theta": theta}
    if "partial_rotary_factor" in kw:
        kw["rope_parameters"]["partial_rotary_factor"] = kw.pop("partial_rotary_factor")
    config_prefix, model_prefix = prefix if isinstance(prefix, tuple) else (prefix, prefix)
    cfg = getattr(transformers, config_prefix + "Config")(**kw, attn_implementation="eager",
                                                          experts_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, model_prefix + "ForCausalLM")(cfg).eval()
    randomize_(model, seed, std)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """model_type -> (a random transformers model of FAMILY_HF, its own checkpoint directory, our model loaded
    from it), made once a test module."""
    cache = {}

    def get(mt):
        if mt not in cache:
            hf = make_hf_family(mt, seed=1)
            path = str(tmp_path_factory.mktemp(mt))
            hf.save_pretrained(path)
            cache[mt] = hf, path, Transformer.from_pretrained(path).eval()
        return cache[mt]
    return get


def assert_greedy_like_generate(hf, model, prompts: list[list[int]], n: int) -> list:
    """Our sampler's greedy tokens (n each) equal transformers' `generate` from the same checkpoint; -> the
    sampler's outputs."""
    from rollout import Sampler
    outs = Sampler(model).generate(prompts, max_new_tokens=n, temperature=0, progress=False)
    for p, o in zip(prompts, outs):
        x = torch.tensor([p])
        with torch.no_grad():
            y = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                            min_new_tokens=n, pad_token_id=0, eos_token_id=None)
        assert y[0, len(p):].tolist() == o.tokens, f"{model.config.model_type}: prompt of length {len(p)}"
    return outs


def load_hf_auto(path: str, dtype=torch.float32):
    """transformers' AutoModelForCausalLM (the class config.json's model_type names); fails if any weight
    was missing, unused or mis-shaped."""
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    return model.eval()


def cli_error(argv: list[str]) -> str:
    """train.py's command line run in this process (train.cli) -> its one error line: run_cli's exit message,
    which a real process prints alone on stderr with status 1 (tests/test_reliability.py runs one)."""
    import train
    with pytest.raises(SystemExit) as e:
        train.cli(argv)
    assert isinstance(e.value.code, str) and "\n" not in e.value.code, e.value.code
    return e.value.code


def with_options(run, **kw):
    """A train.Run whose config has kw set, with the step hooks those options ask for (support/hooks.py),
    set up on the run: a test toggling a plug-in's option between two minibatch steps."""
    import dataclasses
    from support.hooks import plugin_hooks
    tcfg = dataclasses.replace(run.tcfg, **kw)
    run = dataclasses.replace(run, tcfg=tcfg, hooks=plugin_hooks(tcfg, run.rcfg))
    for hook in run.hooks:
        hook.setup(run, None)
    return run
