"""The peak memory of a train.py run, for tests/test_plan.py's check of the plan against it.

    python tests/peak_rss.py --steps=1 ...      # prints {"baseline": bytes, "peak": bytes} as its last line

Memory is the process's anonymous resident memory (RssAnon: the heap, every tensor; not the libraries'
code, which the kernel may drop from RSS under memory pressure), sampled every millisecond by a thread.
baseline: after importing train.py and a warm-up that loads what torch sets up on first use (AdamW's
step, the autograd engine); peak: the most during the run. Their difference is what the run added.
"""
import json
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import train  # noqa: E402  (imported before the baseline is read: the libraries are the baseline's)


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))   # kB


def warm_up() -> None:
    """One tiny backward and AdamW step: torch allocates their machinery (about 140 MB here) on first use."""
    w = torch.zeros(8, requires_grad=True)
    (w * 2).sum().backward()
    torch.optim.AdamW([w]).step()


class Peak(threading.Thread):
    """The most RssAnon seen while it runs (a sample a millisecond: a step's peak lasts far longer)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.done = rss_anon(), False

    def run(self):
        while not self.done:
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)


if __name__ == "__main__":
    warm_up()
    baseline, peak = rss_anon(), Peak()
    peak.start()
    train.main(sys.argv[1:])
    peak.done = True
    peak.join()
    print(json.dumps({"baseline": baseline, "peak": max(peak.peak, rss_anon())}))
