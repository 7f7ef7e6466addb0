"""--log_to=tensorboard|wandb: each metrics row rank 0 writes, copied to the tracker as scalars."""
from __future__ import annotations

import dataclasses
import os

from config import ConfigError
from support.hooks import Hooks


class Tracker(Hooks):
    """The tracker's step hooks: `setup` opens it on rank 0, `log` copies a row, `finish` ends its run.
    Built on every rank when the options are read, so a missing package is one line before any work."""

    def __init__(self, kind: str):
        self.kind, self.run = kind, None
        self.package = import_package(kind)

    def setup(self, run, resumed) -> None:
        if run.d.master:
            config = {"train": dataclasses.asdict(run.tcfg), "rollout": dataclasses.asdict(run.rcfg)}
            self.run = open_run(self.kind, self.package, run.tcfg.out_dir, config)

    def log(self, row: dict) -> None:
        if self.run is not None:
            self.run.log(row)

    def finish(self, exit_code: int) -> None:
        """The tracker's run ends (0: it finished, else failed or stopped: 128 + the signal)."""
        if self.run is not None:
            self.run.close(exit_code)


class TrackerRun:
    """An open tracker: log(row) takes a metrics row, close(exit_code) ends it."""

    def __init__(self, log, close):
        self.log, self.close = log, close


def import_package(kind: str):
    """tensorboard's SummaryWriter or the wandb module (ConfigError naming the package if it is not installed)."""
    try:
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            return SummaryWriter
        import wandb
        return wandb
    except ImportError:
        raise ConfigError(f"--log_to={kind} needs the {kind} package: pip install {kind} "
                          "(or drop --log_to: metrics.jsonl has every row)") from None


def open_run(kind: str, package, out_dir: str, config: dict) -> TrackerRun:
    """tensorboard's event files in out_dir/tensorboard, or a wandb run in out_dir/wandb (online when
    api.wandb.ai answers, else offline; WANDB_MODE decides where set). config: the run's configs, which
    wandb keeps with the run."""
    if kind == "tensorboard":
        w = package(os.path.join(out_dir, "tensorboard"))
        return TrackerRun(lambda row: [w.add_scalar(k, v, row["step"]) for k, v in logged_scalars(row).items()],
                          lambda exit_code: w.close())
    wandb = package
    mode = os.environ.get("WANDB_MODE") or ("online" if network_reachable("api.wandb.ai") else "offline")
    try:
        r = wandb.init(project=os.environ.get("WANDB_PROJECT", "moe-rl"), dir=out_dir, mode=mode, config=config)
    except wandb.errors.Error as e:                                   # e.g. online without `wandb login`
        raise ConfigError(f"--log_to=wandb: {e} (or WANDB_MODE=offline: the run is kept in {out_dir}/wandb "
                          "for `wandb sync`)") from None
    return TrackerRun(lambda row: r.log(logged_scalars(row), step=row["step"]), lambda exit_code: r.finish(exit_code))


def logged_scalars(row: dict) -> dict[str, float]:
    """A metrics row as the trackers' scalars: each number by its key, a list's numbers as key/i (e.g. one
    per layer; key/i/j in a list of lists); a null (a non-finite value in metrics.jsonl) and the step
    itself are left out."""
    def flat(key, v):
        if isinstance(v, list):
            return [item for i, x in enumerate(v) for item in flat(f"{key}/{i}", x)]
        return [(key, v)]
    items = [item for k, v in row.items() if k != "step" for item in flat(k, v)]
    return {k: float(x) for k, x in items if isinstance(x, (int, float))}


def network_reachable(host: str) -> bool:
    import socket
    try:
        socket.create_connection((host, 443), timeout=3).close()
        return True
    except OSError:
        return False
