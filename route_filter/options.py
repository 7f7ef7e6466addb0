"""The route filters' options: the loss weights of tokens whose routes the trainer does not take as the
rollout did (route_filter/filter.py), the cheaper alternative to replaying them (--replay=r3).

config.py composes these fields into TrainConfig (one flat --key=value namespace; --help lists them under
this class).
Nothing of the project is imported at this module's top: deleting the folder takes its options with it."""
from __future__ import annotations

import re
from dataclasses import dataclass

ROUTE_FILTERS = ("none", "mask", "downweight")   # --route_filter
ROUTE_FILTER_LEVELS = ("token", "sequence")      # --route_filter_level


@dataclass
class RouteFilterOptions:
    """The route filters: by top-k overlap, and key tokens by their first choice."""
    route_filter: str = "none"        # none | mask | downweight: the loss of tokens whose rollout/trainer top-k
                                      # overlap is below --route_filter_threshold (masked, or times the overlap)
    route_filter_threshold: float = 0.9    # --route_filter: the overlap (mean over MoE layers) a token needs
    route_filter_level: str = "token"      # token | sequence: filter whole responses by their mean overlap
    route_filter_tokens: str = ""     # key tokens: comma-separated ids and / or a task's token class (digits); such a
                                      # response token gets loss weight 0 where its top-1 expert flipped in any MoE
                                      # layer (times --route_filter's weight if both are on); "": off

    def check(self):
        self.require(self.route_filter in ROUTE_FILTERS, f"--route_filter: {', '.join(ROUTE_FILTERS)}")
        self.require(self.route_filter_level in ROUTE_FILTER_LEVELS,
                     f"--route_filter_level={self.route_filter_level!r}: {' or '.join(ROUTE_FILTER_LEVELS)}")
        self.require(all(re.fullmatch(r"\d+|[A-Za-z_]\w*", t) for t in self.key_token_items()),
                     f"--route_filter_tokens={self.route_filter_tokens!r}: comma-separated token ids and / or a "
                     "task's token class, e.g. --route_filter_tokens=digits or --route_filter_tokens=15,16")
        self.require_range("route_filter_threshold", lambda v: 0 <= v <= 1, "in [0, 1]")

    def check_with_model(self, model):
        if not model.moe_layers:
            for name, off in (("route_filter", "none"), ("route_filter_tokens", "")):
                self.require(getattr(self, name) == off,
                             f"--{name}={getattr(self, name)}: the model has no MoE layer (no routes); drop it")

    def key_token_items(self) -> list[str]:
        """--route_filter_tokens' comma-separated items."""
        return [t.strip() for t in self.route_filter_tokens.split(",")] if self.route_filter_tokens.strip() else []


def hooks(tcfg, rcfg) -> list:
    """The filters' step hook when either is on (support/hooks.py), its code imported only then."""
    if tcfg.route_filter == "none" and not tcfg.route_filter_tokens:
        return []
    from route_filter.filter import RouteFilter
    return [RouteFilter(tcfg)]


TRAIN = [RouteFilterOptions]
ROLLOUT = []
