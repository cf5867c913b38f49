"""Block manager and per-sequence block lists: ids, refcounts, copy-on-write, freeing."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oxygen_torch.kv.block_manager import BlockManager, KVCacheFull, SequenceBlocks


def test_allocate_lowest_first_and_refcounts():
    m = BlockManager(8, first_id=1)
    assert m.allocate(3) == [1, 2, 3]
    assert m.num_used == 3 and m.num_free == 4
    m.incref([2])
    assert m.decref([1, 2]) == [1]  # 2 still has a reference
    assert m.refcount(2) == 1
    assert m.allocate(1) == [1]  # freed ids come back lowest first


def test_full_pool_raises_and_keeps_state():
    m = BlockManager(4, first_id=1)
    m.allocate(2)
    with pytest.raises(KVCacheFull, match="1 free"):
        m.allocate(2)
    assert m.num_free == 1


def test_double_free_is_an_error():
    m = BlockManager(4)
    (b,) = m.allocate(1)
    m.decref([b])
    with pytest.raises(RuntimeError, match="decref of a free block"):
        m.decref([b])


def test_hooks_see_alloc_and_last_free():
    seen = []
    m = BlockManager(
        6, on_alloc=lambda ids: seen.append(("a", ids)), on_free=lambda ids: seen.append(("f", ids))
    )
    ids = m.allocate(2)
    m.incref(ids[:1])
    m.decref(ids)
    m.decref(ids[:1])
    assert seen == [("a", [0, 1]), ("f", [1]), ("f", [0])]


def test_failed_on_alloc_returns_ids():
    def boom(ids):
        raise MemoryError("no page")

    m = BlockManager(4, on_alloc=boom)
    with pytest.raises(MemoryError):
        m.allocate(2)
    assert m.num_free == 4


def test_reserve_allocates_at_block_boundaries():
    s = SequenceBlocks(BlockManager(16, first_id=1), block_tokens=4, batch=2)
    added, cow = s.reserve(0, 5)  # 5 tokens: 2 blocks
    assert added == [(0, 1), (1, 2)] and cow is None
    added, _ = s.reserve(0, 3)  # 8 tokens: still 2 blocks
    assert added == [] and s.lens[0] == 8
    added, _ = s.reserve(0, 1)
    assert added == [(2, 3)]
    assert s.reserve(1, 0) == ([], None)


def test_select_shares_blocks_then_copy_on_write():
    m = BlockManager(16, first_id=1)
    s = SequenceBlocks(m, block_tokens=4, batch=2)
    s.reserve(0, 6)  # blocks [1, 2], last one half full
    s.reserve(1, 4)  # block [3]
    s.select([0, 0, 1])  # beams 0 and 1 both continue sequence 0; sequence 1 kept
    assert s.blocks == [[1, 2], [1, 2], [3]]
    assert m.refcount(1) == 2 and m.refcount(2) == 2 and m.refcount(3) == 1
    added, cow = s.reserve(0, 1)  # writes into the shared half-full block: copy it first
    assert cow == (2, 4) and added == [(1, 4)]
    assert s.blocks[0] == [1, 4] and m.refcount(2) == 1
    added, cow = s.reserve(1, 1)  # now the sole owner of block 2: no copy
    assert cow is None and s.blocks[1] == [1, 2]


def test_no_copy_when_shared_last_block_is_full():
    m = BlockManager(16, first_id=1)
    s = SequenceBlocks(m, block_tokens=4, batch=1)
    s.reserve(0, 8)
    s.select([0, 0])
    added, cow = s.reserve(0, 1)
    assert cow is None and added == [(2, 3)]
    assert s.blocks == [[1, 2, 3], [1, 2]]


def test_select_drops_unused_sequences_blocks():
    m = BlockManager(16, first_id=1)
    s = SequenceBlocks(m, block_tokens=4, batch=3)
    for i in range(3):
        s.reserve(i, 4)
    s.select([2, 2, 2])  # beams 0 and 1 die
    assert m.num_used == 1 and m.refcount(3) == 3


def test_truncate_and_release_free_blocks():
    m = BlockManager(16, first_id=1)
    s = SequenceBlocks(m, block_tokens=4, batch=2)
    s.reserve(0, 10)
    s.reserve(1, 3)
    s.truncate(0, 4)
    assert s.blocks[0] == [1] and s.lens[0] == 4 and m.num_used == 2
    s.release()
    assert m.num_used == 0 and len(s) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("rst"), st.integers(0, 40)), max_size=30))
def test_refcounts_equal_uses(ops):
    """After any sequence of operations, a block's refcount is the number of uses of it."""
    m = BlockManager(400, first_id=1)
    s = SequenceBlocks(m, block_tokens=4, batch=3)
    for op, x in ops:
        n = len(s)
        if op == "r" and n:
            s.reserve(x % n, x % 7)
        elif op == "s" and n:
            s.select([(x * (i + 3)) % n for i in range(1 + x % 4)])
        elif op == "t" and n:
            s.truncate(x % n, x % 9)
    uses = {}
    for blocks in s.blocks:
        for b in blocks:
            uses[b] = uses.get(b, 0) + 1
    for b in range(1, 400):
        assert m.refcount(b) == uses.get(b, 0)
    for blocks, n in zip(s.blocks, s.lens):
        assert len(blocks) == -(-n // 4)
    s.release()
    assert m.num_used == 0


class FakeEvent:
    """A stream event: done when the test says, wait() recorded."""

    def __init__(self):
        self.done, self.waited = False, 0

    def query(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.waited += 1


def test_fenced_frees_count_as_free_and_come_back_once_the_copy_passed():
    freed = []
    m = BlockManager(8, first_id=1, on_free=freed.extend)
    blocks = m.allocate(5)
    ev = FakeEvent()
    assert m.decref(blocks[:3], after=ev) == blocks[:3]
    assert m.num_free == 5 and m.num_used == 2
    assert freed == []  # pages stay mapped: the copy still reads them
    assert m.allocate(2) == [6, 7]  # enough other blocks: the fenced ones are not touched
    assert ev.waited == 0 and freed == []
    ev.done = True
    m.decref([6])  # any later call gives back what has passed
    assert sorted(freed) == [1, 2, 3, 6]
    assert m.allocate(3) == [1, 2, 3] and ev.waited == 0


def test_an_allocation_needing_fenced_blocks_orders_the_stream_after_the_copy():
    m = BlockManager(6, first_id=1)
    blocks = m.allocate(5)
    ev, ev2 = FakeEvent(), FakeEvent()
    m.decref(blocks[:2], after=ev)
    m.decref(blocks[2:3], after=ev2)
    m.decref(blocks[3:4])  # nothing in flight: free at once
    assert m.num_free == 4
    assert m.allocate(1) == [4]
    assert ev.waited == ev2.waited == 0
    with pytest.raises(RuntimeError, match="incref of a free block"):
        m.incref([blocks[0]])  # fenced is free: nobody may take a reference to it
    assert m.allocate(3) == [1, 2, 3]  # not enough without them: both waited on, then taken
    assert ev.waited == ev2.waited == 1
    assert m.num_free == 0
    with pytest.raises(KVCacheFull):
        m.allocate(1)


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 13), min_size=1, max_size=5),
    picks=st.lists(st.integers(0, 4), min_size=1, max_size=7),
    counts=st.lists(st.integers(0, 9), min_size=7, max_size=7),
)
def test_blocks_needed_all_is_what_reserving_every_row_in_turn_takes(lens, picks, counts):
    """The all-or-nothing check of a core's step: the fresh blocks of reserving each row in
    turn, copies of shared last blocks included (the last sharer to write needs none)."""
    m = BlockManager(256, first_id=1)
    s = SequenceBlocks(m, block_tokens=4, batch=len(lens))
    for b, n in enumerate(lens):
        s.reserve(b, n)
    s.select([p % len(lens) for p in picks])  # rows sharing blocks (beams)
    counts = counts[: len(s)]
    need = s.blocks_needed_all(counts)
    free = m.num_free
    for b, n in enumerate(counts):
        s.reserve(b, n)
    assert need == free - m.num_free
