"""--log_samples=N: each step's first N sampled responses of rank 0 to samples.jsonl (strict JSON: the step,
the prompt and the response as text, the answer, the reward), the first also on the console."""
from __future__ import annotations

from support.hooks import Hooks
from support.runlog import append_jsonl, say


class SampleLog(Hooks):
    """samples.jsonl's rows (rank 0; a resume first drops the rows past its checkpoint: append_jsonl)."""

    def __init__(self, n: int):
        self.n = n

    def samples(self, run, step: int, examples, outs, rewards) -> None:
        if not run.d.master:
            return
        G, task = run.tcfg.group_size, run.task
        rows = [{"step": step + 1, "prompt": task.decode(examples[i // G].prompt), "response": task.decode(o.tokens),
                 "answer": examples[i // G].answer, "reward": rewards[i].item()} for i, o in enumerate(outs[:self.n])]
        append_jsonl(run, step, "samples.jsonl", rows)
        r = rows[0]
        say(run, f"step {r['step']} sample: {r['prompt'][-60:]!r} -> {r['response'][:80]!r} (reward {r['reward']:.3f})")
