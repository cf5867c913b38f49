"""The prefix cache's host cost when many calls end together past its budget (CPU, host pool).

    python benchmarks/prefix_inserts.py [--rounds 4] [--calls 64] [--blocks 29] [--budget 512]

Each round, `calls` sequences of `blocks` fresh blocks of random tokens end together and go into
the cache, whose budget holds `budget` blocks, with a CPU tier of 4,000 slots behind it (what
goes past the budget moves down): alternately one `insert` (and zone sweep) a sequence, as the
engine did before, and one `insert_many` for all of them, as it does now (the rows that end at
one step). Prints each way's milliseconds a round, their ratio, and what the pool's
`num_available` (the engine asks it every step: the cache's reclaimable blocks) costs at the
end. The shape of the H200 run that cost 3.9-6.5 s after the last step (64 calls of ~450
tokens, 256 MiB = 512 blocks of a 1B shape); the figures of the fix: benchmarks/history.md,
twenty-seventh session.
"""

from __future__ import annotations

import argparse
import time

import torch

from oxygen_torch.kv.pool import PoolKey, get_pool, release_pools

MiB = 1 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=64)
    p.add_argument("--blocks", type=int, default=29)
    p.add_argument("--budget", type=int, default=512)
    args = p.parse_args()
    bt = 16
    key = PoolKey(torch.device("cpu"), 2, 2, 64, torch.float32, bt, "auto", 256 * MiB, 2 * MiB)
    pool = get_pool(key)
    pool.cpu_tier(4000 * pool.block_bytes())
    pc = pool.prefix_cache(8 * MiB)
    pc.budget = args.budget
    gen = torch.Generator().manual_seed(0)
    took = {"one by one": [], "insert_many": []}
    for i in range(2 * args.rounds):
        way = "one by one" if i % 2 == 0 else "insert_many"
        with pool.lock:
            seqs = [(torch.randint(1, 30000, (args.blocks * bt,), generator=gen).tolist(),
                     pool.manager.allocate(args.blocks)) for _ in range(args.calls)]  # fmt: skip
        t0 = time.perf_counter()
        with pool.lock:
            if way == "one by one":
                for tokens, blocks in seqs:
                    pc.insert("ns", tokens, blocks)
                    pc.sweep()
            else:
                pc.insert_many([("ns", tokens, blocks) for tokens, blocks in seqs])
                pc.sweep()
            for _, blocks in seqs:
                pool.manager.decref(blocks)  # the calls ended: only the cache holds them
        took[way].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(50):
        pool.manager.num_available  # noqa: B018 - timed
    avail = (time.perf_counter() - t0) / 50
    ms = {way: 1e3 * sum(t) / len(t) for way, t in took.items()}
    print(f"{args.calls} calls x {args.blocks} blocks a round into a {args.budget}-block cache "
          f"(nodes at the end {len(pc)}, hot {pc.num_hot}), {args.rounds} rounds each way: "
          f"insert_many {ms['insert_many']:.1f} ms a round, one insert a call (the anchor) "
          f"{ms['one by one']:.1f} ms: {ms['insert_many'] / ms['one by one']:.2f}x; "
          f"num_available {1e6 * avail:.0f} µs")  # fmt: skip
    with pool.lock:
        pc.clear()
    release_pools()


if __name__ == "__main__":
    main()
