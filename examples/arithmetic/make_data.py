"""Write the arithmetic example's data: sums a+b of two numbers in [0, 30), 100 pairs held out for eval.

    python examples/arithmetic/make_data.py     # -> train.jsonl (800 rows), eval.jsonl (100 rows)

One JSON object a line, {"prompt": "12+34=", "answer": "46"}: the format of --task=jsonl. The eval pairs
never appear in train.jsonl, so a policy scores on them only by adding, not by remembering.
"""
import json
import os
import random

pairs = [(a, b) for a in range(30) for b in range(30)]
random.Random(0).shuffle(pairs)
here = os.path.dirname(os.path.abspath(__file__))
for name, part in (("eval.jsonl", pairs[:100]), ("train.jsonl", pairs[100:])):
    with open(os.path.join(here, name), "w") as f:
        f.writelines(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in part)
    print(f"wrote {os.path.join(here, name)}: {len(part)} rows")
