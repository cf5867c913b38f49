"""The disk tier behind the CPU tier (kv/disk.py) and fp8 lowering in the tier (kv/lowering.py).

Bytes are checked exactly through the disk (host backend on both sides: the arena and the
tier), lowered blocks against the original within e4m3's rounding; swap preemption through a
tiny CPU tier and a disk tier against the same calls run alone (float32, greedy)."""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine import llama, prompt, schedulers, together_as_alone

from oxygen_torch import _patching
from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.kv import pool as kv_pool
from oxygen_torch.kv import pool_stats
from oxygen_torch.kv.disk import DiskTier
from oxygen_torch.kv.pool import PoolKey, get_pool, release_pools
from oxygen_torch.kv.tier import PRESSURE, CPUTier, TierFull

# the per-call path (scheduler.engine=false): tests/test_engine_loop.py tests the engine's
pytestmark = pytest.mark.per_call

MiB = 1 << 20


def make_pool(dtype=torch.bfloat16, device="cpu"):
    # 2 layers x K/V, 16 tokens x 2 heads x 64: 4 KiB a region in 16 bits, 16 KiB a block
    key = PoolKey(torch.device(device), 2, 2, 64, dtype, 16, "auto", 16 * MiB, 2 * MiB)
    return get_pool(key)


@pytest.fixture
def pool():
    yield make_pool()
    release_pools()


@pytest.fixture(autouse=True)
def _no_pool_left():
    """Closes the pools a test left busy (blocks it took and never gave back): release_pools()
    keeps those, and a later test file would find their arenas open."""
    yield
    release_pools()
    with kv_pool._pools_lock:
        for key, p in list(kv_pool._pools.items()):
            p.close()
            del kv_pool._pools[key]


def caches(pool):
    return [*pool.storage.k, *pool.storage.v]


def fill(pool, blocks, gen, scale=None):
    """Random data into every cache's `blocks` (per-head magnitudes from 1e-3 to 1e3); returns
    it as float32, per cache [n, T, H, D]."""
    out = []
    for c in caches(pool):
        n, (t, h, d) = len(blocks), c.shape[1:]
        mag = scale if scale is not None else 10 ** (torch.rand(n, 1, h, 1, generator=gen) * 6 - 3)
        data = (torch.randn(n, t, h, d, generator=gen) * mag).to(c.dtype)
        c.index_copy_(0, torch.tensor(blocks, dtype=torch.int64).to(c.device), data.to(c.device))
        out.append(data.float())
    return out


def read(pool, blocks):
    idx = torch.tensor(blocks, dtype=torch.int64)
    return [c.index_select(0, idx.to(c.device)).float().cpu() for c in caches(pool)]


def tier_of(pool, rows, disk_rows=0, path="", lowering=False):
    """A CPU tier of `rows` rows and a disk tier of `disk_rows` records in `path`."""
    probe = CPUTier([pool.storage], 0, pool.key.device, fp8_lowering=lowering)
    return CPUTier(
        [pool.storage], rows * probe.row_bytes, pool.key.device, path,
        disk_rows * probe.row_bytes, lowering,
    )  # fmt: skip


class Model:
    """What the tier should hold: slot -> each cache's float32 data; and the blocks in use."""

    def __init__(self, pool, tier):
        self.pool, self.tier, self.held = pool, tier, {}

    def down(self, n, gen, low=False):
        with self.pool.lock:
            blocks = self.pool.manager.allocate(n)
        data = fill(self.pool, blocks, gen)
        try:
            slots = self.tier.down(blocks, low)
        finally:
            with self.pool.lock:
                self.pool.manager.decref(blocks)
        for i, s in enumerate(slots):
            assert s not in self.held
            self.held[s] = [d[i] for d in data]
        return slots

    def up_and_check(self, slots, gen):
        with self.pool.lock:
            blocks = self.pool.manager.allocate(len(slots))
        fill(self.pool, blocks, gen)  # whatever is there is overwritten
        self.tier.up(slots, blocks)
        got = read(self.pool, blocks)
        for i, s in enumerate(slots):
            for c, g in enumerate(got):
                want = self.held[s][c]
                if self.tier.lowered(s):
                    assert_within_fp8(g[i], want)
                else:  # the same bits
                    dt = caches(self.pool)[c].dtype
                    assert torch.equal(g[i].to(dt).view(torch.int16), want.to(dt).view(torch.int16))
        with self.pool.lock:
            self.pool.manager.decref(blocks)

    def release(self, slots):
        self.tier.release(slots)
        for s in slots:
            del self.held[s]


def assert_within_fp8(got, want):
    """got vs want [T, H, D]: e4m3 keeps 3 mantissa bits (rounding: 2^-4 of the value) over a
    per-head scale of amax / 448, whose subnormal step is 2^-9 of the scale; plus the 16-bit
    rounding on the way back (2^-8 of the value)."""
    amax = want.abs().amax(dim=(0, 2), keepdim=True)  # [1, H, 1]
    bound = want.abs() * (2**-4 + 2**-8) + amax / 448 * 2**-10 + 1e-30
    err = (got - want).abs()
    assert (err <= bound).all(), float((err / bound).max())
    assert (err <= amax * 2**-4).all()  # relative to the head's max in the block


def test_bytes_exact_through_the_disk_tier_with_one_read_per_run(pool, tmp_path):
    gen = torch.Generator().manual_seed(0)
    tier = tier_of(pool, 3, 16, str(tmp_path))
    m = Model(pool, tier)
    first = m.down(2, gen)
    mid = m.down(1, gen)
    m.up_and_check(first, gen)  # `first` is now used more recently than `mid`
    second = m.down(1, gen)  # `mid` spills: the least recently used row
    assert tier.stats()["bytes_to_disk"] == tier.row_bytes
    assert [tier._where[x] < 0 for x in first + mid + second] == [False, False, True, False]
    first += mid
    third = m.down(6, gen)  # more than the CPU tier holds in one down
    s = tier.stats()
    assert s["slots_used"] == 3 and s["disk_used_bytes"] == 7 * tier.row_bytes
    assert tier.num_free == 3 + 16 - 10
    reads = tier.disk.reads
    m.up_and_check(first + second + third, gen)
    on_disk = sorted(-1 - tier._where[x] for x in first + second + third if tier._where[x] < 0)
    run_count = 1 + sum(b != a + 1 for a, b in zip(on_disk, on_disk[1:]))
    assert tier.disk.reads - reads == run_count < len(on_disk)
    assert tier.stats()["bytes_from_disk"] == 7 * tier.row_bytes
    m.release(first + third)
    m.up_and_check(second, gen)
    m.release(second)
    assert tier.num_free == 19 and tier.stats()["disk_used_bytes"] == 0
    with pytest.raises(ValueError, match="slot .* is not taken"):
        tier.release(second[:1])
    tier.close()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(st.tuples(st.sampled_from("dur"), st.integers(1, 5), st.booleans()), max_size=14),
    lowering=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_downs_ups_and_releases_keep_every_block(pool, tmp_path, ops, lowering, seed):
    gen = torch.Generator().manual_seed(seed)
    rnd = __import__("random").Random(seed)
    tier = tier_of(pool, 3, 8, str(tmp_path), lowering)
    m = Model(pool, tier)
    for op, n, low in ops:
        if op == "d":
            try:
                m.down(n, gen, low)
            except TierFull:
                assert n > tier.num_free  # refused only when it cannot fit
        elif m.held:
            pick = rnd.sample(sorted(m.held), min(n, len(m.held)))
            m.up_and_check(pick, gen) if op == "u" else m.release(pick)
    m.up_and_check(sorted(m.held), gen)
    m.release(sorted(m.held))
    assert tier.num_free == 11 and tier.stats()["slots_used"] == 0
    tier.close()


def test_a_failed_disk_write_is_a_full_tier_that_changes_nothing(
    pool, tmp_path, monkeypatch, caplog
):
    _patching.forget_warnings()
    gen = torch.Generator().manual_seed(1)
    tier = tier_of(pool, 2, 8, str(tmp_path))
    m = Model(pool, tier)

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with caplog.at_level(logging.WARNING, logger="oxygen_torch"):
        with pytest.raises(TierFull):
            m.down(3, gen)  # two rows placed, then the spill for the third fails: all undone
        assert tier.stats()["slots_used"] == 0 and tier.num_free == 2  # the disk takes no more
        kept = m.down(2, gen)
        with pytest.raises(TierFull):
            m.down(1, gen)
    assert len([r for r in caplog.records if "disk tier failed" in r.getMessage()]) == 1
    assert tier.num_free == 0  # the CPU rows are as they were
    m.up_and_check(kept, gen)
    m.release(kept[:1])
    m.up_and_check(m.down(1, gen), gen)  # a free CPU row still serves
    tier.close()


def test_the_file_is_gone_when_the_pool_closes_and_at_exit(tmp_path):
    pool = make_pool()
    tier = pool.cpu_tier(1 * MiB, str(tmp_path), 4 * MiB)
    (path,) = tmp_path.iterdir()
    assert (
        str(path) == tier.disk.path
        and path.stat().st_size == tier.disk.num_records * tier.row_bytes
    )
    assert tier.disk.num_records == 4 * MiB // tier.row_bytes
    del pool, tier  # release_pools() closes a pool once nothing refers to it
    release_pools()
    assert not path.exists()
    code = (
        "import sys, torch; from oxygen_torch.kv.tier import CPUTier;"
        "from oxygen_torch.kv.pool import PoolKey, get_pool;"
        "p = get_pool(PoolKey(torch.device('cpu'), 2, 2, 64, torch.bfloat16, 16, 'auto',"
        " 16 << 20, 2 << 20)); t = p.cpu_tier(1 << 20, sys.argv[1], 4 << 20);"
        "print(t.disk.path)"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, check=True,
                         capture_output=True, text=True)  # fmt: skip
    assert out.stdout.strip().startswith(str(tmp_path)) and not list(tmp_path.iterdir())


def test_a_bad_disk_tier_path_or_size_is_refused_when_made(pool, tmp_path, caplog):
    cfg = dict(cpu_tier_bytes=MiB, disk_tier_bytes=4 * MiB)
    with pytest.raises(ValueError, match="pool.disk_tier_path: .*nowhere.* is not a writable dir"):
        load_config(pool={**cfg, "disk_tier_path": str(tmp_path / "nowhere")})
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ValueError, match="pool.disk_tier_path: .* is not a writable directory"):
        load_config(pool={**cfg, "disk_tier_path": str(tmp_path / "file")})
    with pytest.raises(ValueError, match="pool.disk_tier_bytes: .* without pool.disk_tier_path"):
        load_config(pool={"cpu_tier_bytes": MiB, "disk_tier_bytes": MiB})
    with pytest.raises(ValueError, match="pool.disk_tier_path: .* needs a CPU tier"):
        load_config(pool={"cpu_tier_bytes": 0, "disk_tier_path": str(tmp_path),
                          "disk_tier_bytes": MiB})  # fmt: skip
    with pytest.raises(ValueError, match="pool.disk_tier_bytes: .* is more than the .* free"):
        load_config(pool={**cfg, "disk_tier_path": str(tmp_path), "disk_tier_bytes": 1 << 60})
    # the tier itself: a directory gone or space taken between configuration and first use
    # leaves the CPU tier without a disk tier, with one warning; a size that holds no record
    # is an error
    _patching.forget_warnings()
    nowhere, row = str(tmp_path / "nowhere"), tier_of(pool, 1).row_bytes
    with pytest.raises(ValueError, match=r"cannot create a file in .*nowhere.* \(No such file"):
        DiskTier(nowhere, MiB, row)
    with caplog.at_level(logging.WARNING, logger="oxygen_torch"):
        for _ in range(2):  # one warning for both
            tier = CPUTier([pool.storage], MiB, pool.key.device, nowhere, MiB)
            assert tier.disk is None and tier.num_slots == MiB // row and tier.num_free > 0
            tier.close()
        tier = CPUTier([pool.storage], MiB, pool.key.device, str(tmp_path), 1 << 60)
        assert tier.disk is None
        tier.close()
    gone, full = [r.getMessage() for r in caplog.records]
    assert gone == (
        f"oxygen_torch: the KV disk tier is off: pool.disk_tier_path: cannot create a file in "
        f"{nowhere!r} (No such file or directory); the CPU tier goes on"
    )
    assert full.startswith(
        f"oxygen_torch: the KV disk tier is off: pool.disk_tier_path: cannot allocate "
        f"pool.disk_tier_bytes = {(1 << 60) // row * row} bytes in {str(tmp_path)!r} ("
    ) and full.endswith("); lower pool.disk_tier_bytes or free space; the CPU tier goes on")
    with pytest.raises(ValueError, match="pool.disk_tier_bytes: 100 bytes hold no record"):
        CPUTier([pool.storage], MiB, pool.key.device, str(tmp_path), 100)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # nothing left behind


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lowered_blocks_come_back_within_fp8_rounding(dtype):
    pool = make_pool(dtype)
    try:
        gen = torch.Generator().manual_seed(2)
        tier = tier_of(pool, 4, lowering=True)
        m = Model(pool, tier)
        m.down(2, gen)  # high priority: never lowered
        assert tier.stats()["lowered_blocks"] == 0
        low = m.down(4, gen, low=True)  # 6 rows of 4 at full precision: lowered, in 2 rows
        assert all(tier.lowered(s) for s in low) and tier.num_free == 0
        s = tier.stats()
        assert s["lowered_blocks"] == s["lowered_held"] == 4
        assert s["bytes_down"] == 2 * tier.block_bytes + 4 * (tier.block_bytes // 2 + tier._sb)
        assert tier._sb == 4 * 2 * 4  # one fp32 scale per (layer, K/V, head)
        m.up_and_check(sorted(m.held), gen)  # full ones exact, lowered ones within e4m3
        m.release(low[:1])
        more = m.down(1, gen, low=True)  # into the free half of a lowered row
        assert tier.lowered(more[0]) and tier.num_free == 0
        m.up_and_check(more, gen)
    finally:
        release_pools()


def test_zero_and_all_equal_blocks_come_back_exactly(pool):
    tier = tier_of(pool, 2, lowering=True)
    with pool.lock:
        blocks = pool.manager.allocate(3)
    gen = torch.Generator().manual_seed(3)
    heads = torch.randn(1, 1, 2, 1, generator=gen) * 100  # one value per head
    want = fill(pool, blocks[:1], gen, scale=0.0)  # all zero
    for c in caches(pool):
        c[blocks[1]] = heads[0].to(c.dtype)  # all equal per head
        c[blocks[2]] = torch.tensor([3.0, 0.0]).view(1, 2, 1).to(c.dtype)  # one head zero
    want = [torch.cat([w, c[blocks[1:]].float()]) for w, c in zip(want, caches(pool))]
    slots = tier.down(blocks, low_priority=True)
    assert all(tier.lowered(s) for s in slots)
    for c in caches(pool):
        c.index_fill_(0, torch.tensor(blocks), 7.0)
    tier.up(slots, blocks)
    for got, w in zip(read(pool, blocks), want):
        assert torch.equal(got, w) and torch.isfinite(got).all()


@pytest.mark.parametrize("lowering", [False, True])
def test_no_lowering_when_off_when_not_pressed_or_not_low_priority(pool, lowering):
    gen = torch.Generator().manual_seed(4)
    tier = tier_of(pool, 8, lowering=lowering)
    m = Model(pool, tier)
    m.down(int(PRESSURE * 8), gen, low=True)  # exactly at the threshold: not above it
    m.down(1, gen, low=False)  # above it, but not low priority
    assert tier.stats()["lowered_blocks"] == 0
    last = m.down(1, gen, low=True)  # above it and low priority: lowered if lowering is on
    assert tier.lowered(last[0]) == lowering
    assert tier.stats()["lowered_blocks"] == int(lowering)
    m.up_and_check(sorted(m.held), gen)  # byte-exact but for the lowered one


def test_fp32_and_fp8_pools_are_not_lowered():
    for dtype in (torch.float32, torch.float8_e4m3fn):
        pool = make_pool(dtype)
        storages = [pool.storage] + ([pool.scales] if pool.scales is not None else [])
        tier = CPUTier(storages, MiB, pool.key.device, fp8_lowering=True)
        assert not tier.lowering and tier.row_bytes == tier.block_bytes
        release_pools()


def _burst(arch, pool_cfg):
    """tests/test_kv_tier.py's burst: six calls whose KV does not fit at once (blocks of 128
    tokens, 256 KiB each in float32): younger calls are preempted."""
    cfg = load_config(kv={"block_tokens": 128, "arena_bytes": 8 << 20}, pool=pool_cfg)
    model = hf.apply(llama(arch=arch), cfg)
    kws = []
    for s in range(6):
        ids, mask = prompt(s, rows=6, length=100 + s)
        kws.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False))
    return model, kws


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_swap_through_a_tiny_cpu_tier_and_disk_gives_the_tokens_of_no_preemption(
    oxygen, tmp_path, arch
):
    # four CPU rows: a preempted call (12 blocks) goes mostly to disk
    cfg = dict(cpu_tier_bytes=4 << 18, disk_tier_path=str(tmp_path), disk_tier_bytes=64 * MiB)
    model, kws = _burst(arch, cfg)
    together_as_alone(model, kws)
    (sched,) = schedulers(model)
    assert sched.stats.swaps > 0 and sched.stats.swaps == sched.stats.preemptions
    (pool,) = [p for p in pool_stats() if p["block_tokens"] == 128]
    tier = pool["cpu_tier"]
    assert tier["slots_total"] == 4 and tier["bytes_to_disk"] > 0 and tier["bytes_from_disk"] > 0
    assert tier["bytes_up"] == tier["bytes_down"] > 0
    assert tier["slots_used"] == 0 and tier["disk_used_bytes"] == 0 and pool["blocks_used"] == 0


def test_a_failing_disk_degrades_to_recompute_with_one_warning(
    oxygen, tmp_path, monkeypatch, caplog
):
    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    cfg = dict(cpu_tier_bytes=4 << 18, disk_tier_path=str(tmp_path), disk_tier_bytes=64 * MiB)
    model, kws = _burst("llama", cfg)
    with caplog.at_level(logging.WARNING, logger="oxygen_torch"):
        together_as_alone(model, kws)
    (sched,) = schedulers(model)
    assert sched.stats.preemptions > 0 and sched.stats.swaps == 0
    msgs = [r.getMessage() for r in caplog.records]
    assert len([m for m in msgs if "disk tier failed" in m]) == 1
    assert len([m for m in msgs if "CPU tier is full" in m]) == 1


@pytest.mark.cuda
def test_lowered_and_disk_paths_on_a_cuda_pool(tmp_path):
    """The side-stream gather + quantize, pinned staging, dequantize on the device, and the
    disk behind a pinned CPU tier (the lead's H200)."""
    pool = make_pool(torch.bfloat16, "cuda")
    try:
        gen = torch.Generator().manual_seed(5)
        tier = tier_of(pool, 4, 16, str(tmp_path), lowering=True)
        assert tier.host.is_pinned()
        m = Model(pool, tier)
        m.down(2, gen)
        low = m.down(4, gen, low=True)
        assert all(tier.lowered(s) for s in low)
        m.down(5, gen)  # spills to disk
        assert tier.stats()["bytes_to_disk"] > 0
        m.up_and_check(sorted(m.held), gen)
        m.release(sorted(m.held))
        assert tier.num_free == 20
    finally:
        release_pools()


@pytest.mark.parametrize("gone", ["before the first call", "after the first call"])
def test_the_disk_tiers_directory_gone_after_enable_costs_one_warning_not_the_calls(
    oxygen, tmp_path, caplog, gone
):
    """A temp cleaner or an unmounted volume took pool.disk_tier_path after enable(). The tier is
    made at a pool's first call, and with the prefix cache on every call makes it: its file could
    not be made, and every generate() failed. Now the disk tier is off with one warning naming
    the path and the error, and the CPU tier goes on. A tier made before keeps its open file."""
    from test_hf_generate import tiny
    from test_prefix_cache import BT, _prompts, _tokens

    directory = tmp_path / "tier"
    directory.mkdir()
    system = [t % 127 + 1 for t in _tokens(3, 2 * BT + 5)]
    ids, mask = _prompts(4, system, users=[9, 20, 5], pads=[3, 0, 6])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    with torch.no_grad():
        want = tiny("llama").generate(**kw)
    row = 2 * 2 * BT * 2 * 64 * 4  # layers x K/V x tokens x heads x head dim x float32
    pool_cfg = dict(cpu_tier_bytes=2 * row, disk_tier_path=str(directory),
                    disk_tier_bytes=64 * row)  # fmt: skip
    model = hf.apply(tiny("llama"), load_config(prefix_cache=True, pool=pool_cfg))
    outs = []
    with caplog.at_level(logging.WARNING, logger="oxygen_torch"), torch.no_grad():
        if gone == "after the first call":
            outs.append(model.generate(**kw))
        shutil.rmtree(directory)
        outs += [model.generate(**kw) for _ in range(2)]
        (pool,) = [p for p in kv_pool._pools.values() if p.prefix is not None]
        gc.collect()  # the calls' caches give their blocks back
        with pool.lock:  # every cached block to the CPU tier, and on to disk where there is one
            pool.prefix.evict(pool.prefix.num_hot)
        outs.append(model.generate(**kw))  # cold-zone hits
    assert all(torch.equal(out, want) for out in outs)
    warned = [r.getMessage() for r in caplog.records if "disk tier" in r.getMessage()]
    tier = pool.tier.stats()
    if gone == "before the first call":
        assert len(warned) == 1, warned
        assert str(directory) in warned[0] and "No such file or directory" in warned[0]
        assert pool.tier.disk is None and tier["slots_total"] == 2 and tier["bytes_down"] > 0
    else:
        assert warned == [] and tier["bytes_to_disk"] > 0 and tier["bytes_from_disk"] > 0
