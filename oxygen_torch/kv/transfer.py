"""Moving whole KV blocks between a pool's arena and host rows, in large transfers.

A block's bytes are spread over every layer's K and V region (`regions`: uint8 [num_blocks,
width] views). The way down (kv/tier.py) is `gather`, the blocks into one device staging
buffer [n, block bytes] (one index_select per region, at device speed), then `rows_to`, one
copy per run of consecutive host rows straight into the (pinned) host tensor: no host-side
staging copy, no pinned allocation per move. `from_host` is the way back: one copy per run
into a device staging buffer, then one index_copy_ per region. On the H200 one pinned copy of
256 MiB runs at 53-55 GB/s and 256 KiB copies one by one at 20-39 GB/s (benchmarks/bench_tier.py,
migration part, RESULTS.md), so runs of several 512 KiB blocks keep a move near the peak.

On a GPU the copies run on `side` (the caller's stream for moves), after the current stream's
work. `from_host` returns at once with the current stream ordered after the copy (the step that
reads the blocks comes after it; the staging buffer is made and used on `side` only). Host rows
read by a `from_host` still in flight may only be rewritten by later copies on the same stream,
or after a synchronize (the tier does the latter before a host-side write).
"""

from __future__ import annotations

import torch


def runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """(position in `rows`, first row, length) of each run of consecutive rows, in order."""
    out: list[tuple[int, int, int]] = []
    for i, r in enumerate(rows):
        if out and out[-1][1] + out[-1][2] == r:
            p, f, n = out[-1]
            out[-1] = (p, f, n + 1)
        else:
            out.append((i, r, 1))
    return out


def gather(regions: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """uint8 [n, block bytes]: the blocks `idx` (on the regions' device), every region in order."""
    return torch.cat([r.index_select(0, idx) for r in regions], dim=1)


def rows_to(dst: torch.Tensor, rows: list[int], src: torch.Tensor) -> None:
    """dst[rows[i]] = src[i], one copy per run of consecutive rows (on the current stream, not
    waited for when one side is pinned host memory and the other on the device)."""
    for p, first, n in runs(rows):
        dst[first : first + n].copy_(src[p : p + n], non_blocking=True)


def from_host(regions, host: torch.Tensor, rows: list[int], blocks: list[int], side=None) -> None:
    """The bytes of blocks[i] = host[rows[i]] (the inverse of gather + rows_to)."""
    if not blocks:
        return
    idx = torch.tensor(blocks, dtype=torch.int64)
    width = host.shape[1]
    if side is None:
        staged = torch.empty(len(rows), width, dtype=torch.uint8)
        _rows_from(host, rows, staged)
        scatter(regions, idx, staged)
        return
    device = regions[0].device
    stream = torch.cuda.current_stream(device)
    side.wait_stream(stream)  # the blocks' last readers (a freed block reused) come first
    with torch.cuda.stream(side):
        staged = torch.empty(len(rows), width, dtype=torch.uint8, device=device)
        _rows_from(host, rows, staged)
        scatter(regions, idx.to(device, non_blocking=True), staged)
    stream.wait_stream(side)


def _rows_from(src: torch.Tensor, rows: list[int], out: torch.Tensor) -> None:
    for p, first, n in runs(rows):
        out[p : p + n].copy_(src[first : first + n], non_blocking=True)


def scatter(regions: list[torch.Tensor], idx: torch.Tensor, staged: torch.Tensor) -> None:
    """The inverse of gather: block idx[i]'s regions = staged[i] (on the regions' device)."""
    off = 0
    for r in regions:
        r.index_copy_(0, idx, staged[:, off : off + r.shape[1]])
        off += r.shape[1]
