"""The core's size, as a reader meets it: the README's reading order against the files, and the lines a
default step executes.

    python tools/lines.py                  # the reading order's files: README's count, the file's, off by
    python tools/lines.py --check          # exit 1 where a README count is more than 10% off (CI runs this)
    python tools/lines.py --write          # set README's counts to the files'
    python tools/lines.py --trace          # run `train.py --steps=2` under a line tracer: the distinct
                                           # project lines it executes, per file, and their mean width
    python tools/lines.py --trace -- --task=lookup --steps=1   # the traced run's own options after --

The counts are a reader's plan (how long each file takes), so they live in the README; this script keeps
them true without pinning a fork's test suite to them. The tracer counts a line once however often it
runs, and every function that runs whole (a reader reads the function, not only the lines one run took):
the measure of how much code a reader follows through one default step (tests and tools are not counted;
the standard library and torch are not project code). Mean width is over the non-blank lines.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what a default step may execute: (lines, files), today's, lowered as the core shrinks (tests/test_layout.py
# holds it); the goal is 2,500 lines in 10 files (docs/design.md, "The core and its plug-ins")
BUDGET = (3_967, 16)
README = os.path.join(ROOT, "README.md")
ITEM = re.compile(r"`([\w/]+\.py)` \((\d+)\)")     # "`model.py` (726)" in the reading order's items


def reading_order(text: str) -> list[tuple[str, int]]:
    """(file, the README's count) in the order of the "Read in this order" section's numbered items."""
    section = text.split("## Read in this order\n", 1)[1].split("\n## ", 1)[0]
    items = re.findall(r"^\d+\. (.*)$", section, flags=re.M)
    return [(f, int(n)) for item in items for f, n in ITEM.findall(item.split(":")[0])]


def count_lines(path: str) -> int:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return sum(1 for _ in f)


def compare(text: str) -> list[tuple[str, int, int]]:
    """(file, README's count, the file's count) for each file of the reading order."""
    return [(f, n, count_lines(f)) for f, n in reading_order(text)]


def write_counts(text: str) -> str:
    """The README with every reading-order count set to its file's."""
    head, rest = text.split("## Read in this order\n", 1)
    section, tail = rest.split("\n## ", 1)
    section = ITEM.sub(lambda m: f"`{m[1]}` ({count_lines(m[1])})", section)
    return f"{head}## Read in this order\n{section}\n## {tail}"


def trace_step(argv: list[str]) -> tuple[dict[str, set[int]], dict[str, float]]:
    """Runs train.py's main with argv under sys.settrace; returns the executed line numbers of each project
    file (relative path) and each file's mean width over those lines."""
    import threading
    hits: dict[str, set[int]] = {}
    project = ROOT + os.sep
    skip = (os.path.join(ROOT, "tests") + os.sep, os.path.join(ROOT, "tools") + os.sep)

    def local(frame, event, arg):
        if event == "line":
            hits.setdefault(frame.f_code.co_filename, set()).add(frame.f_lineno)
        return local

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        if name.startswith(project) and not name.startswith(skip):
            hits.setdefault(name, set()).add(frame.f_lineno)
            return local
        return None

    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    import train
    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        train.main(argv)
    finally:
        sys.settrace(None)
        threading.settrace(None)
    lines, widths = {}, {}
    for name, nums in hits.items():
        rel = os.path.relpath(name, ROOT)
        with open(name, encoding="utf-8") as f:
            source = f.read()
        lines[rel] = read_lines(source, nums)
        text = [source.splitlines()[i - 1].rstrip() for i in lines[rel]]
        widths[rel] = sum(map(len, text)) / max(sum(1 for t in text if t), 1)     # blank lines: no width
    return lines, widths


def read_lines(source: str, executed: set[int]) -> set[int]:
    """The lines a reader follows: every function that ran, whole (its def to its last line, docstring and
    comments included: a reader reads the function, not the lines the run took), and each other executed
    statement with all of its physical lines."""
    import ast
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if executed & set(range(node.body[0].lineno, node.end_lineno + 1)):
                out |= set(range(node.lineno, node.end_lineno + 1))
        elif isinstance(node, ast.stmt) and node.lineno in executed:
            body = getattr(node, "body", None)
            end = body[0].lineno - 1 if isinstance(body, list) and body else node.end_lineno
            out |= set(range(node.lineno, max(end, node.lineno) + 1))
    return out


def print_trace(argv: list[str]) -> None:
    lines, widths = trace_step(argv)
    total = sum(len(v) for v in lines.values())
    mean = sum(widths[f] * len(lines[f]) for f in lines) / max(total, 1)
    print(f"\n{'file':<32} {'lines run':>9} {'mean width':>10}")
    for f, n in Counter({f: len(v) for f, v in lines.items()}).most_common():
        print(f"{f:<32} {n:>9} {widths[f]:>10.1f}")
    print(f"{'total: ' + str(len(lines)) + ' files':<32} {total:>9} {mean:>10.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 where a README count is over 10%% off")
    p.add_argument("--write", action="store_true", help="set the README's counts to the files'")
    p.add_argument("--trace", action="store_true", help="count the lines a default train.py step executes")
    p.add_argument("rest", nargs="*", help="after --: train.py's options for --trace")
    args = p.parse_args(argv)
    if args.trace:
        print_trace(["--steps=2", "--progress=false", "--out_dir=" + os.path.join(ROOT, "out", "lines-trace"),
                     "--overwrite=true", *args.rest])
        return 0
    text = open(README, encoding="utf-8").read()
    if args.write:
        with open(README, "w", encoding="utf-8") as f:
            f.write(write_counts(text))
        text = open(README, encoding="utf-8").read()
    off = 0
    for f, said, actual in compare(text):
        bad = abs(said - actual) > 0.1 * actual
        off += bad
        print(f"{f:<24} README {said:>5}  file {actual:>5}{'  more than 10% off' if bad else ''}")
    if off and args.check:
        print(f"{off} README count(s) more than 10% off: run python tools/lines.py --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
