"""Whole KV blocks from the device straight into host rows, by a kernel: no copy engine.

`blocks_to_rows(view, idx, dst, rows)`: dst[rows[i]] = the bytes of block idx[i] of `view`
([num_blocks, regions, width], strided: every layer's K and V of a block), each region's
`width` elements in turn. `dst` is pinned host memory, which the GPU reads and writes through
its unified address (the same pointer): the stores cross the host link from the SMs.

Why a kernel: a device-to-host copy queued on a copy engine delays every later device-to-host
copy of the process, whatever its stream, until the queue drains; a decode step's one-element
reads (generate()'s stopping check) then wait behind a whole migration (2.3 ms behind 128 MiB
of queued copies on the H200, against 65 us idle; benchmarks/diag_copy_engines.py). Stores from
a few SMs reach the same bandwidth (50.6 GB/s against 53.8 for one copy) and leave the copy
engines to the decode step. A persistent grid of `programs` programs walks (block, region,
tile) items, so the kernel takes only those SMs from the decode step beside it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 1024  # elements a program moves per item


@triton.jit
def _blocks_to_rows(
    src, idx, dst, rows, n, regions, width, s_block, s_region, s_row, TILE: tl.constexpr
):
    tiles = tl.cdiv(width, TILE)
    total = n * regions * tiles
    offs = tl.arange(0, TILE)
    for item in range(tl.program_id(0), total, tl.num_programs(0)):
        t = item % tiles
        r = (item // tiles) % regions
        i = item // (tiles * regions)
        b = tl.load(idx + i).to(tl.int64)
        row = tl.load(rows + i).to(tl.int64)
        col = t * TILE + offs
        m = col < width
        x = tl.load(src + b * s_block + r * s_region + col, mask=m)
        tl.store(dst + row * s_row + r * width + col, x, mask=m)


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def blocks_to_rows(
    view: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor, programs: int
) -> None:
    """dst[rows[i], r * width : (r + 1) * width] = view[idx[i], r] for every region r.

    view: [num_blocks, regions, width], unit stride on the last dim; idx, rows: int64 [n] on the
    view's device; dst: [num_rows, >= regions x width] of the view's dtype, unit stride on the
    last dim (pinned host memory, or device memory). Queued on the current stream."""
    _need(view.dim() == 3 and view.stride(2) == 1, "blocks_to_rows: view [N, R, W]")
    _need(dst.dim() == 2 and dst.stride(1) == 1, "blocks_to_rows: dst [rows, bytes]")
    _need(dst.dtype == view.dtype, f"blocks_to_rows: dst {dst.dtype}, view {view.dtype}")
    _, regions, width = view.shape
    _need(dst.shape[1] >= regions * width, "blocks_to_rows: dst rows are too short")
    n = idx.numel()
    _need(rows.numel() == n, "blocks_to_rows: idx and rows differ in length")
    if n == 0:
        return
    grid = (max(1, min(programs, n * regions * triton.cdiv(width, TILE))),)
    _blocks_to_rows[grid](
        view, idx, dst, rows, n, regions, width,
        view.stride(0), view.stride(1), dst.stride(0), TILE=TILE,
    )  # fmt: skip
