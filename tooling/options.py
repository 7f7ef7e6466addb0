"""The tooling's run options: evaluation on a held-out JSONL (tooling/eval.py) and supervised steps
before RL (tooling/sft.py).

config.py composes these fields into TrainConfig (one flat --key=value namespace; --help lists them under
this class).
Nothing of the project is imported at this module's top: deleting the folder takes its options with it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalOptions:
    """Evaluation on a held-out JSONL and the fixed probe set (tooling/eval.py); supervised steps (tooling/sft.py);
    the plan before a GPU run (tooling/plan.py)."""
    FREE_ON_RESUME = ("eval_data", "eval_every", "eval_samples", "probe_every", "probe_prompts",   # what it evaluates
                      "preflight")
    eval_data: str = ""               # a JSONL file in --data's format, scored with --reward_fn
    eval_every: int = 0               # evaluate every N steps and at the last (0: at the last step only)
    eval_samples: int = 4             # k sampled responses per eval prompt (pass@k)
    probe_every: int = 0              # > 0: every N steps, roll out a fixed probe set greedily and audit it
    probe_prompts: int = 8            # the probe set's size (drawn once from the task)
    sft_steps: int = 0                # before RL: N optimizer steps of cross-entropy on the task's reference answers
                                      # (minibatch_size examples each; tooling/sft.py), then a checkpoint at step 0;
                                      # 0: off

    preflight: bool = True            # a GPU run: the run's --plan against the GPU's memory before loading; a run that
                                      # does not fit ends in one line naming what would (tooling/plan.py)

    def check(self):
        """The held-out set needs a JSONL task's tokenizer and reward; supervised steps need reference answers
        (supervised_tasks, checked against the tasks in support/tasks.py) and the trainers' sampler."""
        self.require(self.eval_samples >= 1, f"--eval_samples={self.eval_samples}: must be >= 1")
        self.require(self.eval_every >= 0, f"--eval_every={self.eval_every}: must be >= 0")
        self.require(not self.eval_every or self.eval_data,
                     f"--eval_every={self.eval_every}: needs --eval_data=FILE (a held-out JSONL)")
        self.require(not self.eval_data or self.task == "jsonl",
                     f"--eval_data={self.eval_data!r}: needs --task=jsonl (its --tokenizer and --reward_fn score it)")
        self.require(not (self.env and self.eval_data), "--eval_data scores single responses with --reward_fn; it "
                     "does not run --env's episodes yet: drop one of the two")
        self.require(self.probe_every >= 0, f"--probe_every={self.probe_every}: must be >= 0 (0: off)")
        self.require(self.probe_prompts > 0, f"--probe_prompts={self.probe_prompts}: must be >= 1")
        self.require(self.sft_steps >= 0, f"--sft_steps={self.sft_steps}: must be >= 0 (0: no supervised steps)")
        if self.sft_steps:
            self.require(self.task in supervised_tasks() and not self.env,
                         f"--sft_steps={self.sft_steps}: --task={self.task}{' with --env' if self.env else ''} has no "
                         f"reference answers to train on; the tasks that have them: {', '.join(supervised_tasks())} "
                         "(jsonl without --env)")
        self.require(not (self.sft_steps and getattr(self, "rollout_ranks", 0)),
                     f"--sft_steps={self.sft_steps} with --rollout_ranks: the rollout ranks would not see the "
                     "supervised weights; not yet supported")


def hooks(tcfg, rcfg) -> list:
    """The step hooks of the options that are set (support/hooks.py), their code imported only then: the
    supervised phase; the plan before a GPU run; the held-out evaluation, then the probe (the order the
    step's metrics show them)."""
    out = []
    if tcfg.sft_steps or tcfg.resume:             # a resume checks that RL did not begin under other --sft_steps
        from tooling.sft import Supervised
        out.append(Supervised())
    if tcfg.preflight and tcfg.device != "cpu":   # a GPU run: its plan against this rank's GPU, before loading
        import os

        import torch
        if torch.cuda.is_available():
            from tooling.plan import Preflight
            gpu = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0")))
            out.append(Preflight(tcfg, rcfg, gpu.total_memory))
    if tcfg.eval_data or tcfg.probe_every:
        from tooling.eval import Evaluation, Probing
        out += ([Evaluation()] if tcfg.eval_data else []) + ([Probing()] if tcfg.probe_every else [])
    return out


ON_GPU = True                   # every GPU run imports these options: Preflight checks its plan first (config.configs_for)
def supervised_tasks() -> tuple[str, ...]:
    """The tasks with reference answers (--sft_steps' targets): the core's (support/tasks.SUPERVISED_TASKS) and
    those a plug-in's options.py lists in SUPERVISED_TASKS (multi_turn/'s fix)."""
    from config import declared_by
    from support.tasks import SUPERVISED_TASKS
    return (*SUPERVISED_TASKS, *declared_by("SUPERVISED_TASKS"))


TRAIN = [EvalOptions]
ROLLOUT = []
