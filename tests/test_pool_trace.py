"""Replay of generate()-shaped allocation traces: the pool's fragmentation (1 - peak allocated /
peak mapped) must be below what best-fit placement without unmapping gives on the same trace.

Two traces: a synthetic one built here from the shapes of an HF Llama generate() with the dynamic
cache (always runs), and the trace recorded from a real generate() on the H200 by
benchmarks/record_trace.py, if it has been committed under tests/data/.

The host backend maps memfd pages that are never touched here, so replaying gigabytes costs file
descriptors, not memory."""

from __future__ import annotations

import bisect
import gzip
import json
import random
import resource
from pathlib import Path

import pytest

from oxygen_torch.pool import VirtualPool
from oxygen_torch.pool import native as _native

MiB = 1 << 20
PAGE = 2 * MiB
DATA = Path(__file__).parent / "data"


def round512(n: int) -> int:
    return max(512, (n + 511) // 512 * 512)


# ---------------------------------------------------------------------------------------------
# Traces


def synthetic_generate_trace(seed: int = 0) -> list[list]:
    """Alloc/free events of greedy generate() on a small Llama (hidden 1024, 8 layers, GQA 16/4,
    bf16) with the dynamic cache: weights, then per call a prefill and decode steps whose K/V grow
    by torch.cat (new block, then the old one freed) -- the pattern that fragments caches."""
    rng = random.Random(seed)
    h, layers, heads, kvh, d, inter, vocab, bf = 1024, 8, 16, 4, 64, 2816, 32000, 2
    ops: list[list] = []
    live: dict[int, int] = {}
    nid = [0]

    def alloc(n: int) -> int:
        i = nid[0]
        nid[0] += 1
        live[i] = n
        ops.append(["a", n, i, 0])
        return i

    def free(i: int) -> None:
        ops.append(["f", live.pop(i), i, 0])

    for n in (vocab * h, vocab * h) + (h,) * 2:
        alloc(n * bf)
    for _ in range(layers):
        for n in (h * h, h * kvh * d, h * kvh * d, h * h, h * inter, h * inter, inter * h, h, h):
            alloc(n * bf)
    for _ in range(6):
        b, p, new = rng.choice([1, 4, 8, 16]), rng.randint(64, 1024), rng.choice([16, 24, 32])
        ids, mask = alloc(b * p * 8), alloc(b * p * 8)
        kv = [[None, None] for _ in range(layers)]
        length = 0
        for step in range(new + 1):
            s = p if step == 0 else 1
            x = alloc(b * s * h * bf)
            for layer in range(layers):
                tmp = [alloc(b * s * h * bf), alloc(b * heads * s * d * bf)]
                k_new, v_new = alloc(b * kvh * s * d * bf), alloc(b * kvh * s * d * bf)
                for j in range(2):  # DynamicCache: torch.cat makes the grown block first
                    grown = alloc(b * kvh * (length + s) * d * bf)
                    if kv[layer][j] is not None:
                        free(kv[layer][j])
                    kv[layer][j] = grown
                free(k_new)
                free(v_new)
                att = alloc(b * s * h * bf)
                for t in tmp:
                    free(t)
                mlp = [alloc(b * s * inter * bf), alloc(b * s * inter * bf)]
                out = alloc(b * s * h * bf)
                for t in mlp + [att]:
                    free(t)
                free(x)
                x = out
            length += s
            logits = alloc(b * vocab * 4)
            free(x)
            tok = alloc(b * 8)
            free(logits)
            free(tok)
        for layer in kv:
            for t in layer:
                free(t)
        free(ids)
        free(mask)
    return ops


def load_trace(path: Path) -> list[list]:
    with gzip.open(path, "rt") as f:
        header = json.loads(f.readline())
        assert header.get("format") == "oxygen-alloc-trace/1", header
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------------------
# Replays


def replay_pool(ops: list[list], capacity: int, lag_us: int = 0) -> dict:
    """lag_us: host events complete that long after they are recorded, as when the GPU runs
    behind the CPU (the replay runs ~20x faster than the recorded generate(), so 100 us stands
    for a couple of milliseconds of real lag)."""
    lib = _native.lib()
    lib.oxygen_host_set_event_lag(lag_us * 1000)
    try:
        return _replay(ops, capacity)
    finally:
        lib.oxygen_host_set_event_lag(0)


def _replay(ops: list[list], capacity: int) -> dict:
    with VirtualPool(backend="host", capacity=capacity, hysteresis_us=2000) as pool:
        ptrs: dict[int, int] = {}
        for op, size, i, stream in ops:
            if op == "a":
                ptrs[i] = pool.malloc(size, stream)
            elif i in ptrs:
                assert pool.free(ptrs.pop(i), size, stream)
        s = pool.stats()
        for p in ptrs.values():
            pool.free(p)
        return s


def replay_best_fit_no_unmap(ops: list[list]) -> dict:
    """Best fit at 512 B granularity over one growing range, neighbours coalesced, nothing ever
    released: what a caching allocator with expandable segments and no empty_cache holds."""
    by_size: list[tuple[int, int]] = []  # (size, addr) of free holes
    starts: list[int] = []  # addresses of free holes, sorted
    hole: dict[int, int] = {}
    top = 0
    where: dict[int, tuple[int, int]] = {}
    alloc = peak_alloc = peak_top = 0

    def add_hole(a: int, n: int) -> None:
        k = bisect.bisect_left(starts, a)
        if k < len(starts) and a + n == starts[k]:  # join the next hole
            nxt = starts.pop(k)
            by_size.remove((hole[nxt], nxt))
            n += hole.pop(nxt)
        if k > 0 and starts[k - 1] + hole[starts[k - 1]] == a:  # join the previous one
            prv = starts.pop(k - 1)
            by_size.remove((hole[prv], prv))
            a, n = prv, n + hole.pop(prv)
        bisect.insort(starts, a)
        hole[a] = n
        bisect.insort(by_size, (n, a))

    for op, size, i, _ in ops:
        n = round512(size)
        if op == "a":
            k = bisect.bisect_left(by_size, (n, -1))
            if k < len(by_size):
                hn, a = by_size.pop(k)
                starts.remove(a)
                del hole[a]
                if hn > n:
                    add_hole(a + n, hn - n)
            else:
                a, top = top, top + n
            where[i] = (a, n)
            alloc += n
            peak_alloc = max(peak_alloc, alloc)
            peak_top = max(peak_top, -(-top // PAGE) * PAGE)
        elif i in where:
            a, n = where.pop(i)
            alloc -= n
            add_hole(a, n)
    return {
        "peak_allocated_bytes": peak_alloc,
        "peak_mapped_bytes": peak_top,
        "fragmentation": 1 - peak_alloc / peak_top,
    }


def enough_descriptors(pages: int) -> bool:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = pages + 1024
    if soft < want and (hard == resource.RLIM_INFINITY or hard >= want):
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    return soft >= want


def compare(ops: list[list], lag_us: int = 0) -> tuple[dict, dict]:
    base = replay_best_fit_no_unmap(ops)
    pages = base["peak_mapped_bytes"] // PAGE
    if not enough_descriptors(pages + 64):
        pytest.skip(f"replay needs ~{pages} open memfds; RLIMIT_NOFILE is too low here")
    ours = replay_pool(ops, capacity=base["peak_mapped_bytes"] + 64 * MiB, lag_us=lag_us)
    return ours, base


def test_synthetic_generate_trace_fragments_less_than_best_fit():
    ops = synthetic_generate_trace()
    ours, base = compare(ops)
    assert ours["peak_allocated_bytes"] == base["peak_allocated_bytes"]
    print(
        f"\nsynthetic generate trace ({len(ops)} events): oxygen {ours['fragmentation']:.2%}, "
        f"best fit without unmapping {base['fragmentation']:.2%}"
    )
    assert ours["fragmentation"] < base["fragmentation"]
    assert ours["num_ooms"] == 0 and ours["num_bad_frees"] == 0


RECORDED = sorted(DATA.glob("*.trace*")) + sorted(DATA.glob("*trace*.jsonl.gz"))


@pytest.mark.skipif(
    not RECORDED,
    reason="no recorded trace in tests/data/ yet: run benchmarks/record_trace.py on the H200 and "
    "commit its output as tests/data/generate_trace.jsonl.gz",
)
@pytest.mark.parametrize("lag_us", [0, 100, 1000])
@pytest.mark.parametrize("path", sorted(set(RECORDED)), ids=lambda p: p.name)
def test_recorded_generate_trace_fragments_less_than_best_fit(path, lag_us):
    """Also with the device lagging: freed pages it may still read cannot be unmapped, yet mapped
    memory must not overshoot (their handles back the next blocks of the same stream). Before
    that, the same replay at 100 us lag gave ~9 %, as the H200 run did (9.49 %)."""
    ops = load_trace(path)
    ours, base = compare(ops, lag_us)
    print(
        f"\n{path.name} ({len(ops)} events, device lag {lag_us} us): oxygen "
        f"{ours['fragmentation']:.2%} ({ours['num_maps']} maps, {ours['pages_lent']} pages lent), "
        f"best fit without unmapping {base['fragmentation']:.2%}"
    )
    assert ours["fragmentation"] < min(base["fragmentation"], 0.04)
    assert ours["num_ooms"] == 0
    if path.name == "generate_trace.jsonl.gz":
        # Maps cost ~40 us each on the H200 (the pool's main cost in generate()). Placement over
        # idle pages, lending and runs of adjacent free extents bring them from ~91,000 to
        # 7,400-9,600 on this trace; without joining runs it was ~29,000.
        assert ours["num_maps"] < 15_000
