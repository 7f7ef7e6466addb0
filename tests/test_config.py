"""config.py: presets, validation, overrides. Hugging Face config.json: tests/test_hf.py."""
import re

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
    ({"lr_schedule": "linear"}, "--lr_schedule='linear': choose one of cosine, constant, halving"),
    ({"surge_window": "-1"}, "--surge_window=-1: must be >= 0 (0: off)"),
    ({"surge_ratio": "0"}, "--surge_ratio=0: must be > 0"),
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
                     "lr_decay_period": "3", "router_lr_scale": "0", "correction": "seq_mis", "recompute_old_logp": "true", "seq_rho": "product",
                     "gspo_log_ratio_max": "10", "kl_estimator": "k3_clamped", "halving_start": "surge",
                     "surge_window": "3", "surge_ratio": "0.25"}, tcfg, rcfg)


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


def test_the_command_line_sets_a_presets_fields_typed_and_checked():
    from config import RolloutConfig, TrainConfig, apply_command_line
    tcfg, rcfg = TrainConfig(), RolloutConfig()
    apply_command_line({"num_hidden_layers": "2", "mlp_only_layers": "1", "rope_theta": "5e5", "lr": "0.01"}, tcfg, rcfg)
    assert tcfg.model_overrides == {"num_hidden_layers": 2, "mlp_only_layers": [1], "rope_theta": 5e5} and tcfg.lr == 0.01
    cfg = tcfg.preset_config()
    assert (cfg.num_hidden_layers, cfg.mlp_only_layers, cfg.moe_layers) == (2, [1], [0])
    assert ModelConfig.preset("tiny").num_hidden_layers == 4                     # the preset itself is untouched
    for bad, needle in (({"num_hidden_layers": "x"}, "--num_hidden_layers expects int"),
                        ({"head_dim": "7"}, "head_dim must be even"),
                        ({"n_experts": "4"}, "did you mean --num_experts?"),
                        ({"model_type": "mixtral"}, "unknown config key --model_type"),
                        ({"model_overrides": "{}"}, "unknown config key --model_overrides")):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            apply_command_line(bad, TrainConfig(), RolloutConfig())
    with pytest.raises(ConfigError, match=r"--num_experts=4 sets a preset's field; --init_from='nope' is not a preset"):
        apply_command_line({"num_experts": "4", "init_from": "nope"}, TrainConfig(), RolloutConfig())


# ---------------------------------------------------------------------------------------------------
# options by owner: the core's groups and each plug-in folder's options.py, one command line
# ---------------------------------------------------------------------------------------------------
def test_every_option_keeps_its_name_and_default():
    """tests/cli_options.json holds every --key and its default as they were when the options moved to
    their owners: a renamed, lost or changed option fails here (a new one is added to the file)."""
    import json
    import os
    from config import RolloutConfig, TrainConfig, _cli_fields
    with open(os.path.join(os.path.dirname(__file__), "cli_options.json")) as f:
        pinned = json.load(f)
    now = {n: getattr(c, n) for c in (TrainConfig(), RolloutConfig()) for n in _cli_fields(type(c))}
    assert {k: now.get(k, "missing") for k in pinned} == pinned


def test_help_lists_each_option_under_the_group_that_declares_it():
    from config import RolloutConfig, TrainConfig
    text = config.help_text(TrainConfig(), RolloutConfig())
    group = None
    where = {}
    for line in text.splitlines():
        if not line.startswith("  "):
            group = line.split(":")[0]
        else:
            where[line.split("=")[0].strip()] = group
    assert where["--max_staleness"] == "AsyncOptions (asynchrony/options.py)"
    assert where["--expert_parallel"] == "ParallelOptions (parallel/options.py)"
    assert where["--rollout_dtype"] == "FaultOptions (lab/options.py)"
    assert where["--speculative_tokens"] == "SpeculativeOptions (sampling/options.py)"
    assert where["--lr"] == "TrainOptions (config.py)" and where["--temperature"] == "RolloutOptions (config.py)"


def test_two_groups_may_not_declare_one_option():
    from dataclasses import dataclass

    @dataclass
    class Twice:
        lr: float = 1.0                   # the core's --lr again
    with pytest.raises(TypeError, match="'lr' is declared by TrainOptions and Twice"):
        config.compose("TrainConfig", config.TrainOptions, [Twice])


def test_a_deleted_plugin_folder_takes_its_options_with_it(tmp_path):
    """config.py composes whatever */options.py exist: without asynchrony/ its options are unknown keys and
    the rest still parse and check (control: with the folder they are there)."""
    import os
    import shutil
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shutil.copytree(root, tmp_path, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git", "out", "tests", "docs"))
    probe = ("import config\n"
             "t = config.TrainConfig()\n"
             "print(hasattr(t, 'max_staleness'), hasattr(t, 'expert_parallel'))\n"
             "try:\n"
             "    config.apply_overrides({'max_staleness': '1'}, t, config.RolloutConfig())\n"
             "except config.ConfigError as e:\n"
             "    print(e)\n")

    def run():
        r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()
    assert run() == ["True True"]                                     # control: the folder is there
    shutil.rmtree(tmp_path / "asynchrony")
    lines = run()
    assert lines[0] == "False True" and lines[1].startswith("unknown config key --max_staleness")
