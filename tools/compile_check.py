"""Compile every Triton kernel the model launches for a GPU target, on a machine without a GPU.

    python tools/compile_check.py              # sm_90 (H100/H200), bf16 and fp32
    python tools/compile_check.py --arch 80 90 # also sm_80 (A100)
    python tools/compile_check.py --gdn        # also the hybrids' Gated DeltaNet kernel

The interpreter tests (tests/test_triton.py) check what the kernels compute; they cannot show that the
kernels compile, since the interpreter runs the Python body. This script drives the trainer (score
forward + backward) and the real Sampler (prefill + decode, two page sizes) at Qwen3-30B-A3B layer
shapes, gpt-oss-20b's sliding-window attention with sinks and its experts, and Moonlight-16B-A3B's MLA
(trainer and sampler: the 576-dim latent head split 512 + 64, in the wide heads' layout), with every
kernel launch intercepted, then compiles each distinct launch through Triton's own
argument specialization (the signature, constexprs and alignment attributes a CUDA launch would get)
down to a cubin with the ptxas that ships with Triton. It prints registers, shared memory and spilled
bytes (ptxas's stack frame and local memory) per kernel and exits 1 when a kernel fails to compile,
needs more shared memory than the arch has, or spills more than SPILL_BUDGET in bf16. Nothing is
executed: the intercepted launches leave their outputs unset.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

os.environ["TRITON_INTERPRET"] = "0"     # real JITFunctions: must precede importing kernels_triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch                                                       # noqa: E402
import triton                                                      # noqa: E402
from triton.backends.compiler import GPUTarget                     # noqa: E402
from triton.compiler.compiler import ASTSource, make_backend       # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature   # noqa: E402

import kernels                                                     # noqa: E402
from config import ModelConfig                                     # noqa: E402
from kernels_triton import ops as kt                               # noqa: E402
from kernels_triton import moe as ktm                              # noqa: E402
from kernels_triton import vocab as ktv                            # noqa: E402
from hybrids import gdn_triton as ktg                              # noqa: E402
from model import Transformer                                      # noqa: E402
from rollout import Sampler                                        # noqa: E402

# bytes of shared memory one block may use (CUDA programming guide, compute capabilities table)
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}
# bytes a bf16 binary (the GPU's training and rollout dtype) may spill before it is a problem: the tables'
# layouts (not yet tuned on a GPU) spill a few bytes in some kernels (at most 192 B); a layout that does
# not fit a program (MLA's 576-dim head in 64 rows, padded to 1024) spills kilobytes. fp32 binaries (the
# CPU's dtype; on a GPU the bf16 layouts serve them too) are reported, not failed.
SPILL_BUDGET = 256


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kw)` records the launch, runs nothing."""

    def __init__(self, fn: JITFunction, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        def launch(*args, **kw):
            for axis, g in enumerate(grid):
                if not 0 < g < (2**31 if axis == 0 else 65536):
                    raise ValueError(f"{self.fn.__name__}: grid {grid} is outside CUDA's limits")
            if kw.get("enable_fp_fusion") is not False:         # every launch passes kernels_triton.LAUNCH
                raise ValueError(f"{self.fn.__name__} launched without enable_fp_fusion=False (**LAUNCH)")
            self.launches.append((self.fn, args, kw))
            if self.fn.__name__ == "_sample_pick_kernel":   # its tokens feed the next step's embedding:
                args[4].zero_()                              # a valid id (token 0), not empty memory
        return launch


class intercept:
    """`with intercept() as launches:` replaces every kernel of the Triton backend by a Recorder."""

    def __enter__(self):
        self.launches: list = []
        self.originals = [(mod, n, f) for mod in (kt, ktm, ktv, ktg) for n, f in vars(mod).items()
                          if isinstance(f, JITFunction) and n.endswith("_kernel")]
        for mod, name, fn in self.originals:
            setattr(mod, name, Recorder(fn, self.launches))
        return self.launches

    def __exit__(self, *exc):
        for mod, name, fn in self.originals:
            setattr(mod, name, fn)


def make_model(dtype: torch.dtype) -> Transformer:
    """Qwen3-30B-A3B layer shapes (they set the tiles and constexprs), with two layers (one dense, one
    MoE), four experts and a small vocabulary: those sizes are runtime arguments, not constexprs."""
    kw = ModelConfig.preset("qwen3-30b-a3b").__dict__ | dict(
        num_hidden_layers=2, mlp_only_layers=[0], num_experts=4, num_experts_per_tok=2,
        vocab_size=4096, intermediate_size=1024)
    return Transformer(ModelConfig(**kw)).to(dtype)


def new_attention(dtype: torch.dtype, H: int, KVH: int, D: int, sinks: bool, window: int) -> None:
    """paged_attention's launches for another attention geometry: the trainer's forward and backward
    (T = 40) and a decode step of two 4096-key sequences (its key splits in parallel). gpt-oss-20b's
    sliding layers: 64 query heads over 8 KV heads of 64 dims, sinks, a window of 128."""
    s = torch.zeros(H, requires_grad=True) if sinks else None
    q = torch.randn(2, 40, H, D, dtype=dtype, requires_grad=True)
    kv = torch.randn(6, 16, KVH, D, dtype=dtype, requires_grad=True)
    out = kernels.paged_attention(q, kv, kv, torch.arange(6).view(2, 3), torch.arange(40).expand(2, 40), D ** -0.5,
                                  sinks=s, window=window)
    out.float().sum().backward()
    with torch.no_grad():
        kernels.paged_attention(torch.randn(2, 1, H, D, dtype=dtype), *[torch.randn(512, 16, KVH, D, dtype=dtype)] * 2,
                                torch.arange(512).view(2, 256), torch.full((2, 1), 4095), D ** -0.5,
                                sinks=None if s is None else s.detach(), window=window)


def gpt_oss_experts(dtype: torch.dtype) -> None:
    """The fused MoE's launches with gpt-oss-20b's experts (2880 wide, biases, the clamped SwiGLU), forward
    and backward."""
    E, D, I = 4, 2880, 2880
    w13 = torch.randn(E, 2 * I, D, dtype=dtype, requires_grad=True)
    w2 = torch.randn(E, D, I, dtype=dtype, requires_grad=True)
    b13, b2 = torch.zeros(E, 2 * I, dtype=dtype, requires_grad=True), torch.zeros(E, D, dtype=dtype, requires_grad=True)
    x = torch.randn(40, D, dtype=dtype, requires_grad=True)
    weights = torch.rand(40, 4, requires_grad=True)
    ids = torch.stack([torch.randperm(E)[:4] for _ in range(40)])
    kernels.moe_experts(x, w13, w2, ids, weights, b13=b13, b2=b2, swiglu=(1.702, 7.0)).float().sum().backward()


def mla_model(dtype: torch.dtype) -> Transformer:
    """Moonlight-16B-A3B's attention (MLA: a 512-wide latent and a 64-wide RoPE key per token, 16 heads of
    128 + 64 query dims, values of 128) in two layers (one dense, one MoE of four experts)."""
    kw = ModelConfig.preset("moonlight-16b-a3b").__dict__ | dict(
        num_hidden_layers=2, first_k_dense_replace=1, num_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        vocab_size=4096, intermediate_size=1024)
    return Transformer(ModelConfig(**kw)).to(dtype)


def mla_launches(dtype: torch.dtype) -> None:
    """The MLA model's trainer forward and backward and the sampler's prefill and decode steps."""
    model = mla_model(dtype)
    logp, _ = model.score(torch.randint(0, 4096, (2, 40)), temperature=0.7)
    logp.float().sum().backward()
    with torch.no_grad():
        rollout(model, [23, 5], 2, 16)


def gdn_launches() -> None:
    """Qwen3.5-MoE's Gated DeltaNet chunk (hybrids/gdn_triton.py: 128 key and value dims a head, fp32 in
    any compute dtype): about a minute and a half of ptxas, so only with --gdn."""
    q = torch.randn(1, 2, 64, 128)
    ktg.chunk_forward(q, q, q, q[..., 0], q[..., 0], torch.randn(1, 2, 128, 128))


def trainer_forward(model, B, T):
    """model.score on (B, T) tokens: the trainer's forward (and the reference log-probs)."""
    model.score(torch.randint(0, model.config.vocab_size, (B, T)), temperature=0.7)


def rollout(model, prompt_lengths, n, block_size):
    """The real sampler: prefill, then two decode steps (tokens drawn from whatever the intercepted
    kernels left in their outputs: only the launches matter here)."""
    prompts = [torch.randint(0, model.config.vocab_size, (L,)).tolist() for L in prompt_lengths]
    Sampler(model, block_size=block_size, num_blocks=64, max_batch_size=8).generate(
        prompts, max_new_tokens=3, n=n, temperature=0.7, progress=False)


# Batch geometries whose forwards must run the very same binaries, call site by call site. Each
# sampler step runs one forward (the same launches as score: layers, LM head, log-probs).
GEOMETRIES = {
    "trainer B=2 T=40": lambda m: trainer_forward(m, 2, 40),
    "trainer B=1 T=17": lambda m: trainer_forward(m, 1, 17),
    "sampler 3 prompts x 2, pages of 16": lambda m: rollout(m, [23, 5, 40], 2, 16),
    "sampler 1 prompt, pages of 32": lambda m: rollout(m, [37], 1, 32),
}


def compile_launch(fn: JITFunction, args, kw, arch: int):
    """Compile one launch for cuda sm_<arch> the way JITFunction.run specializes it; returns the kernel."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kw = dict(kw, debug=False)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound_args, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def resources(cubin: bytes) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of a cubin, from the cuobjdump that ships with Triton (ptxas puts
    spilled registers in the STACK frame)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in (f.split(":") for f in line.split() if ":" in f and f.split(":")[1].isdigit())}


def spec_key(fn: JITFunction, args, kw, free=()) -> tuple:
    """What selects the compiled binary of a launch: Triton's specialization of every argument + options,
    leaving out the parameters and options named in `free`."""
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    spec = [s for p, s in zip(fn.params, binder(*args, **kw)[1]) if p.name not in free]
    return fn.__name__, repr(spec), tuple(sorted((k, v) for k, v in kw.items() if k not in free))


# The one-binary rule: the binaries of a call site differ only in what leaves the K order alone. For
# the matmul that is its tile config, chosen by M bucket (kernels_triton.MM_TABLE: the K loop runs
# whole and in order in every config, and a CUDA test shows the bits equal); everything else, and
# every other kernel, must be one binary.
FREE = {"_matmul_kernel": kt.MM_TILE_ARGS}
SAMPLING = ("_sample_segments_kernel", "_sample_pick_kernel")


def check_geometries(model) -> tuple[list[str], int]:
    """Each forward call site must get the same binary in every batch geometry; returns the violations
    and the number of forwards compared."""
    runs = {}
    with torch.no_grad(), kernels.set_backend("triton"):
        for name, run in GEOMETRIES.items():
            with intercept() as launches:
                run(model)
            runs[name] = launches
    # the sampler's token draws (after each of its forwards) are not part of the forward; their call
    # sites must get one binary across every sampler geometry too
    sampling = [launch for launches in runs.values() for launch in launches if launch[0].__name__ in SAMPLING]
    runs = {name: [la for la in launches if la[0].__name__ not in SAMPLING] for name, launches in runs.items()}
    (ref_name, ref), problems, n_forwards = next(iter(runs.items())), [], 0
    for kernel in SAMPLING:
        keys = {spec_key(*la) for la in sampling if la[0].__name__ == kernel}
        if len(keys) > 1:
            problems.append(f"{kernel} compiles {len(keys)} binaries across the sampler geometries")
    for name, launches in runs.items():
        forwards = [launches[i:i + len(ref)] for i in range(0, len(launches), len(ref))]
        n_forwards += len(forwards)
        if name.startswith("sampler") and len(forwards) < 3:
            problems.append(f"{name}: {len(forwards)} forwards, expected prefill + 2 decode steps")
        for f, fwd in enumerate(forwards):
            if [fn.__name__ for fn, _, _ in fwd] != [fn.__name__ for fn, _, _ in ref]:
                problems.append(f"{name}: forward {f} launches other kernels than {ref_name}")
                continue
            for i, (a, b) in enumerate(zip(fwd, ref)):
                free = FREE.get(a[0].__name__, ())
                if spec_key(*a, free) != spec_key(*b, free):
                    problems.append(f"{name}: forward {f} call {i} ({a[0].__name__}) compiles another binary "
                                    f"than in {ref_name}:\n    {spec_key(*a, free)[1]}\n    {spec_key(*b, free)[1]}")
    return problems, n_forwards


def compile_row(name: str, launch, arch: int, rows: list, problems: list) -> None:
    """Compile one distinct launch for sm_`arch`: its table row (registers, shared memory, spilled bytes, the
    tensor-core instruction) into rows, what is wrong with it (a failure, over the shared-memory limit, a bf16
    binary spilling past SPILL_BUDGET) into problems."""
    fn, a, kw = launch
    consts = {k: v for k, v in kw.items() if k != "enable_fp_fusion"}
    dt = next(str(x.dtype).removeprefix("torch.") for x in a if isinstance(x, torch.Tensor))
    try:
        k = compile_launch(fn, a, kw, arch)
    except Exception as e:                                              # report every failure, then fail
        problems.append(f"{name} sm_{arch} {dt} {consts}: {type(e).__name__}: {str(e)[:300]}")
        rows.append((name, f"sm_{arch}", dt, str(consts), "FAILED"))
        return
    res, shared = resources(k.asm["cubin"]), k.metadata.shared
    bad = []
    if shared > SHARED_LIMIT.get(arch, 99 * 1024):
        bad.append(f"shared {shared} B > {SHARED_LIMIT.get(arch, 99 * 1024)} B")
    spilled = res.get("STACK", 0) + res.get("LOCAL", 0)
    if spilled > (SPILL_BUDGET if dt == "bfloat16" else 1 << 30):
        bad.append(f"spills {spilled} B (stack and local memory; the bf16 budget is {SPILL_BUDGET} B)")
    problems += [f"{name} sm_{arch} {dt} {consts}: {b}" for b in bad]
    mma = next((m for m in ("tcgen05.mma", "wgmma", "mma.sync") if m in k.asm["ptx"]), "-")   # tensor-core instruction
    rows.append((name, f"sm_{arch}", dt, str(consts), f"{res['REG']}", f"{shared}", f"{spilled}", mma))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[90], help="CUDA compute capabilities (default 90)")
    ap.add_argument("--control", action="store_true",
                    help="only the geometry check, with the matmul's row count specialized again: must report problems")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), nargs="+", default=["bfloat16", "float32"],
                    help="the compute dtypes whose binaries are compiled (default both)")
    ap.add_argument("--gdn", action="store_true", help="also the hybrids' Gated DeltaNet chunk kernel (fp32)")
    args = ap.parse_args()
    t0 = time.time()
    if args.control:     # shows the geometry check can fail: M == 1 (decode) then compiles its own binary
        kt._matmul_kernel = triton.jit(kt._matmul_kernel.fn)
        problems, _ = check_geometries(make_model(torch.float32))
        print("\n".join(problems) or "no problem found")
        return 1 if problems else 0
    rows, problems, launches, n_forwards = [], [], {}, 0
    for dtype in [getattr(torch, name) for name in args.dtype]:
        model = make_model(dtype)
        found, n = check_geometries(model)
        problems += [f"{dtype}: {p}" for p in found]
        n_forwards += n
        with kernels.set_backend("triton"), intercept() as recorded:
            for run in GEOMETRIES.values():
                with torch.no_grad():
                    run(model)
            logp, _ = model.score(torch.randint(0, model.config.vocab_size, (2, 40)), temperature=0.7)
            logp.float().sum().backward()                                  # the trainer's backward
            with torch.no_grad():
                model.score(torch.randint(0, 4096, (2, 9)), temperature=1.0)     # unscaled log-probs
                # at Qwen's vocabulary (19 segments: the per-row combines compile for 32 segments)
                kernels.token_logprobs(torch.randn(2, 9, 151936, dtype=dtype), torch.randint(0, 151936, (2, 9)),
                                       0.7, with_entropy=True)                  # log-probs + entropy
                kernels.sample_tokens(torch.randn(2, 151936, dtype=dtype), 1.0, 1.0, 0, torch.rand(2, dtype=torch.float64))
                # a decode step of two 4096-key sequences: few programs, so the key splits run in parallel
                cfg = model.config
                kernels.paged_attention(torch.randn(2, 1, cfg.num_attention_heads, cfg.head_dim, dtype=dtype),
                                        *[torch.randn(512, 16, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)] * 2,
                                        torch.arange(512).view(2, 256), torch.full((2, 1), 4095), cfg.head_dim ** -0.5)
            new_attention(dtype, 64, 8, 64, sinks=True, window=128)                # gpt-oss-20b's sliding layers
            gpt_oss_experts(dtype)
            mla_launches(dtype)                                                 # Moonlight-16B-A3B's MLA
        for launch in recorded:
            launches.setdefault(spec_key(*launch), launch)
    if args.gdn:
        with intercept() as recorded:
            gdn_launches()
        launches.update((spec_key(*launch), launch) for launch in recorded)
    for (name, _, _), launch in launches.items():
        for arch in args.arch:
            compile_row(name, launch, arch, rows, problems)
    head = ("kernel", "arch", "dtype", "constexprs", "regs", "shared B", "spilled B", "mma")
    widths = [max(len(r[i]) for r in rows + [head] if len(r) > i) for i in range(len(head))]
    for r in [head] + sorted(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    spills = [r for r in rows if len(r) > 6 and r[6] != "0"]
    print(f"\n{len(spills)} binaries spill: {sum(r[2] == 'bfloat16' for r in spills)} bf16 (at most "
          f"{max([int(r[6]) for r in spills if r[2] == 'bfloat16'], default=0)} B), the rest fp32 (at most "
          f"{max([int(r[6]) for r in spills if r[2] != 'bfloat16'], default=0)} B)")
    for p in problems:
        print("PROBLEM:", p)
    print(f"\ncompile_check: {len(rows)} binaries compiled for {', '.join(f'sm_{a}' for a in args.arch)}; "
          f"{len(GEOMETRIES)} batch geometries ({n_forwards} forwards) share each forward binary: {'no' if any('binary' in p for p in problems) else 'yes'}; "
          f"{len(problems)} problem(s); {time.time() - t0:.0f}s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
