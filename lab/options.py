"""The lab's options: its rollout-side faults (lab/faults.py).

config.py composes these fields into RolloutConfig (one flat --key=value namespace; --help lists them under
this class).
Nothing of the project is imported at this module's top: deleting the folder takes its options with it."""
from __future__ import annotations

from dataclasses import dataclass

QUANT_FORMATS = ("int8", "fp8_e4m3")   # --rollout_dtype's quantized formats
# The mismatch lab's episode faults (--rollout_episode_fault; lab.episode_fault applies them to the
# sampler's outputs or cache from outside): where shipped systems break a multi-turn episode's consistency.
EPISODE_FAULTS = ("none",
                  "retokenize",         # the history decoded and re-encoded between turns: other ids for the trainer
                  "dummy_last_route",   # each turn's last token recorded with a dummy route (it was never fed alone)
                  "stale_prefix_kv")    # the prefix cache kept across weight updates: KV of an older policy

# The mismatch lab's router faults (RolloutConfig.rollout_router_fault), set on the rollout copy's MoE
# modules only (lab.set_router_fault, lab.FaultyRouting applies them): what a conversion bug or a
# second engine gets wrong.
ROUTER_FAULTS = ("none",
                 "no_bias",            # the score-correction bias lost: the choice on the raw scores
                 "bias_sign",          # the bias subtracted instead of added
                 "bias_in_weights",    # the combine weights taken from the biased scores
                 "no_renorm",          # the top-k weights not renormalised (norm_topk_prob ignored)
                 "shared_in_topk",     # the shared expert fused into the top-k as one more slot of weight 1,
                                       # renormalised with the routed ones (each weight over 1 + their sum)
                 "expert_map")         # a wrong logical-to-physical expert table (expert_map_fault): the
                                       # router is right, its ids reach the wrong experts, routes are logged as chosen


@dataclass
class FaultOptions:
    """The mismatch lab: deviations on the rollout side only (the trainer always stays invariant)."""
    rollout_mode: str = "invariant"   # invariant | fast (batch-variant torch / cuBLAS / SDPA ops)
    router_bf16: bool = False         # round the rollout's router logits to bf16
    rollout_dtype: str = ""           # "" (the trainer's) | bfloat16 | float16: a lower-precision weight copy |
                                      # int8 | fp8_e4m3: matmul weights rounded to that format per output channel
                                      # (absmax scales) and dequantized (lab.quantized_copy)
    rollout_quant_router: bool = True   # int8 / fp8_e4m3: quantize the router gate too (false: full precision)
    rollout_router_fault: str = "none"  # none | no_bias | bias_sign | bias_in_weights | no_renorm | expert_map: the
                                        # rollout's routing wrong in that one way (ROUTER_FAULTS), the trainer's right
    rollout_episode_fault: str = "none"  # none | retokenize | dummy_last_route | stale_prefix_kv: an episode's
                                        # consistency broken as shipped systems break it (EPISODE_FAULTS, lab/faults.py)
    rollout_linear_decode: str = "grid"  # grid | recurrent: the rollout's Gated DeltaNet layers (hybrids/) run the
                                        # recurrent form, a token at a time, as inference engines decode them

    @property
    def quantized(self) -> bool:
        """Whether the rollout's matmul weights are rounded to a quantized format (lab.quantized_copy)."""
        return self.rollout_dtype in QUANT_FORMATS

    def rollout_ops(self) -> dict:
        """The sampler's op set (kernels.op_set): the fast ops under --rollout_mode=fast, the bf16 router
        rounding under --router_bf16 (lab/fast_ops.py, imported only then)."""
        if self.rollout_mode == "invariant" and not self.router_bf16:
            return {}
        from lab.fast_ops import op_set
        return op_set(self.rollout_mode == "fast", self.router_bf16)

    def check(self):
        self.require(self.rollout_mode in ("invariant", "fast"),
                     f"--rollout_mode={self.rollout_mode!r}: invariant or fast")
        self.require(self.rollout_dtype in ("", "float32", "bfloat16", "float16") + QUANT_FORMATS,
                     f"--rollout_dtype={self.rollout_dtype!r}: '', float32, bfloat16, float16, int8 or fp8_e4m3")
        self.require(self.rollout_quant_router or self.rollout_dtype in QUANT_FORMATS,
                     f"--rollout_quant_router=false: only a quantized rollout (--rollout_dtype=int8 or fp8_e4m3) "
                     f"quantizes the router (this one's is {self.rollout_dtype or 'the trainer dtype'})")
        self.require(self.rollout_episode_fault in EPISODE_FAULTS,
                     f"--rollout_episode_fault={self.rollout_episode_fault!r}: choose one of "
                     f"{', '.join(EPISODE_FAULTS)}")
        self.require(self.rollout_linear_decode in ("grid", "recurrent"),
                     f"--rollout_linear_decode={self.rollout_linear_decode!r}: grid or recurrent")
        self.require(self.rollout_router_fault in ROUTER_FAULTS,
                     f"--rollout_router_fault={self.rollout_router_fault!r}: choose one of {', '.join(ROUTER_FAULTS)}")


@dataclass
class ObservationOptions:
    """The lab's observations of every request."""
    log_hotness: bool = False         # each sequence's expert hotness (the busiest expert's share of its routed
                                      # choices, per MoE layer and their mean) to hotness.jsonl, with its reward;
                                      # request_hot_frac_* quantiles in metrics.jsonl (lab/observe.py)
    mismatch_split: bool = False      # the train-rollout gap (k3 KL, extreme tokens, route flips) split by a response
                                      # token's index (1-8, 9-32, 33-128, later) and an episode's turn (1, 2, 3,
                                      # 4 and later): *_by_position, *_by_turn lists in metrics.jsonl


def hooks(tcfg, rcfg) -> list:
    """The hooks of the options that are set (support/hooks.py), their code imported only then. The fast
    kernels (--rollout_mode, --router_bf16) are the sampler's op set: rollout.Sampler asks rollout_ops."""
    out = []
    if (rcfg.rollout_dtype or rcfg.rollout_router_fault != "none" or rcfg.rollout_episode_fault != "none"
            or rcfg.rollout_linear_decode != "grid"):
        from lab.faults import Faults
        out.append(Faults(tcfg, rcfg))
    if tcfg.log_hotness:
        from lab.observe import Hotness
        out.append(Hotness())
    if tcfg.mismatch_split:
        from lab.observe import MismatchSplit
        out.append(MismatchSplit())
    return out


TRAIN = [ObservationOptions]
ROLLOUT = [FaultOptions]
