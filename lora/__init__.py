"""LoRA (--lora_rank): low-rank adapters beside frozen weights, unmerged, run by the same invariant kernels
in the sampler and the trainer (lora/adapters.py); a PEFT adapter folder out (lora/export.py)."""
