"""The expert-parallel checks in one torchrun job: tests/ep_check.py, ep_train_check.py and eplb_check.py
run in turn on one process group (a launch costs each rank its imports, seconds of CPU), each one's lines
after a `== NAME` line of rank 0 (tests/test_expert_parallel.py reads them apart).

    torchrun --standalone --nproc_per_node=2 tests/ep_suite.py OUT     # 2 or 4 gloo processes
"""
import gc
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ep_check  # noqa: E402
import ep_train_check  # noqa: E402
import eplb_check  # noqa: E402


def main(out: str) -> None:
    dist.init_process_group("gloo")
    for name, checks in (("ep_check", ep_check.checks), ("ep_train_check", lambda: ep_train_check.checks(f"{out}/train")),
                         ("eplb_check", lambda: eplb_check.checks(f"{out}/eplb"))):
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"== {name}", flush=True)
        checks()
    dist.barrier()
    gc.collect()      # the runs' cycles (their gloo work) go while Python is alive, as in train.py
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
