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
rows of prompts): every smaller step with prompt tokens replays one of them.

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
    gen = getattr(model, "generation_config", None)
    token = getattr(gen, "pad_token_id", None)
    if not isinstance(token, int) or not 0 <= token < runner.vocab:
        token = 0
    device = next(model.parameters()).device

    def run(n: int, tokens: int) -> None:
        """One greedy call of n rows of `tokens` tokens, two new tokens each, on the engine."""
        ids = torch.full((n, tokens), token, dtype=torch.long, device=device)
        steps = eng.snapshot()["steps"]
        with front._reasons_lock:
            reasons = dict(front.REASONS)
        with torch.no_grad():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2,
                do_sample=False, pad_token_id=token,
            )  # fmt: skip
        if eng.snapshot()["steps"] == steps:  # it ran its own loop: nothing of the engine's
            with front._reasons_lock:
                why = [r for r, k in front.REASONS.items() if k > reasons.get(r, 0)]
            raise RuntimeError(
                "warm_up: generate() on this model runs on the per-call path, not the engine "
                f"({'; '.join(why) or 'another engine of it'}): there is nothing to warm up"
            )

    t0 = time.perf_counter()
    # kv.mixed_graphs, first: a step with prompt tokens a tokens bucket, with the most rows such
    # a step can have (each real row one token at least, one at least two): every smaller step
    # of that bucket (the prefills of the calls below among them) replays it until its own
    # signature has been asked for often enough
    mixed = []
    top_tokens = cfg.kv.mixed_graphs if replays else 0
    t = mixed_graphs.TOKENS_MIN
    while top_tokens and t <= mixed_graphs.token_bucket(top_tokens):
        n = min(t, rows + 1) - 1
        per = max(1, min(t // n, top_tokens // n))
        if n * per > 1:
            run(n, per)
            mixed.append((mixed_graphs.token_bucket(n * per), mixed_graphs.rows_bucket(n)))
        t *= 2
    done = []
    for b in sizes:
        # (a limit between two buckets: its steps of `limit` rows replay the larger one)
        run(min(b, limit), 1)
        done.append(b)
    return {
        "decode_graphs": replays,
        "rows_buckets": done,
        "captured": runner.graphs.captures - before,
        "graphs": len(runner.graphs.graphs),
        "mixed_buckets": mixed,
        "mixed_captured": runner.mixed.captures - mixed_before,
        "max_length": length,
        "table_blocks": width,
        "seconds": round(time.perf_counter() - t0, 3),
    }
