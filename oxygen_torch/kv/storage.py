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
    ):
        self.backing = backing
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
        waiting for in-flight kernels, waits for those, unmaps them and tries once more."""
        self._reap()
        waiting = bool(self._retired)
        groups = (self._all, self._win) if self._whole is not None else (self._all,)
        done = []
        try:
            for g in groups:
                g.take(self, blocks)
                done.append(g)
        except torch.OutOfMemoryError:
            for g in done:
                self._retire(g, g.drop(self, blocks))
            if again or not waiting:
                raise
            self._reap(force=True)  # pages waiting for in-flight kernels: wait, unmap, retry
            self.on_alloc(blocks, again=True)
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
        """Unmaps retired pages that are still empty once their event has completed."""
        if not self._retired:
            return
        if force and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        keep = []
        for event, group, pages in self._retired:
            if force or event is None or event.query():
                group.unmap(self, [p for p in pages if group.live[p] == 0 and p in group.mapped])
            else:
                keep.append((event, group, pages))
        self._retired = keep

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
