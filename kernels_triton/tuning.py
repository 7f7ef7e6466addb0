"""A GPU sweep's tile configs in place of the Triton backend's tables, for this process (load_tuning).

    python tools/gpu_check.py --tuning-out tuning.json     # writes the file on a GPU
    python tooling/bench.py --tuning tuning.json           # the benchmarks with it; pytest --kernels-tuning
"""
from __future__ import annotations

import json

import torch

from kernels_triton import moe as ktm
from kernels_triton import ops as kt


def load_tuning(path: str | dict) -> dict:
    """Replace the Triton backend's tile tables with a GPU sweep's choice (a JSON file or its dict), for
    this process.

    `python tools/gpu_check.py --tuning-out tuning.json` writes the file: per table the fastest
    candidate that kept the contract on that GPU (a matmul config gives every row the table's bits; an
    attention forward config gives decode the bits of prefill, also through parallel splits). The
    benchmarks and the CUDA tests then run with it (`tooling/bench.py --tuning`, `pytest --kernels-tuning`);
    to keep it, paste it into the tables (ops.py's MM_TABLE, ATTN_KEYS, ATTN_TABLE, ATTN_SPLIT_BELOW;
    moe.py's MOE_TILES). Sampler and trainer must load the same file: the
    attention and MoE configs decide bits. Returns the tuning; a malformed file raises ValueError and
    changes nothing.
    """
    tuning, path = (path, "(dict)") if isinstance(path, dict) else (None, path)
    try:
        if tuning is None:
            with open(path) as f:
                tuning = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"tuning file {path}: cannot read it as JSON ({e})") from None

    def bad(what):
        return ValueError(f"tuning file {path}: {what} (write it with tools/gpu_check.py --tuning-out)")

    def ints(value, n, what, pow2=0):
        # the first pow2 entries (tile sizes, warps) must be powers of two: tl.arange and num_warps need it,
        # and the kernels would fail only at their first launch
        if not (isinstance(value, list) and len(value) == n and all(type(v) is int and v > 0 for v in value)
                and not any(v & (v - 1) for v in value[:pow2])):
            raise bad(f"{what} = {value!r}, need a list of {n} positive integers"
                      + (f", the first {pow2} powers of two" if pow2 else ""))
        return tuple(value)

    def entries(key):
        value = tuning.get(key, {})
        if not isinstance(value, dict):
            raise bad(f"{key} must be an object")
        return value.items()

    if not isinstance(tuning, dict) or set(tuning) - {"mm", "moe", "attn", "attn_keys", "attn_split_below"}:
        raise bad("need an object with entries among mm, moe, attn, attn_keys, attn_split_below")
    dtypes = {"bfloat16": (torch.bfloat16, torch.float16), "float32": (torch.float32,)}
    sets = []                                          # (table, key, value): applied once all are checked
    for name, rows in entries("mm"):
        # [[largest M, BLOCK_M, BLOCK_N, BLOCK_K, warps, stages], ..., [null, ...]], largest M increasing
        if (name not in dtypes or not isinstance(rows, list) or not rows
                or not all(isinstance(row, list) and len(row) == 6 for row in rows) or rows[-1][0] is not None):
            raise bad(f"mm {name!r}: need a dtype in {list(dtypes)} and rows of 6 numbers, the last one's M null")
        bounds = ints([row[0] for row in rows[:-1]], len(rows) - 1, f"mm {name} largest M")
        if list(bounds) != sorted(set(bounds)):
            raise bad(f"mm {name} largest M {bounds}: need increasing")
        table = tuple((row[0],) + ints(row[1:], 5, f"mm {name} row {i}", pow2=4) for i, row in enumerate(rows))
        sets += [(kt.MM_TABLE, dtype, table) for dtype in dtypes[name]]
    for name, tiles in entries("moe"):
        if name not in dtypes:
            raise bad(f"moe {name!r}: need a dtype in {list(dtypes)}")
        sets += [(ktm.MOE_TILES, dtype, ints(tiles, 5, f"moe {name}", pow2=4)) for dtype in dtypes[name]]
    for name, cfg in entries("attn"):
        if name not in kt.ATTN_TABLE:
            raise bad(f"attn {name!r}: need one of {list(kt.ATTN_TABLE)}")
        sets.append((kt.ATTN_TABLE, name, ints(cfg, 3, f"attn {name}", pow2=2)))
    for key, attr in (("attn_keys", "ATTN_KEYS"), ("attn_split_below", "ATTN_SPLIT_BELOW")):
        if key in tuning:
            pow2 = key == "attn_keys"                                             # the key tile: tl.arange
            if type(tuning[key]) is not int or tuning[key] <= 0 or pow2 and tuning[key] & (tuning[key] - 1):
                raise bad(f"{key} = {tuning[key]!r}, need a positive integer" + (", a power of two" if pow2 else ""))
            sets.append((vars(kt), attr, tuning[key]))                       # vars(module)[name]: its global
    for table, key, value in sets:
        table[key] = value
    return tuning
