"""The diagnostics hook: the holdout before the update, diagnostics.jsonl after the step."""
from __future__ import annotations

import torch
import torch.distributed as dist

from diagnostics.rows import diagnostics, hold_out
from support.hooks import Hooks
from support.runlog import append_jsonl


class Diagnostics(Hooks):

    def hold_out(self, run, batch, audit, mask, held):
        """--diagnostics_holdout: the loss mask without the step's diagnostics sequences and their rows of the
        global batch (diagnostics/rows.hold_out); as given without it."""
        if not run.tcfg.diagnostics_holdout:
            return mask, held
        out, rows = hold_out(batch, audit, run.tcfg)
        return mask * out, rows

    def rank_files(self, run, step, batch, outs, rewards, audited, held) -> dict:
        """diagnostics.jsonl's rows of the step (log_diagnostics); diagnostics_held_out, the sequences held out
        of the update, with the holdout."""
        holdout = run.tcfg.diagnostics_holdout
        log_diagnostics(run, step, batch, outs, rewards, audited, held if holdout else None)
        return {"diagnostics_held_out": len(held)} if holdout else {}


def log_diagnostics(run, step: int, batch, outs, rewards, audited, held_out: torch.Tensor | None) -> None:
    """diagnostics.jsonl's rows of the step: each rank writes the rows of its own sequences (global rows lo ..
    lo + len(outs) - 1), rank 0 appends them all. Without a holdout, up to N of each rank's most mismatched;
    with one, exactly the held-out sequences, each row by the rank that owns the sequence, in their order.
    batch: this rank's train.Batch; audited: the packing.Scored forward the step's audit used, of its rows;
    held_out: --diagnostics_holdout's rows of the global batch (diagnostics/rows.hold_out), whose rows are the file's."""
    lo = run.d.rank * len(outs)
    only = None if held_out is None else [r - lo for r in held_out.tolist() if lo <= r < lo + len(outs)]
    found = diagnostics(step + 1, outs, audited.rows, audited.logp, audited.routes, batch.routes[audited.rows],
                               rewards, run.tcfg.diagnostics, n_experts=run.policy.master.config.num_experts,
                               decode=getattr(run.task, "decode", None), only=only, offset=lo,
                               train_margin=None if audited.detail is None else audited.detail.margin)
    if run.d.world > 1:
        every = [None] * run.d.world
        dist.all_gather_object(every, found)
        found = [r for part in every for r in part]
    if held_out is not None:                                          # the holdout's order, at every world size
        order = {r: i for i, r in enumerate(held_out.tolist())}
        found.sort(key=lambda row: order[row["sequence"]])
    for hook in run.hooks:                                            # a plug-in's keys (EPLB: the layouts' plan)
        hook.diagnostics(found)
    append_jsonl(run, step, "diagnostics.jsonl", found)
