"""The seventh session's GPU paths: the CPU tier's pinned, side-stream migration, swap preemption,
prefix-cache hits and merged decode graphs, on a CUDA device (float32: the paged kernels; merged
and alone runs use different kernel shapes, so tokens are compared as an agreement rate, as in
test_engine_cuda.py, and the bytes of migration exactly)."""

from __future__ import annotations

import pytest
import torch
from test_engine import call_kw, in_threads, llama, prompt, schedulers

import oxygen_torch
from oxygen_torch.config import load_config
from oxygen_torch.config.fields import default_cpu_tier_bytes
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.kv import pool_stats, transfer
from oxygen_torch.kv.pool import PoolKey, get_pool

# the per-call path (scheduler.engine=false): tests/test_engine_loop.py tests the engine's
pytestmark = [pytest.mark.cuda, pytest.mark.per_call]
MiB = 1 << 20


def _cuda(kw: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def _agreement(out: dict, ref: list) -> float:
    return sum((out[i] == r).float().mean().item() for i, r in enumerate(ref)) / len(ref)


# 5 and 2: a move of 37 blocks goes in 8 chunks of up to 3 pieces, copies beside gathers, the
# pieces down paced (each gather after the last piece's copy)
@pytest.mark.parametrize("staging_blocks,copy_blocks", [(5, 2), (None, None)])
@pytest.mark.parametrize("copies", ["gather", "mapped", "auto", "auto beside steps"])
def test_cuda_tier_migration_is_byte_exact_while_the_stream_is_busy(
    oxygen, monkeypatch, staging_blocks, copy_blocks, copies
):
    dev = torch.device("cuda")
    monkeypatch.setattr(transfer, "_last_step", {})
    if copies == "auto beside steps":  # a step runs on the device: the kernel moves down
        monkeypatch.setattr(transfer, "BESIDE_S", 3600.0)
        transfer.note_step(dev)
    mapped = {"mapped": 2 * 37, "auto beside steps": 37}.get(copies, 0)  # (auto: up gathered)
    key = PoolKey(dev, 4, 4, 128, torch.bfloat16, 16, "auto", 256 * MiB, 2 * MiB)
    pool = get_pool(key)
    if staging_blocks:
        monkeypatch.setattr(transfer, "STAGING_BYTES", staging_blocks * pool.block_bytes())
        monkeypatch.setattr(transfer, "COPY_BYTES", copy_blocks * pool.block_bytes())
    tier = pool.cpu_tier(64 * MiB, moves=copies.split()[0])
    st = pool.storage
    with pool.lock:
        blocks = pool.manager.allocate(37)
    idx = torch.tensor(blocks, device=dev)
    big = torch.randn(4096, 4096, device=dev)
    want = []
    for cache in (*st.k, *st.v):
        _ = big @ big  # queued work ahead of the writes: the side stream must wait for it
        data = torch.randn(len(blocks), *cache.shape[1:], device=dev).to(cache.dtype)
        cache.index_copy_(0, idx, data)
        want.append(data)
    slots = tier.down(blocks)  # the host does not wait for it
    with pool.lock:
        # freed behind the copy: taking them back at once orders this stream after it
        pool.manager.decref(blocks, after=tier.fence())
        taken = pool.manager.allocate(pool.manager.num_free)
    again = [b for b in taken if b in set(blocks)]
    assert len(again) == 37
    for cache in (*st.k, *st.v):
        cache.index_fill_(0, torch.tensor(again, device=dev), 3.0)
    order = list(reversed(again))
    tier.up(slots, order)
    _ = big @ big
    for cache, data in zip((*st.k, *st.v), want):
        got = cache.index_select(0, torch.tensor(order, device=dev))
        assert torch.equal(got, data)
    tier.release(slots)
    with pool.lock:
        pool.manager.decref(taken)
    s = tier.stats()
    assert s["bytes_down"] == s["bytes_up"] == 37 * tier.block_bytes
    chunk = staging_blocks or transfer.STAGING_BYTES // tier.block_bytes
    assert s["blocks_mapped"] == mapped
    # each move by the kernel: one replay of its bucket's graph, captured at its first move
    moves = (mapped == 2 * 37) + (mapped > 0)
    assert (s["mapped_replays"], s["mapped_graphs"], s["mapped_eager"]) == (moves, moves, 0)
    # kept, allocated once (the mapped kernel stages nothing)
    assert s["staging_bytes"] == (0 if copies == "mapped" else chunk * tier.block_bytes)


@pytest.mark.parametrize("distance, tier_bytes", [(4, 64 * MiB), (0, 64 * MiB), (0, None)])
def test_swap_preemption_on_the_gpu(oxygen, distance, tier_bytes):
    """Swap preemption on the GPU; kv.prefetch_distance 4: swapped calls start coming back when
    a step chooses them (their copy on the side stream) and may sit out while it runs. None:
    the CPU tier of the default size (pool.cpu_tier_bytes not set)."""
    pool_cfg = {} if tier_bytes is None else {"cpu_tier_bytes": tier_bytes}
    cfg = load_config(kv={"block_tokens": 128, "arena_bytes": 8 << 20,
                          "prefetch_distance": distance}, pool=pool_cfg)  # fmt: skip
    model = hf.apply(llama().cuda(), cfg)
    kws = []
    for s in range(6):
        ids, mask = prompt(s, rows=6, length=100 + s)
        kws.append(_cuda(dict(input_ids=ids, attention_mask=mask, max_new_tokens=40,
                              do_sample=False)))  # fmt: skip
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
        out, errors = in_threads(lambda kw: model.generate(**kw), [(kw,) for kw in kws])
    assert not errors, errors
    agree = _agreement(out, ref)
    (sched,) = schedulers(model)
    (pool,) = [p for p in pool_stats() if p["block_tokens"] == 128]
    tier = pool["cpu_tier"]
    st = sched.stats
    print(f"\nswap on the GPU: agreement {agree:.4f}, swaps {st.swaps}, ahead {st.swaps_ahead}, "
          f"sat out {st.sat_out}, tier {tier}")  # fmt: skip
    assert agree >= 0.9
    assert st.swaps > 0 and tier["bytes_up"] == tier["bytes_down"] > 0
    assert (st.swaps_ahead > 0) == (distance > 0) and st.swaps_ahead <= st.swaps
    assert tier["slots_used"] == 0 and pool["blocks_used"] == 0
    if tier_bytes is None:  # the default's size, in whole rows
        want = default_cpu_tier_bytes()
        assert want - tier["capacity_bytes"] < tier["capacity_bytes"] // tier["slots_total"]


def test_a_swap_in_ahead_is_waited_for_by_the_next_step_not_by_the_current_stream(oxygen):
    """swap_in(ahead=True) behind a busy side stream: the current stream does not wait (the
    copy is still pending after its own work is done), and `resident` (the step's start) makes
    it wait, so what the step reads is the K/V from before the swap, not what another user
    wrote into the freed blocks meanwhile."""
    from oxygen_torch.kv.swap import pending, resident, swap_in, swap_out

    model = hf.apply(llama(seed=2).cuda(), load_config(kv={"arena_bytes": 32 * MiB}))
    ids = torch.randint(1, 128, (2, 37), generator=torch.Generator().manual_seed(9)).cuda()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    core = out.past_key_values._core
    want = [core.dense(layer) for layer in range(core.num_layers)]
    tier = core.pool.cpu_tier(16 * MiB)  # (a small arena: every free block is taken below)
    assert swap_out(core) > 0
    with core.pool.lock:  # the freed blocks are overwritten by someone else meanwhile
        taken = core.pool.manager.allocate(core.pool.manager.num_free)
    st = core.pool.storage
    for cache in (*st.k, *st.v):
        cache.index_fill_(0, torch.tensor(taken, device=cache.device), 7.0)
    with core.pool.lock:
        core.pool.manager.decref(taken)
    with torch.cuda.stream(tier._side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of the side stream before the copy
    swap_in(core, ahead=True)
    torch.cuda.current_stream().synchronize()  # the current stream did not wait for it
    assert core._swapped is None and pending(core)
    resident(core)  # (a step's start) the current stream waits for the copy
    assert core._ready is None
    got = [core.dense(layer) for layer in range(core.num_layers)]
    for layer, ((k, v), (gk, gv)) in enumerate(zip(want, got)):
        assert torch.equal(gk, k) and torch.equal(gv, v), layer
    assert not pending(core)


def _down_and_up(pool, tier, n: int, g: torch.Generator, busy=lambda: None) -> None:
    """n blocks of random bytes moved down to the tier and back up over other bytes: each byte
    back in place (`busy` queues work on the current stream before each layer's write)."""
    st, dev = pool.storage, pool.storage.k[0].device
    with pool.lock:
        blocks = pool.manager.allocate(n)
    idx = torch.tensor(blocks, device=dev)
    want = []
    for cache in (*st.k, *st.v):
        busy()
        data = torch.randn(n, *cache.shape[1:], device=dev, generator=g).to(cache.dtype)
        cache.index_copy_(0, idx, data)
        want.append(data)
    slots = tier.down(blocks)
    tier.wait()
    for cache in (*st.k, *st.v):
        cache.index_fill_(0, idx, 5.0)
    tier.up(slots, blocks)
    for cache, data in zip((*st.k, *st.v), want):
        assert torch.equal(cache.index_select(0, idx), data), n
    tier.release(slots)
    with pool.lock:
        pool.manager.decref(blocks)


def test_mapped_moves_replay_one_graph_a_bucket_byte_exact(oxygen, monkeypatch):
    """transfer.MappedMoves on the GPU: moves of 3 to 300 blocks down and back up by graph
    replays (one graph per direction and bucket: 64, 64, 128, 512), each byte in place, behind
    queued work on the current stream; a graph replayed for a smaller move of its bucket moves
    only that move's blocks."""
    dev = torch.device("cuda")
    monkeypatch.setattr(transfer, "_last_step", {})  # no steps: one grid throughout
    key = PoolKey(dev, 4, 4, 128, torch.bfloat16, 16, "auto", 256 * MiB, 2 * MiB)
    pool = get_pool(key)
    tier = pool.cpu_tier(64 * MiB, moves="mapped")
    big = torch.randn(4096, 4096, device=dev)
    g = torch.Generator(device=dev).manual_seed(3)
    for n in (3, 40, 65, 300, 40):
        _down_and_up(pool, tier, n, g, lambda: big @ big)
    s = tier.stats()
    assert s["blocks_mapped"] == 2 * (3 + 40 + 65 + 300 + 40)
    assert (s["mapped_graphs"], s["mapped_replays"], s["mapped_eager"]) == (6, 10, 0), s


def test_prefix_cache_hits_on_the_gpu(oxygen):
    g = torch.Generator().manual_seed(5)
    system = torch.randint(1, 128, (1, 70), generator=g)
    turns = [torch.cat([system, torch.randint(1, 128, (1, 9), generator=g)], 1) for _ in range(3)]
    model = llama(seed=3).cuda()
    with torch.no_grad():
        ref = [model.generate(t.cuda(), max_new_tokens=12, do_sample=False) for t in turns]
    hf.apply(model, load_config(kv={"prefix_cache": True}))
    with torch.no_grad():
        out = {i: model.generate(t.cuda(), max_new_tokens=12, do_sample=False)
               for i, t in enumerate(turns)}  # fmt: skip
    (pc,) = [p["prefix_cache"] for p in pool_stats() if p["prefix_cache"]]
    agree = _agreement(out, ref)
    print(f"\nprefix cache on the GPU: agreement with stock {agree:.4f}, {pc}")
    assert pc["hits"] >= 2 and pc["hit_tokens"] >= 2 * 64
    assert agree >= 0.95


def test_merged_decode_graphs_on_the_gpu(oxygen):
    model = hf.apply(llama(seed=4).cuda(), load_config(scheduler={"decode_graphs": True}))
    kws = [_cuda(call_kw(s)) for s in range(8)]
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
        out, errors = in_threads(lambda kw: model.generate(**kw), [(kw,) for kw in kws])
    assert not errors, errors
    st = oxygen_torch.decode_graph_stats(model)["merged"]
    agree = _agreement(out, ref)
    print(f"\nmerged decode graphs on the GPU: agreement {agree:.4f}, {st}")
    assert st["replays"] >= 1 and st["failed"] == 0, st
    assert agree >= 0.9
    assert max(schedulers(model)[0].stats.batch_sizes) > 3


@pytest.mark.parametrize("moves", ["auto", "mapped"])
def test_warmed_mapped_moves_capture_nothing_at_the_first_swap(oxygen, monkeypatch, moves):
    """CPUTier.warm_moves (oxygen_torch.warm_up) on the GPU: the mapped kernel's graphs for
    moves of up to 300 blocks captured up front (auto: down only, at both grids; mapped: both
    ways); moves down beside steps then replay them, capturing none, byte exact."""
    dev = torch.device("cuda")
    monkeypatch.setattr(transfer, "_last_step", {})
    key = PoolKey(dev, 4, 4, 128, torch.bfloat16, 16, "auto", 256 * MiB, 2 * MiB)
    pool = get_pool(key)
    tier = pool.cpu_tier(64 * MiB, moves=moves)
    with pool.lock:
        warmed = tier.warm_moves(300)
    ways = 2 if moves == "mapped" else 1
    assert warmed == ways * 2 * 4, warmed  # grids x buckets 64, 128, 256, 512
    with pool.lock:
        assert tier.warm_moves(300) == 0
    g = torch.Generator(device=dev).manual_seed(5)
    for n in (40, 300):
        transfer.note_step(dev)  # (steps beside: auto's moves down take the kernel)
        _down_and_up(pool, tier, n, g)
    s = tier.stats()
    assert s["mapped_graphs"] == warmed and s["mapped_eager"] == 0, s
    assert s["mapped_replays"] == 2 * ways, s
