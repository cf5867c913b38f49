"""y = x @ w.T for few rows of x (a decode step's linear layers): the weight streamed once, split
along K so a small N still fills the GPU. An experiment beside cuBLAS (issue 34: the engine's
decode step at 64 rows spent 66 µs a layer in its seven GEMMs on an H100, 1.37 TB/s of weight
read, 41 % of the HBM's rate); `benchmarks/bench_linear.py` times it against torch.mm. Not
called by the model's forward.

x: [M, K], w: [N, K] (nn.Linear's weight), both with unit stride along K; fp16 / bf16 / fp32,
fp32 accumulation. Grid (N tiles, K splits, M tiles): one split stores y directly; several
store fp32 partial sums that a second kernel adds in split order (deterministic: no atomics).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._checks import check_dtype, check_runnable


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr,
    w_ptr,
    out_ptr,  # y [M, N] (one split) or fp32 partials [SPLIT_K, M, N]
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,  # partials: one split's stride
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    PARTIAL: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 inputs: full fp32 products, as torch.mm's default (not tf32)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < M
    col_ok = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < k_hi
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    o_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    o_mask = row_ok[:, None] & col_ok[None, :]
    if PARTIAL:
        tl.store(o_ptrs, acc, mask=o_mask)
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, total, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum over s of part[s, i], s in order (part: [SPLIT_K, total] fp32)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * total + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _block_m(m: int) -> int:
    """A row tile: tl.dot's 16 at least, 64 at most (more rows take more M tiles)."""
    return min(64, max(16, triton.next_power_of_2(m)))


def skinny_mm(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N] in x's dtype. cfg: the tiles (SkinnyConfig())."""
    check_runnable("x", x)
    check_runnable("w", w)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_mm: x {list(x.shape)} and w {list(w.shape)}: want [M, K], [N, K]")
    check_dtype("x", x, (torch.float16, torch.bfloat16, torch.float32))
    if x.dtype != w.dtype:
        raise ValueError(f"skinny_mm: dtypes {x.dtype} / {w.dtype}: x and w need one dtype")
    if x.device != w.device:
        raise ValueError(f"skinny_mm: x on {x.device}, w on {w.device}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("skinny_mm: x and w need unit stride along K")
    cfg = cfg or SkinnyConfig()
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    bm = _block_m(m)
    per = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, per)
    partial = splits > 1
    dst = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if partial else out
    grid = (triton.cdiv(n, cfg.block_n), splits, triton.cdiv(m, bm))
    _skinny_kernel[grid](
        x,
        w,
        dst,
        m,
        n,
        k,
        per,
        x.stride(0),
        w.stride(0),
        n,
        m * n,
        BLOCK_M=bm,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_N=n % cfg.block_n == 0,
        EVEN_K=k % per == 0 and per % cfg.block_k == 0,
        PARTIAL=partial,
        IEEE=x.dtype == torch.float32,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if partial:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            dst, out, m * n, SPLIT_K=splits, BLOCK=block, num_warps=4
        )
    return out
