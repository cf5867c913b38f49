"""The pool on a family of workloads, not one trace (issue 18), on the host backend.

- Mixed generate() workloads of several seeds (benchmarks/workloads.py: real architectures'
  shapes, prefill- and decode-heavy mixes, non-KV buffers on two streams), cut to two layers and
  eight new tokens a call, replayed with every block's content checked: fragmentation (the pool's
  figure, 1 - peak allocated / peak mapped) <= 1.5 % on each seed, and below best fit without
  unmapping on the same trace.
- Random log-uniform 512 B - 45 MiB malloc/free from 4 threads (benchmarks/host_random.py, the
  issue's 11.4 % case; 11-14 % before small blocks shared pages): <= 8 % on each seed, no
  corruption, nothing mapped after empty_cache(). The 8 x 200,000 figure is the benchmark's."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from test_pool_trace import enough_descriptors, replay_best_fit_no_unmap

from oxygen_torch.pool import VirtualPool

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import host_random  # noqa: E402
import workloads  # noqa: E402

MiB = 1 << 20


def test_family_is_deterministic_varied_and_balanced():
    fams = [workloads.family(s) for s in range(16)]
    assert [f.describe() for f in fams] == [workloads.family(s).describe() for s in range(16)]
    assert len({f.arch.name for f in fams}) >= 4 and {f.mix for f in fams} == set(workloads.MIXES)
    ops = workloads.trace(fams[0], layers=2, max_new=4)
    live: dict[int, int] = {}
    for op, size, i, _ in ops:  # every id freed once, with its own size
        if op == "a":
            assert i not in live
            live[i] = size
        else:
            assert live.pop(i) == size
    assert not live
    with pytest.raises(ValueError, match="seed"):
        workloads.family(-1)
    with pytest.raises(ValueError, match="layers"):
        workloads.trace(fams[0], layers=0)


@pytest.mark.parametrize("seed", range(6))
def test_family_trace_fragments_little_and_keeps_contents(seed):
    ops = workloads.trace(workloads.family(seed), layers=2, max_new=8)
    base = replay_best_fit_no_unmap(ops)
    if not enough_descriptors(base["peak_mapped_bytes"] // (2 * MiB) + 64):
        pytest.skip("replay needs more open memfds than RLIMIT_NOFILE allows here")
    cap = base["peak_mapped_bytes"] + 64 * MiB
    # Idle pages age by wall time (the pool's 2 ms hysteresis), so at the default the replay's
    # speed moves the figure (seed 0: 1.0-1.3 % on an idle machine, 1.6 % once under CI's
    # load). With a 1 us hysteresis it does not depend on the machine: 0.2-0.7 %.
    for hysteresis_us, most in ((1, 0.015), (0, base["fragmentation"])):
        s = host_random.replay(ops, capacity=cap, hysteresis_us=hysteresis_us)
        assert s["overwritten"] == 0 and s["mapped_after_empty_cache"] == 0
        assert s["peak_allocated_bytes"] == base["peak_allocated_bytes"]
        assert s["num_ooms"] == 0 and s["num_bad_frees"] == 0
        assert s["fragmentation"] <= most, (hysteresis_us, s["fragmentation"], base)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_threads_fragment_little_without_corruption(seed):
    r = host_random.run(threads=4, ops=3000, seed=seed)
    assert not r["errors"], r["errors"][:5]
    assert r["allocated_after"] == 0 and r["mapped_after_empty_cache"] == 0
    assert r["num_bad_frees"] == 0
    # 3.7-6.1 % over repeated runs (thread interleaving varies); 10.9-14 % before small blocks
    # shared pages
    assert r["fragmentation"] <= 0.08, r


@pytest.mark.parametrize("hysteresis_us", [20_000, 1])
def test_seeded_random_traces_replay_to_the_same_figures_on_the_virtual_clock(hysteresis_us):
    """host_random.random_trace: the random workers' operations in one seeded order, replayed
    on one thread with the pool on the replay's own clock (oxygen_set_virtual_clock, 50 us an
    operation), so that a pool change is judged on the same operations and the same decisions
    every run (bench_allocator.py --host --random-seeds): the same seed gives the same trace,
    another seed another; every free names a block allocated before and every block is freed;
    two replays give the same fragmentation and maps, contents intact, nothing mapped after
    empty_cache(); the pool reads the steady clock again afterwards."""
    seed = int(torch.randint(100, 10_000, (1,)))
    a = host_random.random_trace(seed, threads=3, ops=1500)
    assert a == host_random.random_trace(seed, threads=3, ops=1500)
    assert a != host_random.random_trace(seed + 1, threads=3, ops=1500)
    live = set()
    for op, _size, i, _stream in a:
        if op == "a":
            assert i not in live
            live.add(i)
        else:
            live.remove(i)
    assert not live and len(a) == 2 * sum(op == "a" for op, *_ in a)
    runs = [host_random.replay(a, capacity=16 << 30, hysteresis_us=hysteresis_us, op_ns=50_000)
            for _ in range(2)]  # fmt: skip
    for s in runs:
        assert s["overwritten"] == 0 and s["mapped_after_empty_cache"] == 0
        assert s["num_ooms"] == 0 and s["num_bad_frees"] == 0
    keys = ("fragmentation", "peak_mapped_bytes", "num_maps", "num_unmaps")
    assert [runs[0][k] for k in keys] == [runs[1][k] for k in keys], runs
    # seeds 0-7 (4 workers x 3,000 operations): 20 ms 4.3-8.3 %, at once 2.6-3.6 % (goal 3 %)
    assert runs[0]["fragmentation"] <= (0.12 if hysteresis_us > 1 else 0.06), runs[0]
    with VirtualPool(backend="host", capacity=64 * MiB, hysteresis_us=1000) as pool:
        pool.free(pool.malloc(4 * MiB))  # an idle page, unmapped after 1 ms of the steady clock
        deadline = time.monotonic() + 5
        while pool.stats()["mapped_bytes"] and time.monotonic() < deadline:
            time.sleep(0.005)
        assert pool.stats()["mapped_bytes"] == 0


def test_content_check_sees_an_overlap():
    """The check the tests rely on can fail: a block written over by an overlapping one."""
    with VirtualPool(backend="host", capacity=64 * MiB) as pool:
        a = pool.malloc(4 * MiB)
        host_random.stamp(a, 4 * MiB, 7)
        assert host_random.verify(a, 4 * MiB, 7)
        host_random.stamp(a + 1 * MiB + 512, 128 << 10, 8)  # a block wrongly placed inside a
        assert not host_random.verify(a, 4 * MiB, 7)
        host_random.stamp(a + 100, 4096, 9)  # small: every byte
        assert not host_random.verify(a, 4 * MiB, 7)
        pool.free(a)


def test_map_probe_table_on_the_host_backend():
    """bench_allocator.py --map-probe --host: a row a handle size, each timing the backend's
    calls over 1 GiB; the goal column says met exactly where map + set_access is under 2 ms."""
    import bench_allocator

    sizes = (2, 8, 64, 1024)
    md = bench_allocator.map_probe("host", repeats=1, handles_mib=sizes)
    rows = [line.split("|")[1:-1] for line in md.splitlines() if line.startswith("| ") and
            line.split("|")[1].strip().isdigit()]  # fmt: skip
    assert [int(r[0]) for r in rows] == list(sizes)
    for r in rows:
        assert int(r[1]) * int(r[0]) == 1024
        grow = float(r[7])
        assert grow > 0 and r[8].strip() == ("met" if grow < 2 else "missed")
        assert r[9].strip() == "-" and r[10].strip() == "-"  # no cuda anchor on the host
