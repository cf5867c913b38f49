"""Moving whole KV blocks between a pool's arena and host rows, in large transfers.

A block's bytes lie in every layer's K and V region. `KVStorage.block_view` sees them as one
strided tensor [num_blocks, regions, width], so one index_select gathers whole blocks into a
contiguous staging buffer [n, block bytes] and one index_copy_ scatters them back: a host row is
a block's bytes in address order (the pool's fp8 scales, a second storage, after them).

The way down is `down`: the blocks gathered into the device staging buffer (at device speed),
then one copy per run of consecutive host rows straight into the (pinned) host tensor. `up` is the
way back: one copy per run into the staging buffer, then the scatter. A move goes in pieces of
COPY_BYTES, the copies on a stream of their own, so one piece's copy overlaps the next piece's
gather (or the last one's scatter), and moves larger than the buffer go through it a chunk at a
time. The buffer (`Staging`, 64 MiB at
most) is allocated once, on the first move, and kept: allocating a move's worth of staging from
the pool would map and unmap its pages on every move (46 us a 2 MiB page on the H200).

A device-to-host copy queued on a copy engine holds back every later one of the process,
whatever its stream: on the H200 a decode step's one-element read (generate()'s stopping check)
waited 2.3 ms behind 128 MiB of queued copies (55-65 us idle), and TPOT rose 35-117 % beside
them. So a move down is paced: each piece's gather waits for the last piece's copy, so the copy
engine sees one piece at a time and serves other streams' copies between two. Beside the tier's
own moves (bench_tier.py: a decode loop's TPOT beside a thread moving 38-43 GB/s, 11 runs of each
in 5 device calls) this raised TPOT by 18.5 % at the median (worst 39 %); a one-element kernel on
a third stream between two copies instead raised it 24 % (worst 44 %), no pacing 33 % (worst
57 %), so those ways went; timed per step (twelfth session, 4 rounds) the paced gathers raised it
21-29 %, in 4 MiB pieces 21-30 %. Moves up are not paced: host-to-device copies beside a decode
step did not slow it. (Runs of consecutive blocks as 2D copies on the copy engine, queued by one
native call with no kernel, were slower than the gathers on the H200, 40.5 / 43.7 GB/s against
43.9 / 49.4, with TPOT beside them rising as much: that way went too; benchmarks/history.md.)

`MappedMoves` (pool.tier_moves "mapped", and "auto" beside steps, the default on a GPU) takes no
staging buffer nor the copy engine: one kernel a view (triton_kernels/block_rows.py) reads the
blocks from the arena and stores them into the pinned rows through their device address, or
back, its grid the number of SMs it takes; a move is one upload of its ids and one replay of a
CUDA graph of those launches, captured per size bucket. Whether a step runs on the device is
known from the paged cache's step planning (`note_step`, a time a step); beside steps "auto"
moves down by the kernel's MAPPED_PROGRAMS_BESIDE_STEPS programs, which take a smaller share of
PCIe than the copy engine's copies (36-44 GB/s down with 2, only 17-18 up: moves up, which a
step waits for, stay on the copy engine), and alone by the gathers, the copy engine's full speed
(through the tier the kernel's 16 programs were no faster: 44.6 GB/s each way at 256 MiB against
44.3-47.5 down and 48.2-51.4 up for the gathers, 28 at 32 MiB against 30-39 down and 35-43 up).

Nothing here waits: on a GPU the caller runs these on its side stream and orders the streams.
Host time counts too: a thread migrating holds the interpreter lock against a decode loop beside
it, so a piece costs a few calls (the current stream set rather than a stream context entered,
one kept event for each ordering of two streams, the buffer viewed once a chunk;
benchmarks/profile_tier_host.py times a cycle's host time).
"""

from __future__ import annotations

import array
import contextlib
import gc
import time

import torch

from .._patching import warn_once
from ..config.fields import TIER_MOVES

STAGING_BYTES = 64 << 20  # the device staging buffer of a tier, at most
# one copy between host and device, at most: a copy engine serves another stream's copies (a
# decode step's table upload, generate()'s next-token read) between two, not during one
COPY_BYTES = 16 << 20
# the mapped kernel's grid: alone, and beside decode steps (a step began on the device within
# BESIDE_S). On the H200 (diag_mapped_rows.py) 16 programs moved 48-52 GB/s each way, 2
# programs 36-44 GB/s down and 17-18 up, 1 program 20-22 down and 9-10 up. Beside generate()
# (bench_tier.py: a thread moving 256 blocks down and up without pause; the median rise of
# time per token over a call's rounds, three calls each): 2 programs (22-24 GB/s moved) +8.4,
# +13.5, +11.2 %; 1 program (12-15 GB/s) +16.7, +6.1, +20.1 %; 16 programs (42 GB/s) +57, +64 %;
# the paced gathers (39-43 GB/s) +18.6 to +34.4 %. The rise follows the share of the link taken
# (a step's own small copies wait behind it) until the machine's noise hides it
MAPPED_PROGRAMS = 16
MAPPED_PROGRAMS_BESIDE_STEPS = 2
BESIDE_S = 0.05
_last_step: dict[tuple[str, int], float] = {}  # (device type, index) -> its last step's time


def _device_key(device: torch.device) -> tuple[str, int]:
    """`device` with its index made explicit ("cuda" and "cuda:0" are one GPU: a pool's key may
    name either)."""
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if device.type == "cuda" else 0
    return device.type, index


def way_of(device: torch.device, up: bool, moves: str = "auto") -> str:
    """The way a move (`up`: host rows to blocks) on `device` goes under pool.tier_moves `moves`:
    "auto" resolved to "mapped" for a move down beside steps on a GPU, else "gather" (its
    few programs leave the link room for the steps' own small copies back to the host; every
    other move takes the copy engine's full speed: copies up did not slow decode, and a step
    waits for the move up that brings its blocks back; on the host backend there is no PCIe to
    cross and the kernel would run in Triton's interpreter)."""
    _check_moves(moves)
    if moves != "auto":
        return moves
    down_beside = device.type == "cuda" and not up and beside_steps(device)
    return "mapped" if down_beside else "gather"


def _check_moves(moves: str) -> None:
    if moves not in TIER_MOVES:  # (a tier's `moves` set after the configuration was checked)
        raise ValueError(f"pool.tier_moves: {moves!r} is not one of {TIER_MOVES}")


def kernel_ways(device: torch.device, moves: str = "auto") -> list[bool]:
    """The directions (`up`) whose moves on `device` can go by the mapped kernel under
    pool.tier_moves `moves` (way_of, whether steps run beside them or not)."""
    _check_moves(moves)
    if moves == "mapped":
        return [False, True]
    return [False] if moves == "auto" and device.type == "cuda" else []


def note_step(device: torch.device) -> None:
    """A step begins on `device` (the paged cache's step planning calls this): moves meanwhile
    take the grid beside steps."""
    _last_step[_device_key(device)] = time.monotonic()


def beside_steps(device: torch.device) -> bool:
    """Whether a step began on `device` within BESIDE_S."""
    t = _last_step.get(_device_key(device))
    return t is not None and time.monotonic() - t < BESIDE_S


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor t on `device`, queued on the current stream and not waited for: from pinned
    memory, since a copy from pageable memory waits for the stream's queued work, holding the
    host and the interpreter lock. On the host, t itself."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def put_value(t: torch.Tensor, index: tuple, value) -> None:
    """t[index] = value for an advanced index (device tensors), without waiting for the stream:
    `t[a, b] = 0.0` on a CUDA tensor makes the Python value a CPU tensor and copies it from
    pageable memory (a stream synchronisation: torch.cuda.set_sync_debug_mode flags it); a
    device scalar made by a fill kernel is queued like any other operation."""
    t.index_put_(index, torch.full((), value, dtype=t.dtype, device=t.device))


def aligned(n: int) -> int:
    """n int32 elements rounded up to 16 bytes: where the next part of a packed int32 upload
    starts. Triton specialises a kernel on each pointer's 16-byte alignment, so a part at an
    offset that varies with the step's token or row count compiles a second kernel (~1.3 s on
    the H200, mid-run) the first time it is not aligned."""
    return -(-n // 4) * 4


def packed_int32(parts: list) -> tuple[torch.Tensor, list[int]]:
    """The parts (lists of ints or int tensors) as one int32 host tensor, each starting 16-byte
    aligned (`aligned`), and where each starts. Lists alone: one conversion of one list."""
    at, end = [], 0
    for x in parts:
        at.append(end)
        end += aligned(len(x))
    if all(isinstance(x, list) for x in parts):
        flat: list[int] = []
        for x in parts:
            flat += x
            flat += [0] * (aligned(len(x)) - len(x))
        return torch.tensor(flat, dtype=torch.int32), at
    pieces = []
    for x in parts:
        t = torch.as_tensor(x, dtype=torch.int32)
        pieces += [t, t.new_zeros(aligned(len(x)) - len(x))]
    return torch.cat(pieces), at


def int64(values: list[int]) -> torch.Tensor:
    """int64 host tensor [n] of Python ints, through an array's buffer: 4x faster than
    torch.tensor's element-by-element conversion for a move's hundreds of block ids."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """(position in `rows`, first row, length) of each run of consecutive rows, in order."""
    n = len(rows)
    if n and rows[-1] - rows[0] == n - 1 and rows == list(range(rows[0], rows[0] + n)):
        return [(0, rows[0], n)]  # one run (fresh rows mostly are): compared in C, not looped
    out: list[tuple[int, int, int]] = []
    for i, r in enumerate(rows):
        if out and out[-1][1] + out[-1][2] == r:
            p, f, n = out[-1]
            out[-1] = (p, f, n + 1)
        else:
            out.append((i, r, 1))
    return out


def gather(views: list[torch.Tensor], idx: torch.Tensor, out: torch.Tensor | None = None):
    """uint8 [n, block bytes]: the blocks `idx` (on the views' device), each view's bytes in turn;
    written into `out` (uint8 [n, block bytes], contiguous) when given."""
    n = len(idx)
    if out is None:
        out = torch.empty(n, sum(_width(v) for v in views), dtype=torch.uint8, device=idx.device)
    if len(views) == 1:
        torch.index_select(
            views[0], 0, idx, out=out.view(views[0].dtype).view(n, *views[0].shape[1:])
        )
    else:
        parts = [v.index_select(0, idx).view(torch.uint8).view(n, -1) for v in views]
        torch.cat(parts, dim=1, out=out)
    return out


def scatter(views: list[torch.Tensor], idx: torch.Tensor, staged: torch.Tensor) -> None:
    """The inverse of gather: block idx[i] of every view = staged[i] (on the views' device)."""
    off, n = 0, staged.shape[0]
    for v in views:
        w = _width(v)
        part = staged[:, off : off + w]
        if len(views) > 1:
            part = part.contiguous()
        v.index_copy_(0, idx, part.view(v.dtype).view(n, *v.shape[1:]))
        off += w


def _width(view: torch.Tensor) -> int:
    return view.shape[1] * view.shape[2] * view.element_size()


def _pieces(rows: list[int], row_bytes: int):
    """runs(rows), each cut into pieces of at most COPY_BYTES."""
    most = max(1, COPY_BYTES // row_bytes)
    for p, first, n in runs(rows):
        for k in range(0, n, most):
            yield p + k, first + k, min(most, n - k)


def rows_to(dst: torch.Tensor, rows: list[int], src: torch.Tensor) -> None:
    """dst[rows[i]] = src[i], one copy per run of consecutive rows, COPY_BYTES at most (on the
    current stream, not waited for when one side is pinned host memory and the other on the
    device)."""
    for p, first, n in _pieces(rows, src.shape[1]):
        part = src if n == len(rows) else src[p : p + n]  # (one run: the whole of src)
        dst[first : first + n].copy_(part, non_blocking=True)


def rows_from(src: torch.Tensor, rows: list[int], out: torch.Tensor) -> None:
    """out[i] = src[rows[i]], one copy per run (the inverse of rows_to)."""
    for p, first, n in _pieces(rows, out.shape[1]):
        part = out if n == len(rows) else out[p : p + n]
        part.copy_(src[first : first + n], non_blocking=True)


class Staging:
    """A tier's device staging buffer, made on first use and kept."""

    def __init__(self, block_bytes: int, device: torch.device, nbytes: int = STAGING_BYTES):
        self.block_bytes, self.device = block_bytes, device
        self.blocks = max(1, nbytes // block_bytes)  # blocks a chunk holds
        self._buf: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None  # order()'s, recorded again each call

    @property
    def nbytes(self) -> int:
        """Device bytes the buffer holds (0 before the first move)."""
        return self._buf.numel() if self._buf is not None else 0

    def order(self, waiter: torch.cuda.Stream, stream: torch.cuda.Stream) -> None:
        """`waiter`'s next work comes after `stream`'s so far: waiter.wait_stream(stream) through
        one kept event (a wait binds the event's last record when it is queued), not one event
        made and destroyed a call (a move orders its streams twice or three times a piece)."""
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record(stream)
        waiter.wait_event(self._event)

    def chunks(self, n: int):
        """(lo, hi, buffer [hi - lo, block bytes]) covering n blocks, a buffer's worth at a time."""
        if self._buf is None:
            self._buf = torch.empty(
                self.blocks, self.block_bytes, dtype=torch.uint8, device=self.device
            )
        for lo in range(0, n, self.blocks):
            hi = min(n, lo + self.blocks)
            yield lo, hi, self._buf[: hi - lo]


def _pieces_of(n: int, block_bytes: int):
    """(lo, hi) covering n blocks, COPY_BYTES of them at most each."""
    most = max(1, COPY_BYTES // block_bytes)
    return [(lo, min(n, lo + most)) for lo in range(0, n, most)]


def mapped_grid(device: torch.device) -> int:
    """The mapped kernel's grid: MAPPED_PROGRAMS, or MAPPED_PROGRAMS_BESIDE_STEPS while steps run
    on `device`."""
    return MAPPED_PROGRAMS_BESIDE_STEPS if beside_steps(device) else MAPPED_PROGRAMS


MAPPED_BUCKET = 64  # the smallest move a mapped move's CUDA graph is captured for, in blocks


def _bucket(n: int) -> int:
    """The blocks of the graph a mapped move of n blocks replays: a power of two, at least
    MAPPED_BUCKET."""
    return max(MAPPED_BUCKET, 1 << (n - 1).bit_length())


class MappedMoves:
    """A tier's moves by the mapped kernel (pool.tier_moves "mapped", and "auto" beside steps): each
    is one upload of its int64 buffer [n, ids, rows] (triton_kernels.block_rows.meta) and one
    replay of a CUDA graph of the kernel's launches over that buffer (seed 3.1: a move's copy
    sequence captured per size bucket). A graph per (direction, grid, bucket): moves of up to
    `bucket` blocks, powers of two from MAPPED_BUCKET, replay it, captured at the first such move
    (after one launch that compiles the kernel). Graphs are captured in thread-local mode on a
    stream of their own, so other threads' CUDA calls (a decode step, its own capture) go on.
    On the host backend (Triton's interpreter) the kernel runs over the same buffer, eagerly.
    A capture that fails says why once and that bucket's moves launch the kernel eagerly.
    `move` runs on the current stream (the tier's side stream: one buffer per graph, so its moves
    must queue on one stream) and does not wait."""

    def __init__(self, views: list[torch.Tensor], host: torch.Tensor, device: torch.device):
        from ..triton_kernels.block_rows import check

        check(views, host)
        self.views, self.host, self.device = views, host, device
        self._graphs: dict[tuple[bool, int, int], tuple] = {}
        self._capture_stream: torch.cuda.Stream | None = None
        self.counts = {"graphs": 0, "replays": 0, "eager": 0}

    def move(self, blocks: list[int], rows: list[int], up: bool) -> None:
        """host[rows[i]] = the bytes of block blocks[i] (up: the inverse)."""
        from ..triton_kernels.block_rows import launch, meta

        n = len(blocks)
        if n != len(rows):
            raise ValueError(f"MappedMoves.move: {n} blocks for {len(rows)} rows")
        if not n:
            return
        grid = mapped_grid(self.device)
        cap = _bucket(n)
        buf = int64(meta(blocks, rows, cap))
        if self.device.type != "cuda":
            self.counts["eager"] += 1
            launch(self.views, self.host, buf, cap, up, grid)
            return
        graph, static = self._graph(up, grid, cap)
        if graph is None:  # its capture failed (said once): the kernel itself
            self.counts["eager"] += 1
            launch(self.views, self.host, to_device(buf, self.device), cap, up, grid)
            return
        static.copy_(buf.pin_memory(), non_blocking=True)
        graph.replay()
        self.counts["replays"] += 1

    def prepare(self, up: bool, grid: int, blocks: int) -> int:
        """The graphs that moves of up to `blocks` blocks in this direction and grid replay,
        captured now (the kernel compiled with the first), not at the first such move: that
        one stalls the steps beside it for a Triton compile (~0.1 s on the H200 with a cold
        cache) and a capture. Returns how many were captured; nothing off a GPU (the kernel
        runs eagerly there)."""
        if self.device.type != "cuda":
            return 0
        held, cap = len(self._graphs), MAPPED_BUCKET
        while cap <= _bucket(blocks):
            self._graph(up, grid, cap)
            cap *= 2
        return len(self._graphs) - held

    def _graph(self, up: bool, grid: int, cap: int) -> tuple:
        """The (graph, buffer) of moves of up to `cap` blocks, captured at its first use."""
        key = (up, grid, cap)
        if key not in self._graphs:
            self._graphs[key] = self._capture(up, grid, cap)
        return self._graphs[key]

    def _capture(self, up: bool, grid: int, cap: int) -> tuple:
        """(graph, its buffer) for moves of up to `cap` blocks; (None, None) when the capture
        failed (one warning)."""
        from ..triton_kernels.block_rows import launch

        static = torch.zeros(1 + 2 * cap, dtype=torch.int64, device=self.device)  # n = 0
        launch(self.views, self.host, static, cap, up, grid)  # compiles; moves nothing
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()  # a graph collected meanwhile (its reset) would invalidate the capture
        try:
            with torch.cuda.stream(self._capture_stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    launch(self.views, self.host, static, cap, up, grid)
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - said, and the moves still run (eagerly)
            warn_once(
                f"oxygen_torch: the CPU tier's mapped moves of up to {cap} blocks run without "
                f"a CUDA graph (each launches the kernel): capturing one failed: {exc}"
            )
            return None, None
        finally:
            if collecting:
                gc.enable()
        self.counts["graphs"] += 1
        return graph, static


@contextlib.contextmanager
def _streams_set(device: torch.device):
    """Yields `device`'s current stream, `device` made current: inside, a move sets the current
    stream per piece (torch.cuda.set_stream, one call) rather than entering a stream context (a
    few calls in and out, twice a piece); the device and its stream are as they were after."""
    cur = torch.cuda.current_stream(device)
    with torch.cuda.device(device):
        try:
            yield cur
        finally:
            torch.cuda.set_stream(cur)


def _typed(views: list[torch.Tensor], buf: torch.Tensor) -> torch.Tensor | None:
    """buf [n, block bytes] seen as the one view's blocks [n, regions, width], in its dtype, so
    that a piece's gather or scatter is one call on a slice of it (gather() and scatter() view
    the piece twice and read shapes first); None for two views (an fp8 pool's scales)."""
    if len(views) != 1:
        return None
    v = views[0]
    return buf.view(v.dtype).view(len(buf), *v.shape[1:])


def _gather(views, ids, buf: torch.Tensor, typed, a: int, b: int) -> None:
    """buf[a:b] = the bytes of blocks ids (typed: _typed(views, buf))."""
    if typed is None:
        gather(views, ids, out=buf[a:b])
    else:
        torch.index_select(views[0], 0, ids, out=typed[a:b])


def _scatter(views, ids, buf: torch.Tensor, typed, a: int, b: int) -> None:
    """The bytes of blocks ids = buf[a:b] (typed: _typed(views, buf))."""
    if typed is None:
        scatter(views, ids, buf[a:b])
    else:
        views[0].index_copy_(0, ids, typed[a:b])


def down(views, idx, host: torch.Tensor, rows: list[int], stage: Staging, copy=None) -> None:
    """host[rows[i]] = the bytes of block idx[i] (idx on the device), through the staging buffer,
    a piece (COPY_BYTES) at a time. `copy`: a second stream for the copies, so that each piece's
    copy overlaps the next one's gather (on the current stream, which comes after them all);
    paced: each piece's gather waits for the last piece's copy, so the copy engine serves other
    streams' copies between two pieces."""
    if copy is None:
        for lo, hi, buf in stage.chunks(len(rows)):
            typed = _typed(views, buf)
            for a, b in _pieces_of(hi - lo, stage.block_bytes):
                _gather(views, idx[lo + a : lo + b], buf, typed, a, b)
                rows_to(host, rows[lo + a : lo + b], buf[a:b])
        return
    with _streams_set(idx.device) as cur:
        for lo, hi, buf in stage.chunks(len(rows)):
            typed = _typed(views, buf)
            stage.order(cur, copy)  # the last chunk's copies have read the buffer
            for a, b in _pieces_of(hi - lo, stage.block_bytes):
                if a:
                    stage.order(cur, copy)  # (the pace: after the last piece's copy)
                _gather(views, idx[lo + a : lo + b], buf, typed, a, b)
                stage.order(copy, cur)  # after this piece's gather
                torch.cuda.set_stream(copy)
                rows_to(host, rows[lo + a : lo + b], buf[a:b])
                torch.cuda.set_stream(cur)
        stage.order(cur, copy)


def up(views, host: torch.Tensor, rows: list[int], idx, stage: Staging, copy=None) -> None:
    """The bytes of block idx[i] = host[rows[i]] (the inverse of `down`; `copy` likewise: each
    piece's copy overlaps the last one's scatter)."""
    if copy is None:
        for lo, hi, buf in stage.chunks(len(rows)):
            typed = _typed(views, buf)
            for a, b in _pieces_of(hi - lo, stage.block_bytes):
                rows_from(host, rows[lo + a : lo + b], buf[a:b])
                _scatter(views, idx[lo + a : lo + b], buf, typed, a, b)
        return
    with _streams_set(idx.device) as cur:
        for lo, hi, buf in stage.chunks(len(rows)):
            typed = _typed(views, buf)
            stage.order(copy, cur)  # after the work so far (the last chunk's scatters included)
            for a, b in _pieces_of(hi - lo, stage.block_bytes):
                torch.cuda.set_stream(copy)
                rows_from(host, rows[lo + a : lo + b], buf[a:b])
                torch.cuda.set_stream(cur)
                stage.order(cur, copy)
                _scatter(views, idx[lo + a : lo + b], buf, typed, a, b)
