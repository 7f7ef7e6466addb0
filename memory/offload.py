"""The optimizer on the host (--offload_optimizer): the fp32 masters, their gradient sums and AdamW's moments
live in host memory (pinned when the device is a GPU), and the update runs there; the device keeps the
compute copy the trainer and the sampler run.

How: the hook tells train.setup to build the masters on the host (Hooks.master_device); the policy then
keeps them apart from a compute copy on the device (support/distributed.MixedPrecision, also when both are
fp32): after each backward the compute copy's gradients go to the host (into exact_sum's limbs, or fp32
.grad under --grad_reduce=fast), AdamW steps the masters there, and the recast copies them back (from
pinned memory, queued on the device's stream). Under FSDP2 the shards are the masters: FSDP2's
CPUOffloadPolicy keeps them, their gradients and so AdamW's state on the host and copies each shard to
the device before its all-gather (prefetched: the transfers overlap the previous block's compute).

The update's arithmetic is the same ops on the same values, so on a CPU device (where host and device are
one memory, and the compute copy a second copy) a run's metrics and weights are those of the run without
it, bit for bit (tests/test_memory.py, tests/world_check.py under FSDP2 and EP). On a GPU the host's AdamW
is a CPU kernel: its bits may differ from the GPU's in the last place, a different (equally valid) run;
the sampler and the trainer still read the same compute copy, so the contract holds either way.
"""
from __future__ import annotations

import os

import torch

from config import ConfigError
from support.hooks import Hooks


class Offload(Hooks):
    """--offload_optimizer: the masters (and so their gradients and AdamW's state) on the host."""

    def master_device(self, d):
        return torch.device("cpu")

    def setup(self, run, resumed) -> None:
        need = host_bytes_to_come(run.policy)
        have = available_host_bytes()
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if have is not None and need * ranks > have:
            raise ConfigError(f"--offload_optimizer: the host has {have / 1e9:.1f} GB available, the optimizer's "
                              f"state needs {need * ranks / 1e9:.1f} GB more ({ranks} rank(s) on it); free host "
                              "memory, use more hosts, or drop --offload_optimizer")


def host_bytes_to_come(policy) -> int:
    """What the host will still allocate: the masters' gradients (or the exact sums' limbs) and AdamW's two
    moments (unless a resume loaded them), this rank's share."""
    local = [getattr(p, "to_local", lambda: p)() for p in policy.master.parameters() if p.requires_grad]
    grads = policy.reducer.reserve_bytes() if policy.reducer is not None else sum(t.nbytes for t in local)
    moments = 0 if policy.optimizer.state else 2 * sum(t.nbytes for t in local)
    return grads + moments


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
