"""Which copy-engine copies can move whole KV blocks out of the arena, and how fast (issue 19)?

A KV block's bytes lie in every layer's K and V region of the pool's arena (VMM pages mapped on
demand, 2 MiB each). The tier gathers them with kernels (transfer.COPIES "gather"); a move by
copies alone would leave the SMs to decode. This tries, on the H200, each way a copy engine can
take them, from the arena (a 4 GiB pool with only the moved blocks' pages mapped, and a pool
whose every block is allocated) and from one cudaMalloc'd buffer of the same layout, and says
which the driver accepts and at what GB/s (both directions, pinned host rows):

- 2d_block: one 2D copy a block (its regions are the copy's rows, a region apart);
- 2d_region: one 2D copy a region for a run of consecutive blocks (device side contiguous,
  split where it would cross a 2 MiB page; 2d_region_across_pages: not split);
- batch_1d: cuMemcpyBatchAsync of one copy a (block, region), the blocks scattered;
- gather: the tier's kernels (index_select into a staging buffer, then one copy).

Shapes: the bench_tier migration pool's block (16 layers x 8 kv heads x 64, 16 KiB a region) and
Llama-1.1B's (22 x 4 x 64, 8 KiB a region).

    python benchmarks/diag_block_copies.py      (H200; writes $OUT/diag_block_copies.json)
"""

from __future__ import annotations

import ctypes
import json
import os
import time
import traceback

import torch

MIB = 1 << 20
PAGE = 2 * MIB


class Memcpy2D(ctypes.Structure):
    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t), ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p), ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]  # fmt: skip


class MemcpyAttr(ctypes.Structure):
    _fields_ = [("order", ctypes.c_int), ("src_type", ctypes.c_int), ("src_id", ctypes.c_int),
                ("dst_type", ctypes.c_int), ("dst_id", ctypes.c_int),
                ("flags", ctypes.c_uint)]  # fmt: skip


UNIFIED = 4  # CU_MEMORYTYPE_UNIFIED
cu = ctypes.CDLL("libcuda.so.1")
cu.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(Memcpy2D), ctypes.c_void_p]


def _batch_fn():
    fn, q = ctypes.c_void_p(), ctypes.c_int()
    get = cu.cuGetProcAddress_v2
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                    ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]  # fmt: skip
    if get(b"cuMemcpyBatchAsync", ctypes.byref(fn), 12080, 0, ctypes.byref(q)) or not fn.value:
        return None
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_void_p, ctypes.c_void_p)  # fmt: skip
    return proto(fn.value)


BATCH = _batch_fn()


def name_of(r: int) -> str:
    s = ctypes.c_char_p()
    cu.cuGetErrorName(r, ctypes.byref(s))
    return (s.value or b"?").decode()


def copy2d(dev, dev_pitch, host, host_pitch, width, height, up, stream) -> int:
    p = Memcpy2D()
    p.srcMemoryType = p.dstMemoryType = UNIFIED
    if up:
        p.srcDevice, p.srcPitch, p.dstDevice, p.dstPitch = host, host_pitch, dev, dev_pitch
    else:
        p.srcDevice, p.srcPitch, p.dstDevice, p.dstPitch = dev, dev_pitch, host, host_pitch
    p.WidthInBytes, p.Height = width, height
    return cu.cuMemcpy2DAsync_v2(ctypes.byref(p), ctypes.c_void_p(stream))


class Layout:
    """[regions][num_blocks][width] at base (the arena's order), host rows [n][regions * width]."""

    def __init__(self, base: int, regions: int, num_blocks: int, width: int, rs: int = 0):
        self.base, self.regions, self.num_blocks, self.width = base, regions, num_blocks, width
        self.rs = rs or num_blocks * width  # a region's stride

    def at(self, r: int, b: int) -> int:
        return self.base + r * self.rs + b * self.width


def plan_2d_block(lay, blocks, host, hp):
    return [(lay.at(0, b), lay.rs, host + i * hp, lay.width, lay.width, lay.regions)
            for i, b in enumerate(blocks)]  # fmt: skip


def plan_2d_region(lay, first, n, host, hp, split=True):
    """Consecutive blocks first..first+n to rows 0..n: a copy a region, split at pages (or
    not: a copy may span pages, each its own allocation in the arena)."""
    out = []
    for r in range(lay.regions):
        b = first
        while b < first + n:
            a = lay.at(r, b)
            room = (PAGE - a % PAGE) // lay.width or 1  # blocks left in this page
            m = min(room if split else n, first + n - b)
            out.append((a, lay.width, host + (b - first) * hp + r * lay.width, hp, lay.width, m))
            b += m
    return out


def run_2d(plan, up, stream) -> str:
    for dev, dp, h, hp, w, ht in plan:
        r = copy2d(dev, dp, h, hp, w, ht, up, stream)
        if r:
            return name_of(r)
    return ""


def run_batch(lay, blocks, host, hp, up, stream) -> str:
    srcs, dsts, sizes = [], [], []
    for i, b in enumerate(blocks):
        for r in range(lay.regions):
            d, h = lay.at(r, b), host + i * hp + r * lay.width
            srcs.append(h if up else d)
            dsts.append(d if up else h)
            sizes.append(lay.width)
    n = len(sizes)
    arr = ctypes.c_uint64 * n
    attr = MemcpyAttr(order=1)  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    idx, fail = (ctypes.c_size_t * 1)(0), ctypes.c_size_t(0)
    r = BATCH(arr(*dsts), arr(*srcs), (ctypes.c_size_t * n)(*sizes), n, ctypes.byref(attr), idx,
              1, ctypes.byref(fail), ctypes.c_void_p(stream))  # fmt: skip
    return name_of(r) if r else ""


def timed(fn, stream: torch.cuda.Stream, nbytes: int, reps: int = 5) -> tuple[float, str]:
    err = fn()
    stream.synchronize()
    if err:
        return 0.0, err
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        stream.synchronize()
        ts.append(time.perf_counter() - t)
    return nbytes / min(ts) / 1e9, ""


def one_shape(name, layers, heads, dim, kind: str) -> dict:
    from oxygen_torch.kv.pool import PoolKey, get_pool

    dev = torch.device("cuda")
    regions, width = 2 * layers, 16 * heads * dim * 2
    n = 256
    if kind.startswith("arena"):
        # "arena": a 4 GiB pool, 2n blocks allocated (its other pages unmapped); "arena_full":
        # a pool of 2n blocks, every one allocated (every page mapped)
        full = kind == "arena_full"
        nbytes = 2 * n * regions * width + (64 << 20) if full else 4 << 30
        pool = get_pool(PoolKey(dev, layers, heads, dim, torch.bfloat16, 16, "auto", nbytes, PAGE))
        st = pool.storage
        assert st.backing.name == "arena", st.backing.name
        with pool.lock:
            blocks = pool.manager.allocate(pool.manager.num_free if full else 2 * n)
        view = st.block_view()  # [num_blocks, regions, width]
        base, nb = view.data_ptr(), view.shape[0]
        rs = view.stride(1) * view.element_size()
        assert view.stride(0) * view.element_size() == width, view.stride()
        lay = Layout(base, regions, nb, width, rs)
        view = view.view(torch.uint8)
        idx = torch.tensor(blocks, device=dev)
        view.index_copy_(0, idx, torch.randint(0, 256, (len(blocks), regions, width),
                                               dtype=torch.uint8, device=dev))  # fmt: skip
        flat = None
        blocks = sorted(blocks)
    bb = regions * width
    host = torch.empty(n, bb, dtype=torch.uint8, pin_memory=True)
    hp = host.stride(0)
    gen = torch.Generator().manual_seed(0)
    scattered = [blocks[i] for i in torch.randperm(2 * n, generator=gen)[:n].tolist()]
    first = blocks[0]
    assert blocks[n - 1] == first + n - 1, "the first n blocks are not consecutive"
    stream = torch.cuda.Stream()
    s = stream.cuda_stream
    res = {"shape": name, "memory": kind, "block_bytes": bb, "region_bytes": width,
           "region_stride": lay.rs, "blocks": n}  # fmt: skip

    def gathered(blocks_):
        return view[torch.tensor(blocks_, device=dev)].reshape(len(blocks_), -1).cpu()

    for way, up in (("down", False), ("up", True)):
        rows = {}
        p_block = plan_2d_block(lay, scattered, host.data_ptr(), hp)
        p_region = plan_2d_region(lay, first, n, host.data_ptr(), hp)
        p_span = plan_2d_region(lay, first, n, host.data_ptr(), hp, split=False)
        tries = {
            "2d_block": (lambda p=p_block, up=up: run_2d(p, up, s), scattered),
            "2d_region": (
                lambda p=p_region, up=up: run_2d(p, up, s),
                list(range(first, first + n)),
            ),
        }
        if BATCH is not None:
            tries["batch_1d"] = (
                lambda up=up: run_batch(lay, scattered, host.data_ptr(), hp, up, s),
                scattered,
            )
        for k, (fn, bl) in tries.items():
            want = gathered(bl)
            if up:
                host[: len(bl)].copy_(want)
            gbps, err = timed(fn, stream, n * bb)
            ok = None
            if not err:
                ok = torch.equal(gathered(bl), want) if up else torch.equal(host[: len(bl)], want)
            copies = {"2d_block": len(p_block), "2d_region": len(p_region),
                      "2d_region_across_pages": len(p_span)}.get(k, n * regions)  # fmt: skip
            rows[k] = dict(GBps=gbps, error=err, bytes_ok=ok, copies=copies)
            print(f"{name} {kind} {way} {k}: {gbps:.1f} GB/s, {copies} copies, "
                  f"error {err or '-'}, bytes ok {ok}", flush=True)  # fmt: skip
        res[way] = rows
    if flat is None:
        with pool.lock:
            pool.manager.decref(blocks)
        from oxygen_torch.kv.pool import release_pools

        release_pools()
    return res


def main() -> None:
    out = []
    for name, shape in (("bench 16x8x64", (16, 8, 64)), ("llama-1.1b 22x4x64", (22, 4, 64))):
        for kind in ("arena", "arena_full", "cudaMalloc"):
            try:
                out.append(one_shape(name, *shape, kind))
            except Exception as exc:  # noqa: BLE001 - a diag reports and goes on
                traceback.print_exc()
                print(f"{name} {kind}: {type(exc).__name__}: {exc}", flush=True)
                out.append(dict(shape=name, memory=kind, error=repr(exc)))
    print(f"cuMemcpyBatchAsync: {'found' if BATCH is not None else 'not found'}")
    path = os.path.join(os.environ.get("OUT", "."), "diag_block_copies.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
