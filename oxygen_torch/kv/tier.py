"""The CPU tier of a KV pool: host slots that hold whole blocks (every layer's K and V, and fp8
scales) while they are off the device (pool.cpu_tier_bytes).

A slot is one row of a [slots, bytes per block] uint8 host tensor (pinned on a GPU machine, so
copies run on the copy engine). Migration moves many blocks at once: the blocks are gathered
into one staging buffer on their device (one index_select per layer region), which goes over in
one copy, and the way back scatters a staged copy into the blocks (index_copy_). On a GPU the
copy runs on a side stream after the current stream's work, and the host waits for it before
the blocks are freed or read, so the pool's frees stay ordered after it (not yet run on a GPU:
the CPU path is what CI tests). Only kernels driven by block tables read the arena, and a block
table only ever names device blocks: a block in this tier is brought back before a step uses it.
"""

from __future__ import annotations

import heapq

import torch


class TierFull(RuntimeError):
    """The CPU tier has no free slot for the blocks asked."""


class CPUTier:
    def __init__(self, storages: list, nbytes: int, device: torch.device):
        self._regions = []  # uint8 [num_blocks, block bytes] views of every K/V cache
        for st in storages:
            for cache in (*st.k, *st.v):
                self._regions.append(cache.view(torch.uint8).view(cache.shape[0], -1))
        self.block_bytes = sum(r.shape[1] for r in self._regions)
        self.num_slots = nbytes // self.block_bytes
        self.device = device
        pin = device.type == "cuda"
        self.host = torch.empty(self.num_slots, self.block_bytes, dtype=torch.uint8, pin_memory=pin)
        self._free = list(range(self.num_slots))
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.counts = dict(migrations_down=0, migrations_up=0, bytes_down=0, bytes_up=0)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def used_bytes(self) -> int:
        return (self.num_slots - len(self._free)) * self.block_bytes

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise TierFull(
                f"oxygen KV CPU tier full: {n} slot(s) asked, {len(self._free)} free of "
                f"{self.num_slots} (raise pool.cpu_tier_bytes)"
            )
        return [heapq.heappop(self._free) for _ in range(n)]

    def release(self, slots: list[int]) -> None:
        for s in slots:
            heapq.heappush(self._free, s)

    def down(self, blocks: list[int]) -> list[int]:
        """Copies device blocks into fresh slots (the blocks stay allocated: the caller frees
        them); returns the slots."""
        if not blocks:
            return []
        slots = self._take(len(blocks))
        idx = torch.tensor(blocks, dtype=torch.int64)
        if self._side is None:
            staged = torch.cat([r.index_select(0, idx) for r in self._regions], dim=1)
        else:
            idx = idx.to(self.device, non_blocking=True)
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                gathered = torch.cat([r.index_select(0, idx) for r in self._regions], dim=1)
                staged = torch.empty(gathered.shape, dtype=torch.uint8, pin_memory=True)
                staged.copy_(gathered, non_blocking=True)
            self._side.synchronize()  # the blocks may be freed (unmapped) once we return
        self.host.index_copy_(0, torch.tensor(slots, dtype=torch.int64), staged)
        self.counts["migrations_down"] += 1
        self.counts["bytes_down"] += len(blocks) * self.block_bytes
        return slots

    def up(self, slots: list[int], blocks: list[int]) -> None:
        """Copies slots into device blocks (allocated by the caller); the slots stay taken."""
        if not slots:
            return
        staged = self.host.index_select(0, torch.tensor(slots, dtype=torch.int64))
        idx = torch.tensor(blocks, dtype=torch.int64)
        if self._side is not None:
            staged = staged.pin_memory()
            stream = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._side):
                self._side.wait_stream(stream)
                staged = staged.to(self.device, non_blocking=True)
                idx = idx.to(self.device, non_blocking=True)
            stream.wait_stream(self._side)  # the step that reads the blocks comes after
        off = 0
        for r in self._regions:
            r.index_copy_(0, idx, staged[:, off : off + r.shape[1]])
            off += r.shape[1]
        self.counts["migrations_up"] += 1
        self.counts["bytes_up"] += len(slots) * self.block_bytes

    def stats(self) -> dict:
        return {
            **self.counts,
            "slots_total": self.num_slots,
            "slots_used": self.num_slots - len(self._free),
            "used_bytes": self.used_bytes(),
            "capacity_bytes": self.num_slots * self.block_bytes,
        }
