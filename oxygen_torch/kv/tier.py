"""The CPU tier of a KV pool: host rows that hold whole blocks (every layer's K and V, and fp8
scales) while they are off the device (pool.cpu_tier_bytes), with an optional disk tier behind
it (kv/disk.py) and fp8 lowering of low-priority blocks under pressure (kv/lowering.py).

A row is one line of a [rows, row bytes] uint8 host tensor (pinned on a GPU machine, so copies
run on the copy engine): a block at its own precision, or, lowered, two blocks' e4m3 codes side
by side with their scales after them. A caller holds slots: slot = row x halves + half (halves
is 2 when lowering is possible, else 1), and a slot stays valid wherever its row lives. When a
`down` finds no free CPU row, the rows used least recently (down or up) go to the disk tier in
one sequential write, and `up` reads a row on disk back with one read per run of records.

Migration moves many blocks at once (kv/transfer.py): the blocks are gathered into the tier's
device staging buffer (one index_select over the whole block view; lowered: quantized first), which
goes over in one copy per run of consecutive CPU rows, straight into the pinned rows; the way back
copies the rows up the same way and scatters them into the blocks (one index_copy_; lowered:
dequantized on the device first). A full-precision move down beside decode steps goes by the mapped
kernel instead (pool.tier_moves "auto"; "mapped" both ways always, "gather" never): no staging, the
kernel stores into the pinned rows through their device address, taking less of PCIe than the copy
engine. On a GPU the copies run on a side stream after the current stream's work, and everything
that stream reads is made on it. The host does not wait for a move: `up` orders the current stream
after it (the step that reads the blocks), and a `down`'s blocks are freed behind its event
(`fence()`, BlockManager's fenced frees), so neither their reuse nor their pages' unmapping can
overtake the copy; host-side reads and writes of the rows (the disk tier, lowering) wait first (run
on the H200: tests/test_tier_cuda.py, benchmarks/bench_tier.py). Only kernels driven by block
tables read the arena, and a block table only ever names device blocks: a block in this tier is
brought back before a step uses it.
"""

from __future__ import annotations

import contextlib
import heapq

import torch

from .._patching import warn_once
from ..triton_kernels._checks import interpreting
from ..triton_kernels.block_rows import mapped_view
from . import transfer
from .disk import DiskTier, DiskUnavailable
from .free_rows import FreeRows
from .lowering import LOWERABLE, lower, raise_, scale_bytes
from .transfer import Staging, scatter

# A down of low-priority blocks is lowered when, at full precision, it would leave the CPU tier
# more than this share full (pool.tier_fp8_lowering; docs/operations.md)
PRESSURE = 0.75
FULL = 4  # a row's mask: one block at full precision; bits 1 and 2: lowered halves 0 and 1


class TierFull(RuntimeError):
    """The CPU tier (and the disk tier behind it) has no free slot for the blocks asked."""


class CPUTier:
    def __init__(
        self,
        storages: list,
        nbytes: int,
        device: torch.device,
        disk_path: str = "",
        disk_bytes: int = 0,
        fp8_lowering: bool = False,
        moves: str = "auto",
    ):
        self.moves = moves  # pool.tier_moves (checked by transfer.way_of at each move)
        self._views = [st.block_view() for st in storages]  # [num_blocks, regions, width] each
        self.block_bytes = sum(2 * st.num_layers * st.block_bytes for st in storages)
        st = storages[0]
        self.lowering = fp8_lowering and len(storages) == 1 and st.dtype in LOWERABLE
        self._caches = [*st.k, *st.v] if self.lowering else []  # typed, for lowering
        self._halves = 2 if self.lowering else 1
        self._hb = self.block_bytes // 2  # a lowered block's codes
        self._sb = scale_bytes(self._caches) if self.lowering else 0  # ... and its scales
        self.row_bytes = self.block_bytes + 2 * self._sb
        self.num_slots = nbytes // self.row_bytes  # CPU rows
        self.device = device
        pin = device.type == "cuda"
        self.host = torch.empty(self.num_slots, self.row_bytes, dtype=torch.uint8, pin_memory=pin)
        self._cpu_free = FreeRows(self.num_slots)  # free CPU rows
        self._row_at: list[int | None] = [None] * self.num_slots  # CPU row -> logical row
        self.disk = None
        if disk_path and self.num_slots:
            try:
                self.disk = DiskTier(disk_path, disk_bytes, self.row_bytes)
            except DiskUnavailable as exc:  # every call would fail for it, needing it or not
                warn_once(f"oxygen_torch: the KV disk tier is off: {exc}; the CPU tier goes on")
        n = self.num_slots + (self.disk.num_records if self.disk is not None else 0)
        self._rows = FreeRows(n)  # free logical rows
        self._where: list[int | None] = [None] * n  # CPU row (>= 0) or -1 - disk record
        self._mask = [0] * n
        self._last = [0] * n  # clock of the row's last down or up (LRU for spills)
        self._open: set[int] = set()  # lowered rows on the CPU with one half free
        self._clock = 0
        cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if cuda else None
        self._copy = torch.cuda.Stream(device) if cuda else None  # its copies, beside the side's
        self._stage = Staging(self.block_bytes, device, transfer.STAGING_BYTES if cuda else 4 << 20)
        self._fence = None  # the event of the last down: its blocks are free once it passed
        # the moves through the rows' device alias (tier_moves "mapped"); False: none to be had
        self._alias: transfer.MappedMoves | None | bool = None
        self.counts = dict(
            migrations_down=0, migrations_up=0, bytes_down=0, bytes_up=0,
            bytes_to_disk=0, bytes_from_disk=0, lowered_blocks=0,
            blocks_mapped=0,  # moved by the mapped kernel (pool.tier_moves "mapped")
        )  # fmt: skip

    @property
    def num_free(self) -> int:
        """Blocks at full precision that a `down` can still take (CPU rows and disk records)."""
        disk = self.disk.num_free if self.disk is not None else 0
        return len(self._cpu_free) + disk

    def lowered(self, slot: int) -> bool:
        """Whether the slot holds its block as fp8 (taken slots only)."""
        return self._mask[slot // self._halves] != FULL

    def used_bytes(self) -> int:
        return (self.num_slots - len(self._cpu_free)) * self.row_bytes

    def disk_used_bytes(self) -> int:
        used = sum(1 for w in self._where if w is not None and w < 0)
        return used * self.row_bytes

    def _by_kernel(self, up: bool) -> transfer.MappedMoves | None:
        """The moves over the host rows' device alias when this move goes by the mapped kernel
        (pool.tier_moves "mapped", or "auto" for a move down on a GPU while steps run there),
        else None. On the host backend the kernel runs when asked for by name, in Triton's
        interpreter only (there is no PCIe to cross: "auto" gathers there, a memcpy); on a GPU
        whose pinned rows have no device alias it warns once and gathers."""
        if transfer.way_of(self.device, up, self.moves) != "mapped":
            return None
        return self._kernel_moves()

    def _kernel_moves(self) -> transfer.MappedMoves | None:
        """The mapped moves over the host rows' device alias, made at the first use (None, said
        once, where there is none to be had)."""
        if self._alias is None:
            self._alias = False
            why = ""
            if self.device.type == "cuda" or interpreting():
                try:
                    alias = mapped_view(self.host, self.device)
                    self._alias = transfer.MappedMoves(self._views, alias, self.device)
                except Exception as exc:
                    why = str(exc)
            else:
                why = "on the host backend the kernel runs only in Triton's interpreter"
            if why:
                warn_once(f"oxygen_torch: the CPU tier moves KV blocks through gather kernels, "
                          f"not the mapped kernel (pool.tier_moves \"mapped\"): {why}")  # fmt: skip
        return self._alias if self._alias is not False else None

    def warm_moves(self, max_blocks: int) -> int:
        """Before traffic (oxygen_torch.warm_up): the mapped kernel compiled and the CUDA graphs
        of the moves that can go by it (pool.tier_moves "auto": moves down, the engine's swaps
        beside its steps; "mapped": both ways) captured for moves of up to `max_blocks` blocks,
        at either grid, so that the first preemption does not stall every running call for
        them. Returns the graphs captured; 0 off a GPU."""
        ways = transfer.kernel_ways(self.device, self.moves)
        if not ways or self.device.type != "cuda":
            return 0
        kernel = self._kernel_moves()
        if kernel is None:
            return 0
        grids = (transfer.MAPPED_PROGRAMS, transfer.MAPPED_PROGRAMS_BESIDE_STEPS)
        return sum(kernel.prepare(up, g, max_blocks) for up in ways for g in grids)

    def _pressed(self, n: int) -> bool:
        return self.num_slots - len(self._cpu_free) + n > PRESSURE * self.num_slots

    def down(self, blocks: list[int], low_priority: bool = False) -> list[int]:
        """Copies device blocks into fresh slots (the blocks stay allocated: the caller frees
        them); returns the slots. `low_priority`: the blocks may be lowered to fp8 (the tier
        lowers and the tier is under pressure). TierFull: nothing changed."""
        if not blocks:
            return []
        n, lowered = len(blocks), low_priority and self.lowering and self._pressed(len(blocks))
        opened = sorted(self._open)[:n] if lowered else []
        need = -(-(n - len(opened)) // 2) if lowered else n  # fresh rows
        if need > self.num_free:
            disk = f" and pool.disk_tier_bytes, {self.disk.num_free} free" if self.disk else ""
            raise TierFull(
                f"oxygen KV CPU tier full: {need} row(s) asked, {len(self._cpu_free)} free of "
                f"{self.num_slots} (raise pool.cpu_tier_bytes{disk})"
            )
        try:
            return self._down(blocks, lowered, opened, need)
        finally:
            if self._side is not None:
                self._fence = torch.cuda.Event()
                self._fence.record(self._side)

    def fence(self):
        """The event a caller freeing the last `down`'s blocks frees them behind
        (`BlockManager.decref(after=...)`); None on the host, where moves are done on return."""
        return self._fence

    def wait(self) -> None:
        """Waits for every move in flight (the host touches the rows after this)."""
        if self._side is not None:
            self._side.synchronize()

    def _down(self, blocks: list[int], lowered: bool, opened: list[int], need: int) -> list[int]:
        n = len(blocks)
        # lowered: uint8 [n, codes + scales] on the host; else the blocks' ids (a list when the
        # mapped kernel moves them, else on their device)
        kernel = None if lowered else self._by_kernel(up=False)  # (decided once a move)
        if lowered:
            staged = self._lowered(blocks)
        else:
            staged = blocks if kernel is not None else self._ids(blocks)
        self._clock += 1
        rows, mask, last, clock = self._rows, self._mask, self._last, self._clock
        fresh = rows.take(need)
        if lowered:  # each block's (row, half): the open rows' free halves first, then fresh rows
            places = [(r, 1 - mask[r] // 2) for r in opened]
            places += [(r, h) for r in fresh for h in (0, 1)][: n - len(opened)]
            for r, h in places:
                mask[r] |= 1 << h
                last[r] = clock
            slots = [r * 2 + h for r, h in places]
        else:  # (a loop of plain stores: a move's bookkeeping is host time beside every step)
            places, slots = None, [r * self._halves for r in fresh]
            for r in fresh:
                mask[r] = FULL
                last[r] = clock
        self._open.difference_update(opened)
        per_row = 2 if lowered else 1
        where, row_at = self._where, self._row_at
        try:
            if opened:
                self._put([where[r] for r in opened], places[: len(opened)], staged, lowered,
                          kernel)  # fmt: skip
            done = len(opened)
            for i in range(0, need, self.num_slots):  # at most a CPU tier's rows at a time
                chunk = fresh[i : i + self.num_slots]
                self._make_room(len(chunk))
                at = self._cpu_free.take(len(chunk))
                k = min(per_row * len(chunk), n - done)  # the chunk's rows hold places done..+k
                if lowered:
                    pos = [at[j // 2] for j in range(k)]
                else:  # rows in the blocks' order: consecutive blocks meet consecutive rows
                    pos = (
                        at
                        if isinstance(staged, torch.Tensor)
                        else _in_order(staged[done : done + k], at)
                    )
                # the copies first: the bookkeeping below overlaps them
                half = places[done : done + k] if lowered else None
                self._put(pos, half, staged[done : done + k], lowered, kernel)
                for r, p in zip(chunk, at if lowered else pos):
                    where[r] = p
                    row_at[p] = r
                done += k
        except TierFull:  # the disk failed: rows not placed go back as they are, the rest freed
            unplaced = {r for r in fresh if where[r] is None}
            for r in unplaced:
                mask[r] = 0
            rows.give(unplaced)
            self.release([s for s in slots if s // self._halves not in unplaced])
            raise
        if lowered:
            self._open.update(r for r, _ in places if mask[r] != 3)
        self.counts["migrations_down"] += 1
        self.counts["bytes_down"] += staged.numel() if lowered else n * self.block_bytes
        self.counts["lowered_blocks"] += n if lowered else 0
        return slots

    def _put(self, pos: list[int], places: list, staged, lowered: bool, kernel) -> None:
        """Writes blocks into CPU rows `pos`: `staged` holds the ids of full-precision blocks
        (copied down on the side stream; a list: by `kernel`, the mapped moves), or lowered
        blocks, put at their halves (places[i][1])."""
        if not pos:
            return
        if not lowered:
            with self._on_side():
                host = self.host[:, : self.block_bytes]
                if kernel is not None:  # (staged: the blocks' ids as a list)
                    kernel.move(staged, pos, up=False)
                    self.counts["blocks_mapped"] += len(pos)
                else:
                    transfer.down(self._views, staged, host, pos, self._stage, self._copy)
            return
        self.wait()  # an up still reading rows from the host comes first
        hb, sb, bb = self._hb, self._sb, self.block_bytes
        for h in (0, 1):
            i = [j for j, (_, half) in enumerate(places) if half == h]
            if i:
                at, rows = torch.tensor([pos[j] for j in i]), staged[torch.tensor(i)]
                for dst, src in (
                    (self.host[:, h * hb : (h + 1) * hb], rows[:, :hb]),
                    (self.host[:, bb + h * sb : bb + (h + 1) * sb], rows[:, hb:]),
                ):
                    dst, src = _words(dst, src)
                    dst.index_copy_(0, at, src)

    def _make_room(self, k: int) -> None:
        """Frees k CPU rows by moving the least recently used to disk (TierFull: nothing moved)."""
        need = k - len(self._cpu_free)
        if need <= 0:
            return
        self.wait()  # the victims' rows may still be on their way down
        live = (r for r in self._row_at if r is not None)
        victims = sorted(heapq.nsmallest(need, live, key=self._last.__getitem__),
                         key=self._where.__getitem__)  # fmt: skip
        records = self.disk.take(need)
        try:
            self.disk.write(records, [self.host[self._where[r]] for r in victims])
        except OSError as exc:
            self.disk.release(records)
            warn_once(
                f"oxygen_torch: the KV disk tier failed ({exc}); it takes no more blocks "
                f"(pool.disk_tier_path: {self.disk.path})"
            )
            raise TierFull(f"oxygen KV disk tier: write failed ({exc})") from exc
        for r, rec in zip(victims, records):
            p = self._where[r]
            self._row_at[p], self._where[r] = None, -1 - rec
            self._cpu_free.give((p,))
            self._open.discard(r)
        self.counts["bytes_to_disk"] += need * self.row_bytes

    def _on_side(self):
        """The side stream, after the current stream's work so far (nothing on the host)."""
        if self._side is None:
            return contextlib.nullcontext()
        self._stage.order(self._side, torch.cuda.current_stream(self.device))  # (wait_stream)
        return torch.cuda.stream(self._side)

    def _ids(self, blocks: list[int]) -> torch.Tensor:
        """The blocks' ids on their device, made on the side stream, which reads them: a tensor
        made on the current stream and freed on return could be handed to the caller's next
        kernels while a move still reads it (the pool reuses a stream's own frees at once).
        From pinned memory: a copy from pageable memory would hold the host, and the
        interpreter lock with it, until the side stream's moves in flight are done."""
        idx = transfer.int64(blocks)
        if self._side is None:
            return idx
        with torch.cuda.stream(self._side):
            return transfer.to_device(idx, self.device)

    def _lowered(self, blocks: list[int]) -> torch.Tensor:
        """The blocks lowered to fp8 on their device, as uint8 [n, codes + scales] on the host."""
        idx = self._ids(blocks)
        with self._on_side():
            gathered = lower(self._caches, idx)
            if self._side is None:
                return gathered
            staged = torch.empty(gathered.shape, dtype=torch.uint8, pin_memory=True)
            staged.copy_(gathered, non_blocking=True)
        self._side.synchronize()
        return staged

    def release(self, slots: list[int]) -> None:
        if self._release_full(slots):
            return
        for s in slots:
            r, h = divmod(s, self._halves)
            m = self._mask[r] if 0 <= r < len(self._mask) else 0
            if not (m == FULL and h == 0 or m != FULL and m & 1 << h):
                raise ValueError(f"oxygen KV CPU tier: slot {s} is not taken")
            self._mask[r] = 0 if self._mask[r] == FULL else self._mask[r] & ~(1 << h)
            if self._mask[r]:
                if self._where[r] >= 0:
                    self._open.add(r)
                continue
            self._open.discard(r)
            w = self._where[r]
            if w >= 0:
                self._row_at[w] = None
                self._cpu_free.give((w,))
            else:
                self.disk.release([-1 - w])
            self._where[r] = None
            self._rows.give((r,))

    def _release_full(self, slots: list[int]) -> bool:
        """release() of slots that are all distinct full-precision rows on the CPU (a move's, the
        usual case): checked first, then freed in one plain loop; False: nothing done (the
        general loop frees them, or says which slot is not taken)."""
        h, mask, where = self._halves, self._mask, self._where
        if not slots or min(slots) < 0 or h > 1 and any(s % h for s in slots):
            return False
        rows = slots if h == 1 else [s // h for s in slots]
        if max(rows) >= len(mask) or len(set(rows)) < len(rows):
            return False
        if set(map(mask.__getitem__, rows)) != {FULL}:
            return False
        at, row_at = list(map(where.__getitem__, rows)), self._row_at  # their CPU rows
        if min(at) < 0:  # (some on disk)
            return False
        for r, w in zip(rows, at):
            mask[r] = 0
            row_at[w] = where[r] = None
        self._cpu_free.give(at)
        self._rows.give(rows)
        if self._open:  # (only lowered rows are ever open)
            self._open.difference_update(rows)
        return True

    def _rows_of(self, rows: list[int]) -> torch.Tensor:
        """The rows' bytes, wherever they are, as uint8 [len(rows), row bytes] on the host
        (pinned on a GPU): rows on disk read with one call per run of consecutive records."""
        self.wait()  # rows still on their way down
        pin = self._side is not None
        out = torch.empty(len(rows), self.row_bytes, dtype=torch.uint8, pin_memory=pin)
        cpu = [i for i, r in enumerate(rows) if self._where[r] >= 0]
        if cpu:
            at = torch.tensor([self._where[rows[i]] for i in cpu])
            out[torch.tensor(cpu)] = self.host.index_select(0, at)
        disk = sorted((-1 - self._where[r], i) for i, r in enumerate(rows) if self._where[r] < 0)
        if disk:
            self.disk.read([rec for rec, _ in disk], [out[i] for _, i in disk])
            self.counts["bytes_from_disk"] += len(disk) * self.row_bytes
        return out

    def up(self, slots: list[int], blocks: list[int], wait: bool = True):
        """Copies slots into device blocks (allocated by the caller); the slots stay taken.
        `wait`: the current stream's next work comes after the copy. Else the copy's event is
        returned for the step that reads the blocks to wait for (a swap-in ahead of its step,
        kv/swap.py); None on the host, where the copy is done on return."""
        if not slots:
            return None
        self._clock += 1
        of = slots if self._halves == 1 else [s // self._halves for s in slots]  # their rows
        last, clock = self._last, self._clock
        for r in of:
            last[r] = clock
        at_cpu = list(map(self._where.__getitem__, of))
        if set(map(self._mask.__getitem__, of)) == {FULL}:
            # at full precision: straight from the pinned rows, a copy per run; rows on disk
            # are read into pinned rows first
            on_cpu = min(at_cpu) >= 0
            if on_cpu:
                host = self.host[:, : self.block_bytes]
            else:
                host = self._rows_of(of)[:, : self.block_bytes]
                at_cpu = list(range(len(slots)))
            kernel = self._by_kernel(up=True) if on_cpu else None
            idx = None if kernel is not None else self._ids(blocks)
            with self._on_side():
                if kernel is not None:  # (rows read from disk are in a fresh tensor: gathered)
                    kernel.move(blocks, at_cpu, up=True)
                    self.counts["blocks_mapped"] += len(blocks)
                else:
                    transfer.up(self._views, host, at_cpu, idx, self._stage, self._copy)
            self.counts["bytes_up"] += len(slots) * self.block_bytes
            self.counts["migrations_up"] += 1
            return self._after_up(wait)
        rows = sorted(set(of))
        src = self._rows_of(rows)  # [m, row bytes]
        at = {r: i for i, r in enumerate(rows)}
        full = [i for i, s in enumerate(slots) if self._mask[s // self._halves] == FULL]
        low = [i for i, s in enumerate(slots) if self._mask[s // self._halves] != FULL]
        if full:
            pick = torch.tensor([at[slots[i] // self._halves] for i in full])
            staged = _words(src[:, : self.block_bytes])[0][pick].view(torch.uint8)
            self._scatter(staged, [blocks[i] for i in full], lowered=False)
        if low:
            m, pick = len(rows), torch.tensor([at[slots[i] // 2] for i in low])
            half = torch.tensor([slots[i] % 2 for i in low])
            parts = (src[:, : self.block_bytes].reshape(m, 2, self._hb),
                     src[:, self.block_bytes :].reshape(m, 2, self._sb))  # fmt: skip
            codes, scales = (_words(p)[0][pick, half].view(torch.uint8) for p in parts)
            staged = torch.cat([codes, scales], dim=1)  # [n, codes + scales]
            self._scatter(staged, [blocks[i] for i in low], lowered=True)
        self.counts["migrations_up"] += 1
        return self._after_up(wait)

    def _after_up(self, wait: bool):
        """The step that reads the blocks a move up wrote comes after it: the current stream's
        next work (`wait`), or whoever waits for the event returned."""
        if self._side is None:
            return None
        if wait:
            self._stage.order(torch.cuda.current_stream(self.device), self._side)
            return None
        done = torch.cuda.Event()
        done.record(self._side)
        return done

    def _scatter(self, staged: torch.Tensor, blocks: list[int], lowered: bool) -> None:
        idx = self._ids(blocks)
        nbytes = staged.numel()
        if self._side is None:
            self._write(idx, staged, lowered)
        else:
            staged = staged.pin_memory()
            with self._on_side():  # everything made here is used here only
                self._write(idx, staged.to(self.device, non_blocking=True), lowered)
        self.counts["bytes_up"] += nbytes

    def _write(self, idx: torch.Tensor, staged: torch.Tensor, lowered: bool) -> None:
        if lowered:
            raise_(self._caches, idx, staged)  # dequantized on the device, into the pool dtype
        else:
            scatter(self._views, idx, staged)

    def stats(self) -> dict:
        disk = self.disk
        return {
            **self.counts,
            "slots_total": self.num_slots,
            "slots_used": self.num_slots - len(self._cpu_free),
            "used_bytes": self.used_bytes(),
            "capacity_bytes": self.num_slots * self.row_bytes,
            "staging_bytes": self._stage.nbytes,
            # the mapped moves' CUDA graphs captured, and moves replayed from one
            **{f"mapped_{k}": v for k, v in self._mapped_counts().items()},
            "lowered_held": sum((m & 1) + (m >> 1 & 1) for m in self._mask if m != FULL),
            "disk_slots_total": disk.num_records if disk else 0,
            "disk_used_bytes": self.disk_used_bytes(),
            "disk_capacity_bytes": disk.num_records * self.row_bytes if disk else 0,
        }

    def _mapped_counts(self) -> dict:
        if self._alias:
            return dict(self._alias.counts)
        return {"graphs": 0, "replays": 0, "eager": 0}

    def close(self) -> None:
        self.wait()
        if self.disk is not None:
            self.disk.close()


def _in_order(blocks: list[int], rows: list[int]) -> list[int]:
    """rows (ascending) given to blocks by rank: the least block the least row."""
    out = [0] * len(blocks)
    for r, i in zip(rows, sorted(range(len(blocks)), key=blocks.__getitem__)):
        out[i] = r
    return out


def _words(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same uint8 bytes seen as the widest integers that divide every tensor's rows, its
    offset and its strides: host-side copies go element by element, 8 bytes at a time is 8x
    fewer elements."""
    for dt in (torch.int64, torch.int32, torch.int16):
        e = dt.itemsize
        if all(
            t.shape[-1] % e == 0 and t.storage_offset() % e == 0
            and all(st % e == 0 for st in t.stride()[:-1])
            for t in ts
        ):  # fmt: skip
            return tuple(t.view(dt) for t in ts)
    return ts
