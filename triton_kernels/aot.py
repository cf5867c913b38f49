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

import re

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
