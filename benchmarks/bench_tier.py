"""The CPU tier on the H200 (issue 19), each figure beside its anchor measured in the same run.

Parts (each mode in its own subprocess: enable() comes before the first CUDA allocation, and a
mode's memory cap is its own):

- migration: the tier's gathered moves (CPUTier.down / up) of 64 to 2,048 blocks of the
  Llama-1.1B geometry (512 KiB a block: 16 layers x K, V x 16 tokens x 8 heads x 64, bf16)
  against one contiguous pinned copy of the same bytes (the peak) and 256 KiB copies one by one;
  then generate()'s time per output token (B=16, P=512) with and without a thread moving blocks
  down and up meanwhile. Goals: >= 44 GB/s each way; TPOT rises < 10 % while migrating.
- capacity: prompts of 4,096 + 256 new tokens under a 24 GiB cap: stock dynamic at B=48 and
  OffloadedCache at B=64 (the largest batches the anchors fit), oxygen on the GPU alone at
  B=128 (its KV arena capped at what 128 sequences need) and oxygen at B=512 with the same arena
  and the CPU tier. Goal: 512 complete at >= 0.75x the tok/s of oxygen's 128.
- prefix: a shared 2,000-token system prompt and 64 requests of 100-token user turns, TTFT
  (generate(max_new_tokens=1)) on a miss (prefix cache off), a GPU hit and a CPU-tier hit (every
  cached block moved down before each request); then an 8-turn chat. Goals: GPU hit >= 10x
  lower TTFT than a miss, CPU-tier hit >= 3x lower; hot-zone hit ratio >= 0.85 (GPU-hit run).
  One by one at batch 1, generate()'s host time sets TTFT (prefix_floor: the turn alone, no
  cache). prefix_concurrent_miss / prefix_concurrent / prefix_concurrent_cpu: the 64 requests
  arriving together, one thread each (the engine merges their forwards): each call's TTFT from
  the common release, the burst's wall time, and whether every call started on the cache.
- long: one 131,072-token prompt, 32 new tokens, under the 24 GiB cap: stock dynamic (does it
  fit?) and oxygen (chunked prefill): TTFT and time per output token.
- swap: calls preempted to the CPU tier and back (the multi-task engine): low-priority calls
  fill a small KV arena, high-priority calls arrive in two waves and swap the youngest out; each
  of SWAP_SEEDS workloads (prompt lengths drawn per seed) run twice in turn, swap-ins waited for
  in the step that takes the call back (as kv.prefetch_distance 0) and started ahead while the
  others step (4). Figures: wall time and tok/s, the steps' median time and that of the steps
  during which a swap-in ran, swaps and swap-ins ahead.

- disk: the slow paths, 512 blocks down and up through the disk tier (CPU rows full) and with
  fp8 lowering (past the pressure mark): GB/s each way.
- profile (not run unless named): torch.profiler over one prefix miss and one hit, the top CPU
  ops and CUDA kernels by self time.

Environment: BENCH_TIER_TPOT_ROUNDS (migration: rounds of TPOT beside each churn, default 3);
BENCH_TIER_WAYS (migration: the ways a move goes, "moves:MiB[:programs],...", default
"auto:16,gather:16,mapped:16:2": pool.tier_moves, piece MiB (transfer.COPY_BYTES), the mapped
kernel's grid); BENCH_TIER_SWAP_SEEDS (swap: seeds, default "1,2");
BENCH_TIER_WINDOW and BENCH_TIER_HYBRID_EVERY (long: the window, default 4,096, and
every how many layers a hybrid model's layer is full, default 6).

    python benchmarks/bench_tier.py                  # every part but profile
    python benchmarks/bench_tier.py --parts migration swap
    python benchmarks/bench_tier.py --modes prefix_miss prefix_gpu prefix_floor
    python benchmarks/bench_tier.py --smoke          # tiny model on CPU: the plumbing only

With $OUT set, bench_tier.json and bench_tier.md (bench_tier_<first mode>.* with --modes) are
written there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback

import torch

GIB, MIB = 1 << 30, 1 << 20
CONCURRENT = ("prefix_concurrent_miss", "prefix_concurrent", "prefix_concurrent_cpu")
CAP_BYTES = 24 * GIB
PARTS = {
    "migration": ("migration",),
    "disk": ("disk_lowering",),
    "capacity": ("hf_dynamic", "hf_offloaded", "oxygen_gpu", "oxygen_tier"),
    "prefix": ("prefix_miss", "prefix_gpu", "prefix_cpu", "prefix_floor", *CONCURRENT),
    "long": (
        "long_hf",
        "long_oxygen",
        "long_window_hf",
        "long_window_oxygen",
        "long_hybrid_hf",
        "long_hybrid_oxygen",
    ),
    "profile": ("prefix_profile",),
    "swap": ("swap",),
}
TIMEOUT_S = {"migration": 300, "hf_offloaded": 300, "oxygen_tier": 420, "long_hf": 240,
             "long_oxygen": 240, "long_window_hf": 240, "long_window_oxygen": 240,
             "long_hybrid_hf": 240, "long_hybrid_oxygen": 240, "swap": 420}  # fmt: skip
SMOKE = os.environ.get("BENCH_TIER_SMOKE") == "1"
DEVICE = "cpu" if SMOKE else "cuda"
# (batch, prompt, new) per capacity mode; smoke: tiny
CAP = {"hf_dynamic": 48, "hf_offloaded": 64, "oxygen_gpu": 128, "oxygen_tier": 512}
CAP_P, CAP_N, GPU_BATCH = (4096, 256, 128) if not SMOKE else (40, 8, 4)
SYSTEM, USER, REQUESTS, TURNS = (2000, 100, 64, 8) if not SMOKE else (64, 8, 4, 3)
LONG_P, LONG_N = (131072, 64) if not SMOKE else (256, 8)
# the long_window / long_hybrid modes' sliding window, and how often a hybrid layer is full
WINDOW = int(os.environ.get("BENCH_TIER_WINDOW", "0")) or (4096 if not SMOKE else 32)
HYBRID_EVERY = int(os.environ.get("BENCH_TIER_HYBRID_EVERY", "6"))
TPOT_ROUNDS = int(os.environ.get("BENCH_TIER_TPOT_ROUNDS", "3"))  # migration: TPOT rounds
# swap: (rows a call, low calls, their prompt's shortest, new tokens; high calls a wave, their
# prompt, new tokens); the arena holds SWAP_FIT calls of the longest low prompt
SWAP = (8, 4, 512, 192, 2, 512, 64) if not SMOKE else (4, 4, 24, 12, 1, 24, 6)
SWAP_FIT = 4  # = the low calls: the high waves make room by swapping lows out
SWAP_SEEDS = [int(x) for x in os.environ.get("BENCH_TIER_SWAP_SEEDS", "1,2").split(",")]


def say(msg: str) -> None:
    print("\n".join(f"# {ln}" for ln in msg.splitlines()), flush=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def hybrid_types(layers: int) -> list[str]:
    """Every HYBRID_EVERY-th layer sees every token, the others slide (6: Gemma-3's pattern)."""
    k = HYBRID_EVERY
    return ["full_attention" if i % k == k - 1 else "sliding_attention" for i in range(layers)]


def build_model(max_pos: int = 8192, window: int | None = None, hybrid: bool = False):
    """The Llama-1.1B shape (smoke: tiny); `window`: a Mistral of that shape, every layer
    attending to the last `window` tokens; with `hybrid`, a Qwen2 of that shape whose layers
    slide but every sixth (hybrid_types)."""
    from oxygen_torch.tools.demo_models import LLAMA_1B, TINY_LLAMA, random_llama

    shape = TINY_LLAMA if SMOKE else LLAMA_1B
    dtype = torch.float32 if SMOKE else torch.bfloat16
    extra = dict(family="mistral", sliding_window=window) if window else {}
    if window and hybrid:
        types = hybrid_types(shape["num_hidden_layers"])
        if SMOKE:  # the tiny shape's 4 layers: one full layer all the same
            types = ["sliding_attention"] * 3 + ["full_attention"]
        extra = dict(family="qwen2", use_sliding_window=True, sliding_window=window,
                     max_window_layers=0, layer_types=types)  # fmt: skip
    return random_llama(
        shape, dtype=dtype, device=DEVICE, init_on_device=not SMOKE,
        max_position_embeddings=max_pos, **extra,
    )  # fmt: skip


def shape() -> dict:
    from oxygen_torch.tools.demo_models import LLAMA_1B, TINY_LLAMA

    return TINY_LLAMA if SMOKE else LLAMA_1B


def kv_arena_bytes(seqs: int, tokens: int, bt: int = 16, page: int = 2 * MIB) -> int:
    """Arena bytes holding `seqs` sequences of `tokens` tokens (+ the guard block), bf16; known
    before the model is built (enable() comes before the first CUDA allocation)."""
    c = shape()
    layers, heads = c["num_hidden_layers"], c["num_key_value_heads"]
    dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    elem = 4 if SMOKE else 2
    blocks = seqs * -(-tokens // bt) + 1
    region = -(-blocks * bt * heads * dim * elem // page) * page
    return 2 * layers * region


def oxygen_capped(**sections):
    """The HF integration on torch's own allocator, which the 24 GiB cap (cap_torch) binds; the
    KV arena (outside torch's allocator) is capped by kv.arena_bytes. As bench_generate.py's
    capacity test."""
    from oxygen_torch.config import load_config
    from oxygen_torch.integrations.hf import integration as hf

    cfg = load_config(**sections)
    hf.enable_hf(cfg)
    return cfg


def cap_torch(reserved_for_kv: int) -> None:
    """torch's allocator gets what is left of the 24 GiB once the KV arena is set aside."""
    if DEVICE == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction((CAP_BYTES - reserved_for_kv) / total)


def prompts(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    vocab = 1024 if SMOKE else 32000
    return torch.randint(1, vocab, (batch, length), generator=g).to(DEVICE)


def tier_stats() -> dict:
    from oxygen_torch.kv import pool_stats

    tiers = [p["cpu_tier"] for p in pool_stats() if p.get("cpu_tier")]
    return tiers[0] if tiers else {}


# --- migration ------------------------------------------------------------------------------


def _bench(fn, iters: int = 5, setup=None) -> float:
    """Median seconds of fn() (device synchronized on both ends); setup() runs before each
    call, untimed."""
    ts = []
    for i in range(iters + 1):
        if setup is not None:
            setup()
        t = timed(fn)[1]
        ts += [t] if i else []  # the first call warms
    return statistics.median(ts)


def migration() -> dict:
    import oxygen_torch
    from oxygen_torch.kv.pool import PoolKey, get_pool

    oxygen_torch.enable()  # before the first CUDA allocation

    dev = torch.device(DEVICE)
    sizes = (64, 512, 2048) if not SMOKE else (8, 32)
    key = PoolKey(dev, 16, 8, 64, torch.bfloat16, 16, "auto", 4 * GIB, 2 * MIB)
    pool = get_pool(key)
    tier = pool.cpu_tier((max(sizes) + 8) * pool.block_bytes())
    bb = tier.block_bytes
    res = {"block_bytes": bb, "rows": []}
    with pool.lock:
        blocks = pool.manager.allocate(max(sizes))
    for cache in (*pool.storage.k, *pool.storage.v):
        cache.index_fill_(0, torch.tensor(blocks, device=dev), 1.0)
    for n in sizes:
        mine = blocks[:n]
        slots: list = []

        def down(mine=mine, slots=slots):
            slots[:] = tier.down(mine)

        # the last move's slots are released before each timed move (not a part of it)
        t_down = _bench(down, setup=lambda slots=slots: tier.release(slots))
        t_up = _bench(lambda mine=mine, slots=slots: tier.up(slots, mine))
        tier.release(slots)
        nbytes = n * bb
        dense = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
        t_pin_d2h = _bench(lambda h=host, d=dense: h.copy_(d, non_blocking=True))
        t_pin_h2d = _bench(lambda h=host, d=dense: d.copy_(h, non_blocking=True))
        chunk = 256 * 1024
        k = nbytes // chunk
        src, dst = dense[: k * chunk].view(k, chunk), host[: k * chunk].view(k, chunk)

        def one_by_one(src=src, dst=dst, k=k):
            for i in range(k):
                dst[i].copy_(src[i], non_blocking=True)

        t_each = _bench(one_by_one, 3)
        row = dict(
            blocks=n,
            MiB=nbytes / MIB,
            down_GBps=nbytes / t_down / 1e9,
            up_GBps=nbytes / t_up / 1e9,
            pinned_d2h_GBps=nbytes / t_pin_d2h / 1e9,
            pinned_h2d_GBps=nbytes / t_pin_h2d / 1e9,
            per_256KiB_d2h_GBps=k * chunk / t_each / 1e9,
        )
        say(
            " ".join(f"{a}={b:.1f}" if isinstance(b, float) else f"{a}={b}" for a, b in row.items())
        )
        res["rows"].append(row)
        del dense, host
    res["pieces"] = _pieces(tier, blocks[: 512 if not SMOKE else 64], bb)
    res["tpot"] = _tpot_while_migrating(pool, tier, blocks)
    with pool.lock:
        pool.manager.decref(blocks)
    return res


def _ways(spec: str) -> tuple:
    """(name, pool.tier_moves, piece MiB, programs alone, programs beside steps) of each
    "moves:MiB[:programs]": "mapped" with programs takes that grid alone and beside steps;
    "auto" (the default way: moves down beside steps by the mapped kernel, the rest by the
    gathers) transfer's grids."""
    from oxygen_torch.kv import transfer

    out = []
    for w in spec.split(","):
        moves, mib, *grid = w.split(":")
        alone, beside = transfer.MAPPED_PROGRAMS, transfer.MAPPED_PROGRAMS_BESIDE_STEPS
        if moves == "auto":
            name = f"default (down beside steps by the mapped kernel of {beside}, else gathers)"
        elif moves == "mapped":  # (neither paced nor in pieces: one kernel a move)
            alone = beside = int(grid[0]) if grid else alone
            name = f"mapped kernel, {alone} programs"
        else:
            name = f"gathers, paced, {mib} MiB pieces"
        out.append((name, moves, int(mib), alone, beside))
    return tuple(out)


# the ways a move can go, the default first: BENCH_TIER_WAYS "moves:MiB[:programs],..."
# (pool.tier_moves "auto", "mapped" or "gather", transfer.COPY_BYTES in MiB, the mapped kernel's
# grid)
WAYS = _ways(os.environ.get("BENCH_TIER_WAYS", "auto:16,gather:16,mapped:16:2"))
RUN = 16  # blocks: the "runs" order's runs of consecutive blocks


def _use(way: tuple, tier) -> None:
    """Sets the tier's way and transfer's knobs to a WAYS entry's."""
    from oxygen_torch.kv import transfer

    _, tier.moves, mib, alone, beside = way
    transfer.COPY_BYTES = mib * MIB
    transfer.MAPPED_PROGRAMS, transfer.MAPPED_PROGRAMS_BESIDE_STEPS = alone, beside


def _saved(tier) -> tuple:
    """The tier's way and transfer's knobs as a WAYS entry, to _use again after."""
    from oxygen_torch.kv import transfer

    return ("", tier.moves, transfer.COPY_BYTES // MIB, transfer.MAPPED_PROGRAMS,
            transfer.MAPPED_PROGRAMS_BESIDE_STEPS)  # fmt: skip


def scattered(blocks: list[int], seed: int = 0) -> list[int]:
    """Every other block of `blocks` (consecutive ids), in a random order: no two of them are
    consecutive."""
    every = blocks[::2]
    order = torch.randperm(len(every), generator=torch.Generator().manual_seed(seed)).tolist()
    return [every[i] for i in order]


def in_runs(blocks: list[int], run: int, seed: int = 0) -> list[int]:
    """Runs of `run` consecutive blocks of `blocks` (consecutive ids), `run` blocks apart, the
    runs in a random order."""
    runs = [blocks[a : a + run] for a in range(0, len(blocks) - run + 1, 2 * run)]
    order = torch.randperm(len(runs), generator=torch.Generator().manual_seed(seed)).tolist()
    return [b for i in order for b in runs[i]]


def ordered(blocks: list[int], order: str) -> list[int]:
    """256 of `blocks` (512 or more consecutive ids) as a move of that order takes them."""
    if order == "consecutive":
        return blocks[:256]
    if order == "scattered":
        return scattered(blocks[:512])
    return in_runs(blocks[:512], RUN)  # "runs"


def _pieces(tier, mine: list[int], bb: int) -> list:
    """down / up GB/s of one move by the way it goes (WAYS: the mapped kernel, or gathers into
    the staging buffer), the size of its pieces (transfer.COPY_BYTES) and the order of its
    blocks (consecutive, or scattered: a copy a block)."""
    saved, rows = _saved(tier), []
    orders = {"mapped": ("consecutive", "scattered")}  # gathers: any order alike
    ways = [(w, order) for w in WAYS for order in orders.get(w[1], ("consecutive",))]
    for way_, order in ways:
        name, moves, mib, _, _ = way_
        _use(way_, tier)
        blocks = ordered(mine, order)
        slots: list = []

        def down(slots=slots, blocks=blocks):
            slots[:] = tier.down(blocks)

        t_down = _bench(down, setup=lambda slots=slots: tier.release(slots))
        t_up = _bench(lambda slots=slots, blocks=blocks: tier.up(slots, blocks))
        tier.release(slots)
        n = len(blocks) * bb
        mapped = tier.stats()["blocks_mapped"]
        tier.release(tier.down(blocks))
        share = (tier.stats()["blocks_mapped"] - mapped) / len(blocks)  # mapped, not gathered
        label = {"runs": f"blocks in runs of {RUN}"}.get(order, f"{order} blocks")
        way = f"{name}, {label} ({100 * share:.0f} % mapped)"
        rows.append(dict(blocks=len(blocks), mapped_share=share, down=way, copy_MiB=mib,
                         moves=moves, order=order, down_GBps=n / t_down / 1e9,
                         up_GBps=n / t_up / 1e9))  # fmt: skip
        say(f"{len(blocks)} blocks by {way}: down {n / t_down / 1e9:.1f} GB/s, up "
            f"{n / t_up / 1e9:.1f} GB/s")  # fmt: skip
    _use(saved, tier)
    return rows


def _tpot_while_migrating(pool, tier, blocks) -> dict:
    """generate()'s time per output token alone, then with a thread moving 256 blocks (in runs
    of RUN) down and up without pause, on its
    own stream (another pool on the same GPU: the copy engines and HBM are shared). Churns: the
    tier's moves each way of WAYS (by default: the default way, pool.tier_moves "auto"; the
    paced gathers in 16 MiB pieces; the mapped kernel of 2 programs both ways),
    in TPOT_ROUNDS rounds, each against its own TPOT
    alone measured just before, the order turned by one each round; and the same bytes as bare
    pinned copies in one piece each way (no Python between them: the copy engines' share alone).
    The churn's host time a cycle is its wall time outside the wait (the interpreter lock's
    waits included) and its thread CPU time."""
    from oxygen_torch.kv import transfer

    model = build_model()
    b, p, n = (16, 512, 128) if not SMOKE else (2, 16, 8)
    ids = prompts(b, p)

    def gen(new, **kw):
        with torch.no_grad():
            return model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                **kw,
            )

    def tpot():
        """The median over 3 calls of a call's mean gap between its tokens after the first
        (StepClock: no prefill in it, and this stream's own work only)."""
        from transformers import StoppingCriteriaList

        gen(n)  # warm
        per = []
        for _ in range(3):
            clock = StepClock()
            clock.start()
            gen(n, stopping_criteria=StoppingCriteriaList([clock]))
            per.append(clock.per_token())
        return statistics.median(per)

    alone = tpot()
    mine = ordered(blocks, "runs")
    nbytes = len(mine) * tier.block_bytes
    dense = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEVICE == "cuda")

    def tier_cycle(stream, mine=mine):
        slots = tier.down(mine)
        tier.up(slots, mine)
        tier.release(slots)
        t = time.perf_counter()
        tier.wait()  # the host waits here (not holding the interpreter lock)
        return time.perf_counter() - t

    def raw_cycle(stream, piece):
        for lo in range(0, nbytes, piece):
            host[lo : lo + piece].copy_(dense[lo : lo + piece], non_blocking=True)
        for lo in range(0, nbytes, piece):
            dense[lo : lo + piece].copy_(host[lo : lo + piece], non_blocking=True)
        t = time.perf_counter()
        if stream is not None:
            stream.synchronize()
        return time.perf_counter() - t

    def busy(cycle, alone) -> dict:
        stop, moved, host_s, cycles, cpu_s = threading.Event(), [0], [0.0], [0], [0.0]

        def churn():
            # its own stream, as a thread that migrates has: the waits of its moves are its own
            stream = torch.cuda.Stream() if DEVICE == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                c0 = time.thread_time()
                while not stop.is_set():
                    t = time.perf_counter()
                    waited = cycle(stream)
                    host_s[0] += time.perf_counter() - t - waited
                    cycles[0] += 1
                    moved[0] += 2 * nbytes
                cpu_s[0] = time.thread_time() - c0

        th = threading.Thread(target=churn, daemon=True)
        t0 = time.perf_counter()
        th.start()
        t = tpot()
        stop.set()
        th.join()
        return dict(
            tpot_migrating_ms=t * 1e3,
            rise=t / alone - 1,
            migrated_GBps_meanwhile=moved[0] / (time.perf_counter() - t0) / 1e9,
            churn_host_ms_per_cycle=1e3 * host_s[0] / max(1, cycles[0]),
            churn_cpu_ms_per_cycle=1e3 * cpu_s[0] / max(1, cycles[0]),
            alone_ms=alone * 1e3,
        )

    churns, saved = {}, _saved(tier)
    for k in range(TPOT_ROUNDS):  # a call's noise against the differences: rounds, turned
        alone_k = alone if k == 0 else tpot()
        turn = k % len(WAYS)
        for way in WAYS[turn:] + WAYS[:turn]:
            _use(way, tier)
            churns[f"tier, {way[0]}, round {k + 1}"] = busy(tier_cycle, alone_k)
    _use(saved, tier)
    churns[f"bare copies, {nbytes // MIB} MiB"] = busy(lambda s: raw_cycle(s, nbytes), alone_k)
    # where the rise comes from: a tier cycle's two parts apart, at the tier churns' pace (no
    # bytes reach the host in either: their "GB/s moved" is the pace)
    tiers = [c for k, c in churns.items() if k.startswith("tier")]
    period = 2 * nbytes / (statistics.median(c["migrated_GBps_meanwhile"] for c in tiers) * 1e9)
    held = statistics.median(c["churn_host_ms_per_cycle"] for c in tiers) / 1e3
    idx = torch.tensor(mine, dtype=torch.int64, device=DEVICE)
    buf = torch.empty(len(mine), tier.block_bytes, dtype=torch.uint8, device=DEVICE)
    piece = max(1, transfer.COPY_BYTES // tier.block_bytes)

    def rest_of_period(t0):
        left = period - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)

    def gathers_cycle(stream):  # the device side alone: a cycle's gathers and scatters
        t0 = time.perf_counter()
        for a in range(0, len(mine), piece):
            transfer.gather(tier._views, idx[a : a + piece], out=buf[a : a + piece])
        for a in range(0, len(mine), piece):
            transfer.scatter(tier._views, idx[a : a + piece], buf[a : a + piece])
        t = time.perf_counter()
        if stream is not None:
            stream.synchronize()
        rest_of_period(t0)
        return time.perf_counter() - t

    def python_cycle(stream):  # the host side alone: pure Python for the tier's host time,
        t0 = time.perf_counter()  # the interpreter lock let go 140 times (its torch calls)
        for _ in range(140):
            end = time.perf_counter() + held / 140
            while time.perf_counter() < end:
                pass
            time.sleep(0)
        t = time.perf_counter()
        rest_of_period(t0)
        return time.perf_counter() - t

    churns["the tier cycle's gathers and scatters alone"] = busy(gathers_cycle, alone_k)
    churns[f"pure Python, {held * 1e3:.1f} ms a cycle"] = busy(python_cycle, alone_k)
    for name, c in churns.items():
        say(
            f"TPOT {c['alone_ms']:.2f} ms alone, {c['tpot_migrating_ms']:.2f} ms while migrating "
            f"({name}: {c['migrated_GBps_meanwhile']:.1f} GB/s moved meanwhile, "
            f"{c['churn_host_ms_per_cycle']:.2f} ms host time, {c['churn_cpu_ms_per_cycle']:.2f}"
            f" ms CPU a cycle): {100 * c['rise']:+.1f} %"
        )
    worst = {}
    for name, c in churns.items():
        kind = name.split(", round")[0]
        worst.setdefault(kind, []).append(c["rise"])
    spread = {kind: dict(median=statistics.median(r), worst=max(r), rises=r)
              for kind, r in worst.items()}  # fmt: skip
    for kind, s in spread.items():
        say(f"{kind}: rise median {100 * s['median']:+.1f} %, worst {100 * s['worst']:+.1f} % "
            f"over {len(s['rises'])} round(s)")  # fmt: skip
    first = churns[f"tier, {WAYS[0][0]}, round 1"]  # the default's first round: the summary
    return dict(batch=b, prompt=p, new=n, tpot_ms=alone * 1e3, **first, churns=churns,
                spread=spread)  # fmt: skip


def _slow_path(pool, kind: str, n: int) -> dict:
    import tempfile

    bb = pool.block_bytes()
    if kind == "disk":
        tier = pool.cpu_tier(n * bb, tempfile.gettempdir(), 4 * n * bb)
    else:
        tier = pool.cpu_tier(2 * n * bb, fp8_lowering=True)
    with pool.lock:
        blocks = pool.manager.allocate(n)
    idx = torch.tensor(blocks, device=pool.key.device)
    for cache in (*pool.storage.k, *pool.storage.v):  # only these blocks' pages are mapped
        cache.index_copy_(
            0, idx, torch.randn(n, *cache.shape[1:], device=idx.device).to(cache.dtype)
        )
    for _ in range(2):  # the second round is timed (the first pins, compiles, warms)
        before = tier.stats()
        held = tier.down(blocks)  # the CPU rows full (disk) / past the pressure mark (fp8)
        moved, t = timed(lambda held=held: tier.down(blocks, low_priority=True))
        _, t_back = timed(lambda held=held: tier.up(held, blocks))  # disk: rows on disk now
        tier.release(held + moved)
    st = {k: v - before.get(k, 0) if isinstance(v, int) else v for k, v in tier.stats().items()}
    row = dict(
        blocks=n,
        MiB=n * bb / MIB,
        down_GBps=n * bb / t / 1e9,
        up_GBps=n * bb / t_back / 1e9,
        to_disk_MiB=st["bytes_to_disk"] / MIB,
        from_disk_MiB=st["bytes_from_disk"] / MIB,
        lowered_blocks=st["lowered_blocks"],
    )
    say(f"{kind}: " + " ".join(f"{a}={b:.1f}" if isinstance(b, float) else f"{a}={b}"
                               for a, b in row.items()))  # fmt: skip
    with pool.lock:
        pool.manager.decref(blocks)
    return row


def disk_lowering() -> dict:
    """The slow paths' throughput: moves that spill CPU rows to the disk tier and read them back
    (buffered file I/O in $TMPDIR: the page cache takes the writes), and moves lowered to fp8.
    GB/s count the blocks' full-precision bytes."""
    import oxygen_torch
    from oxygen_torch.kv.pool import PoolKey, get_pool

    oxygen_torch.enable()
    dev = torch.device(DEVICE)
    n = 512 if not SMOKE else 16
    res = {}
    for kind in ("disk", "fp8"):
        arena = (2 if kind == "disk" else 3) * GIB  # another pool: a pool makes its tier once
        pool = get_pool(PoolKey(dev, 16, 8, 64, torch.bfloat16, 16, "auto", arena, 2 * MIB))
        res[kind] = _slow_path(pool, kind, n)
    return res


# --- capacity -------------------------------------------------------------------------------


def capacity(mode: str) -> dict:
    batch = CAP[mode] if not SMOKE else {"oxygen_tier": 4 * GPU_BATCH}.get(mode, GPU_BATCH)
    kw: dict = {}
    reserved = 0
    if mode.startswith("oxygen"):
        arena = kv_arena_bytes(GPU_BATCH, CAP_P + CAP_N)
        reserved = arena
        # a preempted row group's KV (groups need at most half the pool: kv.oversubscribe)
        tier = kv_arena_bytes(GPU_BATCH // 2 + 8, CAP_P + CAP_N) if mode == "oxygen_tier" else 0
        oxygen_capped(kv={"arena_bytes": arena}, pool={"cpu_tier_bytes": tier})
    elif mode == "hf_offloaded":
        kw["cache_implementation"] = "offloaded"
    model = build_model()
    cap_torch(reserved)
    ids = prompts(batch, CAP_P)
    res = dict(mode=mode, batch=batch, prompt=CAP_P, new=CAP_N)
    try:
        with torch.no_grad():
            out, dt = timed(
                lambda: model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=CAP_N,
                    min_new_tokens=CAP_N,
                    do_sample=False,
                    **kw,
                )
            )
        res.update(
            ok=True,
            seconds=dt,
            tok_per_s=batch * CAP_N / dt,
            first_tokens=out[:4, CAP_P : CAP_P + 8].tolist(),
        )
        if mode.startswith("oxygen"):
            res["tier"] = tier_stats()
            res["oversubscribed"] = _oversub_stats()
    except torch.OutOfMemoryError as exc:
        res.update(ok=False, error="OOM: " + str(exc).splitlines()[0][:160])
    say(f"{mode} B={batch}: {res.get('tok_per_s', 0):.0f} tok/s {res.get('error', '')}")
    return res


def _oversub_stats() -> list:
    """Per KV pool: calls split into row groups and groups run (kv.oversubscribe)."""
    from oxygen_torch.kv import pool_stats

    return [p.get("oversubscribed") for p in pool_stats()]


# --- prefix cache -------------------------------------------------------------------------------


def demote_all() -> int:
    """Moves every cached block only the prefix cache holds down to the CPU tier."""
    from oxygen_torch.kv.pool import _pools, _pools_lock

    with _pools_lock:
        pools = list(_pools.values())
    moved = 0
    for p in pools:
        with p.lock:
            if p.prefix is not None:
                moved += p.prefix.demote(p.prefix.num_hot)
    return moved


def _prefix_counts() -> dict | None:
    """The prefix cache's figures (kv_stats()' prefix_cache), None when it is off."""
    from oxygen_torch.kv import pool_stats

    return next((p["prefix_cache"] for p in pool_stats() if p["prefix_cache"]), None)


def prefix(mode: str) -> dict:
    """TTFT of the 64 user turns after the shared system prompt: a miss (no cache), a GPU hit, a
    CPU-tier hit (everything demoted first); prefix_floor: the user turn alone, no system prompt
    and no cache, the forward any hit still runs and generate()'s own cost: no hit can beat it,
    so miss / floor bounds the ratio a hit can reach."""
    import oxygen_torch

    floor = mode == "prefix_floor"
    on = mode not in ("prefix_miss", "prefix_floor")
    tier = 4 * GIB if mode == "prefix_cpu" else 0
    oxygen_torch.enable(
        kv={"prefix_cache": on, "prefix_cache_bytes": 4 * GIB}, pool={"cpu_tier_bytes": tier}
    )
    model = build_model()
    system = prompts(1, SYSTEM, seed=7)
    users = [prompts(1, USER, seed=100 + i) for i in range(REQUESTS)]

    def ttft(ids):
        with torch.no_grad():
            return timed(
                lambda: model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False
                )
            )

    ttft(torch.cat([system, prompts(1, USER, seed=99)], 1))  # warm; fills the cache (on)
    times, tokens = [], []
    for u in users:
        if mode == "prefix_cpu":
            demote_all()
        out, dt = ttft(u if floor else torch.cat([system, u], 1))
        times.append(dt)
        tokens.append(int(out[0, -1]))
    res = dict(
        mode=mode,
        requests=REQUESTS,
        ttft_ms=statistics.median(times) * 1e3,
        ttft_ms_worst=max(times) * 1e3,
        tokens=tokens,
    )
    # the chat: each turn's prompt is the whole conversation so far plus a new user turn
    conv, chat = system, []
    for t in range(TURNS if not floor else 0):
        conv = torch.cat([conv, prompts(1, USER, seed=500 + t)], 1)
        if mode == "prefix_cpu":
            demote_all()
        with torch.no_grad():
            out, dt = timed(
                lambda c=conv: model.generate(
                    c, attention_mask=torch.ones_like(c), max_new_tokens=32, do_sample=False
                )
            )
        chat.append(dt)
        conv = out
    res["chat_turn_ms"] = [c * 1e3 for c in chat]
    res["prefix_cache"] = _prefix_counts()
    res["tier"] = tier_stats()
    say(
        f"{mode}: TTFT median {res['ttft_ms']:.1f} ms, worst {res['ttft_ms_worst']:.1f} ms; "
        f"chat turns {', '.join(f'{c:.0f}' for c in res['chat_turn_ms'])} ms"
    )
    return res


def _burst(model, inputs: list[torch.Tensor]) -> tuple[list[float], float, list[int]]:
    """Each prompt generate(max_new_tokens=1)'d by a thread of its own, all released by one
    barrier. Returns each call's TTFT (the barrier to its token on the host), the burst's wall
    time (the first release to the last return) and each call's token."""
    n = len(inputs)
    barrier, errors = threading.Barrier(n), []
    starts, ends, tokens = [0.0] * n, [0.0] * n, [0] * n
    masks = [torch.ones_like(p) for p in inputs]

    def call(i: int) -> None:
        barrier.wait()
        starts[i] = time.perf_counter()
        try:
            with torch.no_grad():
                out = model.generate(
                    inputs[i], attention_mask=masks[i], max_new_tokens=1, do_sample=False
                )
            tokens[i] = int(out[0, -1])  # (on the host: the call's device work is done)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            errors.append(exc)
        ends[i] = time.perf_counter()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return [e - s for s, e in zip(starts, ends)], max(ends) - min(starts), tokens


def _step_stats(model) -> tuple[int, int, list[int]]:
    """(merged steps, tokens they computed, sequences per step) of `model`'s step schedulers."""
    from oxygen_torch.integrations.hf import batched

    stats = [m.scheduler.stats for m in batched._mergers.get(model, {}).values()]
    sizes = [b for s in stats for b in s.batch_sizes]
    return sum(s.steps for s in stats), sum(s.tokens for s in stats), sizes


def prefix_concurrent(mode: str) -> dict:
    """The 64 user turns arriving together (a serving load): 64 threads call generate(system +
    turn, max_new_tokens=1) at once and the engine merges their forwards step by step (at most
    scheduler.max_step_tokens a step). _miss: the prefix cache off; the hit modes first warm it
    with one call holding the system prompt (_cpu: every cached block demoted to the CPU tier
    before the burst). A burst of other turns warms the merged paths first. That every call
    started on the cache is checked twice: the burst's prefix-cache hits (one per call), and the
    tokens the model's embedding saw (each turn's 100, not the system prompt's 2,000)."""
    import oxygen_torch

    on = mode != "prefix_concurrent_miss"
    tier = 4 * GIB if mode == "prefix_concurrent_cpu" else 0
    oxygen_torch.enable(
        kv={"prefix_cache": on, "prefix_cache_bytes": 4 * GIB}, pool={"cpu_tier_bytes": tier}
    )
    model = build_model()
    embedded: list[int] = []  # (list.append: atomic across the calling threads)
    model.model.embed_tokens.register_forward_hook(lambda m, a, o: embedded.append(a[0].numel()))
    system = prompts(1, SYSTEM, seed=7)

    def turns(seed: int) -> list[torch.Tensor]:
        return [torch.cat([system, prompts(1, USER, seed=seed + i)], 1) for i in range(REQUESTS)]

    _burst(model, turns(99)[:1])  # warm; fills the cache with the system prompt (on)
    _burst(model, turns(300))  # warm: the merged steps' kernels and paths
    if mode == "prefix_concurrent_cpu":
        demote_all()
    before, steps0 = dict(_prefix_counts() or {}), _step_stats(model)
    embedded.clear()
    times, wall, tokens = _burst(model, turns(100))  # the turns prefix() runs one by one
    after, steps1 = _prefix_counts() or {}, _step_stats(model)
    sizes = steps1[2][len(steps0[2]) :]
    res = dict(
        mode=mode,
        requests=REQUESTS,
        ttft_ms=statistics.median(times) * 1e3,
        ttft_ms_worst=max(times) * 1e3,
        wall_ms=wall * 1e3,
        tokens=tokens,
        embedded=sum(embedded),
        merged_steps=steps1[0] - steps0[0],
        merged_tokens=steps1[1] - steps0[1],
        largest_step_seqs=max(sizes, default=0),
    )
    if on:
        res["burst"] = {
            k: after.get(k, 0) - before.get(k, 0)
            for k in ("hits", "misses", "hit_tokens", "gpu_hit_blocks", "cpu_hit_blocks")
        }
        # every call computed only what follows the system prompt's whole blocks
        bt = oxygen_torch.active_config().kv.block_tokens
        own = REQUESTS * (SYSTEM + USER - SYSTEM // bt * bt)
        b = res["burst"]
        res["all_hit"] = (b["hits"], b["misses"], res["embedded"]) == (REQUESTS, 0, own)
    say(
        f"{mode}: {REQUESTS} calls at once: TTFT median {res['ttft_ms']:.1f} ms, worst "
        f"{res['ttft_ms_worst']:.1f} ms, burst {res['wall_ms']:.1f} ms; {res['merged_steps']} "
        f"merged steps (largest {res['largest_step_seqs']} sequences), {res['embedded']} tokens "
        f"embedded ({REQUESTS} x {SYSTEM + USER} in the prompts)"
    )
    if on:
        say(
            f"{mode}: every call started on the prefix cache: "
            f"{'yes' if res['all_hit'] else 'NO'} (the burst's figures {res['burst']})"
        )
    return res


def prefix_profile(mode: str) -> dict:
    """Where a prefix-cache hit's TTFT goes against a miss's: torch.profiler over one of each
    (after warm-ups), the top CPU ops and CUDA kernels by self time."""
    from torch.profiler import ProfilerActivity, profile

    import oxygen_torch

    oxygen_torch.enable(kv={"prefix_cache": True, "prefix_cache_bytes": 4 * GIB})
    model = build_model()
    system = prompts(1, SYSTEM, seed=7)

    def ttft(ids):
        with torch.no_grad():
            return timed(
                lambda: model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False
                )
            )

    out = {"mode": mode}
    for i in range(3):  # warm both paths: a miss (new system prompt) and hits
        ttft(torch.cat([prompts(1, SYSTEM, seed=40 + i), prompts(1, USER, seed=50 + i)], 1))
        ttft(torch.cat([system, prompts(1, USER, seed=60 + i)], 1))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    for name, ids in (
        ("miss", torch.cat([prompts(1, SYSTEM, seed=70), prompts(1, USER)], 1)),
        ("hit", torch.cat([system, prompts(1, USER, seed=71)], 1)),
    ):
        with profile(activities=acts) as prof:
            _, dt = ttft(ids)
        key = "self_cuda_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=14)
        cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
        out[name] = dict(ttft_ms=dt * 1e3)
        say(f"profile {name}: TTFT {dt * 1e3:.1f} ms (under the profiler)\n{table}\n{cpu}")
    return out


# --- 128k context ---------------------------------------------------------------------------


class Clock:
    """A stopping criterion that never stops: it times every token generate() adds (the device
    synchronized first), so one call gives TTFT (start to first token) and the time per output
    token (the median gap between later tokens), free of a second prefill's noise."""

    def start(self) -> None:
        self.times = [time.perf_counter()]

    def __call__(self, input_ids, scores, **kw):
        sync()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def figures(self) -> tuple[float, float]:
        t = self.times
        return t[1] - t[0], statistics.median(b - a for a, b in zip(t[1:], t[2:]))


class StepClock(Clock):
    """Clock timing each token after the current stream's work (not the device's: a thread
    migrating beside it has its own streams, and a device-wide synchronize would wait for its
    moves too)."""

    def __call__(self, input_ids, scores, **kw):
        if DEVICE == "cuda":
            torch.cuda.current_stream().synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def per_token(self) -> float:
        """The mean gap between tokens after the first (the slow steps counted)."""
        t = self.times
        return (t[-1] - t[1]) / (len(t) - 2)


def long(mode: str) -> dict:
    """One 131,072-token prompt under the cap. long_window_*: a Mistral of the same shape whose
    every layer has a 4,096-token window (oxygen keeps only the window's blocks in the pool);
    long_hybrid_*: a Qwen2 of that shape whose layers have that window but every sixth, which
    sees every token (oxygen keeps every block for those, and unmaps the sliding layers' pages
    behind the window)."""
    reserved = 0
    window = WINDOW if "window" in mode or "hybrid" in mode else None
    if mode.endswith("oxygen"):
        reserved = kv_arena_bytes(1, LONG_P + LONG_N + 16)
        oxygen_capped(kv={"arena_bytes": reserved})
    model = build_model(max_pos=LONG_P + 64, window=window, hybrid="hybrid" in mode)
    cap_torch(reserved)
    ids = prompts(1, LONG_P, seed=3)
    res = dict(mode=mode, prompt=LONG_P, new=LONG_N, window=window)
    if "hybrid" in mode:
        res["full_layers"] = hybrid_types(shape()["num_hidden_layers"]).count("full_attention")

    clock = Clock()

    def gen(n, **kw):
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, **kw)  # fmt: skip

    try:
        gen(2)  # warm-up: kernels compiled, pages mapped (and a first OOM shows here)
        sync()
        clock.start()
        out = gen(LONG_N, stopping_criteria=[clock], return_dict_in_generate=True)
        kv_mapped_at_end = 0
        if mode.endswith("oxygen"):  # the finished call's cache still holds its blocks
            kv_mapped_at_end = out.past_key_values._core.pool.mapped_bytes()
        out = out.sequences
        ttft, tpot = clock.figures()
        res.update(ok=True, ttft_s=ttft, tpot_ms=tpot * 1e3, tokens=out[0, LONG_P:].tolist())
        if DEVICE == "cuda":
            res["peak_torch_GiB"] = torch.cuda.max_memory_allocated() / GIB
        if mode.endswith("oxygen"):
            from oxygen_torch.kv import pool_stats

            (p,) = [p for p in pool_stats() if p["peak_blocks_used"]]
            res.update(kv_peak_blocks=p["peak_blocks_used"],
                       kv_peak_mapped_GiB=p["peak_mapped_bytes"] / GIB,
                       window_freed_blocks=p["window_freed_blocks"],
                       window_narrowed_blocks=p["window_narrowed_blocks"],
                       kv_mapped_at_end_GiB=kv_mapped_at_end / GIB)  # fmt: skip
    except torch.OutOfMemoryError as exc:
        res.update(ok=False, error="OOM: " + str(exc).splitlines()[0][:160])
    say(f"{mode}: {res}")
    return res


# --- swap preemption and swap-ins ahead ----------------------------------------------------


def _swap_workload(seed: int) -> tuple[list[dict], list[dict]]:
    """(low calls, high calls) of one seed: generate() keywords; low prompts of the shortest
    length plus up to half of it more, drawn per call."""
    rows, lows, lp, ln, highs, hp, hn = SWAP
    g = torch.Generator().manual_seed(seed)
    low = []
    for i in range(lows):
        n = lp + int(torch.randint(0, lp // 2 + 1, (1,), generator=g))
        low.append(dict(input_ids=prompts(rows, n, seed=seed * 100 + i), max_new_tokens=ln))
    high = [
        dict(input_ids=prompts(rows, hp, seed=seed * 100 + 50 + i), max_new_tokens=hn)
        for i in range(2 * highs)
    ]
    for kw in low + high:
        kw.update(
            attention_mask=torch.ones_like(kw["input_ids"]),
            min_new_tokens=kw["max_new_tokens"],
            do_sample=False,
        )
    return low, high


def _swap_run(model, low: list[dict], high: list[dict]) -> dict:
    """The low calls from threads; each wave of high calls once the engine has taken 20 more
    steps. Returns wall seconds, every call's tokens and the step intervals."""
    import oxygen_torch
    from oxygen_torch.integrations.hf import batched

    outs: dict[int, torch.Tensor] = {}
    errors: list = []
    ends: list[float] = []

    def call(i: int, kw: dict, priority: str) -> None:
        try:
            with oxygen_torch.task(priority=priority), torch.no_grad():
                outs[i] = model.generate(**kw)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            errors.append(exc)
        ends.append(time.perf_counter())

    def scheds():
        return [m.scheduler for m in batched._mergers.get(model, {}).values()]

    def steps() -> int:
        return sum(x.stats.steps for x in scheds())

    sync()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=call, args=(i, kw, "low")) for i, kw in enumerate(low)]
    for th in threads:
        th.start()
    half = len(high) // 2
    for wave in (high[:half], high[half:]):
        start = steps()
        while steps() < start + 20 and any(th.is_alive() for th in threads):
            time.sleep(0.002)
        for kw in wave:
            threads.append(threading.Thread(target=call, args=(len(threads), kw, "high")))
            threads[-1].start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return dict(wall=max(ends) - t0, outs=[outs[i] for i in range(len(threads))])


def swap(mode: str) -> dict:
    """Each seed's workload twice in one process, in turn: its swap-ins waited for in the step
    that takes the call back (as kv.prefetch_distance 0: the runner's fetch starts nothing) and
    started ahead (4), after one warm run of the seed's workload. Every merged step is timed to the
    end of its GPU work (the device synchronized after it; generate() reads each step's tokens
    anyway) and tagged when a swap-in ran during it: inside it (waited for) or beside it (ahead,
    the call sitting out)."""
    import oxygen_torch
    from oxygen_torch.integrations.hf import batched

    rows, lows, lp, ln, highs, hp, hn = SWAP
    arena = kv_arena_bytes(SWAP_FIT * rows, lp + lp // 2 + ln)
    kv = {"arena_bytes": arena, "prefetch_distance": 4}
    if SMOKE:  # blocks of 256 tokens, one 2 MiB page a region: 15 blocks, a row's prompt each
        kv.update(arena_bytes=2 * shape()["num_hidden_layers"] * 2 * MIB, block_tokens=256)
        arena = kv["arena_bytes"]
    oxygen_torch.enable(
        kv=kv,
        pool={"cpu_tier_bytes": 4 * GIB if not SMOKE else 64 * MIB},
    )
    model = build_model()
    fetch, run = batched.Merger.fetch, batched.Merger.run
    way = {"ahead": True}
    steps: list[tuple[float, bool, int]] = []  # (seconds, a swap-in ran during it, rows)

    def fetch_either(self, call):
        return fetch(self, call) if way["ahead"] else (False, False)

    def run_timed(self, chunks):
        inside = any(
            ch.part != "solo" and ch.request.payload.cache._core._swapped is not None
            for ch in chunks
        )
        ahead = self.scheduler.stats.swaps_ahead
        t = time.perf_counter()
        out = run(self, chunks)
        sync()
        beside = self.scheduler.stats.swaps_ahead != getattr(self, "_bench_ahead", ahead)
        self._bench_ahead = ahead
        steps.append((time.perf_counter() - t, inside or beside, sum(ch.rows for ch in chunks)))
        return out

    batched.Merger.fetch, batched.Merger.run = fetch_either, run_timed
    res = dict(mode=mode, arena_MiB=arena / MIB, seeds=[])
    for seed in SWAP_SEEDS:
        for ahead in (None, False, True):  # None: a warm run of the seed's shapes, not timed
            way["ahead"] = ahead is not False
            scheds = [m.scheduler for m in batched._mergers.get(model, {}).values()]
            before = [(x.stats.swaps, x.stats.swaps_ahead, x.stats.sat_out) for x in scheds]
            up0 = tier_stats().get("bytes_up", 0)
            steps.clear()
            low, high = _swap_workload(seed)
            got = _swap_run(model, low, high)
            scheds = [m.scheduler for m in batched._mergers.get(model, {}).values()]
            after = [(x.stats.swaps, x.stats.swaps_ahead, x.stats.sat_out) for x in scheds]
            diff = [sum(a[k] for a in after) - sum(b[k] for b in before) for k in range(3)]
            if ahead is None:
                continue  # warm: kernels for the seed's shapes, graphs, the tier's buffers
            tagged = [t for t, swap_in, _ in steps if swap_in]
            others = [t for t, swap_in, _ in steps if not swap_in]
            tokens = sum(kw["input_ids"].shape[0] * kw["max_new_tokens"] for kw in low + high)
            one = dict(
                seed=seed,
                way="ahead" if ahead else "waited",
                wall_s=got["wall"],
                tok_per_s=tokens / got["wall"],
                steps=len(steps),
                rows_per_step=statistics.mean(r for _, _, r in steps) if steps else 0.0,
                step_ms=1e3 * statistics.median(others) if others else 0.0,
                swap_step_ms=1e3 * statistics.median(tagged) if tagged else 0.0,
                swap_steps=len(tagged),
                swaps=diff[0],
                swaps_ahead=diff[1],
                sat_out=diff[2],
                up_MiB=(tier_stats().get("bytes_up", 0) - up0) / MIB,
                last_tokens=[o[:, -4:].tolist() for o in got["outs"]],
            )
            res["seeds"].append(one)
            say(
                f"swap seed {seed}, swap-ins {one['way']}: {one['wall_s']:.2f} s, "
                f"{one['tok_per_s']:.0f} tok/s, {one['steps']} steps of "
                f"{one['rows_per_step']:.1f} rows on average (median {one['step_ms']:.2f}"
                f" ms; {one['swap_steps']} with a swap-in, median {one['swap_step_ms']:.2f} ms), "
                f"{one['swaps']} swaps ({one['swaps_ahead']} ahead, {one['sat_out']} steps sat "
                f"out), {one['up_MiB']:.0f} MiB up"
            )
    return res


# --- driver -------------------------------------------------------------------------------


def run_mode(mode: str) -> dict:
    try:
        if mode == "migration":
            return {"mode": mode, **migration()}
        if mode == "disk_lowering":
            return {"mode": mode, **disk_lowering()}
        if mode in PARTS["capacity"]:
            return capacity(mode)
        if mode in CONCURRENT:
            return prefix_concurrent(mode)
        if mode in PARTS["prefix"]:
            return prefix(mode)
        if mode == "prefix_profile":
            return prefix_profile(mode)
        if mode in PARTS["swap"]:
            return swap(mode)
        return long(mode)
    except Exception:
        return {"mode": mode, "error": traceback.format_exc()[-2000:]}


def spawn(mode: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--run", mode]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    limit = TIMEOUT_S.get(mode, 180)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        sys.stdout.write("".join(ln + "\n" for ln in out.splitlines() if ln.startswith("#")))
        return {"mode": mode, "error": f"timed out after {limit} s"}
    sys.stdout.write("".join(ln + "\n" for ln in proc.stdout.splitlines() if ln.startswith("#")))
    if os.environ.get("OUT") and proc.returncode:
        with open(os.path.join(os.environ["OUT"], f"bench_tier_{mode}.stderr.txt"), "w") as f:
            f.write(proc.stderr[-200_000:])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"mode": mode, "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    return json.loads(lines[-1])


def table(r: dict) -> str:
    out = []
    m = r.get("migration")
    if m and "rows" in m:
        out += [
            "| blocks | MiB | down GB/s | up GB/s | pinned d2h | pinned h2d | 256 KiB one by one |"
            " down / peak | up / peak |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for x in m["rows"]:
            out.append(
                f"| {x['blocks']} | {x['MiB']:.0f} | {x['down_GBps']:.1f} | {x['up_GBps']:.1f}"
                f" | {x['pinned_d2h_GBps']:.1f} | {x['pinned_h2d_GBps']:.1f} | "
                f"{x['per_256KiB_d2h_GBps']:.1f} | {x['down_GBps'] / x['pinned_d2h_GBps']:.2f}"
                f" | {x['up_GBps'] / x['pinned_h2d_GBps']:.2f} |"
            )
        if m.get("pieces"):
            out += [
                "",
                "| one move in | blocks | down GB/s | up GB/s |",
                "|---|---|---|---|",
            ]
            for x in m["pieces"]:
                out.append(
                    f"| {x['down']} | {x['blocks']} | {x['down_GBps']:.1f} | {x['up_GBps']:.1f} |"
                )
        t = m.get("tpot")
        if t:
            out += [
                "",
                f"TPOT (B={t['batch']}, P={t['prompt']}): {t['tpot_ms']:.2f} ms alone, "
                f"{t['tpot_migrating_ms']:.2f} ms while migrating "
                f"({t['migrated_GBps_meanwhile']:.1f} GB/s): {100 * t['rise']:+.1f} %",
            ]
            if "churns" in t:
                out += ["", "| churn | TPOT ms alone | TPOT ms | rise | GB/s moved | churn host "
                        "ms a cycle | churn CPU ms a cycle |",
                        "|---|---|---|---|---|---|---|"]  # fmt: skip
                for name, c in t["churns"].items():
                    out.append(
                        f"| {name} | {c.get('alone_ms', t['tpot_ms']):.2f} | "
                        f"{c['tpot_migrating_ms']:.2f} | {100 * c['rise']:+.1f} % | "
                        f"{c['migrated_GBps_meanwhile']:.1f} | {c['churn_host_ms_per_cycle']:.2f} "
                        f"| {c.get('churn_cpu_ms_per_cycle', 0):.2f} |"
                    )
            if "spread" in t:
                out += ["", "| churn | rounds | rise median | rise worst |", "|---|---|---|---|"]
                for kind, s in t["spread"].items():
                    out.append(f"| {kind} | {len(s['rises'])} | {100 * s['median']:+.1f} % | "
                               f"{100 * s['worst']:+.1f} % |")  # fmt: skip
    elif m:
        out.append(f"migration: error {m.get('error', '')[-300:]}")
    d = r.get("disk_lowering")
    if d and "disk" in d:
        out += [
            "",
            "| slow path | blocks | MiB | down GB/s | up GB/s | to disk MiB | from disk MiB | "
            "lowered |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for kind in ("disk", "fp8"):
            x = d[kind]
            out.append(
                f"| {kind} | {x['blocks']} | {x['MiB']:.0f} | {x['down_GBps']:.1f} | "
                f"{x['up_GBps']:.1f} | {x['to_disk_MiB']:.0f} | {x['from_disk_MiB']:.0f} | "
                f"{x['lowered_blocks']} |"
            )
    elif d:
        out.append(f"disk_lowering: error {d.get('error', '')[-300:]}")
    cap = [r[k] for k in PARTS["capacity"] if k in r]
    if cap:
        base = r.get("oxygen_gpu", {}).get("tok_per_s")
        out += [
            "",
            "| capacity (P=4096, N=256, 24 GiB) | batch | completes | tok/s | vs oxygen GPU-only |",
            "|---|---|---|---|---|",
        ]
        for x in cap:
            ok = x.get("ok")
            tps = x.get("tok_per_s")
            ratio = f"{tps / base:.2f}x" if tps and base else "-"
            err = x.get("error", "").strip().splitlines()[-1][:80] if not ok else ""
            out.append(
                f"| {x['mode']} | {x.get('batch', '')} | {'yes' if ok else 'no: ' + err} | "
                f"{tps or 0:.0f} | {ratio} |"
            )
    pre = [r[k] for k in PARTS["prefix"] if k in r and k not in CONCURRENT]
    if pre:
        miss = r.get("prefix_miss", {}).get("ttft_ms")
        out += [
            "",
            "| prefix (2,000-token system + 100-token turn) | TTFT median ms | worst | "
            "miss / this | chat turns ms | hit blocks GPU / CPU tier | hot-zone hit ratio | "
            "last tokens = miss |",
            "|---|---|---|---|---|---|---|---|",
        ]
        want = r.get("prefix_miss", {}).get("tokens")
        for x in pre:
            if "error" in x:
                out.append(
                    f"| {x['mode']} | error: {x['error'].strip().splitlines()[-1][:80]} |||||||"
                )
                continue
            ratio = f"{miss / x['ttft_ms']:.1f}x" if miss else "-"
            turns = ", ".join(f"{c:.0f}" for c in x["chat_turn_ms"])
            pc = x.get("prefix_cache") or {}
            hits = f"{pc.get('gpu_hit_blocks', 0)} / {pc.get('cpu_hit_blocks', 0)}" if pc else "-"
            hot = pc.get("hot_zone_hit_ratio")
            hot = f"{hot:.3f}" if hot is not None else "-"
            same = "-"
            if want and x["mode"] != "prefix_floor":  # (the floor's prompts are others)
                same = f"{sum(a == b for a, b in zip(x['tokens'], want))}/{len(want)}"
            out.append(
                f"| {x['mode']} | {x['ttft_ms']:.1f} | {x['ttft_ms_worst']:.1f} | {ratio} | "
                f"{turns} | {hits} | {hot} | {same} |"
            )
    out += _concurrent_table(r)
    out += _swap_table(r)
    lg = [r[k] for k in PARTS["long"] if k in r]
    if lg:
        out += [
            "",
            "| 131,072-token prompt, 24 GiB | fits | TTFT s | TPOT ms | peak torch GiB |"
            " oxygen KV: peak blocks, peak mapped GiB, mapped GiB at the end, blocks freed /"
            " narrowed behind the window |",
            "|---|---|---|---|---|---|",
        ]
        for x in lg:
            if x.get("ok"):
                kv = "-"
                if "kv_peak_blocks" in x:
                    kv = (f"{x['kv_peak_blocks']}, {x['kv_peak_mapped_GiB']:.2f}, "
                          f"{x.get('kv_mapped_at_end_GiB', 0):.2f}, {x['window_freed_blocks']} / "
                          f"{x.get('window_narrowed_blocks', 0)}")  # fmt: skip
                out.append(
                    f"| {x['mode']} | yes | {x['ttft_s']:.2f} | {x['tpot_ms']:.2f} | "
                    f"{x.get('peak_torch_GiB', 0):.1f} | {kv} |"
                )
            else:
                err = x.get("error", "").strip().splitlines()[-1][:100]
                out.append(f"| {x['mode']} | no: {err} | | | | |")
    return "\n".join(out)


def _swap_table(r: dict) -> list[str]:
    """Swap-ins waited for against started ahead, seed by seed (the worst seed's ratio last)."""
    rows = r.get("swap", {}).get("seeds")
    if not rows:
        return []
    out = [
        "",
        "| swap workload | seed | swap-ins | wall s | tok/s | steps (rows a step) | step ms, "
        "median | steps with a swap-in: n, median ms | swaps | swapped in ahead | steps sat out "
        "| MiB up |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        out.append(
            f"| swap | {x['seed']} | {x['way']} | {x['wall_s']:.2f} | {x['tok_per_s']:.0f} | "
            f"{x['steps']} ({x.get('rows_per_step', 0):.1f}) | {x['step_ms']:.2f} | "
            f"{x['swap_steps']}, {x['swap_step_ms']:.2f} | "
            f"{x['swaps']} | {x['swaps_ahead']} | {x['sat_out']} | {x['up_MiB']:.0f} |"
        )
    pairs = [(w, a) for w, a in zip(rows[::2], rows[1::2])]
    if pairs:
        ratios = [a["tok_per_s"] / w["tok_per_s"] for w, a in pairs]
        same = [
            sum(x == y for x, y in zip(w["last_tokens"], a["last_tokens"])) / len(w["last_tokens"])
            for w, a in pairs
        ]
        out += [
            "",
            f"ahead / waited tok/s by seed: {', '.join(f'{q:.3f}' for q in ratios)} (worst "
            f"{min(ratios):.3f}); calls whose last 4 tokens agree: "
            f"{', '.join(f'{q:.2f}' for q in same)}",
        ]
    return out


def _concurrent_table(r: dict) -> list[str]:
    """The bursts of concurrent calls (CONCURRENT), each against the burst of misses."""
    rows = [r[k] for k in CONCURRENT if k in r]
    if not rows:
        return []
    miss = r.get("prefix_concurrent_miss", {})
    out = [
        "",
        f"| prefix, {rows[0].get('requests', REQUESTS)} calls at once | TTFT median ms | worst | "
        "burst ms | miss / this: median, burst | tokens embedded | merged steps (largest) | "
        "prefix hits / misses in the burst | last tokens = miss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        if "error" in x:
            out.append(
                f"| {x['mode']} | error: {x['error'].strip().splitlines()[-1][:80]} ||||||||"
            )
            continue
        ratio = "-"
        if "ttft_ms" in miss:
            ratio = f"{miss['ttft_ms'] / x['ttft_ms']:.1f}x, {miss['wall_ms'] / x['wall_ms']:.1f}x"
        hits = "-"
        if x.get("burst"):
            b = x["burst"]
            hits = f"{b['hits']} / {b['misses']}" + ("" if x["all_hit"] else " (NOT every call)")
        same = "-"
        if miss.get("tokens"):
            same = (
                f"{sum(a == b for a, b in zip(x['tokens'], miss['tokens']))}/{len(miss['tokens'])}"
            )
        out.append(
            f"| {x['mode']} | {x['ttft_ms']:.1f} | {x['ttft_ms_worst']:.1f} | {x['wall_ms']:.1f} | "
            f"{ratio} | {x['embedded']} | {x['merged_steps']} ({x['largest_step_seqs']}) | "
            f"{hits} | {same} |"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--parts",
        nargs="*",
        default=[p for p in PARTS if p != "profile"],
        choices=list(PARTS),
        help="parts to run (default: all but profile)",
    )
    ap.add_argument(
        "--modes",
        nargs="*",
        help="modes to run instead of whole parts: "
        + ", ".join(m for modes in PARTS.values() for m in modes),
    )
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: the plumbing only")
    args = ap.parse_args()
    if args.smoke:
        os.environ["BENCH_TIER_SMOKE"] = "1"
        if not SMOKE:  # re-exec so the module-level sizes follow
            os.execv(sys.executable, [sys.executable, *sys.argv])
    if args.run:
        print(json.dumps(run_mode(args.run), default=str), flush=True)
        return
    modes = args.modes or [m for p in args.parts for m in PARTS[p]]
    results = {}
    for mode in modes:
        say(f"--- {mode}")
        results[mode] = spawn(mode)
        if "error" in results[mode]:
            say(f"{mode}: {results[mode]['error'][-600:]}")
    md = table(results)
    print(md)
    if os.environ.get("OUT"):
        name = "bench_tier" + (f"_{args.modes[0]}" if args.modes else "")
        with open(os.path.join(os.environ["OUT"], f"{name}.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(os.environ["OUT"], f"{name}.md"), "w") as f:
            f.write(md + "\n")


if __name__ == "__main__":
    main()
