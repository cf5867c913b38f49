"""Host-side bookkeeping of KV blocks: ids, reference counts, per-sequence block lists.

Everything here is plain Python ints, so the per-token path never waits on the device. The device
copies of the tables are written by `paged_cache.PagedKVCore` from what these classes report.

A block id indexes the same slot in every layer's K and V cache (`[num_blocks, block_tokens,
num_kv_heads, head_dim]`), so one table serves all layers of a model.

A sequence may give back its leading blocks once no query will read them again (every layer's
sliding window starts past them: `drop_before`). Their entries stay in its block list as
GUARD_BLOCK, so a column is still a token position // block_tokens, and `dropped[i]` counts them;
every reference count here skips them.

A hybrid model's sequence (some layers slide, some see every token) keeps those blocks for its
full-attention layers but no longer reads them through its sliding ones: it *narrows* its
references to them (`narrow_before`; `narrowed[i]` counts them, from the first column). Once every
reference to a block is narrowed, the manager tells the storage (`on_narrow`), which unmaps the
block's pages in the sliding layers' regions when nothing else lies on them (kv/storage.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from .storage import GUARD_BLOCK


class KVCacheFull(RuntimeError):
    """No free KV block is left in the pool."""


class BlockManager:
    """Hands out block ids from [first_id, num_blocks), lowest first, with reference counts.

    Lowest-first keeps live blocks packed at the start of the arena, so whole pages at its end
    become free and can be unmapped. `on_alloc(ids)` runs before ids are handed out (map their
    pages); `on_free(ids)` runs after their last reference is dropped (unmap pages left empty).
    `reclaimer` (set by the pool when it keeps a prefix cache) gives back blocks that only a
    cache holds: `reclaimable()` counts them, `reclaim(n)` frees up to n of them.

    Fenced frees (`decref(..., after=event)`): blocks a copy still reads on another stream (a
    tier's move down, kv/tier.py) count as free but go back to the heap only once the event has
    passed; an allocation that needs them sooner makes the current stream wait for the event
    (`event.wait()`, no host wait) and takes them then.

    Narrowed references (`narrow`, `incref(..., narrowed=True)`, `decref(..., narrowed=True)`):
    a holder that needs only the block's full-attention layers. `on_narrow(ids)` runs when the
    last reference that needed a block whole goes while others remain. A whole reference to a
    block only narrowed ones hold is refused: its sliding layers' pages may be gone.
    """

    def __init__(
        self,
        num_blocks: int,
        first_id: int = 0,
        on_alloc: Callable[[list[int]], None] | None = None,
        on_free: Callable[[list[int]], None] | None = None,
        on_narrow: Callable[[list[int]], None] | None = None,
    ):
        if num_blocks <= first_id:
            raise ValueError(f"num_blocks: {num_blocks} leaves no block after first_id {first_id}")
        self.num_blocks = num_blocks
        self.first_id = first_id
        self._free = list(range(first_id, num_blocks))  # already a valid heap
        self._fenced: list[tuple[object, list[int]]] = []  # (event, blocks): free once passed
        self._num_fenced = 0
        self._ref = [0] * num_blocks
        self._narrow = [0] * num_blocks  # narrowed references among _ref
        self._on_alloc = on_alloc
        self._on_free = on_free
        self._on_narrow = on_narrow
        self.peak_used = 0
        self.reclaimer = None  # has reclaimable() -> int and evict(n) -> int

    @property
    def num_free(self) -> int:
        return len(self._free) + self._num_fenced

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.first_id - self.num_free

    @property
    def num_available(self) -> int:
        """Free blocks plus those a cache would give back on demand."""
        extra = self.reclaimer.reclaimable() if self.reclaimer is not None else 0
        return self.num_free + extra

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def refcounts(self, blocks: Iterable[int]) -> list[int]:
        """refcount() of each block (one call for a core's hundreds: swap preemption)."""
        return list(map(self._ref.__getitem__, blocks))

    def full(self, n: int) -> KVCacheFull:
        """The error of `n` blocks asked that the pool does not have."""
        return KVCacheFull(
            f"KV cache full: {n} block(s) asked, {len(self._free)} free of "
            f"{self.num_blocks - self.first_id} (raise kv.arena_bytes or lower the batch)"
        )

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, each with one reference."""
        if n <= 0:
            return []
        if self._fenced:
            self._unfence(force=n > len(self._free))
        if n > len(self._free) and self.reclaimer is not None:
            self.reclaimer.evict(n - len(self._free))
        if n > len(self._free):
            raise self.full(n)
        pop, free = heapq.heappop, self._free  # (locals: a swap-in takes hundreds of blocks)
        ids = [pop(free) for _ in range(n)]
        if self._on_alloc is not None:
            try:
                self._on_alloc(ids)
            except BaseException:
                for b in ids:
                    heapq.heappush(self._free, b)
                raise
        ref = self._ref
        for b in ids:
            ref[b] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return ids

    def is_narrow(self, block: int) -> bool:
        """Whether every reference to the block is narrowed (its sliding layers' pages may be
        unmapped: nothing may read or copy them)."""
        return 0 < self._narrow[block] == self._ref[block]

    def incref(self, blocks: Iterable[int], narrowed: bool = False) -> None:
        for b in blocks:
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b}: incref of a free block")
            if not narrowed and self._narrow[b] == self._ref[b] > 0:
                raise RuntimeError(
                    f"block {b}: a whole reference to a block only narrowed references hold "
                    "(its sliding layers' pages may be unmapped)"
                )
            self._ref[b] += 1
            self._narrow[b] += narrowed

    def narrow(self, blocks: Iterable[int]) -> None:
        """One whole reference to each block becomes a narrowed one (its holder left it behind
        its sliding window)."""
        gone = []
        for b in blocks:
            if self._narrow[b] >= self._ref[b]:
                raise RuntimeError(f"block {b}: narrow without a whole reference")
            self._narrow[b] += 1
            if self._narrow[b] == self._ref[b]:
                gone.append(b)
        if gone and self._on_narrow is not None:
            self._on_narrow(gone)

    def decref(self, blocks: Iterable[int], after=None, narrowed: bool = False) -> list[int]:
        """Drops one reference from each block (`narrowed`: a narrowed one); returns the blocks
        that became free. `after`: an event (query(), wait()) of copies still reading them;
        None: nothing does."""
        if self._fenced:
            self._unfence()
        freed, gone, ref, narrow = [], [], self._ref, self._narrow
        for b in blocks:
            n = ref[b]
            if n <= 0:
                raise RuntimeError(f"block {b}: decref of a free block")
            if narrowed and narrow[b] <= 0:
                raise RuntimeError(f"block {b}: narrowed decref without a narrowed reference")
            ref[b] = n - 1
            narrow[b] -= narrowed
            if n == 1:
                freed.append(b)
            elif not narrowed and narrow[b] == n - 1:
                gone.append(b)
        if gone and self._on_narrow is not None:
            self._on_narrow(gone)
        if freed and after is not None and not after.query():
            self._fenced.append((after, freed))
            self._num_fenced += len(freed)
        elif freed:
            self._give_back(freed)
        return freed

    def _give_back(self, blocks: list[int]) -> None:
        push, free = heapq.heappush, self._free
        for b in blocks:
            push(free, b)
        if self._on_free is not None:
            self._on_free(blocks)

    def _unfence(self, force: bool = False) -> None:
        """Fenced blocks whose event has passed go back; `force`: all of them, the current stream
        ordered after their events first."""
        keep = []
        for event, blocks in self._fenced:
            if force:
                event.wait()
            elif not event.query():
                keep.append((event, blocks))
                continue
            self._num_fenced -= len(blocks)
            self._give_back(blocks)
        self._fenced = keep


class SequenceBlocks:
    """The block lists and token counts of a batch of sequences that share one BlockManager.

    `lens[i]` counts the tokens stored for sequence i (padding is never stored). Blocks may be
    shared between sequences (fork, reorder); `reserve` copies a shared, partly filled last block
    before it is written (copy-on-write) and reports the copy so the caller moves the data.
    `dropped[i]`: sequence i's leading entries given back (GUARD_BLOCK in its list, never
    referenced). `narrowed[i]`: its leading columns (the dropped ones included) whose references
    are narrowed (a hybrid model's rows, behind their sliding window: `narrow_before`).
    """

    def __init__(self, manager: BlockManager, block_tokens: int, batch: int = 0):
        self.manager = manager
        self.block_tokens = block_tokens
        self.blocks: list[list[int]] = [[] for _ in range(batch)]
        self.lens: list[int] = [0] * batch
        self.dropped: list[int] = [0] * batch
        self.narrowed: list[int] = [0] * batch

    def __len__(self) -> int:
        return len(self.blocks)

    def max_blocks(self) -> int:
        return max((len(b) for b in self.blocks), default=0)

    def held(self, seq: int) -> list[int]:
        """The blocks sequence seq holds a reference to (its list past the dropped entries)."""
        return self.blocks[seq][self.dropped[seq] :]

    def num_held(self) -> int:
        return sum(len(b) - d for b, d in zip(self.blocks, self.dropped))

    def drop_before(self, seq: int, pos: int) -> tuple[list[int], int]:
        """Gives back sequence seq's blocks that lie wholly before token position `pos` (no
        query reads them again); their entries become GUARD_BLOCK. The block holding the last
        token is always kept. Returns (the columns given back, how many blocks became free)."""
        blocks, d = self.blocks[seq], self.dropped[seq]
        upto = min(pos // self.block_tokens, len(blocks) - 1)
        if upto <= d:
            return [], 0
        freed = self.manager.decref(blocks[d:upto])
        blocks[d:upto] = [GUARD_BLOCK] * (upto - d)
        self.dropped[seq] = upto
        return list(range(d, upto)), len(freed)

    def narrow_before(self, seq: int, pos: int) -> int:
        """Narrows sequence seq's references to its blocks that lie wholly before token position
        `pos` (its sliding layers read them no more; its full-attention layers still do). The
        block holding the last token is always kept whole. Returns how many were narrowed."""
        blocks, w = self.blocks[seq], max(self.narrowed[seq], self.dropped[seq])
        upto = min(pos // self.block_tokens, len(blocks) - 1)
        if upto <= w:
            return 0
        self.manager.narrow(blocks[w:upto])
        self.narrowed[seq] = upto
        return upto - w

    def refs(self, seq: int, lo: int = 0) -> tuple[list[int], list[int]]:
        """Sequence seq's held blocks from column lo: (narrowed references, whole ones)."""
        blocks, d = self.blocks[seq], max(self.dropped[seq], lo)
        w = max(self.narrowed[seq], d)
        return blocks[d:w], blocks[w:]

    def _let_go(self, seq: int, lo: int = 0) -> None:
        narrow, whole = self.refs(seq, lo)
        if narrow:
            self.manager.decref(narrow, narrowed=True)
        if whole:
            self.manager.decref(whole)

    def reserve(self, seq: int, extra: int) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
        """Makes room for `extra` more tokens of sequence `seq`.

        Returns (new entries as (column, block id), copy-on-write as (src, dst) or None). The
        token count is advanced; the caller writes the tokens.
        """
        bt, blocks, n = self.block_tokens, self.blocks[seq], self.lens[seq]
        cow = None
        if extra > 0 and n % bt and self.manager.refcount(blocks[-1]) > 1:
            # The last block is partly filled and shared: this sequence writes into its own copy.
            (dst,) = self.manager.allocate(1)
            src = blocks[-1]
            self.manager.decref([src])
            blocks[-1] = dst
            cow = (src, dst)
        need = -(-(n + extra) // bt) - len(blocks)
        new = self.manager.allocate(need) if need > 0 else []
        added = [(len(blocks) + i, b) for i, b in enumerate(new)]
        blocks.extend(new)
        self.lens[seq] = n + extra
        if cow is not None:
            added.append((len(blocks) - len(new) - 1, cow[1]))
        return added, cow

    def blocks_needed(self, seq: int, extra: int) -> int:
        """Fresh blocks `reserve(seq, extra)` would take (its copy-on-write included)."""
        bt, blocks, n = self.block_tokens, self.blocks[seq], self.lens[seq]
        cow = extra > 0 and n % bt and self.manager.refcount(blocks[-1]) > 1
        return max(0, -(-(n + extra) // bt) - len(blocks)) + int(bool(cow))

    def blocks_needed_all(self, counts: list[int]) -> int:
        """Fresh blocks `reserve(b, counts[b])` of every sequence in turn would take: a last
        block shared by several of these sequences is copied by all but the last to write
        (each copy drops a reference, as reserve does)."""
        bt, dropped, need = self.block_tokens, {}, 0
        for b, extra in enumerate(counts):
            if extra <= 0:
                continue
            blocks, n = self.blocks[b], self.lens[b]
            if n % bt:
                last = blocks[-1]
                if self.manager.refcount(last) - dropped.get(last, 0) > 1:
                    need += 1
                    dropped[last] = dropped.get(last, 0) + 1
            need += max(0, -(-(n + extra) // bt) - len(blocks))
        return need

    def truncate(self, seq: int, new_len: int) -> None:
        """Keeps the first new_len tokens of sequence seq, dropping blocks past them."""
        keep = -(-new_len // self.block_tokens)
        blocks = self.blocks[seq]
        if keep < len(blocks):
            self._let_go(seq, keep)
            del blocks[keep:]
        self.dropped[seq] = min(self.dropped[seq], keep)
        self.narrowed[seq] = min(self.narrowed[seq], keep)
        self.lens[seq] = min(self.lens[seq], new_len)

    def select(self, order: list[int]) -> None:
        """Sequence i becomes a copy of old sequence order[i] (beam reorder, repeat, select).

        Shared blocks gain a reference per extra user; blocks no longer used are freed.
        """
        old = [self.refs(j) for j in range(len(self.blocks))]
        self.blocks = [list(self.blocks[j]) for j in order]
        self.lens = [self.lens[j] for j in order]
        self.dropped = [self.dropped[j] for j in order]
        self.narrowed = [self.narrowed[j] for j in order]
        for j in order:
            self.manager.incref(old[j][0], narrowed=True)
            self.manager.incref(old[j][1])
        for narrow, whole in old:
            self.manager.decref(narrow, narrowed=True)
            self.manager.decref(whole)

    def release(self) -> None:
        """Drops every sequence (the cache ended or was dropped)."""
        for i in range(len(self.blocks)):
            self._let_go(i)
        self.blocks = []
        self.lens = []
        self.dropped = []
        self.narrowed = []
