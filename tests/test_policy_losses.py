"""The policy-losses plug-in (policy_losses/): SAPO and CISPO by hand and against verl's, their aggregation,
and --loss=sapo bringing the plug-in (its options) without naming one of them.

    python -m pytest -q tests/test_policy_losses.py
"""
import pytest
import torch

import config
import losses
from config import ConfigError
from test_losses import _batch, _ours, _verl, cfg
from test_reliability import cli_error


def test_auto_aggregation_follows_each_paper():
    assert cfg(loss="cispo").aggregation == "token_mean"
    assert cfg(loss="sapo").aggregation == "seq_mean_token_mean"      # per sequence, then over sequences
    assert cfg(loss="sapo", agg="token_mean").aggregation == "token_mean"


def test_sapo_and_cispo_by_hand():
    logp = torch.log(torch.tensor([[1.2, 0.9]]))
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    loss, _ = losses.policy_loss(logp, old, torch.tensor([1.0]), mask, cfg(loss="sapo"))
    r = torch.tensor([1.2, 0.9])
    assert torch.allclose(loss[0], -(torch.sigmoid(r - 1) * 4))
    loss, _ = losses.policy_loss(logp, old, torch.tensor([-2.0]), mask, cfg(loss="sapo"))
    assert torch.allclose(loss[0], 2 * torch.sigmoid(1.05 * (r - 1)) * 4 / 1.05)
    loss, _ = losses.policy_loss(logp, old, torch.tensor([1.0]), mask, cfg(loss="cispo"))
    assert torch.allclose(loss[0], -torch.tensor([1.2, 0.9]) * logp[0])



VERL_CASES = {"cispo": (dict(loss="cispo"), ("cispo", "token-mean")),
              "sapo": (dict(loss="sapo"), ("sapo", "seq-mean-token-mean"))}


@pytest.mark.parametrize("name", VERL_CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_losses_and_gradients_equal_verls(name, seed):
    over, (kind, mode) = VERL_CASES[name]
    c = cfg(**over)
    logp, old, mu, ref, adv, mask = _batch(seed)
    ours, g_ours = _ours(c, logp, old, mu, ref, adv, mask)
    ref_loss, g_ref = _verl(c, kind, mode, logp, old, mu, ref, adv, mask)
    assert torch.allclose(ours, ref_loss, rtol=1e-5, atol=1e-7), (ours, ref_loss)
    assert torch.allclose(g_ours, g_ref, rtol=1e-5, atol=1e-7)
    assert g_ours.abs().sum() > 0


def test_a_named_loss_brings_the_plugin_and_its_options(tmp_path):
    """--loss=sapo names no option of policy_losses/, yet its configs carry SAPO's (config.configs_for by
    the value); the core's configs alone refuse it in one line; an unknown loss lists every one."""
    tcls, _ = config.configs_for({"loss": "sapo"})
    assert tcls(loss="sapo").sapo_tau_neg == 1.05 and "sapo" in losses.LOSSES
    core, _ = config.configs_for({"loss": "grpo"})
    assert not hasattr(core(), "sapo_tau_neg")                        # control: grpo brings nothing
    with pytest.raises(ConfigError, match="policy_losses/'s, whose options this config lacks"):
        core(loss="sapo")
    assert "--loss='nope': choose one of grpo, gspo, gspo_token, sapo, cispo" \
        in cli_error(f"--out_dir={tmp_path}", "--loss=nope")
