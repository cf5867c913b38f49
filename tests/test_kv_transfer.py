"""Block moves between arena regions and host rows (kv/transfer.py): runs of consecutive rows
become one copy each, and every byte arrives, whatever the order of blocks and rows."""

from __future__ import annotations

import pytest
import torch

from oxygen_torch.kv.transfer import from_host, gather, rows_to, runs


def test_runs_split_rows_where_they_stop_being_consecutive():
    assert runs([]) == []
    assert runs([4, 5, 6, 9, 3, 4, 10]) == [(0, 4, 3), (3, 9, 1), (4, 3, 2), (6, 10, 1)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_blocks_go_to_host_rows_and_back_byte_exact(seed):
    g = torch.Generator().manual_seed(seed)
    widths = [64, 64, 8, 64, 64, 8]  # K, V regions and (fp8 pools) scale regions differ
    regions = [torch.randint(0, 256, (40, w), generator=g, dtype=torch.uint8) for w in widths]
    want = [r.clone() for r in regions]
    blocks = torch.randperm(39, generator=g)[:17].add(1).tolist()
    rows = sorted(torch.randperm(30, generator=g)[:17].tolist())  # runs and gaps
    rows = rows[5:] + rows[:5]  # not in order either
    host = torch.zeros(30, sum(widths), dtype=torch.uint8)
    rows_to(host, rows, gather(regions, torch.tensor(blocks)))
    for i, (b, row) in enumerate(zip(blocks, rows)):
        assert torch.equal(host[row], torch.cat([w[b] for w in want])), i
    for r in regions:
        r.random_(0, 256, generator=g)  # overwritten meanwhile
    back = torch.randperm(39, generator=g)[:17].add(1).tolist()  # into other blocks
    from_host(regions, host, rows, back)
    for b, b2 in zip(blocks, back):
        for r, w in zip(regions, want):
            assert torch.equal(r[b2], w[b])
