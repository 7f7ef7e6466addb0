"""Evaluation on a held-out JSONL: reward and pass rates, greedy and sampled, of a model or a checkpoint.

    python -m tooling.eval out --data=heldout.jsonl   # out's latest checkpoint; the run's tokenizer, reward fn, limits
    python -m tooling.eval CKPT --data=FILE --reward_fn=my_mod:reward --tokenizer=dir/tokenizer.json --samples=8

The file has --data's format (one {"prompt": ..., "answer": ...} a line, support/tasks.py) and is scored with
the same reward function as training. Every prompt is answered once greedily (temperature 0) and k times
sampled (at the run's temperature, from a fixed seed, so two evaluations differ only by the weights).
A response passes when its reward is >= PASS_REWARD: `eval_greedy_pass` is the fraction of prompts whose
greedy response passes (pass@1), `eval_pass@k` the fraction with at least one passing sample of k.

train.py --eval_data=FILE --eval_every=N --eval_samples=k calls the same `evaluate` and logs its keys
into metrics.jsonl. A run folder stands for the checkpoint its `latest` names (checkpoint.checkpoint_folder,
as for export). For a checkpoint train.py wrote, the defaults come from its trainer_state.pt; the
tokenizer from the checkpoint folder itself (exports carry tokenizer.json).
The probe (train.py --probe_every=N) is the other held-out measure: K fixed prompts rolled out greedily
every N steps, audited as a step's batch, and the drift of their routes since the first probe.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import TYPE_CHECKING

from support.hooks import Hooks

if TYPE_CHECKING:                                                     # annotations only: the CLI stays light
    import torch
    from support.packing import Batch

PASS_REWARD = 1.0             # a response with reward >= this counts as solved
EVAL_SEED = 1_000_003         # the sampled responses' seed: the same draws at every evaluation


def evaluate(sampler, task, *, samples: int, max_new_tokens: int, temperature: float, stop_token_ids=(),
             step: int = 0, d=None, **filters) -> dict:
    """Greedy and sampled reward and pass rates of sampler's model on every example of `task` (a JSONL
    task, read from its start each time), rewarded by tasks.compute_rewards (a bad reward stops with the
    example named). Under torchrun each rank answers a contiguous slice of the prompts and the rewards
    are gathered in the examples' order before they are summed, so every rank returns the same dict, the
    same at every world size. filters: the draw's (top_p, top_k, ...: kernels.SAMPLING_FILTERS)."""
    import torch
    from support.distributed import all_gather_rows
    from support.tasks import compute_rewards

    def score(examples, outs, n):
        return torch.tensor(compute_rewards(task, examples, outs, n, step))
    task.load_state_dict({"epoch": 0, "pos": 0})
    examples = task.sample(len(task.rows))                     # every example once, in the task's first order
    rank, world = (d.rank, d.world) if d is not None else (0, 1)
    per = -(-len(examples) // world)
    lo, mine = rank * per, examples[rank * per:(rank + 1) * per]
    greedy, sampled = torch.zeros(0), torch.zeros(0, samples)     # (prompts,), (prompts, k): this rank's
    if mine:
        kw = dict(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, progress=False, **filters)
        prompts = [ex.prompt for ex in mine]
        greedy = score(mine, sampler.generate(prompts, temperature=0.0, n=1, index_offset=lo, **kw), 1)
        outs = sampler.generate(prompts, temperature=temperature, n=samples, seed=EVAL_SEED,
                                index_offset=lo * samples, **kw)
        sampled = score(mine, outs, samples).view(len(mine), samples)
    if world > 1:
        greedy, sampled = (torch.cat(all_gather_rows(t, d)) for t in (greedy, sampled))
    n = len(examples)
    return {"eval_greedy_reward": greedy.sum().item() / n, "eval_greedy_pass": (greedy >= PASS_REWARD).sum().item() / n,
            "eval_sampled_reward": sampled.mean(1).sum().item() / n,
            f"eval_pass@{samples}": (sampled >= PASS_REWARD).any(1).sum().item() / n}


def maybe_evaluate(run, step: int, task) -> dict:
    """--eval_data: eval.evaluate's keys of `task` (the held-out set) every --eval_every steps and at the last
    step, else nothing."""
    tcfg = run.tcfg
    every = tcfg.eval_every or tcfg.steps
    if not ((step + 1) % every == 0 or step + 1 == tcfg.steps):
        return {}
    run.policy.refresh()
    run.policy.master.eval()
    return evaluate(run.sampler, task, samples=tcfg.eval_samples,
                    max_new_tokens=run.rcfg.max_new_tokens or run.task.max_new_tokens, temperature=run.rcfg.temperature,
                    **run.rcfg.sampling_filters(), stop_token_ids=run.task.stop_token_ids, step=step + 1,
                    d=run.d)


# ---- the fixed probe (--probe_every): route drift on the same prompts ------------------------------
@dataclasses.dataclass
class Probe:
    """The fixed probe set (--probe_every): K prompts drawn once, and the first probe's sequences with
    the trainer's routes of them then (what route drift is measured against)."""
    prompts: list[list[int]]
    first: "Batch | None" = None
    first_routes: "torch.Tensor | None" = None     # (K, T, n_moe, k)


class Evaluation(Hooks):
    """--eval_data: the held-out set's keys every --eval_every steps and at the last (maybe_evaluate); the
    set read at setup, with the training task's tokenizer and reward."""

    def setup(self, run, resumed) -> None:
        from support.tasks import make_task
        tcfg = run.tcfg
        self.task = make_task(tcfg.task, tcfg.seed, tcfg.n_digits, tcfg.eval_data, tcfg.tokenizer, tcfg.reward_fn,
                              run.rcfg.max_new_tokens, stop_tokens=tuple(run.task.stop_token_ids) or None)

    def after_step(self, run, step: int, batch, rewards) -> dict:
        return maybe_evaluate(run, step, self.task)


class Probing(Hooks):
    """--probe_every: the fixed probe set's audit and route drift (probe); the set drawn at the first."""

    def __init__(self):
        self.probe: Probe | None = None

    def after_step(self, run, step: int, batch, rewards) -> dict:
        return probe(run, step, self)


def probe(run, step: int, holder) -> dict:
    """--probe_every=N: every N steps the probe prompts are rolled out greedily by the current weights
    and re-scored by the trainer: probe_* is the audit of that rollout (as the step's), and
    probe_route_drift the share of (token, layer) of the first probe's sequences whose top-k set the
    current weights change. Drawing the prompts leaves the task's own stream where it was.
    run: train.Run (its configs, task, sampler, policy); holder: what keeps the Probe (Probing)."""
    import torch
    import replay
    from support.packing import make_batch
    tcfg = run.tcfg
    if not tcfg.probe_every or (step + 1) % tcfg.probe_every:
        return {}
    if holder.probe is None:
        state = run.task.state_dict()
        holder.probe = Probe([ex.prompt for ex in run.task.sample(tcfg.probe_prompts)])
        run.task.load_state_dict(state)
    run.policy.refresh()
    outs = run.sampler.generate(holder.probe.prompts, max_new_tokens=run.rcfg.max_new_tokens or run.task.max_new_tokens,
                                temperature=0.0,
                                stop_token_ids=run.task.stop_token_ids, progress=False)
    batch = make_batch(outs, torch.zeros(len(outs)))
    logp, routes, detail = probe_score(run, batch.tokens)
    E = run.policy.full.config.num_experts
    row = {**replay.mismatch_metrics(logp, batch.rollout_logp, batch.mask),
           **replay.route_audit(batch.routes, routes, batch.route_mask, E, detail)}
    if holder.probe.first is None:
        holder.probe.first, holder.probe.first_routes = batch, routes
    _, now, _ = probe_score(run, holder.probe.first.tokens)
    row["route_drift"] = route_drift(holder.probe.first_routes, now, holder.probe.first.route_mask)
    return {f"probe_{k}": v for k, v in row.items()}


def route_drift(before, after, mask) -> float:
    """The share of (token, layer) decisions at mask (B, T) whose top-k set differs between two
    routings (B, T, n_moe, k) of the same tokens, e.g. by the first and the current weights."""
    import replay
    m = mask.bool()
    return (replay.topk_overlap(before[m], after[m]) < 1).float().mean().item() if m.any() else 0.0


def probe_score(run, tokens):
    """The trainer's own forward of the probe (no replay), at the greedy rollout's temperature 0."""
    import torch
    from model import RouteDetail
    with torch.no_grad():
        logp, routes, detail = run.policy.full.score(tokens.to(run.d.device), temperature=0.0, check=False,
                                                     route_detail=True)
    return logp.float().cpu(), routes.cpu(), RouteDetail(detail.weights.cpu(), detail.margin.cpu(), detail.entropy.cpu())


def format_result(result: dict) -> str:
    k = next(key for key in result if key.startswith("eval_pass@")).removeprefix("eval_pass@")
    return (f"greedy reward {result['eval_greedy_reward']:.3f}, pass@1 {result['eval_greedy_pass']:.3f}; "
            f"sampled (k={k}) reward {result['eval_sampled_reward']:.3f}, pass@{k} {result[f'eval_pass@{k}']:.3f}")


# ---------------------------------------------------------------------------------------------------
# python -m tooling.eval CKPT --data=FILE
# ---------------------------------------------------------------------------------------------------
OPTIONS = {"data": "", "reward_fn": "", "tokenizer": "", "samples": 4, "max_new_tokens": 0, "temperature": 1.0,
           "device": "cpu"}
OPTION_DOCS = {   # --help's line per option; the run's own value is the default where its checkpoint says
    "data": "the held-out JSONL, one {\"prompt\": ..., \"answer\": ...} a line, as train.py's --data (required)",
    "reward_fn": "module:function or file.py:function, reward(prompt, response, answer); default: the run's",
    "tokenizer": "an HF tokenizer.json; default: the checkpoint's own, else the run's",
    "samples": "k sampled responses per prompt (pass@k)",
    "max_new_tokens": "response length limit; 0: the run's, else the JSONL task's",
    "temperature": "the sampled responses' temperature (the greedy ones use 0); default: the run's",
    "device": "cpu or cuda",
}
USAGE = ("usage: python -m tooling.eval CKPT --data=FILE [--reward_fn=mod:fn] [--tokenizer=FILE] [--samples=k] "
         "[--max_new_tokens=N] [--temperature=T] [--device=cpu|cuda]")


def help_text() -> str:
    width = max(len(f"--{k}={v!r}") for k, v in OPTIONS.items())
    return "\n".join([__doc__.strip(), "", USAGE] + [f"  {f'--{k}={v!r}':<{width}}  {OPTION_DOCS[k]}"
                                                      for k, v in OPTIONS.items()])


def checkpoint_defaults(ckpt: str) -> dict:
    """What the run that wrote ckpt used (its trainer_state.pt), where this command line says nothing."""
    from support.checkpoint import load_trainer_state
    out = {"tokenizer": ckpt if os.path.isfile(os.path.join(ckpt, "tokenizer.json")) else ""}
    if os.path.isfile(os.path.join(ckpt, "trainer_state.pt")):
        state = load_trainer_state(ckpt)
        t, r = state.get("train_config", {}), state.get("rollout_config", {})
        out.update(reward_fn=t.get("reward_fn", ""), temperature=r.get("temperature", 1.0),
                   max_new_tokens=r.get("max_new_tokens", 0))
        out["tokenizer"] = out["tokenizer"] or t.get("tokenizer", "")
    return out


def parse(argv: list[str]) -> tuple[str, dict]:
    import difflib
    from config import ConfigError, parse_args
    if not argv or argv[0].startswith("--"):
        raise ConfigError(USAGE + " (--help describes each)")
    from support.checkpoint import checkpoint_folder
    ckpt, given = checkpoint_folder(argv[0]), parse_args(argv[1:])     # a run folder: its latest checkpoint
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        near = difflib.get_close_matches(unknown[0], list(OPTIONS), n=1, cutoff=0.6)
        raise ConfigError(f"unknown option --{unknown[0]}" + (f"; did you mean --{near[0]}?" if near else "")
                          + f" (tooling/eval.py takes {', '.join('--' + k for k in OPTIONS)})")
    opts = {**OPTIONS, **{k: v for k, v in checkpoint_defaults(ckpt).items() if v}}
    for k, raw in given.items():
        try:
            opts[k] = type(OPTIONS[k])(raw)
        except ValueError:
            raise ConfigError(f"--{k} expects {type(OPTIONS[k]).__name__}, got {raw!r}") from None
    for k in ("data", "reward_fn", "tokenizer"):
        if not opts[k]:
            raise ConfigError(f"--{k}=... is needed (the checkpoint's run does not say)")
    if opts["samples"] < 1:
        raise ConfigError(f"--samples={opts['samples']}: must be >= 1")
    if not opts["temperature"] >= 0:
        raise ConfigError(f"--temperature={opts['temperature']}: must be >= 0 (0: greedy)")
    return ckpt, opts


def main(argv: list[str]) -> dict:
    from config import ConfigError
    from support import hf
    from model import Transformer
    from rollout import Sampler
    from support.tasks import make_task
    ckpt, o = parse(argv)
    if ckpt != argv[0]:
        print(f"{argv[0]} is a run folder: evaluating its latest checkpoint, {ckpt}")
    task = make_task("jsonl", data=o["data"], tokenizer=o["tokenizer"], reward_fn=o["reward_fn"],
                     max_new_tokens=o["max_new_tokens"], model_eos=hf.eos_token_ids(ckpt))
    vocab = hf.config_from_hf(ckpt).vocab_size                        # before any weight is read
    if task.vocab_size > vocab:                                       # its ids would index past the embedding
        raise ConfigError(f"--tokenizer={o['tokenizer']} has {task.vocab_size} tokens, {ckpt} has vocab_size={vocab}: "
                          "pass the tokenizer the checkpoint was trained with (its own tokenizer.json, or the run's)")
    eos = hf.read_identity(ckpt).token_ids.get("eos_token_id")
    stop = tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else task.stop_token_ids
    model = Transformer.from_pretrained(ckpt, device=o["device"])
    result = evaluate(Sampler(model), task, samples=o["samples"],
                      max_new_tokens=o["max_new_tokens"] or task.max_new_tokens, temperature=o["temperature"],
                      stop_token_ids=stop)
    print(f"eval {ckpt} on {o['data']} ({len(task.rows)} prompts, stop ids {list(stop)}): {format_result(result)}")
    return result


def cli(argv: list[str]) -> None:
    from config import ConfigError
    from support.hf import CheckpointError
    from support.checkpoint import RunError
    from support.tasks import TaskError
    if "--help" in argv or "-h" in argv:
        return print(help_text())
    try:
        main(argv)
    except (ConfigError, CheckpointError, RunError, TaskError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    cli(sys.argv[1:])
