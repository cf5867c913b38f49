"""triton_kernels/block_copy.py: whole blocks of a strided block view into host rows, against
index_select, under the interpreter on CPU (on the H200: tests/test_tier_cuda.py)."""

from __future__ import annotations

import pytest
import torch
from oxygen_torch.triton_kernels.block_copy import TILE, blocks_to_rows


def _view(num_blocks, regions, width, dtype, seed):
    """A block view laid out like KVStorage.block_view: each region a run of blocks, regions
    apart by more than their blocks (pages of slack), filled with random bits."""
    g = torch.Generator().manual_seed(seed)
    region = num_blocks * width + 13
    flat = torch.randint(-(2**31), 2**31 - 1, (regions * region,), generator=g).to(dtype)
    return flat.as_strided((num_blocks, regions, width), (width, region, 1))


@pytest.mark.parametrize(
    "dtype,regions,width,programs",
    [
        (torch.int64, 6, 40, 1),
        (torch.int64, 4, TILE + 7, 3),  # two tiles a region, the second partial
        (torch.int32, 3, 2 * TILE, 64),  # more programs than items
        (torch.uint8, 5, 33, 2),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_blocks_land_in_their_rows(dtype, regions, width, programs, seed):
    view = _view(12, regions, width, dtype, seed)
    g = torch.Generator().manual_seed(100 + seed)
    idx = torch.randperm(12, generator=g)[:7]
    rows = torch.randperm(9, generator=g)[:7]
    dst = torch.full((9, regions * width + 5), 7, dtype=dtype)
    blocks_to_rows(view, idx, dst, rows, programs)
    want = torch.full_like(dst, 7)
    want[rows, : regions * width] = view[idx].reshape(len(idx), -1)
    assert torch.equal(dst, want)


def test_bad_arguments_are_named():
    view = _view(4, 2, 8, torch.int64, 0)
    idx = rows = torch.arange(2)
    with pytest.raises(ValueError, match="dst torch.int32, view torch.int64"):
        blocks_to_rows(view, idx, torch.zeros(4, 16, dtype=torch.int32), rows, 4)
    with pytest.raises(ValueError, match="too short"):
        blocks_to_rows(view, idx, torch.zeros(4, 15, dtype=torch.int64), rows, 4)
    with pytest.raises(ValueError, match="differ in length"):
        blocks_to_rows(view, idx, torch.zeros(4, 16, dtype=torch.int64), torch.arange(3), 4)
