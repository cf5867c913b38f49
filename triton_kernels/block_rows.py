"""Whole KV blocks copied between a paged pool and host rows by one kernel, through mapped
pinned memory: no staging buffer and no copy engine.

A pool's block view is [num_blocks, regions, width] (one region per layer and K/V, strided far
apart in the arena); a host row is a block's bytes in address order, region after region. Each
program takes (block, region) pieces in turn, a piece being `width` contiguous words on both
sides, and copies them device -> host (`up=False`) or host -> device (`up=True`). On a GPU the
host rows are pinned memory seen through their device address (unified addressing), so the
kernel's loads and stores cross PCIe themselves; a grid of a few programs keeps the kernel to a
few SMs beside a decode step, and nothing queues on the copy engines that a step's own small
copies use (kv/transfer.py). Only the blocks named are touched (the arena rule: a kernel may
not read an unmapped page).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiling import next_pow2

_WORDS = (torch.int32, torch.int16, torch.uint8)  # the widest that divides every offset wins
MAX_BLOCK = 4096  # words a program moves at once


# A move names its blocks and rows in one int64 buffer, meta = [n, ids (cap), rows (cap)], read by
# the kernel: a CUDA graph of its launches (kv/transfer.py MappedMoves) serves every move of up
# to `cap` blocks; n comes from the buffer, so the grid's pieces are counted in the kernel (cap:
# not specialized, block_rows passes n there).
@triton.jit(do_not_specialize=["cap"])
def _block_rows_kernel(
    view_ptr,
    host_ptr,
    meta_ptr,
    cap,
    s_block,
    s_region,
    regions,
    width,
    row_stride,
    col,
    UP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = tl.load(meta_ptr) * regions
    items = (total + nprog - 1) // nprog
    offs = tl.arange(0, BLOCK)
    for k in range(0, items):
        w = pid + k * nprog
        # a program past the last piece moves 0 words (a count, not a scalar mask: see
        # kv_append._token_coords on Triton's interpreter)
        live = tl.where(w < total, width, 0)
        w = tl.minimum(w, total - 1)
        i = w // regions
        r = w - i * regions
        b = tl.load(meta_ptr + 1 + i)
        row = tl.load(meta_ptr + 1 + cap + i)
        dev = view_ptr + b * s_block + r * s_region
        hst = host_ptr + row * row_stride + col + r * width
        for c in range(0, width, BLOCK):
            o = c + offs
            m = o < live
            if UP:
                tl.store(dev + o, tl.load(hst + o, mask=m), mask=m)
            else:
                tl.store(hst + o, tl.load(dev + o, mask=m), mask=m)


def _word(views: list[torch.Tensor], host: torch.Tensor) -> torch.dtype:
    """The widest integer type whose size divides every view's region width, strides, offset
    and the host row's stride and column of each view."""
    col, sizes = 0, []
    for v in views:
        es = v.element_size()
        sizes += [v.shape[2] * es, v.stride(0) * es, v.stride(1) * es, v.data_ptr(), col]
        col += v.shape[1] * v.shape[2] * es
    sizes += [host.stride(0), host.data_ptr()]
    for dt in _WORDS:
        if all(s % dt.itemsize == 0 for s in sizes):
            return dt
    return torch.uint8


def check(views: list[torch.Tensor], host: torch.Tensor) -> None:
    """ValueError unless `views` are block views and `host` rows that hold their blocks."""
    if host.dtype != torch.uint8 or host.dim() != 2 or host.stride(1) != 1:
        raise ValueError("block_rows: host must be uint8 [rows, bytes] with unit last stride")
    need = sum(v.shape[1] * v.shape[2] * v.element_size() for v in views)
    if host.shape[1] < need:
        raise ValueError(f"block_rows: host rows of {host.shape[1]} bytes hold no block of {need}")
    for v in views:
        if v.dim() != 3 or v.stride(2) != 1:
            raise ValueError(f"block_rows: {tuple(v.shape)} {v.stride()} is not a block view")


def meta(ids: list[int], rows: list[int], cap: int) -> list[int]:
    """A move's int64 buffer for the kernel: [n, ids padded to cap, rows padded to cap]."""
    pad = [0] * (cap - len(ids))
    return [len(ids), *ids, *pad, *rows, *pad]


def block_rows(
    views: list[torch.Tensor],
    host: torch.Tensor,
    ids: torch.Tensor,
    rows: torch.Tensor,
    up: bool,
    programs: int,
) -> None:
    """host[rows[i]] = the bytes of block ids[i] of every view in turn (up: the inverse), on the
    current stream, not waited for. views: [num_blocks, regions, width] strided (last stride 1);
    host: uint8 [rows, >= block bytes] (the host tensor's device alias on a GPU: mapped_view);
    ids, rows: int64 [n] on the views' device; programs: the grid (>= 1)."""
    n = ids.numel()
    if rows.numel() != n:
        raise ValueError(f"block_rows: {n} block ids for {rows.numel()} rows")
    check(views, host)
    if not n:
        return
    if programs < 1:
        raise ValueError(f"block_rows: programs {programs} must be at least 1")
    buf = torch.cat([ids.new_tensor([n]), ids.to(torch.int64), rows.to(torch.int64)])
    launch(views, host, buf, n, up, programs)


def launch(
    views: list[torch.Tensor], host: torch.Tensor, meta: torch.Tensor, cap: int, up: bool, grid: int
) -> None:
    """The kernel over a move's buffer (`meta`: int64 [1 + 2 cap] on the views' device, see
    meta()), one launch a view, `grid` programs each; what block_rows and a CUDA graph of a
    move (kv/transfer.py MappedMoves) launch. Arguments as block_rows' (checked there)."""
    wdt = _word(views, host)
    h = host.view(wdt)
    col = 0
    for v in views:
        w = v.view(wdt)
        width, regions = w.shape[2], w.shape[1]
        _block_rows_kernel[(grid,)](
            w,
            h,
            meta,
            cap,
            w.stride(0),
            w.stride(1),
            regions,
            width,
            h.stride(0),
            col,
            UP=up,
            BLOCK=min(MAX_BLOCK, next_pow2(width)),
            num_warps=8 if width >= 2048 else 4,
        )
        col += regions * width


class _HostPointer:
    """A pinned host tensor described by its device address for torch.as_tensor."""

    def __init__(self, t: torch.Tensor):
        self._t = t  # kept alive as long as the alias
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape),
            "typestr": "|u1",
            "data": (t.data_ptr(), False),
            "strides": tuple(s * t.element_size() for s in t.stride()),
            "version": 2,
        }


def mapped_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The uint8 pinned host tensor `host` as a tensor on CUDA `device` over the same memory
    (unified addressing: a pinned page's device address is its host address), for kernels to
    read and write across PCIe. ValueError when `host` is not pinned."""
    if device.type != "cuda":
        return host
    if host.dtype != torch.uint8 or not host.is_pinned():
        raise ValueError("mapped_view: host must be a pinned uint8 tensor")
    out = torch.as_tensor(_HostPointer(host), device=device)
    if out.data_ptr() != host.data_ptr():
        raise ValueError("mapped_view: the pinned rows' device address differs from the host's")
    return out
