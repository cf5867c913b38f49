"""The CPU tier's free rows kept as runs (kv/free_rows.py) against a plain set: taking gives the
lowest rows, giving back merges runs, and a row given back twice or already free is refused with
nothing changed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oxygen_torch.kv.free_rows import FreeRows


def test_take_gives_the_lowest_rows_and_give_merges_runs():
    f = FreeRows(10)
    assert f.take(3) == [0, 1, 2] and len(f) == 7
    f.give([1])
    assert f.take(2) == [1, 3]  # the lowest free first, across runs
    f.give([3, 0, 2, 1])  # in any order: one run again with 4..9
    assert list(f) == list(range(10)) and f._starts == [0] and f._ends == [10]
    assert 5 in f and 10 not in f


def test_a_row_free_already_or_given_twice_is_refused_and_nothing_changes():
    f = FreeRows(6)
    taken = f.take(4)
    with pytest.raises(ValueError, match="already free"):
        f.give([3, 4])  # 4 is free
    with pytest.raises(ValueError, match="given back twice"):
        f.give([1, 1])
    with pytest.raises(ValueError, match="6 rows asked, 2 free"):
        f.take(6)
    assert list(f) == [4, 5] and len(f) == 2
    f.give(taken)
    assert list(f) == list(range(6))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=40),
       st.randoms(use_true_random=False))  # fmt: skip
def test_free_rows_behave_as_a_set_of_the_lowest(n, ops, rnd):
    f, free, held = FreeRows(n), set(range(n)), []
    for take, k in ops:
        if take:
            k = min(k, len(free))
            got = f.take(k)
            assert got == sorted(free)[:k]
            free -= set(got)
            held += got
        elif held:
            rnd.shuffle(held)
            back, held = held[: k % (len(held) + 1)], held[k % (len(held) + 1) :]
            f.give(back)
            free |= set(back)
        assert len(f) == len(free) and list(f) == sorted(free)
        assert all(e < s for e, s in zip(f._ends, f._starts[1:]))  # disjoint, never adjacent
