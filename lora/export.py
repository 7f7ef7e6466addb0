"""A LoRA checkpoint out: a PEFT adapter folder that `peft` loads onto transformers' model of the base, and
the merged HF checkpoint.

    python -m lora.export CKPT OUT

writes OUT/adapter (adapter_config.json, adapter_model.safetensors) and OUT/merged (config.json, the merged
weights, the tokenizer files). CKPT: a checkpoint folder of a --lora_rank run, or its run folder (its latest).

PEFT's layout (0.21, transformers 5): a Linear's adapter is `<module>.lora_A.weight` (r, in) and
`<module>.lora_B.weight` (out, r), matched by target_modules; the fused experts (`mlp.experts.gate_up_proj`
(E, 2I, D), `down_proj` (E, D, I)) are target_parameters, one wrapper around the other: gate_up's factors
under `experts.base_layer`, down's under `experts`, A as (E*r, in) expert-major and B as (out, r*E)
expert-minor; gpt-oss's gate_up_proj (E, D, 2I, multiplied as x @ W) alternates gate and up outputs, and so
do the rows of its B. Qwen3-Next stores its Gated DeltaNet's in_proj_qkv and in_proj_z as one interleaved
in_proj_qkvz: their two rank-r adapters are one of rank 2r there (A stacked, B block-diagonal in the fused
row order), at alpha 2 alpha (rank_pattern, alpha_pattern: the same scale), the same delta exactly. The base's
identity is a sha256 of its weights in adapter_config.json (base_sha256), which lora.export.check_base
compares before an adapter is used on a checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys

import torch

from config import ConfigError
from support import hf
from lora.adapters import EXPERT_FACTORS, Adapted, AdaptedExperts, is_adapter, merged
from model import Transformer

USAGE = "usage: python -m lora.export CKPT OUT   (CKPT: a --lora_rank run's checkpoint or run folder)"


def _digest(t: torch.Tensor) -> bytes:
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).digest()


def base_sha256(model: Transformer, experts: list[int] | None = None, gather=None) -> str:
    """A hash of the frozen weights (every tensor but the adapters', as stored): sha256 over each tensor's name
    and digest, by name; a stacked experts tensor's digest is over its experts' row digests in expert order.
    experts: the logical experts an expert-parallel rank holds (its rows, in order); it completes the rows from
    its peers' (gather: {name: {expert: digest}} -> every rank's; default all_gather_object over the ranks),
    so every rank gets the whole model's hash."""
    from parallel.expert_parallel import is_expert
    state = {n: t for n, t in sorted(model.state_dict().items()) if not is_adapter(n)}
    rows = {n: {e: _digest(t[i]) for i, e in enumerate(experts if experts is not None else range(len(t)))}
            for n, t in state.items() if is_expert(n)}
    if experts is not None:
        for peer in (gather or _all_gather)(rows):
            for n, r in peer.items():
                rows[n].update(r)
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(hashlib.sha256(b"".join(v for _, v in sorted(rows[name].items()))).digest() if name in rows
                 else _digest(t))
    return h.hexdigest()


def _all_gather(obj) -> list:
    import torch.distributed as dist
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _interleaved(model: Transformer) -> bool:
    """Whether the family stores gate_up_proj's gate and up outputs alternating (gpt-oss: 2j gate, 2j + 1 up;
    ours and transformers' other fused experts: the gate half, then the up half)."""
    return hf.family(model.config.model_type).experts == "gpt_oss"


def _fused(model: Transformer) -> bool:
    """Whether the family stores the Gated DeltaNet's in_proj_qkv and in_proj_z fused (Qwen3-Next)."""
    return model.config.model_type == "qwen3_next"


def qkvz_factors(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """A GDN layer's in_proj_qkv and in_proj_z adapters (rank r each) -> one adapter of rank 2r on the fused
    in_proj_qkvz: A (2r, D) stacked, B (fused rows, 2r) block-diagonal in the fused row order, so B A is the
    two deltas interleaved as the weights are (hybrids/gdn.fuse_qwen3_next)."""
    from hybrids.gdn import fuse_qwen3_next
    qkv, z = layer.in_proj_qkv, layer.in_proj_z
    r = qkv.lora_A.shape[0]
    Bq, Bz = qkv.lora_B.detach().float(), z.lora_B.detach().float()
    parts = {"qkv": torch.cat([Bq, torch.zeros_like(Bq)], 1), "z": torch.cat([torch.zeros_like(Bz), Bz], 1),
             "b": torch.zeros(layer.h, 2 * r), "a": torch.zeros(layer.h, 2 * r)}          # (rows, 2r) each
    B, _ = fuse_qwen3_next(parts, layer.hk, layer.h, layer.dk, layer.dv)
    return torch.cat([qkv.lora_A, z.lora_A]).detach().float(), B


@torch.no_grad()
def split_qkvz(layer, A: torch.Tensor, B: torch.Tensor, where: str) -> None:
    """qkvz_factors' inverse into the layer's two adapters; one line for a fused adapter whose two parts
    share factors (no pair of rank-r adapters is it)."""
    from hybrids.gdn import split_qwen3_next
    r = A.shape[0] // 2
    rows = split_qwen3_next(B, B.new_zeros(2 * layer.h, 2 * r), layer.hk, layer.h, layer.dk, layer.dv)
    qkv, z = rows["in_proj_qkv"], rows["in_proj_z"]
    if qkv[:, r:].any() or z[:, :r].any():
        raise ConfigError(f"{where}: in_proj_qkvz's adapter mixes the qkv and z rows' factors; this layer adapts "
                          "in_proj_qkv and in_proj_z apart (rank r each: the fused one's B block-diagonal)")
    for m, a, b in ((layer.in_proj_qkv, A[:r], qkv[:, :r]), (layer.in_proj_z, A[r:], z[:, r:])):
        m.lora_A.copy_(a)
        m.lora_B.copy_(b)


def peft_state(model: Transformer) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """-> (PEFT's adapter tensors by key, target module names, target parameter names)."""
    fam = hf.family(model.config.model_type)
    state, modules, params = {}, set(), []
    for name, m in model.named_modules():
        if isinstance(m, AdaptedExperts):
            pre = "base_model.model." + hf.our_key_to_hf(fam, name) + ".experts"
            A13, B13, A2, B2 = (getattr(m, n).detach().float() for n in EXPERT_FACTORS)
            E = m.w13.shape[0]
            A13, B2 = A13.expand(E, *A13.shape[1:]), B2.expand(E, *B2.shape[1:])   # shared_outer: one row each
            if _interleaved(model):                                   # (E, 2I, r): gate and up rows alternating
                B13 = torch.stack(B13.chunk(2, dim=1), 2).reshape(B13.shape)
            for where, A, B in ((f"{pre}.base_layer", A13, B13), (pre, A2, B2)):
                state[f"{where}.lora_A.weight"] = A.reshape(-1, A.shape[-1]).contiguous()          # (E*r, in)
                state[f"{where}.lora_B.weight"] = B.permute(1, 2, 0).reshape(B.shape[1], -1).contiguous()  # (out, r*E)
            params += ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        elif isinstance(m, Adapted) and not (_fused(model) and name.endswith(".linear_attn.in_proj_z")):
            path = hf.our_key_to_hf(fam, name + ".weight").removesuffix(".weight")
            A, B = m.lora_A.detach().float(), m.lora_B.detach().float()
            if _fused(model) and name.endswith(".linear_attn.in_proj_qkv"):     # with in_proj_z: in_proj_qkvz
                layer = model.get_submodule(name.removesuffix(".in_proj_qkv"))
                path, (A, B) = path.replace("in_proj_qkv", "in_proj_qkvz"), qkvz_factors(layer)
            state[f"base_model.model.{path}.lora_A.weight"] = A
            state[f"base_model.model.{path}.lora_B.weight"] = B
            if ".self_attn." in path or ".linear_attn." in path:
                modules.add(path)
            else:       # the router, dense MLPs, shared experts: PEFT 0.21 would read their names as v4 experts
                params.append(re.sub(r"^model\.layers\.\d+\.", "", path) + ".weight")
    return state, sorted(modules), list(dict.fromkeys(params))


def write_adapter(model: Transformer, out: str, rank: int, alpha: float, base: str = "") -> None:
    """OUT: adapter_config.json and adapter_model.safetensors (fp32) of model's adapters."""
    from safetensors.torch import save_file
    state, modules, params = peft_state(model)
    # full module paths as one regex: PEFT then matches exactly these (a list would match by suffix, and
    # PEFT 0.21 rewrites gate_proj / up_proj / down_proj entries into transformers 5's fused experts)
    shapes = sorted({re.sub(r"layers\.\d+\.", "layers.N.", p) for p in modules})
    pattern = "|".join(re.escape(p).replace("N", r"\d+") for p in shapes) if shapes else None
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
              "target_modules": pattern, "target_parameters": params or None, "base_model_name_or_path": base,
              "base_sha256": base_sha256(model)}
    if any(p.endswith("in_proj_qkvz") for p in modules):              # two rank-r adapters as one of 2r
        config.update(rank_pattern={"in_proj_qkvz": 2 * rank}, alpha_pattern={"in_proj_qkvz": 2 * alpha})
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(state, os.path.join(out, "adapter_model.safetensors"))


@torch.no_grad()
def read_adapter(model: Transformer, adapter_dir: str, rank: int, alpha: float, experts: list[int] | None = None) -> None:
    """An adapter folder (write_adapter's layout) into model's adapters (added by adapt, same targets and
    rank; experts: an EP rank's, whose rows it takes): one line for another base, rank, scale or set of
    adapted layers."""
    from safetensors.torch import load_file
    check_base(adapter_dir, model, experts)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    if (config.get("r"), float(config.get("lora_alpha", 0))) != (rank, float(alpha)):
        raise ConfigError(f"--lora_init={adapter_dir}: rank {config.get('r')}, alpha {config.get('lora_alpha')}; this "
                          f"run has --lora_rank={rank} --lora_alpha={alpha}: pass the adapter's")
    saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    want = peft_state(model)[0]
    E = model.config.num_experts
    shards = E // len(experts) if experts is not None else 1                # an EP rank's factors: its rows
    if set(saved) != set(want) or any(saved[k].numel() != v.numel() * (shards if ".experts." in k else 1)
                                      for k, v in want.items()):
        raise ConfigError(f"--lora_init={adapter_dir}: its adapted layers are not this run's --lora_targets "
                          f"({len(saved)} tensors, this model's adapters make {len(want)}); pass the same targets")
    fam = hf.family(model.config.model_type)
    for name, m in model.named_modules():
        if isinstance(m, AdaptedExperts):
            pre = "base_model.model." + hf.our_key_to_hf(fam, name) + ".experts"
            held = torch.tensor(experts) if experts is not None else torch.arange(E)
            for where, (a, b) in ((f"{pre}.base_layer", ("lora_A13", "lora_B13")), (pre, ("lora_A2", "lora_B2"))):
                A = saved[f"{where}.lora_A.weight"].view(E, rank, -1)                  # (E, r, in)
                B = saved[f"{where}.lora_B.weight"].view(-1, rank, E).permute(2, 0, 1)  # (E, out, r)
                if b == "lora_B13" and _interleaved(model):             # gate and up rows alternating -> halves
                    B = torch.cat([B[:, 0::2], B[:, 1::2]], 1)
                for n, t in ((a, A), (b, B)):
                    ours = getattr(m, n)
                    if len(ours) == 1 and not torch.equal(t, t[:1].expand_as(t)):
                        raise ConfigError(f"--lora_init={adapter_dir}: {name}'s {n} differs by expert; this run "
                                          "shares it (--lora_expert_factors=shared_outer): use per_expert")
                    ours.copy_(t[:1] if len(ours) == 1 else t[held])
        elif _fused(model) and name.endswith(".linear_attn"):
            path = "base_model.model." + hf.our_key_to_hf(fam, name + ".in_proj_qkvz.weight").removesuffix(".weight")
            if isinstance(m.in_proj_qkv, Adapted):
                A, B = saved[f"{path}.lora_A.weight"], saved[f"{path}.lora_B.weight"]
                split_qkvz(m, A, B, f"--lora_init={adapter_dir}")
        elif isinstance(m, Adapted) and not (_fused(model) and ".linear_attn.in_proj_" in name):
            path = "base_model.model." + hf.our_key_to_hf(fam, name + ".weight").removesuffix(".weight")
            m.lora_A.copy_(saved[f"{path}.lora_A.weight"])
            m.lora_B.copy_(saved[f"{path}.lora_B.weight"])


def check_base(adapter_dir: str, model: Transformer, experts: list[int] | None = None) -> None:
    """One line when an adapter folder was trained on other base weights than model's (experts: base_sha256's)."""
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        want = json.load(f).get("base_sha256")
    have = base_sha256(model, experts) if want else ""
    if want and want != have:
        raise ConfigError(f"{adapter_dir}: this adapter was trained on another base (base_sha256 {want[:12]}..., this "
                          f"checkpoint's is {have[:12]}...); load it onto the checkpoint it names")


def export(ckpt: str, out: str) -> str:
    """OUT/adapter (PEFT) and OUT/merged (HF) from a LoRA run's checkpoint folder -> OUT."""
    from support.checkpoint import checkpoint_folder, load_trainer_state, load_weights
    from lora.adapters import adapt
    ckpt = checkpoint_folder(ckpt)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"lora.export: {out!r} exists and is not an empty folder; pass a new one")
    run = load_trainer_state(ckpt)["train_config"]
    if not run.get("lora_rank"):
        raise ConfigError(f"lora.export: {ckpt} is not a --lora_rank run's checkpoint; use "
                          "python -m support.checkpoint export")
    with torch.device("meta"):
        model = Transformer(hf.config_from_hf(ckpt))
    words = {w.strip() for w in run["lora_targets"].split(",") if w.strip()}
    adapt(model, run["lora_rank"], run["lora_alpha"], words, run["lora_expert_factors"] == "shared_outer", 0,
          torch.float32, torch.float32)
    model.load_state_dict(load_weights(ckpt, model), assign=True)      # the masters: base and adapter apart
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write_adapter(model, os.path.join(tmp, "adapter"), run["lora_rank"], run["lora_alpha"], run.get("init_from", ""))
    merged(model).save_pretrained(os.path.join(tmp, "merged"))
    hf.write_identity(os.path.join(tmp, "merged"), hf.read_identity(ckpt))
    if os.path.isdir(out):
        os.rmdir(out)
    os.replace(tmp, out)
    return out


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 1)
    try:
        print(f"wrote {export(*argv)}")
    except ConfigError as e:
        print(f"error: {e}")
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
