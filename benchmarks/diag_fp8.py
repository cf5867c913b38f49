"""Diagnostic for the H200: fp8 prefill through every tile choice at head_dim 64 gave NaN in both
the kernel and the float64 reference (2026-11-29). Prints where non-finite values first appear."""

import sys

import torch

sys.path.insert(0, "tests")
from oxygen_torch.triton_kernels import paged_prefill  # noqa: E402
from oxygen_torch.triton_kernels.reference import paged_prefill_ref  # noqa: E402
from test_kernels_cuda import _fp8_cache  # noqa: E402

for d in (64, 128):
    p, kc, vc, ks, vs, (k, v, slots) = _fp8_cache([300, 129], 16, hkv=4, d=d, seed=15)
    codes_k, codes_v = kc.view(torch.uint8), vc.view(torch.uint8)
    used = p.block_table[p.block_table < kc.shape[0]].unique().long()
    print(
        f"d={d} nan codes k={int(((codes_k & 0x7F) == 0x7F).sum())} "
        f"v={int(((codes_v & 0x7F) == 0x7F).sum())}; "
        f"k/v finite inputs {bool(torch.isfinite(k).all())}/{bool(torch.isfinite(v).all())}; "
        f"scales>0 in used blocks {int((ks[used] > 0).sum())}/{ks[used].numel()}, "
        f"nonfinite scales {int((~torch.isfinite(ks)).sum())}"
    )
    print(
        "  decoded finite:",
        bool(torch.isfinite(kc[used].float()).all()),
        bool(torch.isfinite(vc[used].float()).all()),
    )
    cu = torch.tensor([0, 200, 329], dtype=torch.int32, device="cuda")
    q = torch.randn(329, 28, d, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    paged_prefill(q, kc, vc, p.block_table, cu, p.seq_lens, out=out, k_scale=ks, v_scale=vs)
    ref = paged_prefill_ref(
        q.double(), kc, vc, p.block_table, cu, p.seq_lens, k_scale=ks, v_scale=vs
    )
    bad_o = (~torch.isfinite(out)).nonzero()
    bad_r = (~torch.isfinite(ref)).nonzero()
    print(
        f"  out nonfinite {bad_o.shape[0]} first {bad_o[:3].tolist()}; "
        f"ref nonfinite {bad_r.shape[0]} first {bad_r[:3].tolist()}"
    )
