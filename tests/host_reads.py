"""HostReads: counts the reads of tensor values back to the host, by the repository file that made them
(tests/test_train.py's trainer forward, tests/ep_check.py's decode exchange)."""
import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class HostReads(TorchDispatchMode):
    """Counts the reads of tensor values back to the host, by the repository file that made them.

    Every Python-level read of a value (item, bool, int, float: `if t.any()`, `int(t.max())`) goes
    through aten._local_scalar_dense; ops whose output shape depends on values sync on a GPU too.
    tolist / numpy read without dispatching, so they are patched. The file is that of the innermost
    frame in the repository (not tests/, not torch)."""
    DATA_DEPENDENT = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "bincount",
                      "unique_consecutive"}

    def __init__(self):
        super().__init__()
        self.by_file = {}

    def _count(self):
        for frame in reversed(traceback.extract_stack()):
            if frame.filename.startswith(ROOT) and "/tests/" not in frame.filename:
                name = os.path.relpath(frame.filename, ROOT)   # model.py, parallel/expert_parallel.py
                self.by_file[name] = self.by_file.get(name, 0) + 1
                return

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.DATA_DEPENDENT:
            self._count()
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._patched = [(name, getattr(torch.Tensor, name)) for name in ("tolist", "numpy")]
        for name, real in self._patched:
            setattr(torch.Tensor, name, lambda t, *a, _real=real, **kw: (self._count(), _real(t, *a, **kw))[1])
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self._patched:
            setattr(torch.Tensor, name, real)
        return super().__exit__(*exc)
