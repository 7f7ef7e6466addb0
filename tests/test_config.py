"""config.py: presets, validation, Hugging Face config.json in both field-name generations, overrides."""
import dataclasses
import json

import pytest

import config
from config import ConfigError, ModelConfig, apply_overrides, parse_args
from conftest import TINY, tiny_config


# ---------------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------------
def test_preset_tiny():
    cfg = ModelConfig.preset("tiny")
    assert isinstance(cfg, ModelConfig)
    assert cfg.num_experts > 0 and cfg.moe_layers, "the tiny preset is meant to be a MoE"
    assert cfg.moe_layers == [i for i in range(cfg.num_hidden_layers) if i not in cfg.mlp_only_layers]


def test_preset_qwen3_30b_a3b():
    cfg = ModelConfig.preset("qwen3-30b-a3b")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (151936, 2048, 48)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 4, 128)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)
    assert cfg.norm_topk_prob is True and cfg.rope_theta == 1_000_000.0
    assert cfg.moe_layers == list(range(48))


def test_preset_returns_fresh_objects():
    a = ModelConfig.preset("tiny")
    a.mlp_only_layers.append(1)
    assert ModelConfig.preset("tiny").mlp_only_layers != a.mlp_only_layers


def test_unknown_preset():
    with pytest.raises(ConfigError, match="nope"):
        ModelConfig.preset("nope")


# ---------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, field", [
    (dict(num_attention_heads=6, num_key_value_heads=4), "num_key_value_heads"),
    (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok"),
    (dict(head_dim=15), "head_dim"),
    (dict(mlp_only_layers=[3]), "mlp_only_layers"),
    (dict(mlp_only_layers=[-1]), "mlp_only_layers"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_experts=-1), "num_experts"),
])
def test_validation_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        tiny_config(**overrides)
    assert field in str(e.value)
    assert issubclass(ConfigError, ValueError)


def test_moe_layer_rule():
    # layer is MoE iff not in mlp_only_layers, num_experts > 0 and (i + 1) % decoder_sparse_step == 0
    cfg = tiny_config(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert cfg.moe_layers == [1, 5]
    assert tiny_config(num_experts=0).moe_layers == []
    assert tiny_config(mlp_only_layers=[]).moe_layers == [0, 1, 2]


# ---------------------------------------------------------------------------------------------------
# Hugging Face config.json
# ---------------------------------------------------------------------------------------------------
def _hf_base():
    return dict(model_type="qwen3_moe", vocab_size=1000, hidden_size=64, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                moe_intermediate_size=32, num_experts_per_tok=3, norm_topk_prob=True,
                mlp_only_layers=[0], decoder_sparse_step=1, rms_norm_eps=1e-5,
                tie_word_embeddings=False, max_position_embeddings=512, hidden_act="silu")


def test_from_hf_old_and_new_field_names_agree(tmp_path):
    old = dict(_hf_base(), num_experts=12, rope_theta=123456.0, rope_scaling=None)
    new = dict(_hf_base(), num_local_experts=12,
               rope_parameters={"rope_type": "default", "rope_theta": 123456.0})
    a, b = ModelConfig.from_hf(old), ModelConfig.from_hf(new)
    assert a == b
    assert a.num_experts == 12 and a.rope_theta == 123456.0
    assert (a.num_experts_per_tok, a.moe_intermediate_size, a.rms_norm_eps) == (3, 32, 1e-5)
    # the same through a file and through a directory
    (tmp_path / "config.json").write_text(json.dumps(new))
    assert ModelConfig.from_hf(str(tmp_path)) == b
    assert ModelConfig.from_hf(str(tmp_path / "config.json")) == b


def test_from_hf_accepts_transformers_own_config():
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3MoeConfig(
        vocab_size=77, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        head_dim=8, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=40,
        mlp_only_layers=[2], rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    cfg = ModelConfig.from_hf(hf.to_dict())
    assert (cfg.vocab_size, cfg.num_key_value_heads, cfg.head_dim, cfg.num_experts) == (77, 1, 8, 5)
    assert cfg.rope_theta == 5000.0 and cfg.mlp_only_layers == [2] and cfg.norm_topk_prob is False


def test_to_hf_from_hf_round_trip():
    for cfg in (tiny_config(), tiny_config(norm_topk_prob=False, tie_word_embeddings=True,
                                           decoder_sparse_step=2, mlp_only_layers=[], rope_theta=5e5),
                ModelConfig.preset("qwen3-30b-a3b")):
        d = cfg.to_hf()
        assert d["model_type"] == "qwen3_moe" and d["num_local_experts"] == cfg.num_experts
        assert d["rope_parameters"] == {"rope_type": "default", "rope_theta": cfg.rope_theta}
        back = ModelConfig.from_hf(json.loads(json.dumps(d)))   # through JSON, as on disk
        assert back == cfg
        assert dataclasses.asdict(back) == dataclasses.asdict(cfg)


@pytest.mark.parametrize("bad, needle", [
    (dict(model_type="llama"), "model_type"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "yarn"),
    (dict(model_type="olmoe", clip_qkv=8.0), "clip_qkv"),    # qwen3_moe's attention_bias is supported now
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_from_hf_rejects_unsupported(bad, needle):
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_hf(dict(_hf_base(), num_experts=4, **bad))


def test_from_hf_missing_file(tmp_path):
    with pytest.raises(ConfigError):
        ModelConfig.from_hf(str(tmp_path))


@pytest.mark.parametrize("drop", ["hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads"])
def test_from_hf_missing_required_field_names_it_and_the_file(tmp_path, drop):
    hf = _hf_base()
    del hf[drop]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(str(tmp_path))
    assert f"lacks the required field(s) {drop}" in str(e.value) and str(tmp_path) in str(e.value)


def test_from_hf_invalid_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 10,')
    with pytest.raises(ConfigError, match=r"config.json: not valid JSON"):
        ModelConfig.from_hf(str(tmp_path))


# ---------------------------------------------------------------------------------------------------
# --key=value overrides
# ---------------------------------------------------------------------------------------------------
def test_parse_args_forms():
    assert parse_args(["--a=1", "--flag", "--b", "2", "--some-key=x", "--c", "-3"]) == \
        {"a": "1", "flag": "true", "b": "2", "some_key": "x", "c": "-3"}
    with pytest.raises(ConfigError, match="positional"):
        parse_args(["positional"])


def test_apply_overrides_typed():
    cfg = tiny_config()
    apply_overrides(parse_args(["--hidden_size=48", "--rope_theta=1e5", "--norm_topk_prob=false",
                                "--tie_word_embeddings", "--mlp_only_layers=0,2", "--rms_norm_eps", "1e-5"]),
                    cfg)
    assert cfg.hidden_size == 48 and type(cfg.hidden_size) is int
    assert cfg.rope_theta == 1e5 and type(cfg.rope_theta) is float
    assert cfg.norm_topk_prob is False
    assert cfg.tie_word_embeddings is True
    assert cfg.mlp_only_layers == [0, 2] and all(type(i) is int for i in cfg.mlp_only_layers)
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.moe_layers == [1]
    for raw, want in [("true", True), ("1", True), ("yes", True), ("False", False), ("0", False), ("off", False)]:
        apply_overrides({"norm_topk_prob": raw}, cfg)
        assert cfg.norm_topk_prob is want
    apply_overrides({"mlp_only_layers": "[1]"}, cfg)
    assert cfg.mlp_only_layers == [1]
    apply_overrides({"mlp_only_layers": ""}, cfg)
    assert cfg.mlp_only_layers == []


def test_apply_overrides_unknown_key():
    with pytest.raises(ConfigError) as e:
        apply_overrides({"hiden_size": "48"}, tiny_config())
    assert "hiden_size" in str(e.value)


@pytest.mark.parametrize("key, raw", [
    ("hidden_size", "abc"), ("hidden_size", "1.5"), ("rope_theta", "big"),
    ("norm_topk_prob", "maybe"), ("mlp_only_layers", "0,x"),
])
def test_apply_overrides_wrong_type(key, raw):
    with pytest.raises(ConfigError) as e:
        apply_overrides({key: raw}, tiny_config())
    assert key in str(e.value)


@pytest.mark.parametrize("overrides, needle", [
    ({"steps": "-5"}, "--steps=-5: must be >= 1"),
    ({"steps": "0"}, "--steps=0: must be >= 1"),
    ({"prompts_per_step": "0"}, "--prompts_per_step=0"),
    ({"n_digits": "0"}, "--n_digits=0"),
    ({"micro_batch_size": "-1"}, "--micro_batch_size=-1: must be >= 0"),
    ({"skip_nonfinite_steps": "-1"}, "--skip_nonfinite_steps=-1"),
    ({"lr": "inf"}, "--lr=inf: must be a finite number"),
    ({"lr": "nan"}, "--lr=nan: must be a finite number"),
    ({"temperature": "nan"}, "--temperature=nan: must be a finite number"),
    ({"device": "foo"}, "--device='foo': choose auto, cpu, cuda or cuda:N"),
    ({"device": "cuda:x"}, "--device='cuda:x'"),
    ({"task": "nope"}, "--task='nope'"),
    ({"resume": "true", "overwrite": "true"}, "--resume and --overwrite contradict"),
    ({"lr_schedule": "halving"}, "--lr_decay_period=0: --lr_schedule=halving needs a period of >= 1 steps"),
    ({"lr_schedule": "halving", "lr_decay_period": "-2"}, "--lr_decay_period=-2"),
    ({"lr_decay_period": "10"}, "--lr_decay_period=10: only --lr_schedule=halving uses it"),
    ({"lr_schedule": "linear"}, "--lr_schedule='linear': cosine, constant or halving"),
    ({"router_lr_scale": "-0.5"}, "--router_lr_scale=-0.5: must be >= 0"),
    ({"correction": "seq_none"}, "--correction='seq_none': choose one of none, is, tis, mis, reject, icepop"),
    ({"seq_rho": "sum"}, "--seq_rho='sum': choose one of geo_mean, product"),
    ({"gspo_log_ratio_max": "0"}, "--gspo_log_ratio_max=0.0: must be in (0, 20]"),
    ({"mis_high": "0.8"}, "need 0 <= mis_low <= 1 <= mis_high"),
    ({"kl_estimator": "k4"}, "--kl_estimator='k4': k1, k2, k3, k3_clamped"),
])
def test_train_config_names_the_bad_field(overrides, needle):
    from config import RolloutConfig, TrainConfig
    with pytest.raises(ConfigError) as e:
        apply_overrides(overrides, TrainConfig(), RolloutConfig())
    assert needle in str(e.value)
    tcfg, rcfg = TrainConfig(), RolloutConfig()                       # control: good values pass
    apply_overrides({"steps": "1", "device": "cuda:1", "lr": "0.5", "task": "reverse", "lr_schedule": "halving",
                     "lr_decay_period": "3", "router_lr_scale": "0", "correction": "seq_mis", "seq_rho": "product",
                     "gspo_log_ratio_max": "10", "kl_estimator": "k3_clamped"}, tcfg, rcfg)


def test_model_config_rejects_non_finite():
    with pytest.raises(ConfigError, match="rope_theta=inf"):
        tiny_config(rope_theta=float("inf"))


def test_apply_overrides_revalidates():
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        apply_overrides({"num_experts_per_tok": "9"}, tiny_config())


def test_help_text_lists_fields():
    text = config.help_text(tiny_config())
    for name in TINY:
        assert f"--{name}=" in text
