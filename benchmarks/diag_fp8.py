"""Diagnostic for the H200: fp8 decode and prefill through the explicit launch configs the tiling
rule picks at head_dim 64 gave NaN in both the kernel and the float64 reference (2026-11-29).
For each case: are the caches and scales finite before the kernel, after it, and is the output?
Run it under `compute-sanitizer --tool memcheck` to see an out-of-bounds access."""

import sys

import torch

sys.path.insert(0, "tests")
from oxygen_torch.triton_kernels import paged_decode, paged_prefill  # noqa: E402
from test_kernels_cuda import _fp8_cache, _gpu_choices  # noqa: E402


def finite(*ts) -> str:
    return "/".join(str(bool(torch.isfinite(t.float()).all())) for t in ts)


for phase, launch, d, dt in _gpu_choices():
    if dt != torch.uint8:
        continue
    p, kc, vc, ks, vs, _ = _fp8_cache([300, 129], 16, hkv=4, d=d, seed=15)
    used = p.block_table[p.block_table < kc.shape[0]].unique().long()
    before = finite(kc[used], vc[used], ks, vs)
    if phase == "decode":
        q = torch.randn(2, 28, d, device="cuda", dtype=torch.bfloat16)
        out = torch.full_like(q, float("nan"))
        paged_decode(q, kc, vc, p.block_table, p.seq_lens, out=out, k_scale=ks, v_scale=vs,
                     launch=launch)  # fmt: skip
    else:
        cu = torch.tensor([0, 200, 329], dtype=torch.int32, device="cuda")
        q = torch.randn(329, 28, d, device="cuda", dtype=torch.bfloat16)
        out = torch.full_like(q, float("nan"))
        paged_prefill(q, kc, vc, p.block_table, cu, p.seq_lens, out=out, k_scale=ks, v_scale=vs,
                      launch=launch)  # fmt: skip
    torch.cuda.synchronize()
    after = finite(kc[used], vc[used], ks, vs)
    bad = (~torch.isfinite(out)).nonzero()
    print(f"{phase} d={d} {launch}: inputs finite before {before} after {after}; "
          f"out nonfinite {bad.shape[0]} first {bad[:2].tolist()}", flush=True)  # fmt: skip
