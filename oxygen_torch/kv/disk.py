"""The disk tier behind a KV pool's CPU tier (pool.disk_tier_path, pool.disk_tier_bytes): one
preallocated file of fixed-size records, each holding one CPU-tier row (a block, or two lowered
blocks) byte for byte.

I/O is `os.pwritev` / `os.preadv` on a file descriptor, one call per run of consecutive records:
the call gathers the rows from (or scatters them into) host tensors directly, with no staging
copy, and a failure (a full disk, EIO) comes back as an OSError at the call. A numpy memmap would
spread a run over page faults and surface a failed writeback as SIGBUS, killing the process.
The file is allocated in full when the tier is made (posix_fallocate), so a directory without
room (or gone since the configuration was checked) is found there, not in the middle of a call:
the CPU tier then goes on without a disk tier, with one warning (DiskUnavailable). The file is
removed when the tier closes or the interpreter exits.
"""

from __future__ import annotations

import heapq
import os
import tempfile
import weakref

import torch

_IOV_MAX = 1024  # Linux's limit on buffers per pwritev / preadv call


def _remove(fd: int, path: str) -> None:
    os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def runs(records: list[int]) -> list[tuple[int, int]]:
    """(start index into `records`, length) of each run of consecutive record numbers, at most
    _IOV_MAX long: `records` must be sorted."""
    out, i = [], 0
    while i < len(records):
        j = i + 1
        while j < len(records) and records[j] == records[j - 1] + 1 and j - i < _IOV_MAX:
            j += 1
        out.append((i, j - i))
        i = j
    return out


class DiskUnavailable(ValueError):
    """The directory cannot hold the tier's file now, though the configuration was checked when
    it loaded: it went away (a temp cleaner, an unmounted volume), or its space was taken. The
    CPU tier goes on without a disk tier (kv/tier.py)."""


class DiskTier:
    def __init__(self, directory: str, nbytes: int, record_bytes: int):
        self.record_bytes = record_bytes
        self.num_records = nbytes // record_bytes
        if self.num_records == 0:
            raise ValueError(
                f"pool.disk_tier_bytes: {nbytes} bytes hold no record of {record_bytes} bytes "
                "(one KV block of every layer)"
            )
        # (the errors name the directory and the OS's reason, not the temporary file's name: a
        # warning that says them once stays one warning however many pools make a tier)
        try:
            fd, self.path = tempfile.mkstemp(
                prefix=f"oxygen-kv-{os.getpid()}-", suffix=".tier", dir=directory
            )
        except OSError as exc:
            raise DiskUnavailable(
                f"pool.disk_tier_path: cannot create a file in {directory!r} "
                f"({exc.strerror or exc})"
            ) from exc
        self._fd = fd
        self._close = weakref.finalize(self, _remove, fd, self.path)  # also runs at exit
        size = self.num_records * record_bytes
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            self._close()
            raise DiskUnavailable(
                f"pool.disk_tier_path: cannot allocate pool.disk_tier_bytes = {size} bytes in "
                f"{directory!r} ({exc.strerror or exc}); lower pool.disk_tier_bytes or free space"
            ) from exc
        self._free = list(range(self.num_records))
        # a failed write's message: no more records are handed out (not the exception: its
        # traceback would keep the caller's frames, and the caches on them, alive)
        self.broken: str | None = None
        self.reads = self.writes = 0  # system calls

    @property
    def num_free(self) -> int:
        return 0 if self.broken is not None else len(self._free)

    def take(self, n: int) -> list[int]:
        """n free records, lowest first (so that a spill is one sequential run)."""
        assert n <= self.num_free
        return [heapq.heappop(self._free) for _ in range(n)]

    def release(self, records: list[int]) -> None:
        for r in records:
            heapq.heappush(self._free, r)

    def write(self, records: list[int], rows: list[torch.Tensor]) -> None:
        """rows[i] (uint8 host, record_bytes, contiguous) into record records[i]; records sorted.
        OSError: the tier is marked broken (what was written before stays readable)."""
        try:
            for i, n in runs(records):
                bufs = [r.numpy() for r in rows[i : i + n]]
                done = os.pwritev(self._fd, bufs, records[i] * self.record_bytes)
                self.writes += 1
                if done != n * self.record_bytes:
                    raise OSError(f"short write: {done} of {n * self.record_bytes} bytes")
        except OSError as exc:
            self.broken = str(exc)
            raise

    def read(self, records: list[int], rows: list[torch.Tensor]) -> None:
        """Record records[i] into rows[i] (uint8 host, record_bytes, contiguous); records sorted."""
        for i, n in runs(records):
            bufs = [r.numpy() for r in rows[i : i + n]]
            done = os.preadv(self._fd, bufs, records[i] * self.record_bytes)
            self.reads += 1
            if done != n * self.record_bytes:
                raise OSError(
                    f"oxygen KV disk tier {self.path}: short read, {done} of "
                    f"{n * self.record_bytes} bytes"
                )

    def close(self) -> None:
        self._close()
