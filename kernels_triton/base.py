"""What the Triton files share: the interpreter switch, the launch options and two small helpers.

kernels_triton/ops.py (dense ops, attention), kernels_triton/moe.py (fused MoE) and kernels_triton/vocab.py
(log-probs, the draw) import from here and from nowhere else in the project, so the dependencies run
one way:
    kernels.py --(lazy, on first Triton use)--> kernels_triton*.py --> this file
Nothing here imports kernels.py. Not meant to be run.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must precede every @triton.jit of the backend

import triton                      # noqa: E402

INTERPRET = bool(triton.knobs.runtime.interpret)
UPCAST = INTERPRET                 # interpreter: dot in fp32 (bf16 tl.dot is broken there)

# FP contraction off: every float op rounds as written (no mul+add -> fma chosen by the compiler),
# which keeps the kernels close to their torch twins and their bits independent of code layout.
LAUNCH = dict(enable_fp_fusion=False)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it if its data pointer is not 16-byte aligned (a view at an odd offset). A
    launch specializes on pointer alignment; the copy keeps one call site on one binary."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def operand_dtype(*tensors) -> torch.dtype:
    """The dtype that picks a tile config: the operands' common dtype (mixed dtypes run in fp32)."""
    dts = {t.dtype for t in tensors}
    return dts.pop() if len(dts) == 1 else torch.float32
