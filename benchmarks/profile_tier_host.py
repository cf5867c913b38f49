"""Where a CPU-tier churn cycle's host time goes: thread CPU time and cProfile, on the CPU.

On the H200 a thread migrating KV blocks (bench_tier.py's `_tpot_while_migrating`: 256 blocks of
512 KiB, 128 MiB, moved down to the CPU tier and back up without pause, in 16 MiB pieces) spent
5.4-6.8 ms of host time a 6.6 ms cycle, holding the interpreter lock against generate()'s
host-bound decode loop beside it. This runs the same cycle on the host backend (both the arena
and the tier in host memory, torch on one thread), so a cycle's thread CPU time is its Python
and torch-call overhead plus the copies' own bytes:

- tier: bench_tier.py's cycle, `tier.down(blocks)`, `tier.up(slots, blocks)`, `tier.release`;
- swap: a core holding the blocks (--rows rows of blocks / rows each) swapped out to the tier
  and back in (kv/swap.py `swap_out` / `swap_in`: the block manager's and the core's
  bookkeeping on top of the tier's).

The default geometry keeps the bench's block count, pieces and staging chunks (32 blocks a
16 MiB piece, 128 a 64 MiB chunk at 512 KiB a block) but shrinks a block to 16 layers x 1 kv
head x head_dim 1 (1 KiB: transfer.COPY_BYTES and the staging buffer scaled with it), so the
bytes copied are small and the overhead shows; `--kv-heads 8 --head-dim 64` is the bench's
512 KiB block (Llama-1.1B's) at full size. Per mode: --repeat rounds of --cycles cycles timed
by time.thread_time (no profiler; ms a cycle, median and spread of the rounds), each step's
share, the torch calls a cycle (torch functions and tensor methods, through a
TorchFunctionMode: on CUDA each is ~5-10 us of host time) and the time inside them, then
--cycles cycles under cProfile (thread CPU time): the top functions by own time, in us a cycle.
cProfile inflates Python-heavy code; compare the rounds' figures for absolute ones. On the CPU
the moves take the host path of kv/transfer.py (no streams, events or pacing): the CUDA path's
stream and event calls are not counted here. Each mode first checks that a cycle brings every
byte back and leaves no slot taken.

    python benchmarks/profile_tier_host.py                    # both modes, 1 KiB blocks
    python benchmarks/profile_tier_host.py --modes tier --top 40
    python benchmarks/profile_tier_host.py --kv-heads 8 --head-dim 64 --cycles 20   # 512 KiB
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import time

import torch
from torch.overrides import TorchFunctionMode

from oxygen_torch.kv import transfer
from oxygen_torch.kv.core import PagedKVCore
from oxygen_torch.kv.pool import release_pools
from oxygen_torch.kv.swap import swap_in, swap_out

MiB = 1 << 20
MODES = ("tier", "swap")
GPU_BLOCK = 512 << 10  # the bench's block (Llama-1.1B, bf16, 16 tokens): the pieces it makes
GPU_COPY, GPU_STAGING = transfer.COPY_BYTES, transfer.STAGING_BYTES


class CallCounter(TorchFunctionMode):
    """Counts torch functions and tensor methods called (each is a dispatch: ~5-10 us on CUDA)
    and the thread CPU time inside them (on the host backend, the copies' bytes included)."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.seconds: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        t = time.thread_time()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.calls[name] += 1
            self.seconds[name] += time.thread_time() - t


def build(args):
    """(core, tier, blocks): a core on a host-backend pool holding args.blocks blocks, filled."""
    core = PagedKVCore(
        args.layers, block_tokens=args.block_tokens, arena_bytes=args.arena_mib * MiB
    )
    core.bind(args.rows, args.kv_heads, args.head_dim, args.dtype, "cpu")
    pool = core.pool
    bb = pool.block_bytes()
    # the bench's pieces and chunks at this block size (the host path stages 4 MiB otherwise)
    transfer.COPY_BYTES = max(bb, GPU_COPY // GPU_BLOCK * bb)
    tier = pool.cpu_tier(2 * args.blocks * bb)
    tier._stage = transfer.Staging(bb, torch.device("cpu"), max(bb, GPU_STAGING // GPU_BLOCK * bb))
    per_row = args.blocks // args.rows
    core._reserve([per_row * args.block_tokens] * args.rows)
    blocks = [b for row in core.seqs.blocks for b in row]
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor(blocks)
    for cache in (*pool.storage.k, *pool.storage.v):  # only these blocks' pages are mapped
        data = torch.randn(len(blocks), *cache.shape[1:], generator=g).to(cache.dtype)
        cache.index_copy_(0, idx, data)
    return core, tier, blocks


STEPS = {"tier": ("down", "up", "release"), "swap": ("swap_out", "swap_in")}


def cycles(mode: str, core, tier, blocks, n: int, steps: dict | None = None) -> None:
    """n cycles; `steps`: each step's thread CPU seconds added to steps[name]."""
    clock = time.thread_time
    for _ in range(n):
        t0 = clock()
        if mode == "tier":
            slots = tier.down(blocks)
            t1 = clock()
            tier.up(slots, blocks)
            t2 = clock()
            tier.release(slots)
        else:
            swap_out(core)
            t1 = t2 = clock()
            swap_in(core)
        tier.wait()
        t3 = clock()
        if steps is not None:
            times = (t1 - t0, t2 - t1, t3 - t2) if mode == "tier" else (t1 - t0, t3 - t2)
            for name, dt in zip(STEPS[mode], times):
                steps[name] += dt


def check(mode, core, tier, blocks) -> None:
    """The cycle moves every byte there and back (the profile times a cycle that works)."""
    pool = core.pool
    idx = torch.tensor(blocks)
    want = [c.index_select(0, idx) for c in (*pool.storage.k, *pool.storage.v)]
    cycles(mode, core, tier, blocks, 1)
    now = [b for row in core.seqs.blocks for b in row]
    got = [c.index_select(0, torch.tensor(now)) for c in (*pool.storage.k, *pool.storage.v)]
    assert all(torch.equal(a, b) for a, b in zip(want, got)), mode
    assert tier.stats()["slots_used"] == 0, mode


def timed_rounds(mode: str, core, tier, blocks, args) -> None:
    """Prints the rounds' ms a cycle, each step's, the torch calls' count and time."""
    cycles(mode, core, tier, blocks, max(1, args.cycles // 10))  # warm
    rounds, steps = [], collections.Counter()
    for _ in range(args.repeat):
        t = time.thread_time()
        cycles(mode, core, tier, blocks, args.cycles)
        rounds.append((time.thread_time() - t) / args.cycles * 1e3)
    cycles(mode, core, tier, blocks, args.cycles, steps)
    with CallCounter() as counter:
        cycles(mode, core, tier, blocks, args.cycles)
    per = 1e3 / args.cycles  # seconds over all cycles -> ms a cycle
    calls = sorted(counter.calls.items(), key=lambda kv: -kv[1])
    print(
        f"\n=== {mode}: {statistics.median(rounds):.3f} ms host time a cycle (median of "
        f"{args.repeat} x {args.cycles} cycles; min {min(rounds):.3f}, max {max(rounds):.3f}); "
        f"{sum(counter.calls.values()) // args.cycles} torch calls a cycle ==="
    )
    print("  steps, ms a cycle: " + ", ".join(f"{k} {v * per:.3f}" for k, v in steps.items()))
    top = ", ".join(f"{k} {v * per:.3f}" for k, v in counter.seconds.most_common(4))
    print(f"  inside torch calls: {sum(counter.seconds.values()) * per:.3f} ms a cycle ({top})")
    print("  torch calls a cycle: " + ", ".join(f"{k} {n // args.cycles}" for k, n in calls))


def profiled(mode: str, core, tier, blocks, args) -> None:
    """Prints the top functions by own time under cProfile (thread CPU time), in us a cycle."""
    prof = cProfile.Profile(time.thread_time)
    prof.enable()
    cycles(mode, core, tier, blocks, args.cycles)
    prof.disable()
    per = 1e6 / args.cycles
    print(f"{'function (cProfile)':58s} {'calls/cyc':>9s} {'own us':>9s} {'cum us':>9s}")
    top = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[: args.top]
    for (file, line, fn), (_, calls, own, cum, _) in top:
        name = f"{file.rsplit('/', 1)[-1]}:{line} {fn}"
        print(f"{name[-58:]:58s} {calls / args.cycles:9.1f} {own * per:9.1f} {cum * per:9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=1)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--blocks", type=int, default=256, help="blocks moved a cycle, each way")
    ap.add_argument("--rows", type=int, default=16, help="the core's rows (swap mode)")
    ap.add_argument("--arena-mib", type=int, default=0, help="0: 4 x the blocks, 64 MiB at least")
    ap.add_argument("--cycles", type=int, default=200, help="cycles a timed round")
    ap.add_argument("--repeat", type=int, default=7, help="timed rounds (median, spread)")
    ap.add_argument("--top", type=int, default=25, help="top functions by own time (0: none)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.dtype = getattr(torch, args.dtype)
    block = 2 * args.layers * args.block_tokens * args.kv_heads * args.head_dim
    args.arena_mib = args.arena_mib or max(64, 4 * args.blocks * block * args.dtype.itemsize >> 20)
    core, tier, blocks = build(args)
    bb = tier.block_bytes
    print(
        f"{len(blocks)} blocks of {bb / 1024:g} KiB a move ({len(blocks) * bb / MiB:g} MiB), "
        f"{transfer.COPY_BYTES // bb} a piece, {tier._stage.blocks} a staging chunk; "
        f"torch {torch.__version__}, 1 thread"
    )
    for mode in args.modes:
        blocks = [b for row in core.seqs.blocks for b in row]  # (a swap-in may renumber them)
        check(mode, core, tier, blocks)
        timed_rounds(mode, core, tier, blocks, args)
        if args.top:
            profiled(mode, core, tier, blocks, args)
    core.release()
    release_pools()


if __name__ == "__main__":
    main()
