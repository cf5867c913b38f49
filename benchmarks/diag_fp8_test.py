"""Diagnostic for the H200: the fp8 case of test_every_common_choice_compiles_and_is_correct that
fails inside pytest (decode, block_n 64, head_dim 64) although diag_fp8.py passes the same data.
Runs the test's own body for the fp8 cases in order and reports where NaN codes first appear:
after _fp8_cache (kv_append), or after the kernel."""

import sys

import torch

sys.path.insert(0, "tests")
import test_kernels_cuda as T  # noqa: E402


def nan_codes(name, x):
    c = x.view(torch.uint8)
    bad = ((c & 0x7F) == 0x7F).nonzero()
    if bad.shape[0]:
        print(f"  {name}: {bad.shape[0]} NaN codes, first {bad[:4].tolist()}", flush=True)
    return bad.shape[0]


orig_cache, orig_decode = T._fp8_cache, T.paged_decode


def cache(*a, **k):
    r = orig_cache(*a, **k)
    torch.cuda.synchronize()
    finite = bool(torch.isfinite(r[3]).all() and torch.isfinite(r[4]).all())
    print(f"  after _fp8_cache{a}: nan codes k/v", nan_codes("k", r[1]), nan_codes("v", r[2]),
          "scales finite", finite)  # fmt: skip
    return r


def decode(q, kc, vc, *a, **k):
    out = orig_decode(q, kc, vc, *a, **k)
    torch.cuda.synchronize()
    print("  after paged_decode: nan codes k/v", nan_codes("k", kc), nan_codes("v", vc),
          "q finite", bool(torch.isfinite(q).all()))  # fmt: skip
    return out


T._fp8_cache, T.paged_decode = cache, decode
for phase, launch, d, dt in T._gpu_choices():
    if dt != torch.uint8 or phase != "decode":
        continue
    print(phase, d, launch, flush=True)
    try:
        T.test_every_common_choice_compiles_and_is_correct(phase, launch, d, dt)
        print("  passed")
    except AssertionError as e:
        print("  FAILED", str(e).splitlines()[0])
