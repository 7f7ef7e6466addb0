"""ReadLog: what a checkpoint load reads from disk, by tensor and row (tests/test_hf.py's expert shard
load, tests/ep_train_check.py's training from a checkpoint folder under EP)."""
import re


class ReadLog:
    """safetensors.safe_open, recording what leaves the disk: (key, None) for a whole tensor, (key, row)
    for one leading-dim row of a tensor read through get_slice."""
    def __init__(self, real):
        self.real, self.read = real, []

    def __call__(self, *args, **kw):
        log, handle = self.read, self.real(*args, **kw)

        class Slice:
            def __init__(self, key):
                self.key, self.part = key, handle.get_slice(key)

            def __getitem__(self, row):
                log.append((self.key, row))
                return self.part[row]

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def get_tensor(self, key):
                log.append((key, None))
                return handle.get_tensor(key)

            def get_slice(self, key):
                return Slice(key)
        return Handle()


def experts_read(log: list, cfg) -> set[int]:
    """The expert ids whose weights a ReadLog saw leave the disk (every id for a whole stacked tensor)."""
    ids = set()
    for key, row in log:
        if m := re.search(r"\.experts\.(\d+)\.", key):
            ids.add(int(m.group(1)))
        elif re.search(r"experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$|mlp\.(w13|w2|b13|b2)$", key):
            ids |= set(range(cfg.num_experts)) if row is None else {row}
    return ids
