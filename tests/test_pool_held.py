"""memory_stats()'s split of the memory held (oxygen_torch/pool/figures.py): general allocations,
KV arenas, pages held by the hysteresis, the cached small-block page, cached handles -- each part
against what the test placed, and the parts adding up to physical_bytes."""

import random

from oxygen_torch.pool import Arena, VirtualPool

MiB = 1 << 20
PAGE = 2 * MiB
PARTS = ("held_general_bytes", "held_kv_arena_bytes", "held_hysteresis_bytes",
         "held_cached_small_bytes", "held_handle_cache_bytes")  # fmt: skip


def split(s):
    return {k: s[k] // PAGE for k in PARTS}


def test_split_follows_blocks_idle_pages_and_the_small_page_cache():
    rng = random.Random()
    pages = rng.randint(2, 6)
    with VirtualPool(backend="host", capacity=64 * MiB, hysteresis_us=60_000_000) as p:
        big = p.malloc(pages * PAGE)  # page-aligned at the start of the range: `pages` pages
        small = [p.malloc(rng.randint(1, 200_000)) for _ in range(rng.randint(1, 8))]
        s = p.stats()
        assert split(s)["held_general_bytes"] == pages + 1  # and one small-block page
        assert split(s)["held_hysteresis_bytes"] == 0 and s["held_kv_arena_bytes"] == 0
        p.free(big)
        s = p.stats()
        assert split(s)["held_hysteresis_bytes"] == pages and split(s)["held_general_bytes"] == 1
        for q in small:
            p.free(q)
        s = p.stats()
        assert split(s)["held_cached_small_bytes"] == 1 and s["held_general_bytes"] == 0
        assert sum(s[k] for k in PARTS) == s["physical_bytes"]
        assert s["held_handle_cache_bytes"] == s["handle_cache_pages"] * PAGE
        p.empty_cache()
        s = p.stats()
        assert all(s[k] == 0 for k in PARTS) and s["physical_bytes"] == 0


def test_split_of_a_kv_arena():
    n = random.randint(1, 5)
    a = Arena(16 * PAGE, backend="host")
    try:
        before = a.stats()["held_kv_arena_bytes"]  # other arenas of this process share it
        a.map_pages(3, n)
        s = a.stats()
        assert s["held_kv_arena_bytes"] - before == n * PAGE
        assert s["held_general_bytes"] == 0 and s["held_hysteresis_bytes"] == 0
        assert sum(s[k] for k in PARTS) == s["physical_bytes"]
        a.unmap_pages(3, n)
    finally:
        a.close()
