"""Paged attention on the H200 beside its anchors, all in one run and with one timer.

bf16, 32 query heads, 8 KV heads, head dim 128, block_tokens 16 and 64 (shuffled block tables).
Per case: our kernel, SDPA cuDNN and flash on contiguous K/V (enable_gqa), compiled
FlexAttention, and a plain copy moving the same bytes (the ceiling). Decode is reported in TB/s
of K+V read, prefill in causal TFLOP/s. Beside them: fp8 KV decode and prefill, a skewed decode
batch (one 32k sequence with 31 of 512), and last generate()'s time to first token after
enable() against stock (bench_ttft.py; --no-ttft skips it). Every time is do_bench's median
over replays of a CUDA graph of the call (L2 flushed before each), so it is the GPU's time; our
decode rows also print the host's launch time a call (outside a graph, a step pays it a layer).
Then: the error of every precision mode against float64, and a small sweep of decode launch
choices (bounded by the time left) to feed the tiling rule.

    python benchmarks/bench_attention.py [--no-flex] [--no-sweep]     # OUT=dir: json + md there
    python benchmarks/bench_attention.py --prefill-only --no-flex --no-ttft --prefix-prefill \
        --prefill-sweep                                 # issue 34 goal 3: prefill paths only
    python benchmarks/bench_attention.py --cpu-errors   # only the error table, CPU interpreter
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time

if "--cpu-errors" in sys.argv:  # the Triton interpreter must be on before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F
import triton
from oxygen_torch.triton_kernels import (
    LaunchConfig,
    PrecisionMode,
    kv_append,
    paged_decode,
    paged_decode_ref,
    paged_prefill,
    paged_prefill_ref,
)
from oxygen_torch.triton_kernels.paged_decode import (
    _num_sms,
    balance_target,
    balanced_chunks,
    decode_launch,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from oxygen_torch.tools.progress import progress

HQ, HKV, D = 32, 8, 128
DECODE = [(32, 4096), (64, 1024), (8, 32768), (1, 32768)]
PREFILL = [(4, 4096), (1, 16384)]
FP8_CASES = ((32, 4096), (8, 32768))  # fp8 KV decode beside the bf16 one
# skewed decode batches (n_long rows of `long` tokens beside n_short of `short`): one 32k row
# beside 31 of 512 (issue 17's case), two 16k rows beside 62 of 256, four 8k beside 60 of 1k
SKEWED = ((1, 32768, 31, 512), (2, 16384, 62, 256), (4, 8192, 60, 1024))
BLOCK_TOKENS = (16, 64)
ERR_SHAPE, ERR_NEW = (4, 4096, 16), 512  # (batch, seq_len, block_tokens), new tokens (prefill)
BUDGET_S = 225  # the whole run stays under ~4 minutes; optional parts stop when it is spent
T0 = time.perf_counter()
BF16 = torch.bfloat16
DEV = "cuda"  # a CPU smoke run of this script's logic swaps it (with the Triton interpreter)
ROWS: list[dict] = []


def elapsed() -> float:
    return time.perf_counter() - T0


def bench(fn) -> float:
    """GPU ms of one call: do_bench's median over replays of a CUDA graph of the call (L2
    flushed before each), so the time is the kernels' and not the host's launch (H200,
    2026-12-05: timed eagerly, a decode call of ~0.06 ms of kernels read 0.23 ms, the host's
    Python and launches outrunning the flush). A call that cannot be captured is timed eagerly."""
    if DEV != "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # say so: an eager time may hold the host's launch
        print(f"  (not captured, timed eagerly: {type(e).__name__}: {e})"[:160], flush=True)
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")


def host_us(fn, calls=50) -> float:
    """The host's time to launch one call (µs), the GPU's queue not waited for: what a
    decode step outside a CUDA graph pays per layer."""
    sync = torch.cuda.synchronize if DEV == "cuda" else lambda: None
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = (time.perf_counter() - t0) / calls * 1e6
    sync()
    return dt


def rel_err(out, ref) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def row(case, impl, ms, work, unit, err=None, note=""):
    """work: bytes (decode, TB/s) or FLOPs (prefill, TFLOP/s)."""
    value = work / (ms * 1e-3) / 1e12 if ms else None
    ROWS.append(dict(case=case, impl=impl, ms=ms, value=value, unit=unit, err=err, note=note))
    shown = f"{ms:8.3f} ms {value:7.2f} {unit}" if ms else f"{'-':>8}    {'-':>7} {unit}"
    print(f"{case:28s} {impl:26s} {shown}  {'' if err is None else f'err {err:.1e}'} {note}",
          flush=True)  # fmt: skip


def paged_from_contiguous(x, bt, perm):
    """x: [B, Hkv, L, D] -> cache [B*L/bt, bt, Hkv, D] with blocks stored at perm; the table
    [B, L/bt] int32 maps each sequence's logical blocks to them."""
    b, h, n, d = x.shape
    blocks = x.transpose(1, 2).reshape(b * n // bt, bt, h, d)
    cache = torch.empty_like(blocks)
    cache[perm] = blocks
    return cache


def shuffled_table(b, n, bt, gen):
    perm = torch.randperm(b * n // bt, generator=gen, device=DEV)
    return perm, perm.view(b, n // bt).to(torch.int32)


def anchors(case, q, k, v, causal, work, unit, our_out=None):
    """SDPA cuDNN / flash, compiled Flex and the copy ceiling on contiguous [B, H, S, D]; in
    prefill cases also SDPA unpinned (the backend torch picks itself, what kv/fresh.py's dense
    path gets: it does not pin one, sdpa_kernel's flags being process-wide)."""
    ref = None
    if causal:
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        fn()
        row(case, "sdpa (torch's choice)", bench(fn), work, unit)
    for name, backend in (("sdpa cuDNN", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa flash", SDPBackend.FLASH_ATTENTION)):  # fmt: skip
        try:
            with sdpa_kernel(backend):
                fn = lambda: F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, enable_gqa=True
                )
                out = fn()
                ms = bench(fn)
            ref = out if ref is None else ref
            row(case, name, ms, work, unit)
        except Exception as e:  # a backend may not take this shape: say so, keep going
            row(case, name, None, work, unit, note=f"failed: {type(e).__name__}: {e}"[:120])
    if ARGS.flex and elapsed() < BUDGET_S - 90:
        flex_row(case, q, k, v, causal, work, unit)
    else:
        row(case, "flex (compiled)", None, work, unit, note="skipped (time budget or --no-flex)")
    copy_src = k if unit == "TB/s" else torch.cat([k, v])
    dst = torch.empty_like(copy_src)
    # read + write of copy_src = the K+V bytes of the case (decode) / a bandwidth reference
    row(case, "copy (ceiling)", bench(lambda: dst.copy_(copy_src)), 2 * copy_src.nbytes, "TB/s")
    return ref


def flex_row(case, q, k, v, causal, work, unit):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    try:
        fa = torch.compile(flex_attention, dynamic=False)
        mask = None
        if causal:
            s = q.shape[2]
            mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, s, s, device=DEV)
        fn = lambda: fa(q, k, v, block_mask=mask, enable_gqa=True)
        fn()
        row(case, "flex (compiled)", bench(fn), work, unit)
    except Exception as e:
        row(case, "flex (compiled)", None, work, unit, note=f"failed: {type(e).__name__}"[:80])


def ours_decode(q3, kc, vc, table, lens, ref):
    """Our decode (the tiling rule's launch) on a paged case, run once: (the call, its launch
    choice, its splits, its error against ref [B, Hq, 1, D] or None)."""
    out = torch.empty_like(q3)
    fn = functools.partial(paged_decode, q3, kc, vc, table, lens, out=out)
    fn()
    cfg, _, splits = decode_launch(q3, kc, table, 0, PrecisionMode.AUTO_MIXED, None, None)
    err = rel_err(out, ref[:, :, 0]) if ref is not None else None
    return fn, cfg, splits, err


def decode_case(b, n, gen):
    case = f"decode B={b} L={n}"
    q = torch.randn(b, HQ, 1, D, device=DEV, dtype=BF16, generator=gen)
    k = torch.randn(b, HKV, n, D, device=DEV, dtype=BF16, generator=gen)
    v = torch.randn(b, HKV, n, D, device=DEV, dtype=BF16, generator=gen)
    nbytes = k.nbytes + v.nbytes
    ref = anchors(case, q, k, v, False, nbytes, "TB/s")
    q3 = q[:, :, 0].contiguous()  # [B, Hq, D]
    lens = torch.full((b,), n, dtype=torch.int32, device=DEV)
    for bt in BLOCK_TOKENS:
        perm, table = shuffled_table(b, n, bt, gen)
        kc, vc = paged_from_contiguous(k, bt, perm), paged_from_contiguous(v, bt, perm)
        fn, _, splits, err = ours_decode(q3, kc, vc, table, lens, ref)
        row(case, f"ours bt={bt}", bench(fn), nbytes, "TB/s", err,
            f"splits={splits}, host {host_us(fn):.0f} us a call")  # fmt: skip
        bf16_ms = ROWS[-1]["ms"]  # (the classic grid's: the fp8 rows' reference)
        balanced_row(case, fn, q3, kc, table, lens, bt, nbytes, ref)
        if (b, n) in FP8_CASES:
            fp8_case(q3, k, v, table, perm, lens, bt, ref, bf16_ms)


def balanced_row(case, classic_fn, q3, kc, table, lens, bt, nbytes, ref):
    """The same call in balanced mode (kernel.decode_balance): its time beside the classic
    row just printed, and the chunks it cut (the host mirror of the device's cut)."""
    classic_ms = ROWS[-1]["ms"]
    out = torch.empty_like(q3)
    fn = functools.partial(classic_fn, out=out, balance=True)
    fn()
    cfg, tiles_g, _ = decode_launch(q3, kc, table, 0, PrecisionMode.AUTO_MIXED, None, None)
    target = balance_target(kc.shape[2], tiles_g, _num_sms(q3.device))
    n = balanced_chunks(lens.tolist(), 1 << 30, table.shape[1] * bt, cfg.block_n, target)
    err = rel_err(out, ref[:, :, 0]) if ref is not None else None
    ms = bench(fn)
    ratio = f"{ms / classic_ms:.2f}x the classic time" if ms and classic_ms else ""
    row(case, f"ours balanced bt={bt}", ms, nbytes, "TB/s", err,
        f"chunks {sum(n)} (most a row {max(n)}), {ratio}")  # fmt: skip


def fp8_paged(k, v, table, bt, lens=None):
    """Contiguous k, v [B, Hkv, L, D] (the first lens[b] tokens of row b real; default all) ->
    fp8 e4m3 caches written by kv_append (per-block scales) at the blocks `table` [B, nblk]
    gives: (kc, vc, ks, vs)."""
    b, h, n, d = k.shape
    nb = int(table.max()) + 1
    kc = torch.zeros(nb, bt, h, d, device=DEV, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    ks, vs = torch.zeros(nb, h, device=DEV), torch.zeros(nb, h, device=DEV)
    lens = lens or [n] * b
    pos = [torch.arange(x, device=DEV) for x in lens]
    slots = torch.cat([table[i, p // bt].long() * bt + p % bt for i, p in enumerate(pos)])
    dt = BF16 if DEV == "cuda" else torch.float16
    k_tok = torch.cat([k[i, :, :x].transpose(0, 1) for i, x in enumerate(lens)]).to(dt)
    v_tok = torch.cat([v[i, :, :x].transpose(0, 1) for i, x in enumerate(lens)]).to(dt)
    kv_append(k_tok, v_tok, kc, vc, slots, k_scale=ks, v_scale=vs)  # [T, Hkv, D] token-major
    return kc, vc, ks, vs


def fp8_case(q3, k, v, table, perm, lens, bt, ref, bf16_ms):
    """fp8 e4m3 KV written by kv_append (per-block scales), decoded on the same case."""
    b, h, n, d = k.shape
    kc, vc, ks, vs = fp8_paged(k, v, table, bt)
    nbytes = kc.nbytes + vc.nbytes + ks.nbytes + vs.nbytes
    cfg, _, splits = decode_launch(q3, kc, table, 0, PrecisionMode.AUTO_MIXED, None, None)
    # the codes loaded as int32 words (the default) and as bytes (the earlier path) on the
    # rule's tiles (64 keys, 4 warps since 2026-12-05), words on 128-key tiles of 8 warps (the
    # rule's before: 0.54 ms against 0.38 on the H200 at B=8 L=32768) and on 32-key tiles
    variants = (
        ("words", dataclasses.replace(cfg, num_splits=splits)),
        ("bytes", dataclasses.replace(cfg, num_splits=splits, fp8_words=False)),
        ("words 128/8/3", LaunchConfig(cfg.block_m, 128, 8, 3, num_splits=splits)),
        ("words 32/4/4", LaunchConfig(cfg.block_m, 32, 4, 4, num_splits=splits)),
        # the next tile's codes loaded into registers while this one computes (fp8_prefetch)
        ("words prefetch", dataclasses.replace(cfg, num_splits=splits, fp8_prefetch=True)),
        ("bytes prefetch", dataclasses.replace(cfg, num_splits=splits, fp8_words=False,
                                               fp8_prefetch=True)),  # fmt: skip
        ("words prefetch 128/8/3",
         LaunchConfig(cfg.block_m, 128, 8, 3, num_splits=splits, fp8_prefetch=True)),
        ("words prefetch 2x splits",
         dataclasses.replace(cfg, num_splits=min(2 * splits, 1024), fp8_prefetch=True)),
    )  # fmt: skip
    for name, launch in variants:
        out = torch.empty_like(q3)
        fn = functools.partial(paged_decode, q3, kc, vc, table, lens, out=out, k_scale=ks,
                               v_scale=vs, launch=launch)  # fmt: skip
        fn()
        ms = bench(fn)
        err = rel_err(out, ref[:, :, 0]) if ref is not None else None
        row(f"decode B={b} L={n} fp8 KV", f"ours fp8 {name} bt={bt}", ms, nbytes, "TB/s", err,
            f"time vs bf16 = {ms / bf16_ms:.2f}x (goal <= 0.6)")  # fmt: skip


def prefill_case(b, s, gen, block_tokens=BLOCK_TOKENS, fp8=True):
    case = f"prefill B={b} S={s}"
    q = torch.randn(b, HQ, s, D, device=DEV, dtype=BF16, generator=gen)
    k = torch.randn(b, HKV, s, D, device=DEV, dtype=BF16, generator=gen)
    v = torch.randn(b, HKV, s, D, device=DEV, dtype=BF16, generator=gen)
    flops = 4 * b * HQ * s * s * D / 2  # causal: half of QK^T and PV
    ref = anchors(case, q, k, v, True, flops, "TFLOP/s")
    qt = q.transpose(1, 2).reshape(b * s, HQ, D).contiguous()  # [T, Hq, D]
    cu = torch.arange(0, b + 1, device=DEV, dtype=torch.int32) * s
    lens = torch.full((b,), s, dtype=torch.int32, device=DEV)
    for bt in block_tokens:
        perm, table = shuffled_table(b, s, bt, gen)
        kc, vc = paged_from_contiguous(k, bt, perm), paged_from_contiguous(v, bt, perm)
        out = torch.empty_like(qt)
        fn = functools.partial(paged_prefill, qt, kc, vc, table, cu, lens, out=out)
        fn()
        err = None
        if ref is not None:
            err = rel_err(out, ref.transpose(1, 2).reshape(b * s, HQ, D))
        row(case, f"ours bt={bt}", bench(fn), flops, "TFLOP/s", err)
        bf16_ms = ROWS[-1]["ms"]
        if not fp8:
            continue
        kc, vc, ks, vs = fp8_paged(k, v, table, bt)  # fp8 KV prefill: the same case over codes
        fn = functools.partial(paged_prefill, qt, kc, vc, table, cu, lens, out=out,
                               k_scale=ks, v_scale=vs)  # fmt: skip
        fn()
        err = rel_err(out, ref.transpose(1, 2).reshape(b * s, HQ, D)) if ref is not None else None
        ms = bench(fn)
        row(f"{case} fp8 KV", f"ours fp8 bt={bt}", ms, flops, "TFLOP/s", err,
            f"time vs bf16 = {ms / bf16_ms:.2f}x")  # fmt: skip


def skewed_case(gen, n_long, long_, n_short, short):
    """Long sequences beside many short ones in one decode batch. No SDPA call takes ragged
    lengths: the anchors run one call per length group, timed together; ours is one paged
    call over the ragged batch (the classic grid, then balanced mode)."""
    bt = 16
    lens = [long_] * n_long + [short] * n_short
    b = len(lens)
    case = f"decode skewed {n_long}x{long_}+{n_short}x{short}"
    q = torch.randn(b, HQ, 1, D, device=DEV, dtype=BF16, generator=gen)
    kv = [torch.randn(2, n, HKV, n_tok, D, device=DEV, dtype=BF16, generator=gen)
          for n, n_tok in ((n_long, long_), (n_short, short))]  # fmt: skip
    nbytes = sum(x.nbytes for x in kv)  # K + V read
    ref = None
    for name, backend in (("sdpa cuDNN", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa flash", SDPBackend.FLASH_ATTENTION)):  # fmt: skip
        fn = lambda: [F.scaled_dot_product_attention(qq, x[0], x[1], enable_gqa=True)
                      for qq, x in zip((q[:n_long], q[n_long:]), kv)]  # fmt: skip
        try:
            with sdpa_kernel(backend):
                out = torch.cat(fn())
                row(case, f"{name} (2 calls)", bench(fn), nbytes, "TB/s")
            ref = out if ref is None else ref
        except Exception as e:
            row(case, name, None, nbytes, "TB/s", note=f"failed: {type(e).__name__}"[:80])
    # ours: every sequence's blocks at shuffled places of one cache
    per_seq = [x[:, i].transpose(1, 2).reshape(2, -1, bt, HKV, D) for x in kv for i in
               range(x.shape[1])]  # fmt: skip
    blocks = torch.cat(per_seq, 1)  # [2, nblk, bt, Hkv, D]
    perm = torch.randperm(blocks.shape[1], generator=gen, device=DEV)
    cache = torch.empty_like(blocks)
    cache[:, perm] = blocks
    table = torch.zeros(b, long_ // bt, dtype=torch.int32, device=DEV)
    first = 0
    for i, n in enumerate(lens):
        table[i, : n // bt] = perm[first : first + n // bt].to(torch.int32)
        first += n // bt
    q3, seq_lens = q[:, :, 0].contiguous(), torch.tensor(lens, dtype=torch.int32, device=DEV)
    fn = functools.partial(paged_decode, q3, cache[0], cache[1], table, seq_lens)
    _, _, splits = decode_launch(q3, cache[0], table, 0, PrecisionMode.AUTO_MIXED, None, None)
    err = rel_err(fn(), ref[:, :, 0]) if ref is not None else None
    row(case, f"ours bt={bt}", bench(fn), nbytes, "TB/s", err, f"splits={splits}")
    balanced_row(case, fn, q3, cache[0], table, seq_lens, bt, nbytes, ref)
    src, dst = blocks[0], torch.empty_like(blocks[0])  # read + write of K = the K+V bytes
    row(case, "copy (ceiling)", bench(lambda: dst.copy_(src)), 2 * src.nbytes, "TB/s")


def precision_errors(gen, kinds=("bf16", "fp16", "fp8")):
    """Error of each mode against float64 computed from the same stored K/V (so it is the
    kernel's arithmetic, not the storage rounding): decode of B sequences of n tokens, prefill of
    their last ERR_NEW tokens."""
    out = []
    b, n, bt = ERR_SHAPE
    perm, table = shuffled_table(b, n, bt, gen)
    k = torch.randn(b, HKV, n, D, device=DEV, generator=gen)
    v = torch.randn(b, HKV, n, D, device=DEV, generator=gen)
    q = torch.randn(b * ERR_NEW, HQ, D, device=DEV, generator=gen)  # the last ERR_NEW tokens
    lens = torch.full((b,), n, dtype=torch.int32, device=DEV)
    cu = torch.arange(0, b + 1, device=DEV, dtype=torch.int32) * ERR_NEW
    for kv in kinds:
        dt = {"fp16": torch.float16, "fp32": torch.float32}.get(kv, BF16)
        caches = _error_caches(k, v, bt, perm, table, kv)
        modes = list(PrecisionMode)[:2] if kv == "fp8" else list(PrecisionMode)
        for mode in modes:
            qd = q.to(dt)
            for phase in ("decode", "prefill"):
                out.append(_one_error(phase, kv, mode, qd, caches, table, lens, cu))
    return out


def _error_caches(k, v, bt, perm, table, kv):
    if kv != "fp8":
        dt = {"fp16": torch.float16, "fp32": torch.float32}.get(kv, BF16)
        return (paged_from_contiguous(k.to(dt), bt, perm),
                paged_from_contiguous(v.to(dt), bt, perm), None, None)  # fmt: skip
    return fp8_paged(k, v, table, bt)


def _one_error(phase, kv, mode, q, caches, table, lens, cu):
    kc, vc, ks, vs = caches
    kw = dict(k_scale=ks, v_scale=vs)
    if phase == "decode":
        qd = q[ERR_NEW - 1 :: ERR_NEW].contiguous()  # one query per sequence
        out = paged_decode(qd, kc, vc, table, lens, precision=mode, **kw)
        ref = paged_decode_ref(qd.double(), kc, vc, table, lens, **kw)
    else:
        out = paged_prefill(q, kc, vc, table, cu, lens, precision=mode, **kw)
        ref = paged_prefill_ref(q.double(), kc, vc, table, cu, lens, **kw)
    diff = (out.double() - ref).abs()
    res = dict(phase=phase, kv=kv, mode=mode.name, max_rel=(diff.max() / ref.abs().max()).item(),
               mean_rel=(diff.mean() / ref.abs().mean()).item())  # fmt: skip
    print(f"error {phase:8s} kv={kv:5s} {mode.name:11s} max_rel {res['max_rel']:.2e} "
          f"mean_rel {res['mean_rel']:.2e}", flush=True)  # fmt: skip
    return res


SWEEP = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3),
         (32, 4, 4), (64, 8, 3)]  # fmt: skip


def sweep(gen):
    """Decode (block_n, warps, stages) x splits {auto, 2 x auto} at bt=16, while time is left."""
    best = {}
    for b, n in DECODE:
        k = torch.randn(b * n // 16, 16, HKV, D, device=DEV, dtype=BF16, generator=gen)
        v = torch.randn_like(k)
        _, table = shuffled_table(b, n, 16, gen)
        q = torch.randn(b, HQ, D, device=DEV, dtype=BF16, generator=gen)
        lens = torch.full((b,), n, dtype=torch.int32, device=DEV)
        _, _, auto = decode_launch(q, k, table, 0, PrecisionMode.AUTO_MIXED, None, None)
        for bn, warps, stages in SWEEP:
            for splits in sorted({auto, 2 * auto}):
                if elapsed() > BUDGET_S:
                    return best
                cfg = LaunchConfig(16, bn, warps, stages, num_splits=splits)
                fn = functools.partial(paged_decode, q, k, v, table, lens, launch=cfg)
                ms = bench(fn)
                tbs = 2 * k.nbytes / (ms * 1e-3) / 1e12
                print(f"sweep decode B={b} L={n} {cfg}: {ms:.3f} ms {tbs:.2f} TB/s", flush=True)
                key = f"decode B={b} L={n}"
                if key not in best or ms < best[key]["ms"]:
                    best[key] = dict(ms=ms, tbps=tbs, bn=bn, warps=warps, stages=stages,
                                     splits=splits)  # fmt: skip
    return best


# paged prefill (block_m, block_n, warps, stages): the rule's choice for bf16 D=128 first
PREFILL_SWEEP = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 2),
                 (64, 64, 4, 3), (64, 128, 4, 2), (128, 32, 8, 4), (128, 128, 4, 2)]  # fmt: skip


def prefill_sweep(gen):
    """Causal paged prefill (block_m, block_n, warps, stages) at block_tokens 16 and 64 (issue
    34's prefill at cuDNN speed: which tiles the rule should take on the H200)."""
    best = {}
    for b, s in PREFILL:
        q = torch.randn(b * s, HQ, D, device=DEV, dtype=BF16, generator=gen)
        k = torch.randn(b, HKV, s, D, device=DEV, dtype=BF16, generator=gen)
        v = torch.randn_like(k)
        cu = torch.arange(0, b + 1, device=DEV, dtype=torch.int32) * s
        lens = torch.full((b,), s, dtype=torch.int32, device=DEV)
        flops = 4 * b * HQ * s * s * D / 2
        for bt in BLOCK_TOKENS:
            perm, table = shuffled_table(b, s, bt, gen)
            kc, vc = paged_from_contiguous(k, bt, perm), paged_from_contiguous(v, bt, perm)
            for bm, bn, warps, stages in PREFILL_SWEEP:
                if elapsed() > BUDGET_S:
                    return best
                cfg = LaunchConfig(bm, bn, warps, stages)
                fn = functools.partial(paged_prefill, q, kc, vc, table, cu, lens, launch=cfg)
                try:
                    ms = bench(fn)
                except Exception as e:  # a tile that does not fit shared memory: say so, go on
                    print(f"sweep prefill B={b} S={s} bt={bt} {cfg}: {type(e).__name__}: "
                          f"{str(e)[:120]}", flush=True)  # fmt: skip
                    continue
                tf = flops / (ms * 1e-3) / 1e12
                print(f"sweep prefill B={b} S={s} bt={bt} {cfg}: {ms:.3f} ms {tf:.1f} TFLOP/s",
                      flush=True)  # fmt: skip
                key = f"prefill B={b} S={s} bt={bt}"
                if key not in best or ms < best[key]["ms"]:
                    best[key] = dict(ms=ms, tflops=tf, bm=bm, bn=bn, warps=warps, stages=stages)
    return best


# issue 34 goal 3 beyond the two square cases: fresh prompts shorter than the dense rule's 4,096
# (B, S), and prefill over a cached prefix (B, prefix tokens, new tokens): which path a step
# should take where SDPA's own backends can attend it
FRESH_SHORT = ((32, 1024), (8, 2048), (64, 512), (128, 256))
PREFIX = ((4, 3072, 1024), (32, 1024, 512), (1, 14336, 2048), (16, 4096, 256))


def prefix_prefill(gen):
    """--prefix-prefill: (1) fresh prompts of 256-2,048 tokens: SDPA cuDNN / flash (is_causal)
    beside our paged prefill (whether kv/fresh.py's dense rule should start below 4,096 tokens);
    (2) new tokens over a cached prefix: ours (the table over prefix + new) beside SDPA on
    contiguous K/V with the causal diagonal at the bottom right (flash through
    causal_lower_right, cuDNN through a boolean mask, the varlen flash entry where this torch
    has one), and the gather of the blocks into contiguous K/V that a dense path for cached
    prefixes would pay first."""
    from torch.nn.attention.bias import causal_lower_right

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    bt = 16
    for b, s in FRESH_SHORT:
        prefill_case(b, s, gen, block_tokens=(bt,), fp8=False)
        torch.cuda.empty_cache()
    for b, pre, new in PREFIX:
        if elapsed() > BUDGET_S:
            print(f"prefix prefill: budget spent before B={b} prefix={pre}", flush=True)
            return
        prefix_case(gen, b, pre, new, bt, varlen_attn, causal_lower_right)
        torch.cuda.empty_cache()


def prefix_case(gen, b, pre, new, bt, varlen_attn, causal_lower_right):
    """One cached-prefix case of prefix_prefill: b rows of `new` tokens after `pre` cached."""
    n = pre + new
    case = f"prefix B={b} P={pre} new={new}"
    flops = 4 * b * HQ * D * (new * pre + new * new / 2)  # query i sees pre + i + 1 keys
    q = torch.randn(b, HQ, new, D, device=DEV, dtype=BF16, generator=gen)
    k = torch.randn(b, HKV, n, D, device=DEV, dtype=BF16, generator=gen)
    v = torch.randn(b, HKV, n, D, device=DEV, dtype=BF16, generator=gen)
    ref = None
    bias = causal_lower_right(new, n)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
            ref = fn()
            row(case, "sdpa flash lower-right", bench(fn), flops, "TFLOP/s")
    except Exception as e:
        row(case, "sdpa flash lower-right", None, flops, "TFLOP/s",
            note=f"failed: {type(e).__name__}: {e}"[:120])  # fmt: skip
    mask = torch.ones(new, n, dtype=torch.bool, device=DEV).tril(pre)  # key j <= pre + i
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            out = fn()
            err = rel_err(out, ref) if ref is not None else None
            row(case, "sdpa cuDNN (bool mask)", bench(fn), flops, "TFLOP/s", err)
    except Exception as e:
        row(case, "sdpa cuDNN (bool mask)", None, flops, "TFLOP/s",
            note=f"failed: {type(e).__name__}: {e}"[:120])  # fmt: skip
    qt = q.transpose(1, 2).reshape(b * new, HQ, D).contiguous()  # [T, Hq, D]
    ref_t = ref.transpose(1, 2).reshape(b * new, HQ, D) if ref is not None else None
    if varlen_attn is not None:
        varlen_row(case, varlen_attn, qt, k, v, b, new, n, flops, ref_t)
    perm, table = shuffled_table(b, n, bt, gen)
    kc, vc = paged_from_contiguous(k, bt, perm), paged_from_contiguous(v, bt, perm)
    cu = torch.arange(0, b + 1, device=DEV, dtype=torch.int32) * new
    lens = torch.full((b,), n, dtype=torch.int32, device=DEV)
    out = torch.empty_like(qt)
    fn = functools.partial(paged_prefill, qt, kc, vc, table, cu, lens, out=out)
    fn()
    ours = bench(fn)
    row(case, f"ours bt={bt}", ours, flops, "TFLOP/s", rel_err(out, ref_t) if ref_t is not None
        else None)  # fmt: skip
    flat = table.flatten().long()
    kd, vd = torch.empty_like(kc[: flat.numel()]), torch.empty_like(vc[: flat.numel()])

    def gather():  # the blocks in table order: [B, n, Hkv, D] as flash would read them
        torch.index_select(kc, 0, flat, out=kd)
        torch.index_select(vc, 0, flat, out=vd)

    g = bench(gather)
    row(case, "gather K/V to contiguous", g, 2 * (kd.nbytes + vd.nbytes), "TB/s",
        note=f"{g / ours:.2f}x ours' time")  # fmt: skip


def varlen_row(case, varlen_attn, qt, k, v, b, new, n, flops, ref_t):
    """torch's varlen flash entry on the packed rows, causal at the bottom right. Its keywords
    moved between torch versions (2.13: window_size=(-1, 0), enable_gqa; 2.11 refused both and
    is_causal): they are read from its signature, K/V heads repeated where it takes no GQA."""
    import inspect

    params = inspect.signature(varlen_attn).parameters
    kw, hkv = {}, HKV
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    else:
        k, v, hkv = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1), HQ
    for name, value in (("is_causal", True), ("causal", True), ("window_size", (-1, 0))):
        if name in params:
            kw[name] = value
            break
    else:
        row(case, "varlen flash (packed)", None, flops, "TFLOP/s",
            note=f"no causal keyword in {list(params)}"[:160])  # fmt: skip
        return
    kt = k.transpose(1, 2).reshape(b * n, hkv, D).contiguous()
    vt = v.transpose(1, 2).reshape(b * n, hkv, D).contiguous()
    cq = torch.arange(0, b + 1, device=DEV, dtype=torch.int32) * new
    ck = torch.arange(0, b + 1, device=DEV, dtype=torch.int32) * n
    try:
        fn = functools.partial(varlen_attn, qt, kt, vt, cq, ck, new, n, **kw)
        out = fn()
        err = rel_err(out, ref_t) if ref_t is not None else None
        row(case, "varlen flash (packed)", bench(fn), flops, "TFLOP/s", err, str(kw))
    except Exception as e:
        row(case, "varlen flash (packed)", None, flops, "TFLOP/s",
            note=f"{kw}: failed: {type(e).__name__}: {e}"[:160])  # fmt: skip


# the engine's decode shapes (issue 34's profile: the 1B shape with a 128k vocabulary, head dim
# 64, block_tokens 16, the merged graph's table 512 tokens wide; at 64 rows of ~192 keys the
# kernel took 35 us a layer on the H100, ~0.4 TB/s of K+V): (rows, keys, table width in tokens)
ENGINE_DECODE = [(64, 192, 512), (64, 384, 512), (256, 384, 512), (1, 384, 512), (64, 1024, 2048)]
ENGINE_SWEEP = [(16, 2, 2), (32, 2, 2), (32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3),
                (64, 8, 2), (16, 4, 3)]  # fmt: skip


def engine_decode(gen):
    """--engine-decode: our decode kernel at the engine's shapes (head dim 64, block_tokens 16),
    its table as wide as the engine's graph (the rows' lengths below it) and exactly as wide,
    beside cuDNN on contiguous K/V and the copy of the same bytes; then launch choices
    (block_n, warps, stages) x splits 1, 2, 4 while the budget lasts. What the profile's 35 us a
    layer is made of: the tile rule at a short span, the grid, or the kernel's fixed cost."""
    hq, hkv, d, bt = 32, 8, 64, 16
    best = {}
    for b, n, width in ENGINE_DECODE:
        case = f"engine decode B={b} L={n} D={d}"
        q = torch.randn(b, hq, 1, d, device=DEV, dtype=BF16, generator=gen)
        k = torch.randn(b, hkv, n, d, device=DEV, dtype=BF16, generator=gen)
        v = torch.randn_like(k)
        nbytes = k.nbytes + v.nbytes
        ref = anchors(case, q, k, v, False, nbytes, "TB/s")
        q3 = q[:, :, 0].contiguous()
        lens = torch.full((b,), n, dtype=torch.int32, device=DEV)
        perm, table = shuffled_table(b, n, bt, gen)
        kc, vc = paged_from_contiguous(k, bt, perm), paged_from_contiguous(v, bt, perm)
        wide = torch.zeros(b, width // bt, dtype=torch.int32, device=DEV)
        wide[:, : n // bt] = table  # (past the length: block 0, never read)
        for name, t in (("table as wide as the graph's", wide), ("table exact", table)):
            fn, cfg, splits, err = ours_decode(q3, kc, vc, t, lens, ref)
            row(case, f"ours, {name}", bench(fn), nbytes, "TB/s", err,
                f"{cfg}, splits={splits}")  # fmt: skip
        for bn, warps, stages in ENGINE_SWEEP:
            for splits in (1, 2, 4):
                if elapsed() > BUDGET_S:
                    return best
                cfg = LaunchConfig(16, bn, warps, stages, num_splits=splits)
                fn = functools.partial(paged_decode, q3, kc, vc, wide, lens, launch=cfg)
                ms = bench(fn)
                tbs = nbytes / (ms * 1e-3) / 1e12
                print(f"sweep {case} {cfg}: {ms * 1e3:.1f} us {tbs:.2f} TB/s", flush=True)
                if case not in best or ms < best[case]["ms"]:
                    best[case] = dict(ms=ms, tbps=tbs, bn=bn, warps=warps, stages=stages,
                                      splits=splits)  # fmt: skip
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return best


def table_md() -> str:
    lines = ["| case | impl | ms | value | unit | ours/cuDNN | rel err vs SDPA | note |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    cudnn = {r["case"]: r["ms"] for r in ROWS if r["impl"].startswith("sdpa cuDNN") and r["ms"]}
    for r in ROWS:
        base = cudnn.get(r["case"].replace(" fp8 KV", ""))
        ratio = f"{base / r['ms']:.2f}" if base and r["ms"] and r["impl"].startswith("ours") else ""
        ms = f"{r['ms']:.3f}" if r["ms"] else "-"
        val = f"{r['value']:.2f}" if r["value"] else "-"
        err = f"{r['err']:.1e}" if r["err"] is not None else ""
        lines.append(f"| {r['case']} | {r['impl']} | {ms} | {val} | {r['unit']} | {ratio} | "
                     f"{err} | {r['note']} |")  # fmt: skip
    return "\n".join(lines)


def cpu_errors():
    """The error table on the CPU interpreter (fp32/fp16/fp8 codes; its bf16 dots are wrong)."""
    global DEV, BF16, ERR_SHAPE, ERR_NEW
    DEV, BF16, ERR_SHAPE, ERR_NEW = "cpu", torch.float16, (2, 512, 16), 64
    errors = precision_errors(torch.Generator().manual_seed(0), ("fp32", "fp16", "fp8"))
    print("\n| phase | KV | mode | max rel | mean rel |\n|---|---|---|---|---|")
    for e in errors:
        print(f"| {e['phase']} | {e['kv']} | {e['mode']} | {e['max_rel']:.1e} | "
              f"{e['mean_rel']:.1e} |")  # fmt: skip


def main():
    gen = torch.Generator(device=DEV).manual_seed(0)
    env = dict(torch=torch.__version__, triton=triton.__version__)
    if DEV == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sms=props.multi_processor_count)
    print(env, flush=True)
    # first: the README's error table must not be crowded out
    if ARGS.engine_decode:
        best = engine_decode(gen)
        md = table_md()
        print("\n" + md + f"\n\nsweep best: {json.dumps(best)}\ntotal {elapsed():.0f} s")
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "bench_attention_engine.json"), "w") as f:
                json.dump(dict(env=env, rows=ROWS, sweep=best), f, indent=1)
        return
    errors = precision_errors(gen) if not (ARGS.decode_only or ARGS.prefill_only) else {}
    for b, n in progress(DECODE if not ARGS.prefill_only else (), "decode cases"):
        decode_case(b, n, gen)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    for shape in SKEWED if not ARGS.prefill_only else ():
        skewed_case(gen, *shape)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    for b, s in progress(PREFILL if not ARGS.decode_only else (), "prefill cases"):
        prefill_case(b, s, gen)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    if ARGS.prefix_prefill:
        prefix_prefill(gen)
    best = sweep(gen) if ARGS.sweep and not (ARGS.decode_only or ARGS.prefill_only) else {}
    if ARGS.prefill_sweep:
        best.update(prefill_sweep(gen))
    md = table_md()
    print("\n" + md + f"\n\nsweep best: {json.dumps(best)}\ntotal {elapsed():.0f} s")
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "bench_attention.json"), "w") as f:
            json.dump(dict(env=env, rows=ROWS, errors=errors, sweep=best), f, indent=1)
        with open(os.path.join(out_dir, "bench_attention.md"), "w") as f:
            f.write(md + "\n")
    if ARGS.ttft:  # generate()'s time to first token, in processes of its own (bench_ttft.py)
        torch.cuda.empty_cache()
        subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "bench_ttft.py")])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--no-flex", dest="flex", action="store_false",
                        help="skip compiled FlexAttention (its compiles take minutes)")  # fmt: skip
    parser.add_argument("--no-sweep", dest="sweep", action="store_false",
                        help="skip the sweep of decode launch choices")  # fmt: skip
    parser.add_argument("--prefill-sweep", action="store_true",
                        help="also time paged prefill tiles (block_m, block_n, warps, "
                        "stages)")  # fmt: skip
    parser.add_argument("--cpu-errors", action="store_true",
                        help="only the precision error table, on CPU (interpreter)")  # fmt: skip
    parser.add_argument("--no-ttft", dest="ttft", action="store_false",
                        help="skip the generate() TTFT rows (bench_ttft.py)")  # fmt: skip
    parser.add_argument(
        "--decode-only", action="store_true", help="only the decode cases (bf16 and fp8 KV)"
    )
    parser.add_argument(
        "--prefill-only",
        action="store_true",
        help="only the prefill cases (no error table, decode or skewed rows)",
    )
    parser.add_argument("--prefix-prefill", action="store_true",
                        help="also fresh prompts of 256-2,048 tokens and prefill over a cached "
                        "prefix, beside SDPA's backends (issue 34 goal 3)")  # fmt: skip
    parser.add_argument("--engine-decode", action="store_true",
                        help="only decode at the engine's shapes (head dim 64, tables as wide "
                        "as its graphs') and a sweep of launch choices there")  # fmt: skip
    ARGS = parser.parse_args()
    cpu_errors() if ARGS.cpu_errors else main()
