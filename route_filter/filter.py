"""The route filters: per-token loss weights from the trainer's routes against the rollout's, the cheaper
alternative to replaying them. --route_filter weighs a token by its top-k overlap (masked below the
threshold, or times the overlap; per token or per response), --route_filter_tokens zeroes the weight of
chosen key tokens whose first choice flipped. Without a mismatch every weight is exactly 1, so either is a
no-op at the contract. The step hook hands them to the loss (support/hooks.Hooks.token_weights); the core
counts the tokens they lowered (route_filtered_frac).
"""
from __future__ import annotations

import torch

from config import ConfigError
from replay import topk_overlap
from support.hooks import Hooks


class RouteFilter(Hooks):
    """The filters in the step: the key tokens' table set up once (the task's classes, the model's
    vocabulary), each micro-batch's weights from its forward's routes."""

    def __init__(self, tcfg):
        self.tcfg, self.table = tcfg, None

    def check_build(self, task, config) -> None:
        route_filter_token_ids(self.tcfg, task, config.vocab_size)   # one line for a bad id, before the build

    def setup(self, run, resumed) -> None:
        vocab = run.policy.master.config.vocab_size
        self.table = key_token_table(route_filter_token_ids(self.tcfg, run.task, vocab), vocab, run.d.device)

    def token_weights(self, run, mb, out, mask):
        return route_filter(mb.routes.to(mask.device), out.routes, mask, run.tcfg, mb.tokens, self.table)


def route_filter_token_ids(cfg, task, vocab_size: int) -> tuple[int, ...]:
    """--route_filter_tokens as sorted ids: its ids and its classes' (task.token_class, which refuses a class
    the task does not define); an id outside the model's vocabulary is one line. () when off."""
    ids = set()
    for item in cfg.key_token_items():
        ids.update([int(item)] if item.isdigit() else task.token_class(item))
    bad = sorted(i for i in ids if i >= vocab_size)
    if bad:
        raise ConfigError(f"--route_filter_tokens={cfg.route_filter_tokens}: ids {bad[:5]} are not in the model's "
                          f"vocabulary of {vocab_size} ids (0..{vocab_size - 1})")
    return tuple(sorted(ids))


def token_overlap(rollout: torch.Tensor, train: torch.Tensor) -> torch.Tensor:
    """Each token's top-k overlap averaged over MoE layers: routes (B, T, n_moe, k) -> (B, T); 1 where
    the model has no MoE layer (nothing can flip)."""
    if rollout.shape[2] == 0:
        return torch.ones(rollout.shape[:2], device=rollout.device)
    return topk_overlap(rollout, train).mean(-1)


def route_filter_weights(overlap: torch.Tensor, mode: str, threshold: float, level: str = "token",
                         mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token loss weights (B, T) from each token's top-k overlap (B, T) (token_overlap: the
    rollout's experts against the trainer's, averaged over MoE layers). mask: 0 for tokens whose overlap
    is below the threshold; downweight: their loss times the overlap.
    level "sequence": the same rule on each response's mean overlap over its tokens (mask (B, T), the
    response tokens), applied to all its tokens. Without a mismatch every overlap is 1: weights all 1."""
    if level == "sequence":
        m = mask.to(overlap.dtype)
        mean = (overlap * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)   # (B, 1)
        overlap = torch.where(m.sum(-1, keepdim=True) > 0, mean, 1.0).expand_as(overlap)
    below = overlap < threshold
    if mode == "mask":
        return (~below).float()
    if mode == "downweight":
        return torch.where(below, overlap, 1.0)
    return torch.ones_like(overlap)


def route_filter(rollout: torch.Tensor, train: torch.Tensor, mask: torch.Tensor, cfg,
                 tokens: torch.Tensor | None = None, key_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
    """The route filters' per-token loss weights (B, T-1) for a forward's routes (B, T, n_moe, k) against the
    rollout's (position j's route scores token j + 1, as logp[:, j]); mask (B, T-1): the loss tokens.
    --route_filter's (route_filter_weights) times --route_filter_tokens' (key_token_weights of tokens (B, T)
    and key_tokens, key_token_table's); None when both are off (cfg: a TrainConfig)."""
    weights = None
    if cfg.route_filter != "none":
        overlap = token_overlap(rollout[:, :-1], train[:, :-1])
        weights = route_filter_weights(overlap, cfg.route_filter, cfg.route_filter_threshold, cfg.route_filter_level,
                                       mask)
    if key_tokens is not None:
        key = key_token_weights(rollout, train, tokens.to(rollout.device), key_tokens)
        weights = key if weights is None else weights * key
    return weights


def key_token_table(ids, vocab_size: int, device=None) -> torch.Tensor | None:
    """(V,) bool: the ids --route_filter_tokens names (route_filter_token_ids); None for none (off)."""
    if not ids:
        return None
    table = torch.zeros(vocab_size, dtype=torch.bool)
    table[list(ids)] = True
    return table.to(device)


def key_token_weights(rollout: torch.Tensor, train: torch.Tensor, tokens: torch.Tensor,
                      table: torch.Tensor) -> torch.Tensor:
    """--route_filter_tokens' weights (B, T-1): 0 for a key token (table[token], (V,) bool) whose top-1 expert at
    the position that scores it differs between the rollout's and the trainer's routes (B, T, n_moe, k) in any
    MoE layer, else 1; tokens (B, T), column j of the result scores tokens[:, j + 1]. Without a mismatch no
    top-1 differs: every weight is exactly 1."""
    first_r, first_t = rollout[:, :-1, :, 0], train[:, :-1, :, 0]           # (B, T-1, n_moe): the first choices
    flipped = ((first_r != first_t) & (first_r >= 0)).any(-1)               # an unrecorded position (-1) is no flip
    return (~(flipped & table[tokens[:, 1:]])).float()
