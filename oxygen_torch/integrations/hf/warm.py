"""oxygen_torch.warm_up(model): the engine's first-use costs paid before the traffic comes.

The engine replays its decode steps from CUDA graphs, one per (rows bucket, table width): the
first step of a bucket the engine had not seen captured one, 130-430 ms on the H100 in the
arrival trace of benchmarks/bench_multitask.py, and every row of the engine waited through it
(the high class's slowest tokens and first tokens). warm_up() runs one short greedy generate()
per rows bucket up to `max_rows`, each a prefill step and a decode step of that many rows, so
every bucket is captured (and the forward compiled) before the first real call, as vLLM and
SGLang capture theirs at startup. Where there are no decode graphs (kv.decode_graphs off, a
CPU without kv.cpu_decode_graphs) it runs one and two rows only: the KV pool is made and the
first calls' costs are paid. With kv.mixed_graphs it first captures, for each tokens bucket up
to that setting, the mixed-step graph of the most rows such a step has (one call of that many
rows of prompts): every smaller step with prompt tokens replays one of them. With
kv.prefill_compile, a prompt one token past kv.mixed_graphs runs the compiled forward the longer
steps run (the graphs' compile: batched._symbolic), if no step before did. And
it makes the KV pool's CPU tier (pool.cpu_tier_bytes: the engine swaps preempted rows there),
which on a GPU pins that much host memory (~0.3 s a GiB): the engine would otherwise make it at
its first preemption, beside its steps, recomputing the rows it preempts until it is made. On a
GPU it also compiles the tier's mapped-move kernel and captures the graphs of moves down of up
to a row's blocks at `max_length` (the engine's swaps beside its steps): the first swap compiled
it in the loaded trace on the H200, a 124 ms choosing of a step every running call waited on.

The graphs' block tables are as wide as `max_length` tokens need (HFRunner.widen_graphs): a
later step of any sequence up to that length replays its rows bucket's graph instead of
capturing one for a wider table. A table that wide costs each replayed step its copy: rows x
width int32 in one pinned copy (256 rows of 8,192 tokens in 16-token blocks: 512 KiB), hence
the default length's bound.
"""

from __future__ import annotations

import time

import torch

# max_length's default: the model's max_position_embeddings, at most this many tokens
DEFAULT_LENGTH = 8192


def _int(name: str, value, low: int, high: int, why: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"warm_up: {name} {value!r} is not an integer")
    if not low <= value <= high:
        raise ValueError(f"warm_up: {name} {value} is out of range; allowed: {low} to {high} {why}")
    return value


def buckets_up_to(rows: int) -> list[int]:
    """The rows buckets a decode step of 1 to `rows` rows replays (merged_graphs.bucket)."""
    from .merged_graphs import bucket

    out: list[int] = []
    n = 1
    while n <= rows:
        b = bucket(n)
        out.append(b)
        n = b + 1
    return out


def warm_up(model, *, max_rows: int | None = None, max_length: int | None = None) -> dict:
    """See the module docstring. Returns what it did: the rows buckets run, the decode graphs
    captured, the mixed steps' (tokens, rows) buckets and graphs captured, the table width, the
    seconds it took."""
    from . import engine_runner, front, graphs, mixed_graphs
    from .integration import config_of, uses_oxygen

    text = model.config.get_text_config(decoder=True)
    if not uses_oxygen(model, text):
        raise RuntimeError(
            "warm_up: this model does not attend through oxygen: call oxygen_torch.enable() "
            "before creating it, or oxygen_torch.apply(model)"
        )
    cfg = config_of(model)
    if not cfg.scheduler.engine:
        raise RuntimeError(
            "warm_up: the engine is off (scheduler.engine=false); it warms the engine's steps"
        )
    limit = cfg.scheduler.max_step_seqs
    rows = limit if max_rows is None else _int("max_rows", max_rows, 1, limit,
                                               "(scheduler.max_step_seqs)")  # fmt: skip
    positions = getattr(text, "max_position_embeddings", None)
    top = positions if isinstance(positions, int) and positions >= 2 else None
    if max_length is None:
        length = min(top or DEFAULT_LENGTH, DEFAULT_LENGTH)
    else:
        length = _int("max_length", max_length, 2, top or (1 << 31),
                      "(the model's max_position_embeddings)" if top else "")  # fmt: skip
    eng = engine_runner.engine_for(model, cfg, text)
    runner = eng.runner
    width = runner.widen_graphs(length)
    # no decode graphs (kv.decode_graphs off, a CPU without kv.cpu_decode_graphs): nothing to
    # capture; one and two rows still make the KV pool and pay the first calls' costs
    replays = graphs.usable(runner.device, runner._proto_cache)
    sizes = buckets_up_to(rows) if replays else buckets_up_to(min(rows, 2))
    before, mixed_before = runner.graphs.captures, runner.mixed.captures
    held_before = set(runner.mixed.graphs)
    gen = getattr(model, "generation_config", None)
    pad = getattr(gen, "pad_token_id", None)
    if not isinstance(pad, int) or not 0 <= pad < runner.vocab:
        pad = 0
    device = next(model.parameters()).device
    offset = [1]  # the next prompt token id: every prompt differs (no prefix-cache hit)

    def run(lengths: list[int]) -> None:
        """One greedy call of len(lengths) rows of those many prompt tokens (left-padded), two
        new tokens each, on the engine."""
        width = max(lengths)
        count = sum(lengths)
        real = torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]
        ids = torch.full((len(lengths), width), pad, dtype=torch.long)
        ids[real] = (offset[0] + torch.arange(count)) % runner.vocab
        offset[0] += count
        ids, mask = ids.to(device), real.to(device=device, dtype=torch.long)
        steps = eng.snapshot()["steps"]
        with front._reasons_lock:
            reasons = dict(front.REASONS)
        with torch.no_grad():
            model.generate(
                ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False,
                pad_token_id=pad,
            )  # fmt: skip
        if eng.snapshot()["steps"] == steps:  # it ran its own loop: nothing of the engine's
            with front._reasons_lock:
                why = [r for r, k in front.REASONS.items() if k > reasons.get(r, 0)]
            raise RuntimeError(
                "warm_up: generate() on this model runs on the per-call path, not the engine "
                f"({'; '.join(why) or 'another engine of it'}): there is nothing to warm up"
            )

    t0 = time.perf_counter()
    # each rows bucket captures its own decode graph, although the mixed pass's first calls
    # capture a larger one it could replay padded (until asked for merged_graphs.CAPTURE_AFTER
    # times: then it would capture mid-traffic)
    runner.capture_exact = True
    try:
        # kv.mixed_graphs, first and largest first (their graphs share one memory pool): a
        # step with prompt tokens a tokens bucket, `target` tokens (the bucket's top, or the
        # limit) over the most rows such a step has (every row one token at least): every
        # smaller step of that bucket (the prefills of the calls below among them) replays it
        # until its own signature has been asked for often enough. Not past the engine's step
        # budget: no step is larger
        top = min(cfg.kv.mixed_graphs, eng.step_tokens) if replays else 0
        buckets = []
        t = mixed_graphs.TOKENS_MIN
        while top and t <= mixed_graphs.token_bucket(top):
            buckets.append(t)
            t *= 2
        for t in reversed(buckets):
            target = min(t, top)
            n = min(target, rows)
            run([target // n + (i < target % n) for i in range(n)])
        for b in sizes:
            # (a limit between two buckets: its steps of `limit` rows replay the larger one)
            run([1] * min(b, limit))
        # kv.prefill_compile: the steps no graph replays (over kv.mixed_graphs tokens) run the
        # forward compiled with dynamic shapes, one compile for every token count: one prompt
        # just past the mixed graphs' limit pays it, if no step above did and one can be that
        # long (within the step budget and max_length)
        if runner._compiles_prefill() and not runner._prefill_ready:
            over = (cfg.kv.mixed_graphs + 1) if replays and cfg.kv.mixed_graphs else 16
            if over <= min(eng.step_tokens, length - 2):
                run([over])
    finally:
        runner.capture_exact = False
    # the KV pool's CPU tier (pool.cpu_tier_bytes), where the engine swaps the rows it
    # preempts: made on a GPU at the first preemption, beside the steps, and until then those
    # rows are recomputed; made here, the first preemption swaps (its pinning: ~0.3 s a GiB)
    try:
        tier = eng.kvs.pool.cpu_tier_of(cfg.pool)
    except Exception as err:  # noqa: BLE001 - the engine recomputes what it preempts instead
        from ..._patching import warn_once

        warn_once(f"oxygen_torch: warm_up could not make the KV pool's CPU tier: {err!r}; "
                  "preempted rows are recomputed instead of swapped")  # fmt: skip
        tier = None
    # and its moves down by the mapped kernel (a swap beside the steps): the kernel compiled
    # and their graphs captured for a row's blocks up to max_length, not at the first swap (on
    # the H200 that one's choosing took 124 ms, a Triton compile of 106 ms, in the loaded trace)
    tier_graphs = 0
    if tier is not None:
        with eng.kvs.pool.lock:
            tier_graphs = tier.warm_moves(width)
    mixed = sorted((k[0], k[1]) for k in set(runner.mixed.graphs) - held_before)
    return {
        "decode_graphs": replays,
        "rows_buckets": sizes,
        "captured": runner.graphs.captures - before,
        "graphs": len(runner.graphs.graphs),
        "mixed_buckets": mixed,
        "mixed_captured": runner.mixed.captures - mixed_before,
        "prefill_compiled": runner._prefill_ready,  # (kv.prefill_compile's forward, compiled)
        "cpu_tier_bytes": tier.num_slots * tier.row_bytes if tier is not None else 0,
        "tier_graphs": tier_graphs,  # (the CPU tier's mapped moves' graphs captured)
        "max_length": length,
        "table_blocks": width,
        "seconds": round(time.perf_counter() - t0, 3),
    }
