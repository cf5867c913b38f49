"""The tiling rule table, its memo, and: every tile choice the rule can make runs correctly."""

from __future__ import annotations

import itertools

import pytest
import torch
from oxygen_torch.triton_kernels import (
    LaunchConfig,
    TileQuery,
    launch_config,
    paged_decode,
    paged_decode_ref,
    paged_prefill,
    paged_prefill_ref,
    record_choice,
    select_block_size,
    select_num_splits,
    select_num_stages,
    select_num_warps,
)
from oxygen_torch.triton_kernels.tiling import base_block_size, clear_choices
from test_kernels_helpers import assert_close_rel, make_paged, poisoned_like, randn

BF16 = torch.bfloat16


def tq(**kw):
    args = dict(hidden_size=4096, head_dim=128, num_q_heads=32, num_kv_heads=8, dtype=BF16)
    args.update(kw)
    return TileQuery(**args)


@pytest.mark.parametrize(
    "hidden,kind,expected",
    [(4096, "dense", (128, 128)), (2048, "dense", (128, 128)), (2047, "dense", (64, 64)),
     (4096, "moe", (32, 32)), (4096, "sliding", (64, 64))],
)  # fmt: skip
def test_seed_rule(hidden, kind, expected):
    assert base_block_size(tq(hidden_size=hidden, attention_type=kind)) == expected


@pytest.mark.parametrize(
    "query,expected",
    [
        # prefill: smem (Q + the stages of K and V) must fit 180 KiB: half-precision D=128
        # takes two stages of (128, 128) rather than halve block_n
        (dict(head_dim=64), (128, 128)),
        (dict(head_dim=128), (128, 128)),
        (dict(head_dim=80), (128, 128)),  # padded to 128
        (dict(head_dim=128, dtype=torch.float16), (128, 128)),
        (dict(head_dim=256), (64, 64)),  # accumulator cap halves block_m, then smem
        (dict(head_dim=128, dtype=torch.float32), (128, 32)),
        (dict(head_dim=128, precision="fp32_safe"), (64, 32)),
        (dict(phase="decode", precision="fp32_safe"), (16, 32)),
        (dict(head_dim=64, dtype=torch.uint8), (128, 64)),  # fp8 prefill: block_n <= 64
        (dict(head_dim=128, dtype=torch.uint8), (128, 64)),
        (dict(hidden_size=1024, head_dim=64), (64, 64)),
        (dict(attention_type="moe"), (32, 32)),
        (dict(seq_len=20), (128, 128)),  # prefill: no cap by length (each cap a compile)
        (dict(seq_len=5), (128, 128)),
        # decode: block_m = GQA group padded to a power of two >= 16, block_n in [64, 128]
        (dict(phase="decode"), (16, 64)),
        (dict(phase="decode", dtype=torch.uint8), (16, 64)),  # fp8: 64-key tiles (H200)
        (dict(phase="decode", dtype=torch.uint8, hidden_size=1024), (16, 64)),
        (dict(phase="decode", num_q_heads=28, num_kv_heads=4), (16, 64)),
        (dict(phase="decode", num_q_heads=32, num_kv_heads=1), (32, 64)),
        (dict(phase="decode", num_q_heads=128, num_kv_heads=1), (64, 64)),
        (dict(phase="decode", attention_type="moe"), (16, 64)),
        (dict(phase="decode", seq_len=20), (16, 32)),
        (dict(phase="decode", dtype=torch.float32, head_dim=256), (16, 32)),
        # overrides win
        (dict(block_m=32, block_n=16), (32, 16)),
        (dict(phase="decode", block_n=256), (16, 256)),
    ],
)
def test_refined_rule(query, expected):
    assert select_block_size(tq(**query)) == expected


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_m", 48),
        ("block_n", 8),
        ("block_n", 512),
        ("block_m", True),
        ("phase", "train"),
        ("attention_type", "local"),
        ("head_dim", 0),
        ("num_q_heads", 6),
        ("precision", "fast"),
    ],
)
def test_bad_queries_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        tq(**{field: value, "num_kv_heads": 4})


def test_warps_stages_and_splits():
    q = tq()
    assert select_num_warps(q, 128, 64) == 8 and select_num_warps(q, 64, 64) == 4
    assert select_num_warps(tq(phase="decode"), 16, 64) == 4
    assert select_num_warps(tq(phase="decode", dtype=torch.uint8), 16, 128) == 8
    fp8 = launch_config(tq(phase="decode", dtype=torch.uint8, seq_len=32768))
    assert (fp8.block_n, fp8.num_warps, fp8.num_stages) == (64, 4, 3)  # the H200's fastest
    assert select_num_warps(tq(precision="fp32_safe"), 64, 32) == 8
    assert select_num_stages(tq(head_dim=64)) == 3 and select_num_stages(tq(head_dim=256)) == 2
    # half-precision prefill at D=128: two stages of the seed tile (fits 180 KiB; three do not)
    assert select_num_stages(q) == 2 and select_num_stages(tq(phase="decode")) == 3
    assert select_num_stages(tq(dtype=torch.uint8)) == 3  # (fp8: its 64-key tiles fit three)
    assert select_num_stages(tq(block_m=16)) == 2  # (the 128-key tiles decide: 196 KiB at 3)
    assert select_num_stages(tq(block_n=64)) == 3  # (a caller's key tile: its stages are fit)
    clear_choices()
    cfg = launch_config(q)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (128, 128, 8, 2)
    clear_choices()
    # batch x kv_heads programs vs 2 x 132 SMs on the H200 anchor cases
    assert select_num_splits(32 * 8, 4096, 64) == 2
    assert select_num_splits(64 * 8, 1024, 64) == 1
    assert select_num_splits(8 * 8, 32768, 64) == 5
    assert select_num_splits(1 * 8, 32768, 64) == 33
    assert select_num_splits(1, 100, 64) == 1  # too short to split
    with pytest.raises(ValueError, match="num_splits"):
        LaunchConfig(16, 64, 4, 3, num_splits=0)


def test_choices_are_memoised_per_bucket():
    clear_choices()
    a = launch_config(tq(phase="decode", seq_len=3000))
    assert launch_config(tq(phase="decode", seq_len=4000)) is a  # same power-of-two bucket
    assert launch_config(tq(phase="decode", seq_len=5000)) is not a
    tuned = LaunchConfig(16, 128, 8, 4, num_splits=3)
    record_choice(tq(phase="decode", seq_len=4096), tuned)
    assert launch_config(tq(phase="decode", seq_len=2049)) == tuned
    clear_choices()


def _all_choices(phase):
    """Every (block_m, block_n) the rule returns over a grid of models and shapes."""
    found = {}
    grid = itertools.product(
        [1024, 4096], [64, 80, 96, 128, 256], [(32, 8), (28, 4), (8, 8), (64, 1)],
        [torch.float16, BF16, torch.float32, torch.uint8], [8, 40, 4096],
        ["dense", "moe", "sliding"], ["auto_mixed", "fp32_safe"],
    )  # fmt: skip
    for hidden, d, (hq, hkv), dt, n, kind, prec in grid:
        q = TileQuery(hidden, d, hq, hkv, dt, phase, n, kind, precision=prec)
        bm, bn = select_block_size(q)
        found.setdefault(
            (bm, bn), LaunchConfig(bm, bn, select_num_warps(q, bm, bn), select_num_stages(q))
        )
    return sorted(found.items())


DECODE_CHOICES = _all_choices("decode")
PREFILL_CHOICES = _all_choices("prefill")


def test_rule_makes_a_bounded_set_of_choices():
    assert 5 <= len(DECODE_CHOICES) <= 16 and 5 <= len(PREFILL_CHOICES) <= 16
    for (bm, bn), _ in DECODE_CHOICES + PREFILL_CHOICES:
        assert bm & (bm - 1) == 0 and bn & (bn - 1) == 0 and bm >= 16 and bn >= 16


@pytest.mark.parametrize("tile,launch", DECODE_CHOICES, ids=lambda x: str(x))
def test_every_decode_choice_is_correct(tile, launch):
    p = make_paged([70, 130], 1, 64, 16, torch.float16, seed=1)
    q = randn((2, 5, 64), torch.float16, seed=2)
    for splits in (1, 2):
        out = poisoned_like(q)
        paged_decode(
            q,
            p.k_cache,
            p.v_cache,
            p.block_table,
            p.seq_lens,
            out=out,
            launch=launch,
            num_splits=splits,
        )
        ref = paged_decode_ref(q.double(), p.k_cache, p.v_cache, p.block_table, p.seq_lens)
        assert_close_rel(out, ref, torch.float16)


@pytest.mark.parametrize("tile,launch", PREFILL_CHOICES, ids=lambda x: str(x))
def test_every_prefill_choice_is_correct(tile, launch):
    p = make_paged([150, 40], 1, 64, 16, torch.float16, seed=3)
    cu = torch.tensor([0, 140, 160], dtype=torch.int32)
    q = randn((160, 2, 64), torch.float16, seed=4)
    out = poisoned_like(q)
    paged_prefill(q, p.k_cache, p.v_cache, p.block_table, cu, p.seq_lens, out=out, launch=launch)
    ref = paged_prefill_ref(q.double(), p.k_cache, p.v_cache, p.block_table, cu, p.seq_lens)
    assert_close_rel(out, ref, torch.float16)
