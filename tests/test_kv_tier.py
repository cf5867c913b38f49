"""The CPU tier (kv/tier.py), block heat (kv/heat.py) and swap preemption (kv/swap.py).

Migration is checked byte for byte on the host backend (both sides in host memory: the arena and
the tier); swap preemption against the same calls run alone (float32, greedy: the same tokens)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from sim_steps import Steps
from test_engine import generate, in_threads, llama, prompt, schedulers, together_as_alone

import oxygen_torch
from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.kv import pool_stats
from oxygen_torch.kv.attention import gather_blocks
from oxygen_torch.kv.heat import HOT, Heat
from oxygen_torch.kv.lruk import NEVER
from oxygen_torch.kv.pool import PoolKey, get_pool, release_pools
from oxygen_torch.kv.swap import swap_out
from oxygen_torch.tools import metrics

# the per-call path (scheduler.engine=false): tests/test_engine_loop.py tests the engine's
pytestmark = pytest.mark.per_call

MiB = 1 << 20


def test_heat_counters_saturate_decay_and_order_lru_k():
    heat = Heat(8, sweep_every=0)
    for _ in range(5):  # block 1: read every step, saturates at 3
        heat.touch(torch.tensor([[1, 1, 0]]))  # a repeat in one step counts once; 0 is the guard
    assert heat.key(1)[0] == HOT and heat.key(0)[0] == 0
    heat.touch(torch.tensor([2, 3]))  # 2, 3: once each, at clock 6
    heat.touch(torch.tensor([3, 4]))  # 3 twice; 4 once, later
    heat.touch(torch.tensor([5]))
    assert heat.coldest([1, 2, 3, 4, 5], 5) == [2, 4, 5, 3, 1]
    # counters tie at 1 for 2, 4, 5; 3 has 2; LRU-K: 2, 4, 5 have no second access (oldest last
    # access first), then 3
    heat.sweep()  # halves: 1 -> 0, 2 -> 1, 3 -> 1
    assert [heat.key(b)[0] for b in (1, 2, 3)] == [1, 0, 1]
    heat.sweep()
    assert heat.key(1)[0] == 0
    # all cold now: LRU-K alone decides; 1 was read five times (its 2nd-last read at clock 4)
    assert heat.coldest([1, 2, 3, 4, 5], 5) == [2, 4, 5, 1, 3]
    heat.forget([3])
    assert heat.coldest([1, 3], 1) == [3]
    before = [heat.key(b) for b in range(8)]
    table = torch.tensor([-1, 8, 99])
    heat.touch(table)  # ids outside the pool (padding): nothing counted, the table unchanged
    assert [heat.key(b) for b in range(8)] == before and table.tolist() == [-1, 8, 99]


def test_heat_sampled_every_nth_step_counts_that_step_only():
    """touch_every 4 (the pool's HEAT_EVERY): the 1st-3rd touches count nothing, the 4th
    counts its blocks at clock 1; sweeps count touches that counted."""
    heat = Heat(8, sweep_every=2, touch_every=4)
    for blocks in ([1], [2], [3]):
        heat.touch(torch.tensor(blocks))
    assert heat.clock == 0 and all(heat.key(b)[0] == 0 for b in (1, 2, 3))
    heat.touch(torch.tensor([[4, 4, 0]]))
    assert heat.clock == 1 and heat.key(4) == (1, NEVER, 1)
    for _ in range(4):
        heat.touch(torch.tensor([4]))
    assert heat.clock == 2 and heat.key(4)[0] == 1  # 2 counted, then halved by the 2nd's sweep


@pytest.fixture
def host_pool():
    key = PoolKey(torch.device("cpu"), 3, 2, 64, torch.float32, 16, "auto", 16 * MiB, 2 * MiB)
    pool = get_pool(key)
    yield pool
    release_pools()


@pytest.mark.parametrize("tier_first", [True, False])
def test_block_heat_is_kept_only_with_a_tier_and_a_prefix_cache(host_pool, tier_first):
    """The blocks' heat (its one reader: the prefix cache's order of what moves down) is made
    once the pool has both, whichever comes first; a pool with a tier alone counts no step's
    reads (each count: ~15 torch calls on the engine thread); with both, its counts work."""
    pool = host_pool
    if tier_first:
        assert pool.cpu_tier(2 * MiB) is not None
    else:
        assert pool.prefix_cache(4 * MiB) is not None
    assert pool.heat is None
    if tier_first:
        pc = pool.prefix_cache(4 * MiB)
    else:
        pool.cpu_tier(2 * MiB)
        pc = pool.prefix
    heat = pool.heat
    assert heat is not None and pc.heat is heat
    assert pool.prefix_cache(4 * MiB) is pc and pool.heat is heat  # made once
    blocks = [int(b) for b in torch.randperm(pool.storage.num_blocks - 1)[:3] + 1]
    for _ in range(heat.touch_every):
        heat.touch(torch.tensor([blocks]))
    assert [heat.key(b)[0] for b in blocks] == [1, 1, 1]


def test_a_release_naming_a_slot_twice_frees_it_once_then_says_so(host_pool):
    """A move's slots are freed at once (one check, then one loop); a list that names a slot
    twice frees what comes before the repeat, as freeing them one by one does, and raises."""
    pool = host_pool
    tier = pool.cpu_tier(2 * MiB)
    with pool.lock:
        blocks = pool.manager.allocate(4)
    slots = tier.down(blocks)
    free = tier.num_free
    with pytest.raises(ValueError, match=f"slot {slots[1]} is not taken"):
        tier.release([slots[0], slots[1], slots[1]])
    assert tier.num_free == free + 2
    tier.release(slots[2:])
    assert tier.num_free == free + 4 and tier.stats()["slots_used"] == 0
    assert tier.down(blocks) == slots  # the lowest rows again
    tier.release(slots)
    with pool.lock:
        pool.manager.decref(blocks)


def test_migration_down_and_up_preserves_every_byte(host_pool):
    pool = host_pool
    tier = pool.cpu_tier(2 * MiB)
    assert pool.storage.backing.name == "arena"  # the host backend's arena, pages mapped on use
    assert tier.num_slots == 2 * MiB // (16 * 2 * 64 * 4 * 2 * 3)
    with pool.lock:
        blocks = pool.manager.allocate(7)
    st = pool.storage
    idx = torch.tensor(blocks)
    want = []
    for cache in (*st.k, *st.v):
        data = torch.randn(len(blocks), *cache.shape[1:])
        cache.index_copy_(0, idx, data)
        want.append(data)
    slots = tier.down(blocks)
    with pool.lock:
        pool.manager.decref(blocks)  # freed: their pages may go
        again = pool.manager.allocate(7)
    for cache in (*st.k, *st.v):  # whatever is there now is overwritten
        cache.index_copy_(0, torch.tensor(again), torch.randn(7, *cache.shape[1:]))
    order = list(reversed(again))  # back into other blocks, in another order
    tier.up(slots, order)
    for cache, data in zip((*st.k, *st.v), want):
        got = cache.index_select(0, torch.tensor(order))
        assert torch.equal(got.view(torch.int32), data.view(torch.int32))
    tier.release(slots)
    stats = tier.stats()
    assert stats["slots_used"] == 0
    assert stats["bytes_down"] == stats["bytes_up"] == 7 * tier.block_bytes
    with pool.lock:
        pool.manager.decref(again)


def test_an_unknown_way_of_moves_is_named_and_moves_nothing(host_pool):
    """pool.tier_moves is checked where the configuration loads, and a tier given an unknown way
    (set on it later) names it on its next move, having moved nothing."""
    with pytest.raises(ValueError, match="pool.tier_moves: 'dma' is not allowed"):
        load_config(pool={"tier_moves": "dma"})
    tier = host_pool.cpu_tier(2 * MiB)
    with host_pool.lock:
        blocks = host_pool.manager.allocate(2)
    tier.moves = "dma"
    with pytest.raises(ValueError, match="pool.tier_moves: 'dma' is not one of"):
        tier.down(blocks)
    assert tier.stats()["bytes_down"] == tier.stats()["slots_used"] == 0
    tier.moves = "auto"
    with host_pool.lock:
        host_pool.manager.decref(blocks)


def test_tier_moves_by_the_mapped_kernel_or_gathers_give_the_same_rows(host_pool):
    """The tier's moves both ways, by the mapped kernel (pool.tier_moves "mapped", in Triton's
    interpreter here) and by gathers and scatters alone ("gather", what "auto" takes on the
    host), leave the same rows and blocks."""
    from oxygen_torch.kv import transfer

    st, tier, got = host_pool.storage, host_pool.cpu_tier(2 * MiB), {}
    for way in ("mapped", "gather"):
        tier.moves = way
        mapped = tier.stats()["blocks_mapped"]
        with host_pool.lock:
            blocks = host_pool.manager.allocate(9)
        for c in (*st.k, *st.v):  # the same bytes for both ways
            c.copy_(torch.randn(c.shape, generator=torch.Generator().manual_seed(9)))
        order = blocks[4:] + blocks[:4]
        want = transfer.gather([st.block_view()], torch.tensor(order))
        slots = tier.down(order)
        rows = tier.host[[tier._where[s] for s in slots], : tier.block_bytes].clone()
        assert torch.equal(rows, want)  # the rows hold the blocks in the order given
        for c in (*st.k, *st.v):
            c.view(torch.uint8).fill_(0)
        tier.up(slots, blocks)  # and come up into `blocks` in that order
        got[way] = transfer.gather([st.block_view()], torch.tensor(blocks))
        assert torch.equal(got[way], want)
        assert tier.stats()["blocks_mapped"] - mapped == (18 if way == "mapped" else 0)
        tier.release(slots)
        with host_pool.lock:
            host_pool.manager.decref(blocks)
    tier.moves = "auto"
    assert torch.equal(got["mapped"], got["gather"])


def test_the_mapped_way_on_the_host_without_the_interpreter_gathers_and_says_why(
    host_pool, monkeypatch, caplog
):
    """pool.tier_moves "mapped" on the host backend outside Triton's interpreter: the moves
    gather (every byte arrives) and one warning names why."""
    from oxygen_torch.kv import transfer

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    st, tier = host_pool.storage, host_pool.cpu_tier(2 * MiB, moves="mapped")
    with host_pool.lock:
        blocks = host_pool.manager.allocate(5)
    want = transfer.gather([st.block_view()], torch.tensor(blocks))
    with caplog.at_level(logging.WARNING, logger="oxygen_torch"):
        for _ in range(2):
            slots = tier.down(blocks)
            for c in (*st.k, *st.v):
                c.view(torch.uint8).fill_(0)
            tier.up(slots, blocks)
            tier.release(slots)
    assert torch.equal(transfer.gather([st.block_view()], torch.tensor(blocks)), want)
    assert tier.stats()["blocks_mapped"] == 0
    said = [r.getMessage() for r in caplog.records if "not the mapped kernel" in r.getMessage()]
    assert len(said) == 1 and "only in Triton's interpreter" in said[0]
    with host_pool.lock:
        host_pool.manager.decref(blocks)


def _burst(tier_bytes: int, graphs: bool = False, prefetch: int = 4, moves: str = "auto"):
    """31 KV blocks of 128 tokens; six calls of six rows start at one block a row (prompts of
    about 100 tokens: five calls admitted at once) and cross into a second during decode, so
    any three of them at once need 36: younger calls are preempted even when the calls
    overlap only partly (a loaded machine). `graphs`: merged decode steps through graphs too."""
    cfg = load_config(
        kv={
            "block_tokens": 128,
            "arena_bytes": 8 << 20,
            "prefetch_distance": prefetch,
            "cpu_decode_graphs": "rerun" if graphs else "off",
        },
        pool={"cpu_tier_bytes": tier_bytes, "tier_moves": moves},
        scheduler={"decode_graphs": graphs},
    )
    model = hf.apply(llama(), cfg)
    kws = []
    for s in range(6):
        ids, mask = prompt(s, rows=6, length=100 + s)
        kws.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False))
    return model, kws


@pytest.mark.parametrize("graphs,copies", [(False, "auto"), (True, "auto"), (False, "mapped")])
def test_swap_preemption_gives_the_tokens_of_no_preemption(oxygen, monkeypatch, graphs, copies):
    """With `graphs`, decode steps (alone and merged) go through the decode graphs' bookkeeping
    (the CPU stand-in): a swapped-out call comes back before its graph step plans it. "mapped":
    the moves go by the mapped kernel (Triton's interpreter), beside the steps."""
    from oxygen_torch.kv import transfer

    monkeypatch.setattr(transfer, "_last_step", {})
    model, kws = _burst(64 * MiB, graphs, moves=copies)
    together_as_alone(model, kws)
    monkeypatch.setattr(transfer, "BESIDE_S", 3600.0)
    assert transfer.beside_steps(torch.device("cpu"))  # the cache's steps were noted
    if graphs:
        st = oxygen_torch.decode_graph_stats(model)
        assert st["replays"] + st["merged"]["replays"] > 0, st
    (sched,) = schedulers(model)
    assert sched.stats.swaps > 0 and sched.stats.swaps == sched.stats.preemptions
    (pool,) = [p for p in pool_stats() if p["block_tokens"] == 128]
    tier = pool["cpu_tier"]
    assert tier["migrations_down"] > 0 and tier["bytes_up"] == tier["bytes_down"] > 0
    moved = tier["bytes_down"] // (tier["capacity_bytes"] // tier["slots_total"])
    assert tier["blocks_mapped"] == (2 * moved if copies == "mapped" else 0)
    assert tier["slots_used"] == 0 and pool["blocks_used"] == 0  # nothing left behind
    mem = oxygen_torch.memory_stats()
    assert mem["migrated_to_cpu_bytes"] == mem["migrated_to_gpu_bytes"] == tier["bytes_down"]
    assert mem["tier_cpu_capacity_bytes"] == tier["capacity_bytes"] > 0
    assert mem["tier_cpu_used_bytes"] == 0
    text = metrics.scrape()
    series = 'oxygen:migration_bytes_total{device="0",direction="gpu_to_cpu"}'
    (line,) = [ln for ln in text.splitlines() if ln.startswith(series)]
    assert float(line.split()[-1]) == tier["bytes_down"]


@pytest.mark.parametrize("distance", [0, 1, 3])
def test_swapped_calls_come_back_ahead_of_their_step(oxygen, monkeypatch, distance):
    """kv.prefetch_distance: a swapped-out call that a step chooses starts coming back then,
    and while its copy runs (here: a copy said to be running at every look) it sits out up to
    `distance` steps in a row while the others step, then joins; the tokens are those of no
    preemption. 0: nothing starts ahead and nobody sits out (its step swaps it in)."""
    from oxygen_torch.integrations.hf import batched

    coming: set[int] = set()  # cores whose swap-in ahead is "still copying"
    monkeypatch.setattr(batched, "pending", lambda core: id(core) in coming)
    fetch, seen = batched.Merger.fetch, []

    def watched(self, call):
        core = call.state.cache._core
        swapped = core._swapped is not None
        if swapped:
            coming.add(id(core))
        ahead, sit = fetch(self, call)
        assert ahead == (swapped and distance > 0)  # every chosen swapped call, at once
        if not sit:
            coming.discard(id(core))
        seen.append((call.sat_out, sit))
        return ahead, sit

    monkeypatch.setattr(batched.Merger, "fetch", watched)
    from oxygen_torch.engine.scheduler import StepScheduler

    ahead_of, steps = StepScheduler._fetch_ahead, []  # steps: (calls chosen, calls that would sit)

    def looked(self, step):
        chosen, before = len(step.chosen), len(seen)
        ahead_of(self, step)
        steps.append((chosen, sum(sit for _, sit in seen[before:])))

    monkeypatch.setattr(StepScheduler, "_fetch_ahead", looked)
    model, kws = _burst(64 * MiB, prefetch=distance)
    for s, kw in enumerate(kws):  # calls that end apart: a swapped call comes back beside others
        kw["max_new_tokens"] += 6 * s
    together_as_alone(model, kws)
    (sched,) = schedulers(model)
    st = sched.stats
    assert st.swaps > 0
    if distance == 0:
        assert st.swaps_ahead == st.sat_out == 0 and not any(sit for _, sit in seen)
        return
    assert st.swaps_ahead > 0
    # Who sat out is decided per step: those whose copy still runs, unless that is every call
    # the step chose (then it waits for their copies). Whether a swapped call comes back beside
    # others or alone is the threads' timing (a loaded CI machine: alone, now and then).
    assert st.sat_out == sum(sit for chosen, sit in steps if sit < chosen)
    if not st.sat_out:
        assert all(sit == chosen for chosen, sit in steps if sit)
        return
    assert max(n for n, sit in seen if sit) <= distance - 1  # never more steps in a row
    if distance == 1:
        assert any(n == 1 and not sit for n, sit in seen)  # one step out, then taken
    assert sched.snapshot()["sat_out"] == st.sat_out
    (pool,) = [p for p in pool_stats() if p["block_tokens"] == 128]
    assert pool["cpu_tier"]["slots_used"] == 0 and pool["blocks_used"] == 0


class _Steps(Steps):
    """sim_steps.Steps: call "B" sits its `sit_at`-th chosen step out once
    (a swap-in ahead)."""

    def __init__(self, step_s: float, sit_at: int):
        super().__init__(step_s)
        self.sit_at, self.chosen = sit_at, 0

    def fetch(self, call):
        if call.key != "B":
            return False, False
        self.chosen += 1
        return False, self.chosen == self.sit_at


def test_a_call_that_sat_out_steps_with_the_others_again():
    """After a call sits a step out (its swap-in ahead still copying), it waits for the next
    step with the others, as a fresh submit does: its request, older than the gather deadline
    once the step is over, must not make a step due at once with it alone while the others are
    in their own code, which would keep the two a step apart from then on."""
    import time

    from oxygen_torch.config import SchedulerConfig
    from oxygen_torch.engine.scheduler import StepScheduler
    from oxygen_torch.engine.task import Task

    runner = _Steps(step_s=0.12, sit_at=3)  # a step: 3x the gather deadline
    sched = StepScheduler(SchedulerConfig(gather_ms=40.0), runner)
    calls = {k: sched.enter(Task(), key=k) for k in "AB"}

    def loop(key):
        for _ in range(12):
            sched.submit(calls[key], None)
            time.sleep(0.002)  # sampling, in the call's own code
        sched.leave(calls[key])

    _, errors = in_threads(loop, [(k,) for k in "AB"])
    assert not errors, errors
    assert sched.stats.sat_out == 1
    after = runner.log[runner.log.index(["A"]) + 1 :]  # the step B sat out, then
    assert after[0] == ["A", "B"] or after[1] == ["A", "B"]
    assert sum(step == ["A", "B"] for step in after) >= len(after) - 3, runner.log


def test_a_full_cpu_tier_degrades_to_recompute_with_one_warning(oxygen, caplog):
    model, kws = _burst(256 * 1024)  # one slot: no call's KV fits
    with caplog.at_level(logging.WARNING, logger="oxygen_torch"):
        together_as_alone(model, kws)
    (sched,) = schedulers(model)
    assert sched.stats.preemptions > 0 and sched.stats.swaps == 0
    full = [r for r in caplog.records if "CPU tier is full" in r.getMessage()]
    assert len(full) == 1


def test_a_swapped_out_cache_comes_back_before_a_decode_graph_step_plans_it(oxygen):
    """A call preempted to the CPU tier whose next step is a single call's decode graph: the
    graph's plan (block table, slots) must name its blocks back on the device, holding its K/V,
    not the freed ids it had before the swap."""
    model = hf.apply(llama(seed=2))
    ids = torch.randint(1, 128, (2, 37), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    core = out.past_key_values._core
    want = [core.dense(layer) for layer in range(core.num_layers)]
    core.pool.cpu_tier(16 * MiB)  # (the engine attaches it at its first preemption)
    held = sorted({b for row in core.seqs.blocks for b in row})
    assert swap_out(core) > 0 and core._swapped is not None
    with core.pool.lock:  # the freed blocks are taken and overwritten by someone else, who
        taken = core.pool.manager.allocate(core.pool.manager.num_free)  # keeps them meanwhile
    assert set(held) <= set(taken)
    st = core.pool.storage
    for cache in (*st.k, *st.v):  # (only those: the whole pool is 4 GiB of host pages to touch)
        cache.index_fill_(0, torch.tensor(held), 7.0)
    with core.pool.lock:
        core.pool.manager.decref([b for b in taken if b not in set(held)])
    table, _ = core.begin_graph_step(16)
    assert core._swapped is None
    n = core.length - 1  # the step begun counts its token already
    blocks = table[:, : -(-n // core.block_tokens)].to(torch.int64)
    for layer, (k, _) in enumerate(want):  # (a plan naming the old ids reads 7s)
        got = gather_blocks(st.k[layer], core.pool.k_scale(layer), blocks, n, k.dtype)
        assert torch.equal(got, k), layer
    core.end_graph_step()
    with core.pool.lock:
        core.pool.manager.decref(held)


@pytest.mark.parametrize("at", [0, 1, 5])
def test_a_lone_forward_short_of_blocks_goes_through_the_scheduler(oxygen, monkeypatch, at):
    """The only live call runs its forwards by itself, without a KV check or preemption; a call
    that enters meanwhile can take the blocks first (the KVCacheFull that reached calls in
    whole-suite runs). Such a forward reserved nothing and goes through the scheduler instead:
    the call ends with the tokens it has alone."""
    from oxygen_torch.integrations.hf import batched, router
    from oxygen_torch.kv.block_manager import KVCacheFull

    model, kws = _burst(64 * MiB, prefetch=0)
    kw = kws[at % len(kws)]
    want = generate(model, kw)
    alone, wanted, forward = router._alone, batched.Merger.wanted, batched.Merger.forward
    n, entered, served = [0], [], []

    def short_once(*a, **k):  # the lone forward number `at` finds no block: a call entered
        n[0] += 1
        if n[0] == at + 1:
            entered.append(1)
            raise KVCacheFull("KV cache full: 1 block(s) asked, 0 free of 31 (test)")
        return alone(*a, **k)

    def wanted_now(self, kw, args):  # (the call that entered: live() is 2 for that look)
        return bool(entered and entered.pop()) or wanted(self, kw, args)

    def counted(self, *a, **k):
        served.append(1)
        return forward(self, *a, **k)

    monkeypatch.setattr(router, "_alone", short_once)
    monkeypatch.setattr(batched.Merger, "wanted", wanted_now)
    monkeypatch.setattr(batched.Merger, "forward", counted)
    got = generate(model, kw)
    assert torch.equal(got, want) and len(served) == 1
    (pool,) = [p for p in pool_stats() if p["block_tokens"] == 128]
    assert pool["blocks_used"] == 0


def test_a_lone_call_short_of_blocks_by_itself_keeps_its_error(oxygen, monkeypatch):
    """Still the only live call, a forward short of blocks is short by itself: its KVCacheFull
    stands (kv.oversubscribe splits such a call, or says why not), not a scheduler's error."""
    from oxygen_torch.integrations.hf import router
    from oxygen_torch.kv.block_manager import KVCacheFull

    model, kws = _burst(64 * MiB, prefetch=0)

    def short(*a, **k):
        raise KVCacheFull("KV cache full: 3 block(s) asked, 0 free of 31 (test)")

    monkeypatch.setattr(router, "_alone", short)
    with pytest.raises(KVCacheFull, match="test"):
        generate(model, kws[0])


class SlowTier:
    """CPUTier made slowly (as pinning GiBs is on a GPU machine), the threads that made one."""

    def __init__(self, monkeypatch, seconds: float):
        from oxygen_torch.kv import pool as pool_mod

        real, self.made = pool_mod.CPUTier, []

        def slow(*args, **kwargs):
            self.made.append(threading.current_thread().name)
            time.sleep(seconds)
            return real(*args, **kwargs)

        monkeypatch.setattr(pool_mod, "CPUTier", slow)


def test_a_tier_asked_for_without_waiting_is_made_beside_the_caller(host_pool, monkeypatch):
    """cpu_tier(wait=False) where making it pins memory (told so here): None at once, the tier
    made by a thread of its own while the pool's lock stays free; a caller that waits meanwhile
    gets that same tier (one made, not two); then every caller gets it at once."""
    slow = SlowTier(monkeypatch, 0.4)
    monkeypatch.setattr(type(host_pool), "_pins", lambda self: True)
    t0 = time.perf_counter()
    assert host_pool.cpu_tier(4 * MiB, wait=False) is None
    assert time.perf_counter() - t0 < 0.2
    assert host_pool.cpu_tier(4 * MiB, wait=False) is None  # (still making: one thread)
    got = []
    waiter = threading.Thread(target=lambda: got.append(host_pool.cpu_tier(4 * MiB)))
    waiter.start()
    time.sleep(0.05)
    t1 = time.perf_counter()
    with host_pool.lock:  # (free while the tier is made)
        assert time.perf_counter() - t1 < 0.2
        assert host_pool.tier is None
    waiter.join(5)
    host_pool.wait_tier_ahead(5)
    tier = host_pool.tier
    assert tier is not None and tier.num_slots > 0
    assert got == [tier] and slow.made == ["oxygen-cpu-tier"], (got, slow.made)
    assert host_pool.cpu_tier(4 * MiB, wait=False) is tier
    # a block goes down and back byte-exact through the tier made beside
    blocks = host_pool.manager.allocate(2)
    view = host_pool.storage.block_view()
    for b in blocks:
        view[b].copy_(torch.randint(0, 255, view[b].shape, dtype=torch.uint8))
    want = [view[b].clone() for b in blocks]
    slots = tier.down(blocks)
    for b in blocks:
        view[b].zero_()
    tier.up(slots, blocks, wait=True)
    assert all(torch.equal(view[b], w) for b, w in zip(blocks, want))
    tier.release(sorted(slots))
    host_pool.manager.decref(blocks)


def test_a_caller_that_waits_before_the_tiers_thread_has_run_gets_that_threads_tier(
    host_pool, monkeypatch
):
    """The thread of cpu_tier(wait=False) started, but not yet run a line (a loaded machine:
    CI once saw it): a caller that waits meanwhile waits for that thread's tier instead of
    making a second one; the thread makes it."""
    from oxygen_torch.kv import pool as pool_mod

    slow = SlowTier(monkeypatch, 0.05)
    monkeypatch.setattr(type(host_pool), "_pins", lambda self: True)
    go = threading.Event()
    real_ahead = pool_mod.KVPool._make_tier_ahead

    def late(self, *args):
        go.wait(5)
        real_ahead(self, *args)

    monkeypatch.setattr(pool_mod.KVPool, "_make_tier_ahead", late)
    assert host_pool.cpu_tier(4 * MiB, wait=False) is None
    got = []
    waiter = threading.Thread(target=lambda: got.append(host_pool.cpu_tier(4 * MiB)))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive() and not got and slow.made == []  # (waits: makes none)
    go.set()
    waiter.join(5)
    host_pool.wait_tier_ahead(5)
    assert got == [host_pool.tier] and got[0] is not None, got
    assert slow.made == ["oxygen-cpu-tier"], slow.made


def test_a_tier_that_fails_to_be_made_beside_is_said_once_and_tried_again(
    host_pool, monkeypatch, caplog
):
    """The thread's tier fails (here: raises): one warning naming the tier and what follows,
    no tier; the next cpu_tier(wait=False) tries again, and this time it is made."""
    from oxygen_torch import _patching
    from oxygen_torch.kv import pool as pool_mod

    _patching.forget_warnings()
    real, calls = pool_mod.CPUTier, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("no pinned memory here")
        return real(*args, **kwargs)

    monkeypatch.setattr(pool_mod, "CPUTier", flaky)
    monkeypatch.setattr(type(host_pool), "_pins", lambda self: True)
    with caplog.at_level("WARNING", logger="oxygen_torch"):
        assert host_pool.cpu_tier(4 * MiB, wait=False) is None
        host_pool.wait_tier_ahead(5)
    said = [r.getMessage() for r in caplog.records if "CPU tier" in r.getMessage()]
    assert len(said) == 1 and "no pinned memory here" in said[0] and "recomputed" in said[0]
    assert host_pool.tier is None
    assert host_pool.cpu_tier(4 * MiB, wait=False) is None
    host_pool.wait_tier_ahead(5)
    assert host_pool.tier is not None and len(calls) == 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_swapped_out_cores_step_counts_the_blocks_its_swap_in_and_tokens_take(oxygen, seed):
    """A merged step of a core swapped out to the CPU tier counts what it takes: its blocks
    back, then its rows' new tokens on top of the tokens they come back with. Its rows' new
    tokens were counted against the swapped core's empty rows as well, a block a row too many:
    a 12-row call needing 12 blocks was counted 24 and failed on a 15-block pool with "needs
    24 KV blocks, the whole KV pool holds 15" (and under tensor parallelism planned steps no
    rank could hold)."""
    from oxygen_torch.kv.merged import MergedStep, Part

    g = torch.Generator().manual_seed(seed)
    model = hf.apply(llama(seed=2), load_config(kv={"block_tokens": 16}))
    rows = int(torch.randint(1, 5, (1,), generator=g))
    length = int(torch.randint(5, 60, (1,), generator=g))
    ids = torch.randint(1, 128, (rows, length), generator=g)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    core = out.past_key_values._core
    core.pool.cpu_tier(16 * MiB)
    assert swap_out(core) > 0 and core._swapped is not None
    lens = list(core._swapped.lens)
    for counts in ([1] * rows, [int(n) for n in torch.randint(0, 40, (rows,), generator=g)]):
        step = MergedStep([Part(core, counts, max(counts))])
        m = core.pool.manager
        with core.pool.lock:
            need, before = step.blocks_needed(), m.num_free
            step.reserve(build=False)
            taken = before - m.num_free
        assert need == taken, (lens, counts, need, taken)
        step.abandon()  # (the rows keep what they came back with)
        assert core.seqs.lens == lens and core._swapped is None
        assert swap_out(core) > 0  # out again for the next counts


def test_swapped_calls_on_a_pool_that_holds_one_and_a_bit_of_them_finish(oxygen):
    """Four calls of 12 rows (12 blocks each) on a 15-block pool with a CPU tier, per call (the
    merged path that tensor parallelism takes), a high-priority one last: low ones are swapped
    out for it and come back; each call gets its tokens alone (one of them raised "needs 24 KV
    blocks, the whole KV pool holds 15" when a swapped call's rows were counted twice)."""
    cfg = load_config(kv={"block_tokens": 256, "arena_bytes": 8 << 20},
                      pool={"cpu_tier_bytes": 64 << 20}, scheduler={"engine": False})  # fmt: skip
    model = hf.apply(llama(seed=3), cfg)
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    kws = []
    for _ in range(4):
        ids = torch.randint(1, 128, (12, 11), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        kws.append(dict(input_ids=ids * mask, attention_mask=mask, max_new_tokens=40,
                        do_sample=False))  # fmt: skip
    ref = [generate(model, kw) for kw in kws]

    def one(i):
        if i == 3:  # once a low call holds the pool (a fixed 0.3 s: CI once saw all three end)
            end = time.monotonic() + 30
            while time.monotonic() < end and not any(s.stats.steps >= 3 for s in schedulers(model)):
                time.sleep(0.001)
        with oxygen_torch.task(priority="high" if i == 3 else "low"):
            return generate(model, kws[i])

    out, errors = in_threads(one, [(i,) for i in range(4)])
    assert not errors, errors
    for i, r in enumerate(ref):
        assert torch.equal(out[i], r), i
    (pool,) = [p for p in pool_stats() if p["block_tokens"] == 256]
    assert pool["blocks_total"] == 15
    assert schedulers(model)[0].stats.swaps > 0
