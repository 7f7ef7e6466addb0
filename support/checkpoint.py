"""Checkpoints and run folders: out_dir/ckpt-NNNNNN/ (HF weights + trainer_state.pt), out_dir/latest.

    save_checkpoint(out_dir, step, model, opt_state, tcfg, rcfg, task)   # whole or not at all
    state = load_trainer_state(latest_checkpoint(out_dir))               # plain data: nothing is unpickled
    model.load_state_dict(load_weights(ckpt, model))                     # the exact weights to resume from
    resumed = resume(tcfg, model, task, experts=None, print0=print)     # all a resume loads and checks
    python -m support.checkpoint export out DIR [--save_dtype=bfloat16]   # a clean HF folder of out's latest checkpoint

A checkpoint folder is an HF folder plus what a resume needs (trainer_state.pt: AdamW's state, twice the
weights; masters.safetensors). `export` writes a folder with only what transformers, vLLM or the Hub
need: the weights in --save_dtype (default: the run's), config.json, generation_config.json and the
tokenizer files (export()). It and tooling/eval.py take a checkpoint folder or a run folder, which stands for the
checkpoint its `latest` names (checkpoint_folder).

Mixed precision: the HF export is written in --save_dtype (default the compute dtype: the compute copy
itself, as the sampler ran it); when that loses bits of the fp32 masters, they are saved beside it
(masters.safetensors, this model's state_dict keys), and a resume reads them, with AdamW's state.

The rules (docs/design.md, "Reliability"): a checkpoint is written to a .tmp folder and renamed, only
from finite weights, and the last good one is never replaced by a bad one; `latest` names a ckpt folder
inside out_dir; trainer_state.pt is read with torch.load(weights_only=True); a folder that holds a run
is not started over unless asked (--overwrite=true).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import pickle
import re
import shutil
import sys
from typing import TYPE_CHECKING

import torch

from config import (MODEL_PRESETS, ConfigError, ModelConfig, TrainOptions, apply_command_line, configs_for,
                    parse_args, parse_bool)
from support.hf import (CheckpointError, Identity, config_from_hf, config_to_hf, eos_token_ids, expert_rows,
                         hf_to_state, read_safetensors_dir, read_safetensors_file, write_identity)
from model import Transformer, expert_group
from support.tasks import make_task

if TYPE_CHECKING:                     # a run's classes: config.configs_for
    from config import RolloutConfig, TrainConfig

MASTERS = "masters.safetensors"                                       # the exact weights, when the export rounds
SFT_CKPT = "ckpt-000000"                                               # the end of --sft_steps' phase (tooling/sft.py)


class RunError(RuntimeError):
    """A run that must stop for a reason that is not a bug (a non-finite loss, a full disk); says what to do."""



# ---------------------------------------------------------------------------------------------------
# checkpoints: out_dir/ckpt-NNNNNN/ (HF weights + trainer_state.pt), out_dir/latest names the newest.
# The weights are saved full (FSDP2 gathers them), by rank 0 alone.
# ---------------------------------------------------------------------------------------------------
def optimizer_state(scorer, opt, sharding=None):
    """AdamW's state as saved: whole (a sharding plug-in gathers it: parallel/fsdp.py), whole experts under EP
    (collective on every rank)."""
    state = opt.state_dict() if sharding is None else sharding.optimizer_state(scorer, opt)
    ep = expert_group(scorer)                                         # EP (parallel/): whole experts' moments
    return state if ep is None else ep.gather_optimizer_state(opt, scorer, state)


def load_optimizer_state(scorer, opt, state, sharding=None):
    """The saved state into opt: under EP, this rank's experts' moments (at any EP degree); sharded by the
    sharding plug-in that saved it whole."""
    ep = expert_group(scorer)
    if ep is not None:                                                # EP (parallel/): this rank's experts'
        state = ep.shard_optimizer_state(opt, scorer, state)
    if sharding is None:
        return opt.load_state_dict(state)
    sharding.load_optimizer_state(scorer, opt, state)


CKPT_NAME = re.compile(r"ckpt-\d{6}")                               # the only names `latest` may hold
RUN_JSON = "run.json"                                                 # the configs in force, readable
RUN_FILES = ("metrics.jsonl", "samples.jsonl", "routes.jsonl", "diagnostics.jsonl", "eplb.jsonl", "hotness.jsonl",
             "latest", "latest.tmp", RUN_JSON)                                  # with ckpt-*: what makes a folder a run


def check_finite_weights(model: Transformer, step: int) -> None:
    """Raise RunError naming the first non-finite weight: no checkpoint is ever written from one."""
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p.detach()).all()):
            raise RunError(f"step {step}: weight {name!r} is not finite; not saving a checkpoint (the last good "
                           "one stays); lower --lr or check the rewards, then --resume")


def export_model(model: Transformer, masters: dict | None, save_dtype: str) -> Transformer:
    """The model the HF export is written from: `model` itself when it is in save_dtype, else the masters
    (or model's own state) cast to save_dtype, on the meta device then assigned (no second full copy)."""
    dtype = getattr(torch, save_dtype) if save_dtype else model.embed_tokens.weight.dtype
    if model.embed_tokens.weight.dtype == dtype:
        return model
    state = masters if masters is not None else model.state_dict()
    with torch.device("meta"):
        out = Transformer(model.config)
    out.load_state_dict({k: v.detach().to(dtype) for k, v in state.items()}, assign=True)
    out.extra_tensors = {k: v.to(dtype) for k, v in model.extra_tensors.items()}   # MTP weights, kept as loaded
    return out


def save_checkpoint(out_dir, step, model, opt_state, tcfg, rcfg, task, extra: dict | None = None,
                    masters: dict | None = None, save_dtype: str = "", identity: Identity | None = None,
                    keep: int = 1, exported: Transformer | None = None) -> str:
    """Write ckpt-NNNNNN via a .tmp folder renamed into place, point `latest` at it, keep the `keep`
    newest; returns its path. `identity` (token ids, tokenizer files) makes the weights a checkpoint
    transformers' generate stops on (hf.write_identity).

    model: the full weights (the compute copy); masters: the fp32 master state when it is another
    (mixed precision); save_dtype: the HF export's dtype ("" = model's). The masters are saved beside
    the export when the export does not hold their exact bits. exported: the model the export is written
    from when it is not `model` (LoRA's merged weights); model's own state (the masters) is then kept too.

    A failed write (a full disk) removes the partial .tmp and raises RunError: `latest` and the
    checkpoint it names are untouched until the new one is complete.
    """
    check_finite_weights(model, step)
    final = os.path.join(out_dir, f"ckpt-{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        export = export_model(model, masters, save_dtype) if exported is None else export_model(exported, None, save_dtype)
        export.save_pretrained(tmp)
        exact = masters if masters is not None else model.state_dict()
        saved = export.state_dict()
        if set(saved) != set(exact) or any(saved[k].dtype != v.dtype for k, v in exact.items()):   # keep the masters
            from safetensors.torch import save_file
            save_file({k: v.detach().cpu().contiguous() for k, v in exact.items()}, os.path.join(tmp, MASTERS))
        if identity is not None:
            write_identity(tmp, identity)
        torch.save({"step": step, "optimizer": opt_state, "train_config": dataclasses.asdict(tcfg),
                    "rollout_config": dataclasses.asdict(rcfg), "model_config": dataclasses.asdict(model.config),
                    "task": task.state_dict(), **(extra or {})},
                   os.path.join(tmp, "trainer_state.pt"))
    except (OSError, RuntimeError) as e:          # torch.save reports a short write as a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(out_dir).free
        full = isinstance(e, OSError) and e.errno == errno.ENOSPC
        raise RunError(f"step {step}: writing checkpoint {final} failed ({'disk full: ' if full else ''}{e}); "
                       f"removed the partial {os.path.basename(tmp)}, the previous checkpoint is kept. "
                       f"{free / 2**30:.1f} GiB free in {out_dir}: free some space, then --resume") from None
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)                                            # a checkpoint appears whole or not at all
    with open(os.path.join(out_dir, "latest.tmp"), "w") as f:
        f.write(os.path.basename(final))
    os.replace(os.path.join(out_dir, "latest.tmp"), os.path.join(out_dir, "latest"))
    done = sorted(n for n in os.listdir(out_dir) if CKPT_NAME.fullmatch(n) and n <= os.path.basename(final))
    later = [n for n in os.listdir(out_dir) if n.startswith("ckpt-") and n not in done]   # a run started over
    if SFT_CKPT in done[:-1]:                             # --sft_steps' supervised start is kept (--init_from=it)
        done.remove(SFT_CKPT)
    for name in done[:-keep] + later:
        shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    return final


def latest_checkpoint(out_dir) -> str:
    """The checkpoint folder `out_dir/latest` names; it must be a ckpt-NNNNNN folder inside out_dir."""
    path = os.path.join(out_dir, "latest")
    if not os.path.isfile(path):
        files = sorted(n for n in os.listdir(out_dir) if n in RUN_FILES) if os.path.isdir(out_dir) else []
        held = f"it holds {', '.join(files)} but " if files else ""
        raise ConfigError(f"--resume: no checkpoint in {out_dir!r} ({held}no 'latest' file): nothing to "
                          "continue; start fresh with --overwrite=true in place of --resume=true"
                          + (" (deletes those files)" if files else ""))
    with open(path) as f:
        name = f.read().strip()
    if not CKPT_NAME.fullmatch(name):
        raise CheckpointError(f"{path} holds {name[:80]!r}, not the name of a checkpoint folder (ckpt-NNNNNN) "
                              "inside out_dir; refusing to follow it")
    if not os.path.isdir(os.path.join(out_dir, name)):
        raise CheckpointError(f"{path} names {name}, which is not in {out_dir!r}")
    return os.path.join(out_dir, name)


def checkpoint_folder(path: str) -> str:
    """The checkpoint a command reads (export, tooling/eval.py): path itself when it holds config.json, the one a
    run folder's `latest` names when it holds that; else ConfigError, one line saying what path is."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if os.path.isfile(os.path.join(path, "latest")):
        return latest_checkpoint(path)
    if os.path.exists(path):
        raise ConfigError(f"{path!r} is neither a checkpoint folder (no config.json) nor a run folder (no 'latest'); "
                          "pass out_dir (its latest checkpoint) or out_dir/ckpt-NNNNNN")
    run = os.path.dirname(os.path.normpath(path)) or "."
    if os.path.isfile(os.path.join(run, "latest")):                  # a checkpoint the run no longer keeps
        hint = f"; {run!r} is a run folder: pass it for its latest checkpoint"
    elif hub_id(path):
        hint = f"; nothing is downloaded: fetch it first (`hf download {path} --local-dir DIR`), then pass DIR"
    else:
        hint = ""
    raise ConfigError(f"{path!r} does not exist{hint}")


def load_weights(ckpt: str, model: Transformer, experts: list[int] | None = None) -> dict[str, torch.Tensor]:
    """The weights to resume from (model.state_dict keys): the saved masters if the export rounded
    them, else the HF export. experts: the model holds only these (an expert-parallel shard); the
    checkpoint's other experts are never read."""
    path = os.path.join(ckpt, MASTERS)
    if not os.path.isfile(path):
        return hf_to_state(read_safetensors_dir(ckpt, expert_rows(model.config, experts)), model, experts)
    state = read_safetensors_file(path, expert_rows(model.config, experts, hf_keys=False))
    want = model.state_dict()
    if set(state) != set(want) or any(tuple(state[k].shape) != tuple(v.shape) for k, v in want.items()):
        raise CheckpointError(f"{path}: its tensors do not match the model config (keys or shapes differ)")
    return state


def plugin_tensors(ckpt: str, model: Transformer) -> bool:
    """Whether the checkpoint's masters file holds tensors the plain model has none of (a plug-in's)."""
    from safetensors import safe_open
    path = os.path.join(ckpt, MASTERS)
    if not os.path.isfile(path):
        return False
    with safe_open(path, "pt") as f:
        return bool(set(f.keys()) - set(model.state_dict()))


def load_trainer_state(ckpt: str) -> dict:
    """trainer_state.pt, unpickling only tensors and plain data (weights_only=True: no code runs)."""
    path = os.path.join(ckpt, "trainer_state.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete")
    try:
        # on the CPU: every rank would otherwise put rank 0's optimizer tensors on rank 0's GPU
        # memory-mapped: under EP a rank reads only its experts' optimizer state (shard_optimizer_state)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path} holds objects other than tensors and plain data; refusing to unpickle it "
                              f"(it could run code): {str(e).splitlines()[0]}") from None
    except (RuntimeError, EOFError) as e:
        raise CheckpointError(f"{path}: unreadable ({str(e).splitlines()[0]}); was it truncated?") from None


def prepare_out_dir(tcfg: TrainConfig, master: bool) -> None:
    """Refuse to start a new run over an old one unless --overwrite=true, which removes (on rank 0) the old
    run's files: RUN_FILES and ckpt-*, nothing else."""
    if os.path.exists(tcfg.out_dir) and not os.path.isdir(tcfg.out_dir):
        raise ConfigError(f"--out_dir={tcfg.out_dir!r} is a file; pass a folder")
    os.makedirs(tcfg.out_dir, exist_ok=True)
    if tcfg.resume:
        return
    found = sorted(n for n in os.listdir(tcfg.out_dir) if n in RUN_FILES or n.startswith("ckpt-"))
    if found and not tcfg.overwrite:
        if "latest" in found:
            raise ConfigError(f"--out_dir={tcfg.out_dir!r} holds a run ({', '.join(found[:3])}); continue it with "
                              "--resume=true, start over with --overwrite=true (deletes it), or pick another --out_dir")
        raise ConfigError(f"--out_dir={tcfg.out_dir!r} holds a run's files ({', '.join(found[:3])}) but no checkpoint, "
                          "so --resume=true has nothing to continue: start over with --overwrite=true (deletes "
                          "them), or pick another --out_dir")
    for name in found if master else ():                              # --overwrite=true: start over knowingly
        path = os.path.join(tcfg.out_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def write_run_json(out_dir: str, tcfg: TrainConfig, rcfg: RolloutConfig, model_cfg: ModelConfig, start: int) -> str:
    """out_dir/run.json: every field of the configs this leg trains with (strict JSON, one field a line),
    written at its start; a resume rewrites it after printing what changed (resume_changes). The
    checkpoints' trainer_state.pt holds the same dicts: a resume reads those."""
    path = os.path.join(out_dir, RUN_JSON)
    run = {"start_step": start, "train": dataclasses.asdict(tcfg), "rollout": dataclasses.asdict(rcfg),
           "model": dataclasses.asdict(model_cfg)}
    with open(path + ".tmp", "w") as f:
        json.dump(run, f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path


def trim_metrics(path: str, last_step: int, sft_done: int | None = None) -> None:
    """On resume: keep the rows up to the checkpoint's step (and drop a line cut short by a kill); sft_done:
    also the supervised rows (step 0, tooling/sft.py) up to the checkpoint's supervised step."""
    kept = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                with contextlib.suppress(json.JSONDecodeError):
                    row = json.loads(line)
                    if row["step"] <= last_step and (sft_done is None or row.get("sft_step", 0) <= sft_done):
                        kept.append(line)
    with open(path, "w") as f:
        f.writelines(kept)


# ---------------------------------------------------------------------------------------------------
# the model --init_from names: a checkpoint folder or a preset
# ---------------------------------------------------------------------------------------------------
def model_config(init_from: str) -> ModelConfig:
    """The config --init_from names, no weights read: a checkpoint folder's config.json, or a preset's."""
    if os.path.isdir(init_from):
        return config_from_hf(init_from)
    if init_from in MODEL_PRESETS:
        return ModelConfig.preset(init_from)
    if os.path.exists(init_from):
        raise ConfigError(f"--init_from={init_from!r} is a file; pass the checkpoint's folder (config.json and *.safetensors)")
    if hub_id(init_from):
        raise ConfigError(f"--init_from={init_from!r}: no such folder; nothing is downloaded at run time: fetch the "
                          f"checkpoint first (`hf download {init_from} --local-dir DIR`, huggingface_hub's command "
                          "line), then pass --init_from=DIR")
    if os.sep in init_from or init_from.startswith((".", "~")):
        raise ConfigError(f"--init_from={init_from!r}: no such checkpoint folder")
    raise ConfigError(f"--init_from={init_from!r} is neither a model preset ({', '.join(MODEL_PRESETS)}) "
                      "nor a checkpoint folder")


def hub_id(name: str) -> bool:
    """Whether name reads as a Hugging Face Hub id (owner/model), not a local path."""
    owner, slash, model = name.partition("/")
    return bool(slash and owner and model and "/" not in model and not name.startswith((".", "~", "/")))


def initial_config(tcfg: TrainConfig, preset: ModelConfig | None = None) -> ModelConfig:
    """The model config --init_from names, read before any weight: a checkpoint's config.json, or a
    preset (given: with --vocab_size applied, TrainConfig.model_preset)."""
    if preset is not None and not os.path.isdir(tcfg.init_from):
        return preset
    return model_config(tcfg.init_from)


def run_task(tcfg: TrainConfig, rcfg: RolloutConfig):
    """The task, the preset (None for a checkpoint folder) and the model config --init_from names, refused
    now, not at the first save, if its family's config.json cannot express it (a preset's field set on the
    command line)."""
    from_dir = os.path.isdir(tcfg.init_from)
    task = make_task(tcfg.task, tcfg.seed, tcfg.n_digits, tcfg.data, tcfg.tokenizer, tcfg.reward_fn, rcfg.max_new_tokens,
                     stop_tokens=rcfg.stop_token_ids, model_eos=eos_token_ids(tcfg.init_from) if from_dir else ((), ""),
                     chat_template=tcfg.chat_template, system_prompt=tcfg.system_prompt,
                     checkpoint=tcfg.init_from if from_dir else "", env=tcfg.env)
    preset = tcfg.model_preset(task.vocab_size, tokenizer=tcfg.task == "jsonl")
    config = initial_config(tcfg, preset)
    config_to_hf(config)
    return task, preset, config


def build_model(tcfg: TrainConfig, device, dtype, preset: ModelConfig | None = None,
                experts: list[int] | None = None) -> Transformer:
    """The same initial weights on every rank: from a checkpoint, or a preset seeded by --seed.
    experts: keep only these of every MoE layer (an expert-parallel rank's shard). A checkpoint then
    reads only them from disk; a preset is drawn whole (the same bits at every EP degree), then cut."""
    if os.path.isdir(tcfg.init_from):
        return Transformer.from_pretrained(tcfg.init_from, dtype=dtype, device=device, experts=experts)
    torch.manual_seed(tcfg.seed)
    model = Transformer(initial_config(tcfg, preset))
    if experts is not None:
        model.keep_experts(experts)
    return model.to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# resuming a run: what it keeps, what it may change (docs/design.md, "Reliability", "The learning-rate horizon")
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Resumed:
    """What a resume hands the loop: the configs it continues with, where it continues, the saved state."""
    tcfg: TrainConfig                # with the saved run's lr horizon
    start: int                       # the first step to run
    skipped: int                     # optimizer steps skipped so far (--skip_nonfinite_steps)
    optimizer: dict                  # AdamW's saved state (checkpoint.optimizer_state's layout)
    rollouts: dict | None = None     # the batches generated ahead of the step (pipeline.Colocated.state_dict)
    surge: dict | None = None        # the response-length surge detector's state (runlog.LengthSurge.state_dict)
    sft_done: int = 0                # --sft_steps' supervised steps the weights have had (tooling/sft.py)
    plugins: dict = dataclasses.field(default_factory=dict)   # each plug-in hook's saved state, by its name


def resume(tcfg: TrainConfig, model: Transformer, task, experts: list[int] | None, print0) -> Resumed:
    """Continue the run in tcfg.out_dir from its latest checkpoint: the model's weights (this rank's
    experts under EP) and the task's data order are loaded in place; the configs are checked against the
    saved ones (resume_plan). The model's dtypes are kept (an fp32 router reads back its saved bits)."""
    ckpt = latest_checkpoint(tcfg.out_dir)
    state = load_trainer_state(ckpt)
    tcfg = resume_plan(tcfg, state, print0)
    if ModelConfig(**state["model_config"]) != model.config:       # fields added since take their defaults
        raise ConfigError(f"{ckpt} was trained with a different model config than --init_from={tcfg.init_from!r}")
    want = model.state_dict()
    model.load_state_dict({k: v.to(device=want[k].device, dtype=want[k].dtype)
                           for k, v in load_weights(ckpt, model, experts).items()})
    task.load_state_dict(state["task"])
    return Resumed(tcfg, state["step"], state.get("skipped_steps", 0), state["optimizer"], state.get("rollouts"),
                   state.get("length_surge"), state.get("sft_done", 0), state.get("plugins") or {})


def resume_plan(tcfg: TrainConfig, state: dict, print0) -> TrainConfig:
    """Check --steps against the checkpoint and keep the run's lr horizon (train.lr_at)."""
    done = state["step"]
    if tcfg.steps <= done:
        raise ConfigError(f"--resume: the checkpoint in {tcfg.out_dir!r} is at step {done} and --steps={tcfg.steps}"
                          + (": the run is finished" if tcfg.steps == done else "")
                          + f"; pass --steps=N with N > {done} to train further")
    ckpt_cfg = state["train_config"]
    saved = ckpt_cfg.get("lr_decay_steps") or ckpt_cfg["steps"]
    horizon = tcfg.lr_decay_steps or saved
    if tcfg.lr_schedule == "cosine" and tcfg.steps > horizon:
        print0(f"resume: --steps={tcfg.steps} extends the run past its lr horizon of {horizon} steps: lr follows "
               f"the planned cosine to step {horizon}, then holds at {tcfg.lr * tcfg.min_lr_ratio:.3g} "
               f"(pass --lr_decay_steps={tcfg.steps} to re-plan the schedule instead)")
    fields = {f.name: f for f in dataclasses.fields(tcfg)}
    plan = ("lr_schedule", *resume_rule(tcfg, "LR_PLAN"))            # a plug-in schedule's plan (lr_halving/'s)
    was, now = [ckpt_cfg.get(k, fields[k].default) for k in plan], [getattr(tcfg, k) for k in plan]
    if was != now:
        print0(f"resume: the lr schedule changes from {schedule_words(plan, was)} to {schedule_words(plan, now)}: "
               f"lr is re-planned from step {done + 1}")
    for name in resume_rule(tcfg, "FIXED_ON_RESUME"):               # the batches ahead (and in flight) were made so
        was = ckpt_cfg.get(name, fields[name].default)
        if was != getattr(tcfg, name):
            raise ConfigError(f"--{name}={getattr(tcfg, name)}: the run was saved with {name}={was} and its batches "
                              "generated ahead by that schedule; resume with the same value")
    tcfg.check_saved(ckpt_cfg)                                        # each group's check_with_saved
    return dataclasses.replace(tcfg, lr_decay_steps=horizon)


def schedule_words(plan: tuple[str, ...], values: list) -> str:
    """An lr schedule as resume_plan prints it: `halving (lr_decay_period 2, halving_start surge)`, `cosine`."""
    rest = ", ".join(f"{k} {v}" for k, v in zip(plan[1:], values[1:]))
    return f"{values[0]} ({rest})" if rest else str(values[0])


def resume_rule(cfg, rule: str) -> tuple[str, ...]:
    """The option names every group of cfg's class lists under `rule`: FREE_ON_RESUME (what a resume may
    change without changing the run's numbers; any other setting that differs is refused unless
    --resume_changes=allow, docs/design.md "Reliability"), FIXED_ON_RESUME (never changed on resume) or LR_PLAN
    (a plug-in schedule's options: a change re-plans lr, resume_plan)."""
    return tuple(dict.fromkeys(n for cls in reversed(type(cfg).__mro__) for n in vars(cls).get(rule, ())))   # in order


ACTS = ("resume", "overwrite")           # the command itself, not a setting of the run


def config_changes(saved: tuple, now: tuple) -> list[tuple[str, object, object]]:
    """(field, saved value, new value) of every setting of (TrainConfig, RolloutConfig) that differs."""
    out = []
    for a, b in zip(saved, now):
        out += [(f.name, getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
                if f.name not in ACTS and getattr(a, f.name) != getattr(b, f.name)]
    return out


def check_resume_changes(saved: tuple, now: tuple, print0) -> None:
    """Print each setting the resume changes; refuse (ConfigError, one line) those that would change the
    run's numbers, unless --resume_changes=allow."""
    changes = config_changes(saved, now)
    free = resume_rule(now[0], "FREE_ON_RESUME") + resume_rule(now[1], "FREE_ON_RESUME")
    for name, was, new in changes:
        print0(f"resume: --{name}={new!r} (the saved run's: {was!r})"
               + ("" if name in free else ": changes the run's numbers"))
    breaking = [name for name, _, _ in changes if name not in free]
    if breaking and now[0].resume_changes != "allow":
        raise ConfigError(f"--resume: {', '.join('--' + n for n in breaking)} differ from the saved run and would change "
                          "its numbers; drop them to continue it exactly, or pass --resume_changes=allow to continue "
                          "with them (docs/design.md, \"Reliability\")")


def command_line_configs(overrides: dict[str, str], print0) -> tuple[TrainConfig, RolloutConfig]:
    """The configs a command line runs: the defaults with its options; with --resume=true the saved
    run's (out_dir/latest's) with its options on top, checked by check_resume_changes. They carry the
    plug-ins whose options the command line (or the saved run) names (config.configs_for)."""
    gpu = overrides.get("device", "auto") != "cpu" and torch.cuda.is_available()
    if not parse_bool("resume", overrides.get("resume", "false")):
        tcls, rcls = configs_for(overrides, gpu)
        tcfg, rcfg = tcls(), rcls()
        apply_command_line(overrides, tcfg, rcfg)
        return tcfg, rcfg
    ckpt = latest_checkpoint(overrides.get("out_dir", TrainOptions.out_dir))
    state = load_trainer_state(ckpt)
    tcfg, rcfg = saved_configs(state, ckpt, overrides, gpu)
    apply_command_line(overrides, tcfg, rcfg)
    check_resume_changes(saved_configs(state, ckpt, overrides, gpu), (tcfg, rcfg), print0)
    return tcfg, rcfg


def saved_configs(state: dict, ckpt: str, keys=(), gpu: bool = False) -> tuple[TrainConfig, RolloutConfig]:
    """The configs a checkpoint was trained with (plain dicts in trainer_state.pt), ready to resume; with
    the plug-ins its options and `keys` (a resume's command line) name."""
    try:
        saved = {**state["train_config"], **state["rollout_config"]}
        tcls, rcls = configs_for({**saved, **dict(keys)}, gpu)
        tcfg = tcls(**{**state["train_config"], "overwrite": False})   # overwriting was the first leg's act
        return tcfg, rcls(**state["rollout_config"])
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{ckpt}/trainer_state.pt: its configs do not fit this train.py ({e}); "
                              "was it written by another version?") from None


# ---------------------------------------------------------------------------------------------------
# python -m support.checkpoint export CKPT DIR: a clean HF folder
# ---------------------------------------------------------------------------------------------------
EXPORT_USAGE = "usage: python -m support.checkpoint export CKPT DIR [--save_dtype=float32|bfloat16]"


def export(ckpt: str, out: str, save_dtype: str = "") -> str:
    """Write out/ from checkpoint folder ckpt (a run folder: its latest, checkpoint_folder): the exact weights
    (the masters where the checkpoint's export rounded them) cast to save_dtype (default: the run's
    --save_dtype, else its --dtype, else the checkpoint's), config.json, generation_config.json and the
    tokenizer files; no optimizer state, no masters. Written to out.tmp and renamed; an out that holds
    files is refused."""
    from support.hf import config_from_hf, read_identity
    ckpt = checkpoint_folder(ckpt)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"export: {out!r} exists and is not an empty folder; pass a new one (nothing is overwritten)")
    _require_dtype(save_dtype)
    if not save_dtype and os.path.isfile(os.path.join(ckpt, "trainer_state.pt")):
        run = load_trainer_state(ckpt)["train_config"]
        save_dtype = run.get("save_dtype") or run.get("dtype", "")
    with torch.device("meta"):
        model = Transformer(config_from_hf(ckpt))
    if plugin_tensors(ckpt, model):                                   # LoRA's adapters: the export merged them
        print(f"{ckpt}: its masters hold a plug-in's tensors (LoRA's adapters: python -m lora.export writes them "
              "as a PEFT adapter); exporting its HF weights, which fold them in")
        model.load_state_dict(hf_to_state(read_safetensors_dir(ckpt), model), assign=True)
    else:
        model.load_state_dict(load_weights(ckpt, model), assign=True)     # the exact bits, masters first
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    export_model(model, None, save_dtype).save_pretrained(tmp)
    write_identity(tmp, read_identity(ckpt))
    if os.path.isdir(out):
        os.rmdir(out)                                                 # empty (checked above)
    os.replace(tmp, out)
    return out


def _require_dtype(save_dtype: str) -> None:
    if save_dtype not in ("", "float32", "bfloat16"):
        raise ConfigError(f"export: --save_dtype={save_dtype!r}: float32 or bfloat16 (default: the run's)")


def export_cli(argv: list[str]) -> None:
    """`python -m support.checkpoint export CKPT DIR [--save_dtype=...]`: one `error:` line per mistake, exit 1."""
    if not argv or argv[0] in ("-h", "--help"):
        return print(EXPORT_USAGE + "\n\n" + __doc__)
    try:
        opts = [a for a in argv[1:] if a.startswith("--")]
        paths = [a for a in argv[1:] if not a.startswith("--")]
        if argv[0] != "export" or len(paths) != 2:
            raise ConfigError(EXPORT_USAGE)
        given = parse_args(opts)
        unknown = sorted(set(given) - {"save_dtype"})
        if unknown:
            raise ConfigError(f"export: unknown option --{unknown[0]} ({EXPORT_USAGE})")
        ckpt = checkpoint_folder(paths[0])
        if ckpt != paths[0]:
            print(f"{paths[0]} is a run folder: exporting its latest checkpoint, {ckpt}")
        path = export(ckpt, paths[1], save_dtype=given.get("save_dtype", ""))
        print(f"exported {ckpt} to {path}")
    except (ConfigError, CheckpointError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    export_cli(sys.argv[1:])
