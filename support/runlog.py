"""What a run shows and writes beside its checkpoints, and how it stops.

    run.outputs = open_outputs(run)      # the exports' identity, run.json, the progress bar or lines
    print(banner(run, max_new))          # two lines: what trains where, what the rollout stops on
    row.update(run.surge.watch(run, row))     # --surge_window: length_surge (and its one warning line)
    history.append(log_row(run, step, row))   # metrics.jsonl (strict JSON), a tracker's copy, a progress line

metrics.jsonl is the record of a run (trackers/'s --log_to=tensorboard|wandb copies each row); without a
progress bar (--progress: a bar only on a terminal) a line every --log_every steps is printed. run.json
holds the settings in force (checkpoint.write_run_json). routes.jsonl (log_routes) and a plug-in's files
(diagnostics/, trackers/' samples.jsonl) are appended through append_jsonl.
A SIGINT / SIGTERM asks the loop to stop after the step under way (StopRequest, stop_requested,
Interrupted); under torchrun a rank's reason to exit goes to its error file (tell_launcher); `run_cli`
is the command line's frame (one `error:` line per mistake, exit 1 / 130 / 143). The functions take
train.py's Run as `run` (its configs, ranks, task and outputs).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

import replay
from config import ConfigError
from support import hf
from support.hf import CheckpointError
from model import Transformer
from support.checkpoint import RunError, latest_checkpoint, trim_metrics, write_run_json
from support.distributed import PER_RANK, Dist, all_cat
from support.tasks import TaskError, generation_line

if TYPE_CHECKING:                     # a run's classes: config.configs_for
    from config import TrainConfig


# ---- the run's outputs besides metrics.jsonl -------------------------------------------------------
@dataclasses.dataclass
class Outputs:
    """The run's other outputs: its exports' identity and whether this process draws a progress bar (else
    progress lines: progress_bar)."""
    identity: hf.Identity
    bar: bool = False


def open_outputs(run) -> Outputs:
    tcfg = run.tcfg
    if run.d.master:                                                  # the configs in force, readable
        write_run_json(tcfg.out_dir, tcfg, run.rcfg, run.policy.full.config, run.start)
    return Outputs(export_identity(tcfg, run.task), bar=run.d.master and progress_bar(tcfg))


def progress_bar(tcfg: TrainConfig) -> bool:
    """--progress: true / false, or auto: a bar only when stdout and stderr are both a terminal (a bar
    redrawn into a log file is kilobytes of frames; the lines say the same, once)."""
    if tcfg.progress != "auto":
        return tcfg.progress == "true"
    return sys.stdout.isatty() and sys.stderr.isatty()


def say(run, line: str) -> None:
    """A line on the console that does not tear the progress bar (rank 0 calls it)."""
    tqdm.write(line) if run.outputs is not None and run.outputs.bar else print(line, flush=True)


def export_identity(tcfg: TrainConfig, task) -> hf.Identity:
    """The token ids and tokenizer files every checkpoint carries: --init_from's own (a checkpoint folder),
    else the task's stop ids as eos and --tokenizer's file."""
    ident = hf.read_identity(tcfg.init_from) if os.path.isdir(tcfg.init_from) else hf.Identity()
    if ident.token_ids.get("eos_token_id") is None and task.stop_token_ids:
        stop = list(task.stop_token_ids)
        ident.token_ids["eos_token_id"] = stop[0] if len(stop) == 1 else stop
    if tcfg.tokenizer and "tokenizer.json" not in ident.files:
        path = os.path.join(tcfg.tokenizer, "tokenizer.json") if os.path.isdir(tcfg.tokenizer) else tcfg.tokenizer
        ident.files["tokenizer.json"] = path
    return ident


def banner(run, max_new: int, episode_tokens: int | None = None) -> str:
    """The start of a run in two lines: what trains where, and what the rollout stops on (at most
    max_new tokens a response, or a turn of an episode of at most episode_tokens)."""
    tcfg, cfg, d = run.tcfg, run.policy.full.config, run.d
    with torch.device("meta"):                                        # the whole model, also under EP
        n_params = sum(p.numel() for p in Transformer(cfg).parameters())
    moe = f", {cfg.num_experts} experts top-{cfg.num_experts_per_tok}" if cfg.num_experts else ""
    where = f"{d.device}" + (f" x {d.world} ranks ({getattr(run.policy.sharding, 'name', 'ddp')})" if d.world > 1 else "")
    start = (f"resume: continuing from step {run.start} ({latest_checkpoint(tcfg.out_dir)}) to step {tcfg.steps}"
             if run.start else f"steps 1..{tcfg.steps}")
    name = tcfg.init_from + "".join(f" --{k}={v}" for k, v in tcfg.model_overrides.items())   # a preset, resized
    return (f"train: {name} ({cfg.model_type}, {n_params / 1e6:.2f}M parameters{moe}) on {where}, "
            f"{tcfg.dtype}; task {tcfg.task}; out_dir {tcfg.out_dir}; {start}\n"
            f"{generation_line(run.task, max_new, episode_tokens)}; temperature {run.rcfg.temperature}, "
            f"{tcfg.prompts_per_step} prompts x {tcfg.group_size} responses")


# ---- metrics rows: metrics.jsonl, the loggers, progress lines ----------------------------------
LATENCY_QUANTILES = (50, 95, 99)            # rollout_latency_pNN
# the metrics that measure time, not the run: the only keys two runs of the same commit may differ in
TIMINGS = ("step_time", "rollout_tokens_per_s") + tuple(f"rollout_latency_p{q}" for q in LATENCY_QUANTILES)
# the keys a run's layout (ranks, EP degree) or its timing decides; every other key is the same at any world size
PER_LAYOUT = frozenset(TIMINGS) | frozenset(PER_RANK) | {"prefix_hit_rate", "spec_accept_rate", "ep_rows", "ep_load_layer",
                                                           "ep_load_max", "eplb_imbalance_before", "eplb_imbalance_after"}


def latency_metrics(outs, d: Dist) -> dict:
    """rollout_latency_pNN: quantiles, over every rank's sequences, of the seconds from the step's generate
    call to each sequence's end (SequenceOutput.finish_time): the long tail that holds a step back."""
    t = all_cat(torch.tensor([o.finish_time for o in outs], dtype=torch.float32), d).double()
    return {f"rollout_latency_p{q}": torch.quantile(t, q / 100).item() for q in LATENCY_QUANTILES}

def json_row(row: dict) -> dict:
    """The metrics row with every non-finite float as None, so metrics.jsonl is strict JSON (null).

    The quantities that matter (reward, loss, grad norm) stop the run before they get here; what can
    still be NaN is a diagnostic of an empty selection (e.g. a mean over zero tokens).
    """
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        return [clean(x) for x in v] if isinstance(v, list) else v
    return {k: clean(v) for k, v in row.items()}


def log_row(run, step: int, row: dict) -> dict:
    """Append the row to metrics.jsonl (strict JSON: a non-finite value becomes null); rank 0 writes."""
    row = json_row(row)
    if run.d.master and is_log_step(run, step):
        with open(run.metrics_path, "a") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")
        for hook in run.hooks:                                        # a tracker's copy (trackers/)
            hook.log(row)
        if run.outputs is None or not run.outputs.bar:
            print(progress_line(run, row), flush=True)
    return row


def is_log_step(run, step: int) -> bool:
    return (step + 1) % run.tcfg.log_every == 0 or step + 1 == run.tcfg.steps


def append_jsonl(run, step: int, name: str, rows: list[dict]) -> None:
    """Rank 0 appends rows to out_dir/name (strict JSON); a resumed run first drops the rows past its
    checkpoint, as metrics.jsonl's."""
    if not run.d.master:
        return
    path = os.path.join(run.tcfg.out_dir, name)
    if step == run.start and run.start > 0:
        trim_metrics(path, run.start)
    if rows:
        with open(path, "a") as f:
            f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in rows)


def log_routes(run, step: int, batch, audited) -> None:
    """The per-expert load histograms of the step (routes.jsonl, at logged steps, summed over ranks).
    batch: this rank's train.Batch; audited: the packing.Scored forward the step's audit used, of its rows."""
    if is_log_step(run, step):
        rows, E, m = audited.rows, run.policy.master.config.num_experts, batch.route_mask[audited.rows]
        loads = torch.stack([replay.expert_load(batch.routes[rows][m], E), replay.expert_load(audited.routes[m], E)])
        loads = all_cat(loads[None], run.d).sum(0)                    # (2, n_moe, E) over every rank
        append_jsonl(run, step, "routes.jsonl", [{"step": step + 1, "expert_load_rollout": loads[0].tolist(),
                                                  "expert_load_train": loads[1].tolist()}])


def episode_metrics(run, batch, outs, episodes, audited) -> dict:
    """Multi-turn episodes: turns per episode, the environment's share of the tokens, each turn's mean
    reward and the last turn's, and route flips at the observation tokens (in the route audit, marked:
    their routes are replayed and audited, their log-probs are not the policy's). batch: the global
    packing.Batch; audited: the packing.Scored forward of the step's audit (over it); outs and episodes
    (tasks.Episodes, or the batch's record): this rank's, gathered here, so every value is global."""
    d = run.d
    turns = all_cat(torch.tensor([o.num_turns for o in outs], dtype=torch.float64), d)
    generated = all_cat(torch.tensor([len(o.tokens) for o in outs]), d)
    width = int(all_cat(torch.tensor([max(map(len, episodes.rewards))]), d).max())   # the most turns anywhere
    rewards = torch.full((len(outs), max(1, width)), math.nan, dtype=torch.float64)   # (B, turns), nan: none
    for i, r in enumerate(episodes.rewards):
        rewards[i, :len(r)] = torch.tensor(r, dtype=torch.float64)
    rewards = all_cat(rewards, d)
    n = (~rewards.isnan()).sum(1)                                     # (B,) each episode's turns rewarded
    finals = rewards[torch.arange(len(n)), (n - 1).clamp(min=0)][n > 0]   # each episode's last turn's
    row = {"episode_turns": turns.mean().item(),
           "observation_token_frac": batch.observed.sum().item() / max(1, int(generated.sum())),
           "turn_reward": rewards[:, :width].nanmean(0).tolist(),
           "final_turn_reward": finals.mean().item() if len(finals) else 0.0}
    rows, m = audited.rows, (batch.observed & batch.route_mask)[audited.rows]
    E = run.policy.master.config.num_experts
    row["route_flip_frac_observation"] = replay.route_audit(batch.routes[rows], audited.routes, m, E).get(
        "route_flip_frac", math.nan)                                  # nan: no observation token in this step
    return row


def stale(row: dict) -> bool:
    """Whether the row's train-rollout gap is staleness (the policy's age), not numerics: the console says so."""
    return "kl_staleness" in row


def bar_postfix(row: dict) -> dict:
    """The progress bar's postfix: the reward and the train-rollout gap (stale_ under staleness)."""
    gap = "stale_" if stale(row) else ""
    return {"reward": f"{row['reward_mean']:.3f}", gap + "kl": f"{row['train_rollout_kl']:.1e}",
            gap + "flip": f"{row.get('route_flip_frac', 0):.3f}"}


def progress_line(run, row: dict) -> str:
    """Without a bar: one line every --log_every steps (a value that is null in the row shows as -)."""
    def f(key, spec):
        return "-" if row.get(key) is None else format(row[key], spec)
    stale_ = f" (staleness; numerics {f('kl_numerics', '.1e')})" if stale(row) else ""
    return (f"step {row['step']}/{run.tcfg.steps}: reward {f('reward_mean', '.3f')}, loss {f('loss', '.4g')}, "
            f"train-rollout kl {f('train_rollout_kl', '.1e')}{stale_}, "
            f"route flips {f('route_flip_frac', '.3f')}{' (staleness)' if stale_ else ''}, "
            f"response len {f('response_len', '.1f')}, {f('step_time', '.2f')} s"
            + "".join(f", {k} {f(k, '.3f')}" for k in row if k.startswith("eval_")))


def warn_low_entropy(run, history: list[dict]) -> None:
    """--entropy_warn: one line when the mean entropy has stayed below it for --entropy_warn_steps steps
    in a row (once a stretch): a collapsed policy samples near-identical responses, so groups carry
    little advantage and clipping and gradients fade."""
    limit, n = run.tcfg.entropy_warn, run.tcfg.entropy_warn_steps
    if not limit or not run.d.master or len(history) < n:
        return
    low = [h.get("entropy") is not None and h["entropy"] < limit for h in history[-n - 1:]]
    if all(low[-n:]) and (len(low) == n or not low[0]):              # the stretch just reached n steps
        h = history[-1]
        say(run, f"warning: step {h['step']}: entropy below {limit:g} for {n} steps ({h['entropy']:.3g} now, reward "
                 f"{h['reward_mean']:.3f}): responses barely differ, so groups give little signal; an entropy bonus "
                 "(--entropy_coef=1e-3) or a higher --temperature keeps exploring (--entropy_warn=0: no warning)")


def is_length_surge(lengths: list[float], window: int, ratio: float) -> bool:
    """True when the mean of the last `window` lengths is over (1 + ratio) times the mean of the `window`
    before them (False until there are 2 * window)."""
    if window < 1 or len(lengths) < 2 * window:
        return False
    return sum(lengths[-window:]) > (1 + ratio) * sum(lengths[-2 * window:-window])   # the same W: sums, not means


@dataclasses.dataclass
class LengthSurge:
    """--surge_window: the response-length surge detector's state, saved in checkpoints, so a resumed run
    detects on the same step as the uninterrupted one and --halving_start=surge (lr_halving/) plans the same lr.
    step: the step (1-based) the surge was detected on, once a run, or None; lengths: the last 2W steps'
    response_len (global, the same on every rank)."""
    step: int | None = None
    lengths: list[float] = dataclasses.field(default_factory=list)

    def observe(self, tcfg: TrainConfig, step: int, response_len: float) -> bool:
        """Take step's (1-based) mean response length; True on the step the surge is first detected."""
        W = tcfg.surge_window
        self.lengths = (self.lengths + [response_len])[-2 * W:]
        if self.step is None and is_length_surge(self.lengths, W, tcfg.surge_ratio):
            self.step = step
            return True
        return False

    def watch(self, run, row: dict) -> dict:
        """The loop's call, before log_row: length_surge, 1 on the step a surge is detected (one warning
        line) and 0 on the others; {} when --surge_window=0. Responses that keep growing often come
        before a run goes unstable."""
        tcfg = run.tcfg
        if not tcfg.surge_window:
            return {}
        fired = self.observe(tcfg, row["step"], row["response_len"])
        if fired and run.d.master:
            self.warn(run, row["step"])
        return {"length_surge": int(fired)}

    def warn(self, run, step: int) -> None:
        """The one line of a surge seen at `step`: the two windows' mean lengths, and what the lr does."""
        tcfg, W = run.tcfg, run.tcfg.surge_window
        say(run, f"warning: step {step}: response length surged to {sum(self.lengths[W:]) / W:.1f} tokens "
                 f"(mean of the last {W} steps) from {sum(self.lengths[:W]) / W:.1f} (the {W} before), over 1 + "
                 f"{tcfg.surge_ratio:g} times; with --lr_schedule=halving --halving_start=surge lr halves from the "
                 "next step (--surge_window=0: no warning)")

    def state_dict(self) -> dict:
        return {"step": self.step, "lengths": list(self.lengths)}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}                                           # a checkpoint from before the detector
        self.step, self.lengths = state.get("step"), list(state.get("lengths", []))


def count_steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def summary(history: list[dict], seconds: float, out_dir: str) -> str:
    """The last line of a run: reward at the start and the end, the worst train-rollout mismatch."""
    n = max(1, len(history) // 10)
    first = sum(h["reward_mean"] for h in history[:n]) / n
    last = sum(h["reward_mean"] for h in history[-n:]) / n
    kl = [abs(h["train_rollout_kl"]) for h in history if h["train_rollout_kl"] is not None]
    flips = [h["route_flip_frac"] for h in history if h.get("route_flip_frac") is not None]
    return (f"done: {count_steps(len(history))} in {seconds:.0f}s; reward {first:.3f} (first tenth) -> "
            f"{last:.3f} (last tenth); max |train-rollout KL| {max(kl, default=math.nan):.2e}; max route flips "
            f"{max(flips, default=0.0):.2e}; metrics in {os.path.join(out_dir, 'metrics.jsonl')}")


# ---- stopping on a signal ------------------------------------------------------------------------
class Interrupted(Exception):
    """A SIGINT / SIGTERM stopped the run after `step`, which is saved; exit status 128 + signum."""

    def __init__(self, step: int, signum: int):
        super().__init__(step, signum)
        self.step, self.signum = step, signum


class StopRequest:
    """The signal handlers' flag. The first SIGINT / SIGTERM asks the loop to stop after the step under
    way; a second one stops at once (KeyboardInterrupt), saving nothing more."""
    signum = 0

    @classmethod
    def handler(cls, signum, frame):
        if cls.signum:
            raise KeyboardInterrupt
        cls.signum = signum
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"\n{signal.Signals(signum).name}: stopping after this step and saving it "
                  "(send it again to stop now without saving)", file=sys.stderr, flush=True)


def stop_requested(d: Dist) -> int:
    """The signal number if any rank was asked to stop, else 0: every rank stops after the same step."""
    signum = StopRequest.signum
    if d.world > 1:
        t = torch.tensor([signum], device=d.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        signum = int(t.item())
    return signum


def tell_launcher(line: str) -> None:
    """Under torchrun, this rank's reason to exit in its error file (TORCHELASTIC_ERROR_FILE): torchrun's
    failure report then shows it as the root cause, instead of a pointer to tracebacks there are none of."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)


# ---- the command line: one line per mistake, an exit status per outcome -----------------------------
LAUNCHER_GRACE_S = 10.0     # a rank but 0, on a mistake, waits this long for rank 0 to print it first


def run_cli(main, argv: list[str]) -> None:
    """main(argv), with user mistakes and stopped runs as one line `error: ...` and exit status 1, no
    traceback; under torchrun rank 0 alone prints it (every rank meets the same mistake), every rank exits 1
    and tells torchrun why (`tell_launcher`). The other ranks first give rank 0 up to LAUNCHER_GRACE_S to
    print and fail: torchrun stops every rank once one has failed, and a rank 0 still importing when a
    faster rank failed would be stopped before its line.
    SIGINT / SIGTERM save the last whole step and exit 130 / 143 (128 + the signal's number)."""
    rank0 = int(os.environ.get("RANK", "0")) == 0
    handlers = {sig: signal.signal(sig, StopRequest.handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        main(argv)
    except (ConfigError, CheckpointError, RunError, TaskError) as e:
        tell_launcher(f"error: {e}")
        if not rank0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)             # torchrun's stop ends the wait
            time.sleep(LAUNCHER_GRACE_S)
        sys.exit(f"error: {e}" if rank0 else 1)
    except Interrupted as e:
        tell_launcher(f"interrupted at step {e.step}; resume with --resume=true")
        if rank0:
            print(f"interrupted at step {e.step}; resume with --resume=true", file=sys.stderr, flush=True)
        sys.exit(128 + e.signum)
    except BrokenPipeError:                                           # stdout's reader is gone (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # the exit's flush cannot fail again
        sys.exit(128 + signal.SIGPIPE)
    except KeyboardInterrupt:                                         # a second signal, or one before the loop
        if rank0:
            print("interrupted; the step under way is not saved (the last checkpoint, if any, is kept)",
                  file=sys.stderr, flush=True)
        sys.exit(128 + (StopRequest.signum or signal.SIGINT))
    finally:
        StopRequest.signum = 0
        for sig, h in handlers.items():
            signal.signal(sig, h)
