"""Tile overrides (`Tiles`: KernelConfig / model profiles) reach the paged kernels: the launch the
tiling module records changes as asked, and the values stay those of the float64 reference."""

from __future__ import annotations

import pytest
import torch
from oxygen_torch.triton_kernels import (
    LaunchConfig,
    TileQuery,
    Tiles,
    choices,
    launch_config,
    paged_decode,
    paged_decode_ref,
    paged_prefill,
    paged_prefill_ref,
)
from oxygen_torch.triton_kernels.tiling import clear_choices
from test_kernels_helpers import assert_close_rel, make_paged, poisoned_like, randn

FP16 = torch.float16


@pytest.fixture(autouse=True)
def _fresh_memo():
    clear_choices()
    yield
    clear_choices()


def _chosen():
    """(attention_type, block_m, block_n) of the one launch choice made since the memo was
    cleared."""
    (key, cfg), *rest = choices().items()
    assert not rest, f"expected one launch choice, got {len(rest) + 1}"
    return key[1], cfg.block_m, cfg.block_n


def _decode(p, q, **kw):
    out = poisoned_like(q)
    paged_decode(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, out=out, num_splits=2, **kw)
    ref = paged_decode_ref(q.double(), p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                           sliding_window=kw.get("sliding_window"))  # fmt: skip
    assert_close_rel(out, ref, FP16)
    return _chosen()


def _prefill(p, q, cu, **kw):
    out = poisoned_like(q)
    paged_prefill(q, p.k_cache, p.v_cache, p.block_table, cu, p.seq_lens, out=out, **kw)
    ref = paged_prefill_ref(q.double(), p.k_cache, p.v_cache, p.block_table, cu, p.seq_lens,
                            sliding_window=kw.get("sliding_window"))  # fmt: skip
    assert_close_rel(out, ref, FP16)
    return _chosen()


DECODE = [
    # (tiles, window, chosen (attention_type, block_m, block_n)); automatic: (dense, 16, 64)
    pytest.param(None, None, ("dense", 16, 64), id="auto"),
    pytest.param(Tiles(block_n=32), None, ("dense", 16, 32), id="key-tile"),
    pytest.param(Tiles(block_m=64, block_n=16), None, ("dense", 16, 16), id="block_m-ignored"),
    pytest.param(Tiles(), 40, ("sliding", 16, 64), id="window-is-sliding"),
    pytest.param(Tiles(attention_type="moe", block_n=128), 40, ("moe", 16, 128), id="moe-window"),
]


@pytest.mark.parametrize("tiles,window,chosen", DECODE)
def test_decode_takes_the_key_tile(tiles, window, chosen):
    p = make_paged([70, 130], 2, 64, 16, FP16, seed=1)
    q = randn((2, 8, 64), FP16, seed=2)
    assert _decode(p, q, tiles=tiles, sliding_window=window) == chosen


PREFILL = [
    # hidden = 4 heads x 64 < 2048: the seed's dense rule gives (64, 64), MoE (32, 32)
    pytest.param(None, None, ("dense", 64, 64), id="auto"),
    pytest.param(Tiles(block_m=32, block_n=16), None, ("dense", 32, 16), id="both-tiles"),
    pytest.param(Tiles(block_n=32), None, ("dense", 64, 32), id="key-tile-only"),
    pytest.param(Tiles(attention_type="moe"), None, ("moe", 32, 32), id="moe"),
    pytest.param(Tiles(block_m=16), 13, ("sliding", 16, 64), id="window"),
]


@pytest.mark.parametrize("tiles,window,chosen", PREFILL)
def test_prefill_takes_query_and_key_tiles(tiles, window, chosen):
    p = make_paged([150, 40], 2, 64, 16, FP16, seed=3)
    cu = torch.tensor([0, 100, 140], dtype=torch.int32)
    q = randn((140, 4, 64), FP16, seed=4)
    assert _prefill(p, q, cu, tiles=tiles, sliding_window=window) == chosen


@pytest.mark.parametrize(
    "kw,field",
    [(dict(block_m=48), "tiles.block_m"), (dict(block_n=8), "tiles.block_n"),
     (dict(block_n=True), "tiles.block_n"), (dict(attention_type="local"), "tiles.attention")],
)  # fmt: skip
def test_bad_tiles_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        Tiles(**kw)


def test_tiles_and_launch_are_exclusive_and_typed():
    p = make_paged([20], 1, 64, 16, FP16)
    q = randn((1, 2, 64), FP16, seed=5)
    args = (q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    with pytest.raises(ValueError, match="tiles: given together with launch"):
        paged_decode(*args, tiles=Tiles(block_n=16), launch=LaunchConfig(16, 16, 4, 2))
    with pytest.raises(ValueError, match="tiles: expected a Tiles"):
        paged_decode(*args, tiles=(16, 16))
    cu = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="tiles: expected a Tiles"):
        paged_prefill(q[0][None], p.k_cache, p.v_cache, p.block_table, cu, p.seq_lens, tiles=16)


def _query(**kw):
    args = dict(hidden_size=4096, head_dim=128, num_q_heads=32, num_kv_heads=8, dtype=FP16)
    return TileQuery(**{**args, **kw})


def test_overridden_tiles_take_fewer_stages_to_fit_shared_memory():
    auto = launch_config(_query())
    assert (auto.block_n, auto.num_stages) == (128, 2)  # the rule's own tiles fit as chosen
    assert launch_config(_query(phase="decode")).num_stages == 3
    # Q 32 KiB + 256-key K/V tiles of 64 KiB each per stage: only one stage fits 180 KiB
    big = launch_config(_query(block_m=128, block_n=256))
    assert (big.block_m, big.block_n, big.num_stages) == (128, 256, 1)
    with pytest.raises(ValueError, match="block_m/block_n: tiles \\(256, 256\\)"):
        launch_config(_query(head_dim=256, block_m=256, block_n=256))
