"""Where KV blocks live: one flat byte range cut into per-layer K and V caches.

Layout: 2 x num_layers regions (layer l: K = region 2l, V = region 2l+1), each a whole number of
pages and each viewed as `[num_blocks, block_tokens, num_kv_heads, head_dim]`, contiguous, as the
kernels expect. Block b of every region sits at the same offset inside its region, so the pages a
block needs are the same page numbers in every region: they are mapped in all regions together.

Two backings:
- `ArenaBacking` (default): the VMM arena of `oxygen_torch.pool` (cuda on a GPU, memfd+mmap
  on the host). Only pages holding live blocks are mapped. Touching an unmapped page segfaults
  (host) or poisons the CUDA context, so only block-table-driven kernels touch these tensors, and
  block 0 is a guard block that stays mapped (unused table entries point at it).
- `TorchBacking`: one `torch.empty`, everything always "mapped" (development, or no native lib).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import Counter

import torch

from ..config.fields import DEVICE_GRANULARITY, _sized
from ..pool import Arena

log = logging.getLogger("oxygen_torch")

MiB = 1 << 20
_ERR_OOM = 5  # status of _native.NativeError for out of memory (csrc/vmm_backend.h)
GUARD_BLOCK = 0  # always mapped, never handed out: unused block-table entries point here


class TorchBacking:
    """A plain torch allocation standing in for the arena."""

    name = "torch"

    def __init__(self, nbytes: int, device: torch.device, page_size: int = 2 * MiB):
        self.page_size = page_size
        self.capacity = nbytes - nbytes % page_size
        self.flat = torch.empty(self.capacity, dtype=torch.uint8, device=device)
        self.device = self.flat.device

    def tensor(self) -> torch.Tensor:
        return self.flat

    def map_pages(self, first: int, count: int) -> None:
        pass

    def unmap_pages(self, first: int, count: int) -> None:
        pass

    def is_mapped(self, page: int) -> bool:
        return 0 <= page < self.capacity // self.page_size

    def close(self) -> None:
        self.flat = None


class ArenaBacking:
    """The VMM arena: pages mapped on demand."""

    name = "arena"

    def __init__(self, nbytes: int, device: torch.device, page_size: int = 2 * MiB):
        backend = "cuda" if device.type == "cuda" else "host"
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.arena = Arena(nbytes, backend=backend, device=device.index or 0, page_size=page_size)
        self.page_size = self.arena.page_size
        self.capacity = self.arena.capacity
        self.flat = None  # built by tensor(), once page 0 is mapped (torch probes the base)

    def tensor(self) -> torch.Tensor:
        if self.flat is None:
            self.flat = self.arena.as_tensor()
        return self.flat

    def map_pages(self, first: int, count: int) -> None:
        self.arena.map_pages(first, count)

    def unmap_pages(self, first: int, count: int) -> None:
        self.arena.unmap_pages(first, count)

    def is_mapped(self, page: int) -> bool:
        return self.arena.is_mapped(page)

    def close(self) -> None:
        self.flat = None
        self.arena.close()


def make_backing(kind: str, nbytes: int, device: torch.device, page_size: int):
    """kind: "arena", "torch", or "auto" (arena, else torch with one warning)."""
    if kind == "torch":
        return TorchBacking(nbytes, device, page_size)
    try:
        return ArenaBacking(nbytes, device, page_size)
    except Exception as exc:  # no native library / no Arena yet / driver refused
        if kind == "arena":
            raise
        log.warning("oxygen KV cache: VMM arena unavailable (%s); using a plain torch buffer", exc)
        return TorchBacking(min(nbytes, 256 * MiB), device, page_size)


def _holds_no_block(capacity: int, page: int, num_layers: int, block_bytes: int) -> ValueError:
    """The error for an arena whose regions (each layer's K and V, a page at least) hold no block
    besides the guard, naming the field that caused it: pool.page_size when the same arena would
    hold blocks in pages of the default size, else kv.arena_bytes."""
    regions = 2 * num_layers
    pages = -(-2 * block_bytes // page)  # per region: the guard block and one more
    need = regions * pages * page
    small = DEVICE_GRANULARITY
    if page > small and capacity // regions // small * small // block_bytes >= 2:
        return ValueError(
            f"pool.page_size: {_sized(page)} is too large for the KV arena: its {num_layers} "
            f"layers' K and V take {regions * pages} pages at least ({_sized(need)}), and the "
            f"arena holds {_sized(capacity)} (kv.arena_bytes, or its default when 0); lower "
            f"pool.page_size (the default is {_sized(small)}) or raise kv.arena_bytes to ≥ {need}"
        )
    return ValueError(
        f"kv.arena_bytes: {_sized(capacity)} holds no block for {num_layers} layers x "
        f"{block_bytes} bytes per block (need ≥ {_sized(need)} with pool.page_size = "
        f"{_sized(page)})"
    )


def debug_checks_enabled(flag: bool = False) -> bool:
    return flag or os.environ.get("OXYGEN_DEBUG_KV", "0") not in ("", "0")


class KVStorage:
    """Per-layer K/V caches over a backing, with page mapping driven by block allocation.

    window_layers: layers (a hybrid model's sliding ones) whose regions keep a block's pages only
    while some reference needs them whole: `on_narrow(blocks)` says no reference reads those
    blocks through a window layer any more (every holder left them behind its window), and their
    pages in the window layers' regions are unmapped once no such block is left on them. The
    other layers' regions keep every allocated block (kv/window.py)."""

    def __init__(
        self,
        backing,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        block_tokens: int,
        window_layers: tuple[int, ...] = (),
        lock=None,
    ):
        self.backing = backing
        # guards the page state against the map-ahead thread (`map_ahead`); the KV pool's lock
        # (block allocation holds it around on_alloc / on_free)
        self.lock = lock if lock is not None else threading.RLock()
        self._ahead: _Ahead | None = None
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.block_tokens = dtype, block_tokens
        elem = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = block_tokens * num_kv_heads * head_dim * elem
        page = backing.page_size
        regions = 2 * num_layers
        self.region_pages = backing.capacity // regions // page
        self.num_blocks = self.region_pages * page // self.block_bytes
        if self.num_blocks < 2:  # (block 0 is the guard)
            raise _holds_no_block(backing.capacity, page, num_layers, self.block_bytes)
        if any(not 0 <= layer < num_layers for layer in window_layers):
            raise ValueError(f"KVStorage: window layers {window_layers} of {num_layers} layers")
        windowed = set(window_layers) if len(set(window_layers)) < num_layers else set()
        # two sets of regions: every allocated block's pages are mapped in `_all`'s, only the
        # pages of blocks held whole (`_whole`) in `_win`'s (empty without window layers)
        pages = self.region_pages
        self._all = _Regions([r for r in range(regions) if r // 2 not in windowed], pages)
        self._win = _Regions([r for r in range(regions) if r // 2 in windowed], pages)
        self._whole = bytearray(self.num_blocks) if self._win.regions else None
        self._retired: list = []  # (event or None, regions, pages): unmapped once the GPU is past
        self._device = getattr(backing, "device", torch.device("cpu"))
        self.peak_pages = 0
        self.on_alloc([GUARD_BLOCK])
        flat = backing.tensor()
        region_bytes = self.region_pages * page
        shape = (self.num_blocks, block_tokens, num_kv_heads, head_dim)
        used = self.num_blocks * self.block_bytes
        self.k, self.v = [], []
        for r in range(regions):
            t = flat[r * region_bytes : r * region_bytes + used].view(dtype).view(shape)
            (self.k if r % 2 == 0 else self.v).append(t)

    def _mapped_pages(self) -> int:
        return sum(len(g.mapped) * len(g.regions) for g in (self._all, self._win))

    def block_view(self) -> torch.Tensor:
        """[num_blocks, 2 x num_layers, block width]: block b of every region (address order:
        layer l's K at 2l, its V at 2l+1), one strided view of the flat range (no copy), typed
        by the widest integer dividing a block's bytes, so one index op moves whole blocks."""
        flat = self.backing.tensor()
        region_bytes = self.region_pages * self.backing.page_size
        for dt in (torch.int64, torch.int32, torch.int16, torch.uint8):
            e = dt.itemsize
            if self.block_bytes % e == 0 and region_bytes % e == 0 and flat.numel() % e == 0:
                break
        base = flat.view(dt)
        w = self.block_bytes // e
        return base.as_strided(
            (self.num_blocks, 2 * self.num_layers, w), (w, region_bytes // e, 1),
            base.storage_offset(),
        )  # fmt: skip

    def _pages_of(self, block: int) -> range:
        start = block * self.block_bytes
        page = self.backing.page_size
        return range(start // page, (start + self.block_bytes - 1) // page + 1)

    def _page_uses(self, blocks: list[int]) -> Counter:
        """{region page: how many of `blocks` touch it} (a move's blocks share a few pages)."""
        bb, page = self.block_bytes, self.backing.page_size
        if page % bb == 0:  # no block straddles two pages: one division a block
            return Counter([b * bb // page for b in blocks])
        return Counter([p for b in blocks for p in self._pages_of(b)])

    def on_alloc(self, blocks: list[int], again: bool = False) -> None:
        """Maps the pages `blocks` need (all or none); on out of memory with pages still
        waiting for in-flight kernels (or mapped ahead), waits for those, unmaps them and tries
        once more."""
        with self.lock:
            ahead = self._ahead
            if ahead is not None:
                ahead.settle(self, blocks)  # (a page the thread is mapping: wait for it)
            self._on_alloc(blocks, again)
            if ahead is not None:
                ahead.allocated()

    def _on_alloc(self, blocks: list[int], again: bool) -> None:
        self._reap()
        ahead = self._ahead
        groups = (self._all, self._win) if self._whole is not None else (self._all,)
        done = []
        try:
            for g in groups:
                g.take(self, blocks)
                done.append(g)
        except torch.OutOfMemoryError:
            for g in done:
                self._retire(g, g.drop(self, blocks))
            waiting = bool(self._retired) or (ahead is not None and ahead.holds(self))
            if again or not waiting:
                raise
            if ahead is not None:  # its pages go first
                ahead.drop_all(self)
            self._reap(force=True)  # pages waiting for in-flight kernels: wait, unmap, retry
            self._on_alloc(blocks, again=True)
            return
        except BaseException:
            for g in done:
                self._retire(g, g.drop(self, blocks))
            raise
        if self._whole is not None:
            for b in blocks:
                self._whole[b] = 1
        self.peak_pages = max(self.peak_pages, self._mapped_pages())

    def on_free(self, blocks: list[int]) -> None:
        with self.lock:
            self._retire(self._all, self._all.drop(self, blocks))
            if self._whole is not None:
                self.on_narrow(blocks)

    def on_narrow(self, blocks: list[int]) -> None:
        """No reference reads these blocks through a window layer any more: their pages in the
        window layers' regions go once no block held whole is left on them."""
        whole = self._whole
        if whole is None:
            return
        gone = [b for b in blocks if whole[b]]
        for b in gone:
            whole[b] = 0
        self._retire(self._win, self._win.drop(self, gone))

    def _retire(self, group: _Regions, empty: set[int]) -> None:
        if not empty:
            return
        # On a GPU the host runs ahead: kernels already queued may still read these blocks, and
        # touching an unmapped page poisons the context. Unmap once the stream is past this
        # point (an event), or at once on the host, where ops are synchronous.
        event = None
        if self._device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
        self._retired.append((event, group, sorted(empty)))
        self._reap()

    def _reap(self, force: bool = False) -> None:
        """Unmaps retired pages that are still empty once their event has completed. With a
        map-ahead thread, that thread unmaps them (and keeps the ones it would map next), unless
        `force` (memory is short: this thread waits for the device and unmaps at once)."""
        if not self._retired:
            return
        ahead = self._ahead
        if force and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        keep, old = [], self._retired
        self._retired = []  # (pages a finalizer retires meanwhile: kept below)
        for event, group, pages in old:
            if ahead is not None and group is self._all and not force:
                keep.append((event, group, pages))  # (the map-ahead thread's)
            elif force or event is None or event.query():
                group.unmap(self, [p for p in pages if group.live[p] == 0 and p in group.mapped])
            else:
                keep.append((event, group, pages))
        self._retired = keep + self._retired
        if ahead is not None and self._retired:
            ahead.wake()

    def map_ahead(self, nbytes: int) -> None:
        """Keeps up to `nbytes` of empty pages (in every region of the layers that keep all
        their blocks) mapped ahead of the block allocator, by a thread of this storage: a step
        that needs new pages finds them mapped, and pages left empty are unmapped by that thread
        too (kv.map_ahead_bytes; 0: off, every map and unmap on the allocating thread). The
        pages go back once allocations stop for AHEAD_KEEP_S. Not for a TorchBacking (always
        mapped)."""
        if isinstance(self.backing, TorchBacking) or not self._all.regions:
            nbytes = 0  # (always mapped)
        region_page = self.backing.page_size * len(self._all.regions)
        pages = max(1, nbytes // region_page) if nbytes > 0 else 0
        with self.lock:
            if pages and self._ahead is None:
                self._ahead = _Ahead(self, pages)
            elif self._ahead is not None:
                if pages:
                    self._ahead.pages = pages
                    self._ahead.wake()
                else:
                    ahead, self._ahead = self._ahead, None
                    ahead.stop(self)

    def close_ahead(self) -> None:
        """Stops the map-ahead thread (before the backing closes)."""
        with self.lock:
            ahead, self._ahead = self._ahead, None
            if ahead is not None:
                ahead.stop(self)

    def ahead_stats(self) -> dict:
        a = self._ahead
        return a.stats() if a is not None else {}

    def mapped_bytes(self, peak: bool = False) -> int:
        pages = self.peak_pages if peak else self._mapped_pages()
        return pages * self.backing.page_size

    def window_mapped_bytes(self) -> int:
        """Bytes mapped in the window layers' regions (0 without window layers)."""
        return len(self._win.mapped) * len(self._win.regions) * self.backing.page_size

    def check_blocks(self, blocks: torch.Tensor) -> None:
        """Debug: every block id is in range and its pages are mapped in every region that
        keeps all allocated blocks (a host sync). A window layer's regions may have let a
        narrowed block's pages go: its kernels never read behind the window, so those are not
        checked. Region page p of region r is arena page r * region_pages + p."""
        ids = sorted(set(int(b) for b in blocks.flatten().tolist()))
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise RuntimeError(
                    f"oxygen KV debug: block id {b} out of range [0, {self.num_blocks})"
                )
            for p in self._pages_of(b):
                unmapped = p not in self._all.mapped or any(
                    not self.backing.is_mapped(r * self.region_pages + p) for r in self._all.regions
                )
                if unmapped:
                    raise RuntimeError(f"oxygen KV debug: block {b} lies on unmapped page {p}")


class _Regions:
    """A set of a KVStorage's regions whose pages are mapped together: for each region page,
    how many live blocks touch it, and whether it is mapped (in every region of the set)."""

    def __init__(self, regions: list[int], region_pages: int):
        self.regions = regions
        self.region_pages = region_pages
        self.live = [0] * region_pages if regions else []
        self.mapped: set[int] = set()

    def _apply(self, pages: list[int], fn) -> None:
        """fn(first, count) over contiguous runs of region pages, in every region of the set."""
        pages = sorted(pages)
        runs, i = [], 0
        while i < len(pages):
            j = i
            while j + 1 < len(pages) and pages[j + 1] == pages[j] + 1:
                j += 1
            runs.append((pages[i], j - i + 1))
            i = j + 1
        for r in self.regions:
            for first, count in runs:
                fn(r * self.region_pages + first, count)

    def take(self, st: KVStorage, blocks: list[int]) -> None:
        """Counts blocks live on their pages and maps the pages that were not (all or none)."""
        need, live = [], self.live
        for p, k in st._page_uses(blocks).items():
            if live[p] == 0 and p not in self.mapped:
                need.append(p)
            live[p] += k
        if not need:
            return
        try:
            self._map(st, sorted(need))
        except BaseException:
            self.untake(st, blocks)
            raise

    def untake(self, st: KVStorage, blocks: list[int]) -> None:
        for p, k in st._page_uses(blocks).items():
            self.live[p] -= k

    def drop(self, st: KVStorage, blocks: list[int]) -> set[int]:
        """Counts blocks no longer live; returns the pages left with none."""
        empty, live = set(), self.live
        for p, k in st._page_uses(blocks).items():
            live[p] -= k
            if live[p] == 0:
                empty.add(p)
        return empty

    def _map(self, st: KVStorage, pages: list[int], retried: bool = False) -> None:
        backing = st.backing
        try:
            self._apply(pages, backing.map_pages)
        except BaseException as exc:
            for r in self.regions:  # roll back the regions that did get mapped
                for p in pages:
                    if backing.is_mapped(r * self.region_pages + p):
                        backing.unmap_pages(r * self.region_pages + p, 1)
            if getattr(exc, "status", None) == _ERR_OOM and not retried:
                # the activations' pool keeps idle pages mapped while allocations come (up to
                # its recent peak): the KV's growth takes them back before it reports OOM
                from ..pool.stats import empty_cache

                empty_cache()
                return self._map(st, pages, retried=True)
            if getattr(exc, "status", None) == _ERR_OOM:
                raise torch.OutOfMemoryError(
                    f"oxygen KV cache: no device memory for {len(pages)} more page(s) in each of "
                    f"{len(self.regions)} regions; {st.mapped_bytes()} bytes of KV mapped ({exc})"
                ) from exc
            raise
        self.mapped.update(pages)

    def unmap(self, st: KVStorage, pages: list[int]) -> None:
        if pages:
            self._apply(pages, st.backing.unmap_pages)
            self.mapped.difference_update(pages)


AHEAD_KEEP_S = 0.1  # pages mapped ahead stay this long after the last allocation
AHEAD_POLL_S = 0.002  # how often the thread looks at retired pages' events while any wait
AHEAD_SWEEP_S = 0.02  # how often at most it walks the mapped pages for ones no longer wanted


class _Ahead:
    """The map-ahead thread of one KVStorage (KVStorage.map_ahead). The block allocator hands out
    the lowest free ids first, so the pages it needs next are the lowest pages with no live
    block: the thread keeps the `pages` lowest of those mapped (in every region of `_all`), one
    page at a time with the storage's lock released during the driver's calls, and unmaps the
    other empty pages once the kernels queued before they emptied have passed (their events).
    A page the thread is mapping or unmapping is `busy`: an allocation that needs it waits.

    The thread holds the storage weakly: a storage let go ends it."""

    def __init__(self, st: KVStorage, pages: int):
        self.pages = pages
        self.busy: set[int] = set()
        self.cond = threading.Condition(st.lock)
        self.last_alloc = time.monotonic()
        self.stopped = False
        self.maps = self.unmaps = 0
        self.map_s = self.unmap_s = 0.0
        self.waits = 0  # allocations that waited for a page in flight
        self.swept = 0.0  # when a walk of the mapped pages last found none to give back
        self.pid = os.getpid()
        ref = weakref.ref(st)
        self.thread = threading.Thread(
            target=_Ahead._run, args=(ref, self), name="oxygen-kv-ahead", daemon=True
        )
        self.thread.start()

    # --- the allocating thread's side (the storage's lock held) --------------------------------

    def wake(self) -> None:
        self.cond.notify_all()

    def allocated(self) -> None:
        self.last_alloc = time.monotonic()
        self.cond.notify_all()

    def settle(self, st: KVStorage, blocks: list[int]) -> None:
        if not self.busy or self.pid != os.getpid():
            return
        pages = st._page_uses(blocks)
        while self.busy.intersection(pages):
            self.waits += 1
            self.cond.wait(1.0)

    def holds(self, st: KVStorage) -> bool:
        """Whether empty pages are mapped (ahead, or retired and not yet unmapped)."""
        g = st._all
        return any(g.live[p] == 0 for p in g.mapped)

    def drop_all(self, st: KVStorage) -> None:
        """Out of memory: every empty page goes now (this thread; in-flight maps first)."""
        while self.busy:
            self.cond.wait(1.0)
        if st._device.type == "cuda":
            torch.cuda.synchronize(st._device)
        g = st._all
        g.unmap(st, [p for p in g.mapped if g.live[p] == 0 and p != 0])
        st._retired = [r for r in st._retired if r[1] is not g]
        self.last_alloc = 0.0  # (no map ahead until the next allocation)

    def stop(self, st: KVStorage) -> None:
        self.stopped = True
        self.cond.notify_all()
        if threading.current_thread() is not self.thread:
            while self.busy and self.thread.is_alive():
                self.cond.wait(1.0)

    def stats(self) -> dict:
        return {"pages": self.pages, "maps": self.maps, "unmaps": self.unmaps,
                "map_s": self.map_s, "unmap_s": self.unmap_s, "waits": self.waits}  # fmt: skip

    # --- the thread ------------------------------------------------------------------------

    @staticmethod
    def _run(ref, self: _Ahead) -> None:
        while True:
            st = ref()
            if st is None or self.stopped or self.pid != os.getpid():
                return
            with st.lock:
                if self.stopped:
                    return
                job = self._next(st)
                if job is None:
                    ours = any(group is st._all for _, group, _ in st._retired)
                    wait = AHEAD_POLL_S if ours else 1.0
                    if time.monotonic() - self.last_alloc < AHEAD_KEEP_S + 2 * AHEAD_SWEEP_S:
                        wait = min(wait, AHEAD_SWEEP_S)  # (the pages ahead are soon due back)
                    del st  # (not held while waiting: a storage let go ends the thread)
                    self.cond.wait(wait)
                    continue
                kind, page = job
                self.busy.add(page)
            del st  # (not held across the driver's calls: a storage let go ends the thread)
            self._do(ref, kind, page)

    def _do(self, ref, kind: str, page: int) -> None:
        st = ref()
        if st is None:
            return
        g = st._all
        t = time.perf_counter()
        ok = False
        try:
            if kind == "map":
                g._apply([page], st.backing.map_pages)
            else:
                g._apply([page], st.backing.unmap_pages)
            ok = True
        except Exception as exc:  # noqa: BLE001 - no memory for more, say: allocations map
            log.debug("oxygen KV map-ahead: %s of page %d failed: %r", kind, page, exc)
            if kind == "map":  # roll back the regions that did get mapped
                for r in g.regions:
                    if st.backing.is_mapped(r * g.region_pages + page):
                        st.backing.unmap_pages(r * g.region_pages + page, 1)
        took = time.perf_counter() - t
        with st.lock:
            self.busy.discard(page)
            if ok and kind == "map":
                g.mapped.add(page)
                self.maps += 1
                self.map_s += took
            elif ok:
                g.mapped.discard(page)
                self.unmaps += 1
                self.unmap_s += took
            elif kind == "map":
                self.last_alloc = 0.0  # (failed: no more ahead until the next allocation)
            self.cond.notify_all()

    def _next(self, st: KVStorage):
        """(the storage's lock held) The next page to map or unmap, or None."""
        g = st._all
        live, mapped, busy = g.live, g.mapped, self.busy
        want = self.pages if time.monotonic() - self.last_alloc < AHEAD_KEEP_S else 0
        # the lowest empty pages are the allocator's next (page 0 holds the guard block)
        keep, p = set(), 1
        while len(keep) < want and p < g.region_pages:
            if live[p] == 0:
                keep.add(p)
            p += 1
        for p in sorted(keep):
            if p not in mapped and p not in busy:
                return "map", p
        # retired pages whose kernels have passed (their events): unmapped unless kept; pages
        # whose kernels may still run are never touched
        # (a cache's finalizer run by the garbage collector in this thread may retire pages
        # while this walks the list: those go to a fresh one, kept below)
        job, retired, old = None, [], st._retired
        st._retired = []
        for event, group, pages in old:
            if group is not g:  # (window layers' regions: KVStorage._reap)
                retired.append((event, group, pages))
                continue
            if job is not None or (event is not None and not event.query()):
                retired.append((event, group, pages))
                continue
            rest = [q for q in pages if live[q] == 0 and q in mapped and q not in keep]
            left = [q for q in rest if q in busy]
            rest = [q for q in rest if q not in busy]
            if rest:
                job = "unmap", rest[0]
                left += rest[1:]
            if left:
                retired.append((None, group, left))
        st._retired = retired + st._retired
        if job is not None:
            return job
        # pages mapped ahead no longer wanted (allocations stopped): back (a walk of every
        # mapped page: at most every AHEAD_SWEEP_S while it finds none)
        now = time.monotonic()
        if now - self.swept < AHEAD_SWEEP_S:
            return None
        pending = {q for _, group, pages in st._retired if group is g for q in pages}
        for q in mapped:
            if q and live[q] == 0 and q not in keep and q not in busy and q not in pending:
                return "unmap", q
        self.swept = now
        return None
