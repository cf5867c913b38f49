"""Property test: after any random trace of malloc/free (sizes from 0 to several pages, two
streams, bad frees mixed in) the pool's statistics agree with a model of the live blocks, blocks
never overlap, and mapped bytes cover exactly what live blocks need (plus idle pages)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oxygen_torch.pool import VirtualPool

MiB = 1 << 20
PAGE = 2 * MiB
CAPACITY = 96 * MiB

sizes = st.one_of(
    st.integers(0, 4096), st.integers(4097, 1 << 20), st.integers((1 << 20) + 1, 12 * MiB)
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), sizes, st.sampled_from([0, 7])),
        st.tuples(st.just("free"), st.integers(0, 1000), st.sampled_from([0, 7])),
        st.tuples(st.just("bad_free"), st.integers(0, 1000), st.just(0)),
    ),
    max_size=60,
)


def round512(n):
    return max(512, (n + 511) // 512 * 512)


def touched_pages(live, base):
    pages = set()
    for ptr, n in live.items():
        span = round512(n)
        pages.update(range((ptr - base) // PAGE, (ptr + span - 1 - base) // PAGE + 1))
    return pages


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_stats_agree_with_a_model(trace):
    with VirtualPool(backend="host", capacity=CAPACITY, hysteresis_us=10_000_000) as p:
        live: dict[int, int] = {}
        bad = 0
        for op, arg, stream in trace:
            if op == "malloc":
                if sum(round512(n) for n in live.values()) + arg > CAPACITY // 2:
                    continue
                ptr = p.malloc(arg, stream)
                assert ptr not in live
                live[ptr] = arg
            elif op == "free" and live:
                ptr = sorted(live)[arg % len(live)]
                assert p.free(ptr, live.pop(ptr), stream)
            elif op == "bad_free":
                assert not p.free(p.base + 1 + arg * 512)  # never a block start
                bad += 1
            s = p.stats()
            assert s["allocated_bytes"] == sum(round512(n) for n in live.values())
            assert s["requested_bytes"] == sum(live.values())
            assert s["live_blocks"] == len(live)
            assert s["num_bad_frees"] == bad
            assert s["peak_allocated_bytes"] >= s["allocated_bytes"]
            assert s["peak_mapped_bytes"] >= s["mapped_bytes"]
        spans = sorted((ptr, round512(n)) for ptr, n in live.items())
        for (a, n), (b, _) in zip(spans, spans[1:], strict=False):
            assert a + n <= b, "two live blocks overlap"
        # small blocks live in slab pages, so only large ones are checked page by page
        large = {ptr: n for ptr, n in live.items() if n > 1 << 20}
        mapped_pages = p.stats()["mapped_bytes"] // PAGE
        assert mapped_pages >= len(touched_pages(large, p.base))
        p.empty_cache()  # idle pages go; pages of live blocks stay
        s = p.stats()
        assert s["idle_pages"] == 0 and s["slab_cached_pages"] == 0
        small_pages = s["mapped_bytes"] // PAGE - len(touched_pages(large, p.base))
        assert 0 <= small_pages <= sum(1 for n in live.values() if n <= 1 << 20)
        for ptr, n in list(live.items()):
            p.free(ptr, n)
        p.empty_cache()
        assert p.stats()["mapped_bytes"] == 0 and p.stats()["allocated_bytes"] == 0
