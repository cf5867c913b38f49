"""Leak check for ``doctor``: does every physical handle and reserved range come back?

Two views are compared with what the pools say about themselves:
- the operating system's, for the host backend: each physical page is a memfd named
  ``oxygen_page`` and each reserved range a mapping of its own empty memfd named ``oxygen_va``
  (csrc/vmm_backend.cpp), so ``/proc/self/fd`` counts live handles and ``/proc/self/maps``
  counts mapped bytes and tells the pool's mappings from anyone else's (a thread's malloc arena
  placed in a range the pool just released is not the pool's), independently of the pool's own
  counters;
- the driver's, for the cuda backend: ``cuMemGetInfo`` (free / total of the device).

``check_process(expect_released=True)`` is what to run after ``disable()`` / at exit: anything
still held is a leak. ``exercise(backend)`` runs one pool life cycle and checks that it hands
back exactly what it took. ``run()`` does both and is what ``doctor`` prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..pool import native as _native

MEMFD_NAME = "oxygen_page"  # the name the host backend gives every physical page
VA_MEMFD_NAME = "oxygen_va"  # ... and the empty memfd each reserved range is a mapping of
MiB = 1 << 20


@dataclass
class LeakReport:
    checked: list[str] = field(default_factory=list)  # what was verified, one line each
    leaks: list[str] = field(default_factory=list)  # what leaked, said plainly
    skipped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.leaks

    def extend(self, other: LeakReport) -> None:
        self.checked += other.checked
        self.leaks += other.leaks
        self.skipped += other.skipped


@dataclass(frozen=True)
class HostView:
    handles: int  # open memfds named oxygen_page
    mapped_bytes: int  # bytes of them mapped into this process


def host_view() -> HostView | None:
    """What Linux says this process holds of the host backend's pages (None off Linux)."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    handles = 0
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the fd listdir itself used, or one closed meanwhile
            continue
        handles += target.startswith(f"/memfd:{MEMFD_NAME}")
    mapped = sum(m.hi - m.lo for m in read_maps() or [] if m.is_memfd(MEMFD_NAME))
    return HostView(handles, mapped)


@dataclass(frozen=True)
class Mapping:
    """One line of /proc/self/maps."""

    lo: int
    hi: int
    inode: int
    path: str

    def is_memfd(self, name: str) -> bool:
        return self.path.startswith(f"/memfd:{name}")


def read_maps() -> list[Mapping] | None:
    """This process's mappings (None off Linux)."""
    try:
        with open("/proc/self/maps") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        fields = line.split(None, 5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        out.append(Mapping(lo, hi, int(fields[4]), fields[5] if len(fields) > 5 else ""))
    return out


def reservation_inode(base: int) -> int | None:
    """The inode of the oxygen_va memfd a host pool's range at ``base`` is a mapping of."""
    for m in read_maps() or []:
        if m.lo <= base < m.hi and m.is_memfd(VA_MEMFD_NAME):
            return m.inode
    return None


def driver_used_bytes(device: int) -> int | None:
    """Device memory in use by everyone (total - free from cuMemGetInfo); None without a driver."""
    try:
        info = _native.cuda_device_info(device)
    except (_native.NativeError, _native.NativeLibraryError):
        return None
    return info["total_bytes"] - info["free_bytes"]


def _mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def pool_holdings(stats: dict) -> dict:
    """Live handles, reserved ranges and bytes a pool reports, from whichever keys it has."""
    page = int(stats.get("page_size", 2 * MiB)) or 2 * MiB
    mapped = int(stats.get("mapped_bytes", 0))
    if "live_handles" in stats or "owned_pages" in stats:  # created and not yet released
        handles = int(stats.get("live_handles", stats.get("owned_pages", 0)))
    elif "handles_created" in stats:
        handles = int(stats["handles_created"]) - int(stats.get("handles_released", 0))
    else:
        handles = mapped // page + int(stats.get("handle_cache_pages", 0))
    reserved = int(stats.get("reserved_va_bytes", 0))
    ranges = int(stats.get("reserved_ranges", stats.get("live_ranges", 1 if reserved else 0)))
    return {
        "page": page,
        "handles": handles,
        "ranges": ranges,
        "mapped": mapped,
        "reserved": reserved,
        "cached": int(stats.get("handle_cache_pages", 0)),
        "backend": str(stats.get("backend", "?")),
        "device": int(stats.get("device", 0)),
    }


def check_process(expect_released: bool = True) -> LeakReport:
    """Compare every reported pool with itself and with the OS / driver view.

    Always a leak: a handle created but neither mapped, cached nor released (lost), and counters
    the OS or driver contradict. With ``expect_released`` (after ``disable()``, at exit) also
    anything a pool still holds -- except the global pool's reserved range and handle cache,
    which it keeps until exit by design (PyTorch may free tensors during shutdown); of the
    global pool only open KV arenas and mapped pages with no live block count then."""
    from .metrics import pool_snapshots

    if expect_released:
        _empty_global_cache()
    rep = LeakReport()
    host_handles = 0
    for label, stats in pool_snapshots():
        h = pool_holdings(stats)
        host_handles += h["handles"] if h["backend"] == "host" else 0
        rep.checked.append(
            f"pool {label} ({h['backend']}, device {h['device']}): {h['handles']} handle(s), "
            f"{_mib(h['mapped'])} mapped, {h['cached']} cached, {h['ranges']} reserved "
            f"range(s) ({_mib(h['reserved'])} of address space)"
        )
        lost = h["handles"] - h["mapped"] // h["page"] - h["cached"]
        if lost > 0:
            rep.leaks.append(
                f"pool {label}: {lost} physical handle(s) were created and are neither mapped, "
                "cached nor released: they are lost until the process exits"
            )
        if expect_released:
            _check_released(rep, label, h, int(stats.get("allocated_bytes", 0)))
        if h["backend"] == "cuda":
            _compare_driver(rep, label, h)
    held = _check_held(rep) if expect_released else 0
    _compare_host(rep, host_handles, expect_released and not held)
    return rep


def _check_held(rep: LeakReport) -> int:
    """Arenas closed while tensors from Arena.as_tensor() still view them keep their memory
    (reading such a tensor must not fault): held, and said so, until the tensors are dropped."""
    from ..pool import held_arenas

    held = held_arenas()
    if held:
        mapped = sum(a.mapped_pages() * a.page_size for a in held)
        rep.leaks.append(
            f"{len(held)} KV arena(s) were closed while tensors from Arena.as_tensor() still "
            f"view them: {_mib(mapped)} stay mapped (with the handles behind them) until those "
            "tensors are dropped"
        )
    return len(held)


def _open_arenas(device: int) -> list:
    from ..pool import live_arenas

    return live_arenas(device)


def _empty_global_cache() -> None:
    from .. import pool

    try:
        pool.empty_cache()
    except Exception:  # no pool in this install, or never created: nothing to empty
        pass


def _check_released(rep: LeakReport, label: str, h: dict, allocated: int) -> None:
    where = f"pool {label} ({h['backend']}, device {h['device']})"
    if label == "global":
        arenas = _open_arenas(h["device"])
        if arenas:
            mapped = sum(a.mapped_pages() * a.page_size for a in arenas)
            rep.leaks.append(
                f"{len(arenas)} KV arena(s) on device {h['device']} still open ({_mib(mapped)} "
                "mapped in them): a KV cache was not released (oxygen_torch.disable() closes "
                "idle KV pools)"
            )
        elif h["mapped"] and not allocated:
            rep.leaks.append(
                f"{where}: {_mib(h['mapped'])} stay mapped with no live block after "
                "empty_cache(): pages were not unmapped"
            )
        elif allocated:  # not a leak by itself: cuBLAS workspaces, RNG state, live tensors
            rep.checked.append(
                f"{where}: {_mib(allocated)} still allocated by live tensors (cuBLAS "
                "workspaces, tensors still referenced)"
            )
        return
    if h["handles"] or h["ranges"] or h["mapped"]:
        rep.leaks.append(
            f"{where} still holds {h['handles']} physical handle(s) ({_mib(h['mapped'])} "
            f"mapped, {h['cached']} cached unmapped) and {h['ranges']} reserved range(s) "
            f"({_mib(h['reserved'])}): it was not closed"
        )


def _compare_host(rep: LeakReport, pool_handles: int, expect_released: bool) -> None:
    view = host_view()
    if view is None:
        rep.skipped.append("OS view of host pages: /proc not available")
        return
    rep.checked.append(
        f"OS view: {view.handles} host page handle(s) open, {_mib(view.mapped_bytes)} mapped"
    )
    stray = view.handles - pool_handles
    if stray < 0:
        rep.leaks.append(
            f"the pools report {pool_handles} host page handle(s) but only {view.handles} are "
            "open: the pools' counters are wrong"
        )
    if stray > 0 and expect_released:
        rep.leaks.append(
            f"{stray} host page handle(s) (memfd '{MEMFD_NAME}') are open in this process that "
            f"no reported pool accounts for ({_mib(view.mapped_bytes)} of them mapped): a pool "
            "or arena was dropped without close(), or a handle was never released"
        )


def _compare_driver(rep: LeakReport, label: str, h: dict) -> None:
    used = driver_used_bytes(h["device"])
    if used is None:
        return
    held = h["mapped"] + h["cached"] * 2 * MiB
    rep.checked.append(
        f"driver: {_mib(used)} in use on device {h['device']} by every process; "
        f"pool {label} holds {_mib(held)} of it"
    )
    if held > used:
        rep.leaks.append(
            f"pool {label} claims {_mib(held)} on device {h['device']} but the driver shows only "
            f"{_mib(used)} in use: the pool's counters are wrong"
        )


# Sizes of one exercise: slab-sized, page-sized and multi-page blocks, as generate() makes them.
_EXERCISE_SIZES = [512, 4096, 300_000, 1 * MiB, 2 * MiB, 3 * MiB + 5, 8 * MiB]


def exercise(backend: str, device: int = 0, rounds: int = 3) -> LeakReport:
    """Create a pool, allocate and free a generate-like mix, close it; check that the OS (host)
    or the driver (cuda) sees exactly what it saw before."""
    rep = LeakReport()
    try:
        from ..pool import VirtualPool
    except Exception as exc:  # the pool is not built in this install
        rep.skipped.append(f"{backend} pool life cycle: pool unavailable ({exc})")
        return rep
    before_host = host_view()
    pool = VirtualPool(backend=backend, capacity=64 * MiB, device=device)
    # The driver's baseline is taken with the pool (and so the CUDA context) already there and
    # its handle cache emptied: a context created by the pool is not memory the pool leaked.
    pool.empty_cache()
    before_drv = driver_used_bytes(device) if backend == "cuda" else None
    try:
        peak_mapped = _churn(pool, rounds)
        stats = dict(pool.stats())
        va = (int(pool.base), int(stats.get("pool_va_bytes", stats.get("reserved_va_bytes", 0))))
        inode = reservation_inode(va[0]) if backend == "host" else None
    finally:
        pool.close()
    h = pool_holdings(stats)
    if h["mapped"] or int(stats.get("allocated_bytes", 0)):
        rep.leaks.append(
            f"{backend} pool: after freeing every block and empty_cache(), {_mib(h['mapped'])} "
            f"stay mapped and {stats.get('allocated_bytes', 0)} bytes count as allocated"
        )
    if backend == "host":
        _host_returned(rep, before_host, host_view())
        _range_returned(rep, *va, inode)
    else:
        _driver_returned(rep, device, before_drv, driver_used_bytes(device), peak_mapped)
    rep.checked.append(
        f"{backend} pool life cycle: {rounds} rounds, peak {_mib(peak_mapped)} mapped, "
        "everything unmapped and released on close()"
    )
    return rep


def _churn(pool, rounds: int) -> int:
    peak = 0
    for _ in range(rounds):
        live = [(pool.malloc(n), n) for n in _EXERCISE_SIZES]
        peak = max(peak, int(pool.stats().get("mapped_bytes", 0)))
        for ptr, n in live:
            pool.free(ptr, n)
    pool.empty_cache()
    return peak


def _host_returned(rep: LeakReport, before: HostView | None, after: HostView | None) -> None:
    if before is None or after is None:
        rep.skipped.append("host pool life cycle: no /proc, OS view not compared")
        return
    if after.handles > before.handles or after.mapped_bytes > before.mapped_bytes:
        rep.leaks.append(
            f"host pool: after close(), {after.handles - before.handles} page handle(s) are "
            f"still open and {_mib(after.mapped_bytes - before.mapped_bytes)} still mapped "
            "(OS view, /proc/self)"
        )


def _range_returned(rep: LeakReport, base: int, size: int, inode: int | None) -> None:
    """After close() nothing of the host pool may stay in [base, base + size): neither its
    reservation (a mapping of its own oxygen_va memfd, ``inode``) nor a page (an oxygen_page
    memfd). Whatever else the range holds now was placed there by someone else once the pool
    let it go -- a thread's glibc malloc arena (64 MiB, PROT_NONE, anonymous) is the usual one --
    and is not the pool's."""
    maps = read_maps()
    if maps is None:
        return
    inside = [m for m in maps if m.lo < base + size and m.hi > base]
    overlap = {m: min(m.hi, base + size) - max(m.lo, base) for m in inside}

    def mine(m: Mapping) -> bool:
        return m.is_memfd(VA_MEMFD_NAME) and (inode is None or m.inode == inode)

    # a page in the range is ours unless another pool's reservation has taken the range since
    other_pool = any(m.is_memfd(VA_MEMFD_NAME) and not mine(m) for m in inside)
    reserved = sum(n for m, n in overlap.items() if mine(m))
    pages = sum(n for m, n in overlap.items() if m.is_memfd(MEMFD_NAME)) if not other_pool else 0
    foreign = sum(overlap.values()) - reserved - pages
    if reserved:
        rep.leaks.append(
            f"host pool: after close(), {_mib(reserved)} of its reserved range "
            f"[{base:#x}, {base + size:#x}) are still reserved: the range was not freed"
        )
    if pages:
        rep.leaks.append(
            f"host pool: after close(), {_mib(pages)} of its pages are still mapped in its range "
            f"[{base:#x}, {base + size:#x})"
        )
    if foreign:
        rep.checked.append(
            f"host pool: after close(), {_mib(foreign)} of its former range hold other mappings "
            "(placed there once it was free, e.g. a thread's malloc arena): not the pool's"
        )


def _driver_returned(rep: LeakReport, device: int, before, after, peak_mapped: int) -> None:
    if before is None or after is None:
        rep.skipped.append("cuda pool life cycle: driver memory not readable")
        return
    # Other processes share the GPU: count it ours only if at least half what we mapped stayed.
    grown = after - before
    if peak_mapped and grown >= peak_mapped // 2:
        rep.leaks.append(
            f"cuda pool: after close(), the driver shows {_mib(grown)} more in use on device "
            f"{device} than before (the pool mapped {_mib(peak_mapped)} at its peak)"
        )


def run(backends: tuple[str, ...] = ("host",), device: int = 0) -> LeakReport:
    """Life cycle of a fresh pool per backend, then the whole process, expecting nothing held."""
    rep = LeakReport()
    for backend in backends:
        rep.extend(exercise(backend, device))
    rep.extend(check_process(expect_released=True))
    return rep
