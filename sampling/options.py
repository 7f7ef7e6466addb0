"""The sampling plug-in's options: the sampler's n-gram drafts (sampling/speculative.py).

config.py composes these fields into RolloutConfig (one flat --key=value namespace; --help lists them under
this class).
Nothing of the project is imported at this module's top: deleting the folder takes its options with it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculativeOptions:
    """The sampler's n-gram drafts (sampling/speculative.py)."""
    FREE_ON_RESUME = ("speculative_tokens", "speculative_ngram")   # the contract keeps plain decoding's bits
    speculative_tokens: int = 0       # k > 0: each decode step verifies k n-gram drafts of the sequence's own ids
                                      # (sampling/speculative.py): the tokens, log-probs and routes of plain decoding,
                                      # faster where the text repeats; 0: off
    speculative_ngram: int = 3        # the drafts are the ids that followed an earlier place of the sequence's
                                      # last n ids, the longest n from this down to 1 that has one

    def draft_policy(self):
        """The n-gram drafts (sampling/speculative.NgramDrafts) when --speculative_tokens > 0."""
        if not self.speculative_tokens:
            return None
        from sampling.speculative import NgramDrafts
        return NgramDrafts(self.speculative_tokens, self.speculative_ngram)

    def check(self):
        self.require_range("speculative_tokens", lambda v: v >= 0, ">= 0 (0: off)")
        self.require_range("speculative_ngram", lambda v: v >= 1,
                           ">= 1 (the longest n-gram the drafts are looked up by)")

    def check_with_training(self, tcfg):
        """An in-flight update lands after a number of engine steps and a verify step samples several
        tokens, so speculative decoding would change which policy version samples a token."""
        inflight = getattr(tcfg, "inflight_update", "off")                 # asynchrony/'s
        self.require(not (self.speculative_tokens and inflight != "off"),
                     f"--speculative_tokens={self.speculative_tokens} with --inflight_update={inflight}: an update "
                     "lands after a number of engine steps, which speculative decoding changes; drop one")


TRAIN = []
ROLLOUT = [SpeculativeOptions]
