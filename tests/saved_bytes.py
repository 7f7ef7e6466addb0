"""What a trainer forward keeps for its backward: the bytes of every tensor autograd saves (each storage
once, parameters aside), per token, for tests/test_plan.py's check of the plan's activation formula.

    python tests/saved_bytes.py '{"hidden_size": 64, ...}' LENGTH N_SEQS BACKEND DTYPE   # prints the number

A packed forward of N_SEQS sequences of LENGTH tokens, as the trainer runs it (score with the entropy,
--logits_chunk's default). Run as a script under TRITON_INTERPRET=1 for the Triton backend on a CPU.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import kernels  # noqa: E402
from config import ModelConfig  # noqa: E402
from model import Transformer  # noqa: E402
from support.packing import Packing  # noqa: E402


def saved_bytes_per_token(cfg: ModelConfig, length: int, n_seqs: int, backend: str = "torch",
                          dtype: torch.dtype = torch.float32, lora_rank: int = 0) -> float:
    torch.manual_seed(0)
    model = Transformer(cfg).to(dtype)
    if lora_rank:                                    # every target but the router, the base frozen in dtype
        from lora.adapters import adapt
        adapt(model, lora_rank, 32.0, {"attention", "mlp", "experts"}, False, 1, dtype, dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, cfg.vocab_size, (1, length * n_seqs))
    seen = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            seen[key] = t.untyped_storage().nbytes()
        return t
    with kernels.set_backend(backend), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.score(tokens, packing=Packing.concat([length] * n_seqs), with_entropy=True, logits_chunk=4096,
                    check=False)
    return sum(seen.values()) / tokens.numel()


if __name__ == "__main__":
    fields, length, n, backend, dtype = sys.argv[1:]
    print(saved_bytes_per_token(ModelConfig(**json.loads(fields)), int(length), int(n), backend, getattr(torch, dtype)))
