"""Compile a kernel for the H200 (sm_90) without a GPU, and count what its PTX does.

Triton's whole pipeline (TTIR, TTGIR, LLVM IR, PTX, then ptxas to a cubin) runs on any machine
for an explicit target. The CPU interpreter runs kernels as Python, so a kernel the GPU compiler
refuses still passes every interpreter test. `compile_sm90` catches that, and `ptx_counts`
shows instructions that explain a kernel's speed before a device is involved: byte-wise shared
loads, `cp.async` widths, `ldmatrix`, `wgmma` against `mma.sync`.

Call it in a process where TRITON_INTERPRET is unset: under the interpreter, `@triton.jit`
builds interpreted functions, which cannot be compiled.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)
FLOAT_ARGS = ("qk_scale", "factor")  # the float scalars of oxygen's kernels

# What ptx_counts reports: name -> regex over the PTX text.
PTX_PATTERNS = {
    "ld.shared.b8": r"ld\.shared\.b8\b",  # one byte per shared load: 8-bit tiles re-laid out
    "ldmatrix": r"\bldmatrix\.",
    "cp.async.cg (16 B)": r"cp\.async\.cg\.",
    "cp.async.ca (4/8 B)": r"cp\.async\.ca\.",
    "ld.global.v4": r"ld\.global[a-z0-9.:]*\.v4\.",
    "wgmma": r"\bwgmma\.mma_async",
    "mma.sync": r"\bmma\.sync",
    "cvt": r"\bcvt\.",
}


def compile_sm90(fn, pointers: dict, constexprs: dict, *, num_warps=4, num_stages=3, target=SM90):
    """`fn` (a @triton.jit kernel) compiled for `target`, as a launch would specialise it:
    pointers and strides (arguments named *_ptr / stride*) divisible by 16. `pointers` maps each
    pointer argument to its Triton type ("*bf16", "*u8", ...); other non-constexpr arguments are
    i32, except the float scalars in FLOAT_ARGS."""
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise TypeError(
            f"{getattr(fn, '__name__', fn)!r} is not a compilable JIT function (is "
            "TRITON_INTERPRET set in this process?)"
        )
    names = list(fn.arg_names)
    unknown = (set(pointers) | set(constexprs)) - set(names)
    if unknown:
        raise ValueError(f"not arguments of {fn.__name__}: {sorted(unknown)}")
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            if n not in pointers:
                raise ValueError(f"{fn.__name__}: give the Triton type of pointer {n!r}")
            sig[n] = pointers[n]
        else:
            sig[n] = "fp32" if n in FLOAT_ARGS else "i32"
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    return triton.compile(
        src, target=target, options=dict(num_warps=num_warps, num_stages=num_stages)
    )


def ptx_counts(compiled) -> dict[str, int]:
    """How often each PTX_PATTERNS instruction appears in a compiled kernel's PTX."""
    ptx = compiled.asm["ptx"]
    return {name: len(re.findall(rx, ptx)) for name, rx in PTX_PATTERNS.items()}


def sass(compiled) -> str:
    """The kernel's SASS (nvdisasm, bundled with Triton, on the cubin)."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "nvdisasm")  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def longest_loop(compiled) -> list[str]:
    """The SASS instructions of the kernel's longest loop body (the span of its longest
    backward branch): where a kernel spends its issue slots per tile."""
    labels: dict[str, int] = {}
    ins: list[str] = []
    for line in sass(compiled).splitlines():
        m = re.match(r"^(\.L\w+):", line.strip())
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(.*?);", line)
        if m:
            ins.append(m.group(1))
    best: list[str] = []
    for i, text in enumerate(ins):
        m = re.search(r"BRA\s+(?:`\()?(\.L\w+)", text)
        if m and labels.get(m.group(1), i) < i and i + 1 - labels[m.group(1)] > len(best):
            best = ins[labels[m.group(1)] : i + 1]
    return best


def decode_report() -> list[str]:
    """The paged decode kernel's main loop at D=128 (GQA 4, block_tokens 16), bf16 at its
    tiles against fp8 at 128 keys and 8 warps (the rule's until 2026-12-05; it takes 64 keys
    and 4 warps now), codes as int32 words and as bytes:
    instructions a warp a loop, per element a lane, the PTX's byte loads."""
    import importlib

    kernel = importlib.import_module(__package__ + ".paged_decode")._decode_kernel
    lines = []
    for name, fp8, bn, warps in (("bf16", 0, 64, 4), ("fp8 words", 1, 128, 8),
                                 ("fp8 bytes", 2, 128, 8)):  # fmt: skip
        kv = "*u8" if fp8 else "*bf16"
        ptrs = dict(q_ptr="*bf16", k_ptr=kv, v_ptr=kv, ks_ptr="*fp32", vs_ptr="*fp32",
                    bt_ptr="*i32", lens_ptr="*i32", out_ptr="*bf16", po_ptr="*fp32",
                    pml_ptr="*fp32")  # fmt: skip
        consts = dict(HEAD_DIM=128, D_PAD=128, BLOCK_G=16, BLOCK_N=bn, BLOCK_TOKENS=16, FP8=fp8,
                      PRECISION=1, HALF_ACC=False, SPLIT=True)  # fmt: skip
        c = compile_sm90(kernel, ptrs, consts, num_warps=warps)
        loop = longest_loop(c)
        per_elem = len(loop) * warps * 32 / (bn * 128 * 2)  # K and V elements of a tile
        lines.append(f"{name}: block_n {bn}, {warps} warps: loop {len(loop)} instructions a "
                     f"warp, {per_elem:.2f} a K/V element a lane, ld.shared.b8 "
                     f"{ptx_counts(c)['ld.shared.b8']}")  # fmt: skip
    return lines


if __name__ == "__main__":  # python -m oxygen_torch.triton_kernels.aot (no TRITON_INTERPRET)
    print("\n".join(decode_report()))
