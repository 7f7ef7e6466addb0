"""--rollout_ranks=R: the last R ranks of a torchrun job generate, the others train. Each side is its own
default process group (so every collective of one side, DDP, FSDP2 and EP included, runs among its ranks
only), and a Bridge of gloo groups joins them: weights one way, batches the other (asynchrony/pipeline.py).

    d = init_distributed(device, RolloutRanks(R, ep_size))    # support/distributed.py calls it per rank
"""
from __future__ import annotations

import os

import torch.distributed as dist

from config import ConfigError
from support.distributed import Dist


class RolloutRanks:
    """The split of a torchrun job's ranks into trainers and R rollout ranks (Hooks.split_ranks)."""

    def __init__(self, n_rollout: int, ep_size: int = 1):
        self.n, self.ep_size = n_rollout, ep_size          # ep_size: both sides' EP degree (Bridge)

    def single(self) -> None:
        raise ConfigError(f"--rollout_ranks={self.n} splits the ranks of a torchrun job: launch it with "
                          f"torchrun --nproc_per_node=N (N > {self.n}), or drop it")

    def __call__(self, rank: int, world: int, dev, backend: str, kw: dict) -> Dist:
        if self.n >= world:
            raise ConfigError(f"--rollout_ranks={self.n}: the job has {world} ranks; at least one must train")
        store = launcher_store(world)
        n_train = world - self.n
        role, side_rank, side_world = ("train", rank, n_train) if rank < n_train else ("rollout", rank - n_train, self.n)
        dist.init_process_group(backend, store=dist.PrefixStore(role, store), rank=side_rank, world_size=side_world,
                                **kw)
        return Dist(side_rank, side_world, dev, role, Bridge(store, rank, n_train, self.n, self.ep_size))


def launcher_store(world: int):
    """torchrun's key-value store (its agent's, or the one rank 0 serves), to build more process groups on."""
    from datetime import timedelta
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         not agent and int(os.environ["RANK"]) == 0, timedelta(minutes=30))


class Bridge:
    """The gloo groups between the trainers and the rollout ranks (disaggregated, --rollout_ranks):
    `weights`: trainer 0 and the rollout ranks (trainer 0 broadcasts each new version's compute weights);
    under EP of degree N, one such group per EP rank s: trainer s and the rollout ranks r with r % N == s,
    since both sides form EP groups of N consecutive ranks with the same placement, so trainer s's weights
    (the dense ones and its E/N experts) are exactly what those rollout ranks hold;
    `batches[r]`: rollout rank r and every trainer (rank r broadcasts each batch it generated).
    Each is a group of its own, so its broadcasts pair up in their own order whatever the other does."""

    def __init__(self, store, rank: int, n_train: int, n_rollout: int, ep_size: int = 1):
        from datetime import timedelta
        self.n_train, self.n_rollout, self.global_rank = n_train, n_rollout, rank
        timeout = timedelta(minutes=30)
        self.weights = None
        for s in range(ep_size):
            members = [s] + [n_train + r for r in range(n_rollout) if r % ep_size == s]
            if rank in members:
                self.weights = dist.ProcessGroupGloo(dist.PrefixStore(f"bridge/weights/{s}", store),
                                                     members.index(rank), len(members), timeout)
        self.batches = {}
        for r in range(n_rollout):
            members = list(range(n_train)) + [n_train + r]
            if rank in members:
                self.batches[r] = dist.ProcessGroupGloo(dist.PrefixStore(f"bridge/batches/{r}", store),
                                                        members.index(rank), len(members), timeout)
