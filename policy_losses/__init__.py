"""The policy-losses plug-in: losses beyond the core's PPO-clip family (GRPO, GSPO), SAPO's soft gate and
CISPO's clipped IS weight. policy_losses/losses.py adds them to losses.LOSSES when --loss names one.
"""
