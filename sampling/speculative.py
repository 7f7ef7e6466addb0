"""Speculative decoding that changes nothing but speed: n-gram (prompt lookup) drafts and their check.

    sampler = Sampler(model, speculative_tokens=4)     # RolloutConfig.speculative_tokens, speculative_ngram
    outs = sampler.generate(prompts, ...)              # the tokens, log-probs and routes of plain decoding
    sampler.spec_accept_rate                           # the share of drafted tokens kept

Each decode step becomes a verify step (rollout.ModelRunner._verify_step). For every running sequence,
`propose` looks up its last m ids (m = speculative_ngram, then shorter, down to 1) at an earlier place
in the sequence (prompt and generated ids alike; which one: below) and drafts the k ids that followed.
One forward feeds each sequence its last id and its drafts, k + 1 query positions over its paged KV,
and every position samples with the sequence's own draw for (seed, sequence, position). `accept` keeps
the drafts while each equals the token sampled before it, then the first sampled token that differs
(the bonus token): 1 .. k + 1 tokens a step.

Why the bits are plain decoding's: the invariant kernels give a query row the same bits whatever the
other rows of the call (a verify forward is a chunked prefill of k + 1 tokens), so a position whose
fed ids are the true ones gets plain decoding's logits, hence its token, log-prob and routes. A draft
is kept only if it is the token plain decoding samples there, so every kept position's inputs are the
true ones. Positions past the first mismatch read a wrong id: their KV, routes and samples are thrown
away. Nothing needs undoing: the sequence's length advances only by what was kept, the next step
writes the KV and routes of every position from its own first one (the earliest rejected slot) before
any query reads it, attention never reads a key past its query, and a sequence's routes are collected
only below its length. On the batch-variant fast path a row's bits depend on the rows beside it, so
there speculative decoding does change the bits (the mismatch lab's "fast+speculative" row).

The drafts are any function of the sequence: they decide how many tokens a step keeps, never which.
A longer n-gram wins (it predicts better, as in vLLM's and transformers' prompt lookup). Among its
places the most recent that k ids follow (the text just written predicts the next best), else the
earliest (in a loop shorter than k the most recent place is followed by fewer ids than the earliest);
vLLM and transformers take the earliest always. On tooling/bench.py's copy section (`--only speculative`)
this rule was faster than the most recent place alone at 4, 8 and 32 sequences. The lookup is a few
tensor ops over the rows' token buffers on the device, no host read, like the rest of a step.

CUDA graphs: a verify step is a fixed set of tensor ops over the runner's buffers (the lookup, a forward
of (bucket, k + 1) tokens, the draw, the check, the writes), so it is captured per batch-size bucket
like a decode step; tests/test_speculative.py -k cuda checks graph against eager. An in-flight weight
update (Sampler.generate's on_step) is refused with it: the update lands after a number of engine
steps, and verify steps would change which version samples a token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def propose(tokens: torch.Tensor, n_tok: torch.Tensor, room: torch.Tensor, k: int,
            ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts for each row: tokens (B, L) its ids (positions >= n_tok unread), n_tok (B,) how many it
    holds, room (B,) the most drafts it may take -> drafts (B, k) ids and n_draft (B,) how many of them
    count (0: no match). The last m ids are matched for m = ngram .. 1 and the longest m with a match
    wins, at its most recent place that k ids follow, else its earliest (the most ids follow it); the
    drafts are the ids after it, at most up to the end."""
    B, L = tokens.shape
    at = torch.arange(L, device=tokens.device)[None, :]                         # (1, L)
    back = (n_tok[:, None] - 1 - torch.arange(ngram, device=tokens.device)).clamp(min=0)
    last = tokens.gather(1, back)                                               # (B, ngram): last id, then the one before
    before_end = at <= (n_tok - 2)[:, None]               # a match ends before the last id: at least one follows it
    k_follow = at <= (n_tok - 1 - k)[:, None]             # ... k of them
    ok = torch.ones(B, L, dtype=torch.bool, device=tokens.device)   # ok[b, j]: ids j-m+1..j are the last m
    best = torch.full((B,), -1, dtype=torch.long, device=tokens.device)
    for i in range(ngram):                                # m = i + 1
        shifted = F.pad(tokens, (i, 0), value=-1)[:, :L]                        # (B, L): shifted[b, j] = tokens[b, j - i]
        ok = ok & (shifted == last[:, i:i + 1])
        recent = torch.where(ok & k_follow, at, -1).amax(1)                     # (B,) -1: none
        first = torch.where(ok & before_end, at, L).amin(1)                     # (B,) L: none
        end = torch.where(recent >= 0, recent, torch.where(first < L, first, -1))
        best = torch.where(end >= 0, end, best)                                 # a longer match replaces a shorter one
    follow = (best[:, None] + 1 + torch.arange(k, device=tokens.device)).clamp(max=L - 1)   # (B, k)
    n_draft = torch.minimum(torch.minimum(n_tok - 1 - best, room), torch.full_like(room, k))
    return tokens.gather(1, follow), torch.where(best >= 0, n_draft, 0)


def accept(drafts: torch.Tensor, n_draft: torch.Tensor, sampled: torch.Tensor,
           stop_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of a verify step's sampled tokens each row keeps: drafts (B, k), n_draft (B,), sampled
    (B, k + 1) (sampled[:, i] at the position after the i-th fed id) -> kept (B,) in 1 .. k + 1 and
    stopped (B,) bool. The drafts hold while each equals the token sampled at its position; the first
    sampled token that does not (or the one after the last draft) is kept too. A stop token among the
    kept ends the turn there: the tokens after it are dropped."""
    k = drafts.shape[1]
    t = torch.arange(k + 1, device=sampled.device)                              # (k+1,)
    match = (sampled[:, :k] == drafts) & (t[None, :k] < n_draft[:, None])       # (B, k)
    accepted = match.long().cumprod(1).sum(1)                                   # (B,) drafts confirmed in a row
    stop = (sampled[..., None] == stop_ids[None, None, :]).any(-1) & (t[None, :] <= accepted[:, None])   # (B, k+1)
    first_stop = torch.where(stop, t, k + 1).amin(1)                            # (B,) k+1: none among the kept
    return torch.minimum(accepted, first_stop) + 1, first_stop <= k


class NgramDrafts:
    """The sampler's draft policy (RolloutConfig.draft_policy): k drafts a verify step, looked up by the
    longest n-gram from `ngram` down (propose), kept while they match the sampled tokens (accept)."""

    def __init__(self, k: int, ngram: int):
        self.k, self.ngram = k, ngram

    def propose(self, tokens: torch.Tensor, n_tok: torch.Tensor, room: torch.Tensor):
        return propose(tokens, n_tok, room, self.k, self.ngram)

    def accept(self, drafts: torch.Tensor, n_draft: torch.Tensor, sampled: torch.Tensor, stop_ids: torch.Tensor):
        return accept(drafts, n_draft, sampled, stop_ids)

