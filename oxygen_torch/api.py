"""enable() / disable(): the one line users add, and what it attaches.

enable() validates the configuration, then attaches, in order, each part of oxygen_torch (the pool
as PyTorch's allocator, the HF integration, ...). disable() detaches them in reverse order.
"""

from __future__ import annotations

import threading
from typing import Any

from . import pool
from .compile import inductor
from .config import OxygenConfig, load_config

_lock = threading.Lock()
_active: OxygenConfig | None = None


def _attach_allocator(cfg: OxygenConfig) -> None:
    pool.enable_allocator(cfg.pool)


def _detach_allocator() -> None:
    pool.disable_allocator()


def _attach_compile(cfg: OxygenConfig) -> None:
    if pool.route.installed():  # Inductor's CUDA graphs must then go through oxygen's runner
        inductor.attach()


def _detach_compile() -> None:
    inductor.detach()


def _hf_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def _attach_hf(cfg: OxygenConfig) -> None:
    # transformers is optional (the `hf` extra): without it there is no model to integrate with
    if _hf_available():
        from .integrations.hf import enable_hf

        enable_hf(cfg)


def _detach_hf() -> None:
    if _hf_available():
        from .integrations.hf import disable_hf

        disable_hf()


def _attachments():
    """(name, attach(cfg), detach()) for each part enable() switches on, in order."""
    return [
        ("allocator", _attach_allocator, _detach_allocator),
        ("compile", _attach_compile, _detach_compile),
        ("transformers", _attach_hf, _detach_hf),
    ]


def enable(**overrides: Any) -> OxygenConfig:
    """Switch oxygen_torch on (call before the first CUDA allocation). Returns the config in force.

    Keyword overrides take precedence over OXYGEN_CONF and OXYGEN_CONFIG_FILE. Calling it again
    with the same effective configuration does nothing; with a different one it raises ValueError
    naming what differs (call disable() first).
    """
    global _active
    cfg = load_config(**overrides)
    with _lock:
        if _active is not None:
            diff = _active.diff(cfg)
            if not diff:
                return _active
            what = "; ".join(f"{k}: {a!r} now, {b!r} asked" for k, (a, b) in diff.items())
            raise ValueError(
                f"oxygen_torch is already enabled with a different configuration ({what}); "
                "call oxygen_torch.disable() first"
            )
        done = []
        try:
            for name, attach, detach in _attachments():
                attach(cfg)
                done.append((name, detach))
        except BaseException:
            for _, detach in reversed(done):
                detach()
            raise
        _active = cfg
        return cfg


def disable() -> None:
    """Undo what enable() did. Safe to call when not enabled.

    A generate() call running on oxygen's paged cache meanwhile either finishes (its forwards
    were done) or raises one OxygenDisabledError (a RuntimeError naming disable()); KV pools
    that running calls hold stay until those calls end."""
    global _active
    with _lock:
        if _active is None:
            return
        for _, _, detach in reversed(_attachments()):
            detach()
        _active = None


def is_enabled() -> bool:
    return _active is not None


def active_config() -> OxygenConfig | None:
    """The configuration enable() put in force, or None."""
    return _active


def memory_stats(device: int | None = None) -> dict:
    """The pool's figures: allocated / mapped / reserved / peaks / fragmentation / maps / latency.

    With enable() on a GPU these are the global pool's (the allocator PyTorch uses); on a CPU
    machine, the host backend's. The KV tiers below the GPU are added, summed over the KV pools
    (pool.cpu_tier_bytes): `tier_cpu_used_bytes`, `tier_cpu_capacity_bytes`, and the bytes
    migrated each way, `migrated_to_cpu_bytes` / `migrated_to_gpu_bytes`."""
    out = dict(pool.memory_stats(device))
    out.update(_tier_figures())
    return out


def _tier_figures() -> dict:
    from .kv import pool_stats

    tiers = [p["cpu_tier"] for p in pool_stats() if p.get("cpu_tier")]
    return {
        "tier_cpu_used_bytes": sum(t["used_bytes"] for t in tiers),
        "tier_cpu_capacity_bytes": sum(t["capacity_bytes"] for t in tiers),
        "migrated_to_cpu_bytes": sum(t["bytes_down"] for t in tiers),
        "migrated_to_gpu_bytes": sum(t["bytes_up"] for t in tiers),
    }


def kv_stats() -> list[dict]:
    """One dict per KV pool (device, model geometry): blocks used / total, peak blocks, mapped
    and reserved bytes, dtype, the prefix cache's figures (hits, misses, hit tokens,
    cached / reclaimable blocks, evictions; None while the pool has none), the blocks freed
    behind sliding windows (window_freed_blocks), and for a hybrid model's pool the blocks
    narrowed behind its window and the bytes its sliding layers still map
    (window_narrowed_blocks, window_layers, window_mapped_bytes)."""
    from .kv import pool_stats

    return pool_stats()


def clear_prefix_cache() -> int:
    """Drops the prefix cache of every KV pool (kv.prefix_cache), e.g. after a model's weights
    changed; returns the blocks it held. Blocks a live call shares stay that call's."""
    from .integrations.hf import prefix

    return prefix.clear()


def decode_graph_stats(model) -> dict:
    """generate()'s decode graphs of `model`: held, captured, replays, failed signatures, and how
    they were compiled (whole forward by backend "oxygen", or RMSNorm / MLP / rotary only);
    under "merged", the engine's merged decode graphs (by rows bucket): held, captured,
    replays, padded replays, failed signatures, and how many were compiled whole or fused;
    under "mixed", the same of the engine's graphs of steps with prompt tokens
    (kv.mixed_graphs)."""
    from .integrations.hf import batched, engine_runner, graphs, merged_graphs

    held = batched.merged_graphs_of(model) + engine_runner.graphs_of(model)
    mixed = merged_graphs.summed(engine_runner.mixed_graphs_of(model))
    return {**graphs.stats(model), "merged": merged_graphs.summed(held), "mixed": mixed}


def engine_stats(model=None) -> dict:
    """The engines' figures (`model`'s, when given; else every model's), summed: steps,
    forwards, tokens computed and drawn, preemptions and swaps, rows a step, host / GPU time and
    the GPU's idle time between steps, running and waiting rows; and under "per_call", the
    generate() calls that ran their own loop instead, by reason (every model's)."""
    from .integrations.hf import engine_runner, front

    with front._reasons_lock:
        reasons = dict(front.REASONS)
    return {**engine_runner.engine_stats(model), "per_call": reasons}


def warm_up(model, *, max_rows: int | None = None, max_length: int | None = None) -> dict:
    """Pay the engine's first-use costs before traffic: one short greedy generate() per rows
    bucket up to `max_rows` (default scheduler.max_step_seqs), so each bucket's decode CUDA
    graph is captured (and the forward compiled) now, with block tables for sequences up to
    `max_length` tokens (default the model's max_position_embeddings, at most 8,192), and with
    kv.mixed_graphs one graph per tokens bucket of the steps with prompt tokens; with
    kv.prefill_compile, the forward the longer prompt steps run is compiled; the KV pool's CPU
    tier (pool.cpu_tier_bytes, where preempted rows are swapped) is made, and on a GPU the
    graphs of its moves by the mapped kernel captured for a row's blocks. Later steps of
    those sizes replay instead of stalling every running call for a capture. Needs the
    model on oxygen attention (enable() before creating it, or apply()) and the engine
    (scheduler.engine). Returns the buckets run, graphs captured, whether the prefill forward
    is compiled, the CPU tier's bytes and its moves' graphs captured, table width and
    seconds."""
    from .integrations.hf.warm import warm_up as _warm_up

    return _warm_up(model, max_rows=max_rows, max_length=max_length)


def empty_cache() -> None:
    """Unmap pages with nothing live and release cached physical handles."""
    pool.empty_cache()


def apply(model, **overrides: Any):
    """Switch a transformers model created before enable() to oxygen attention and paged KV.

    Keyword overrides (as for enable()) apply to this model only, over enable()'s own."""
    from .integrations.hf import apply as _apply

    active = _active
    if active is not None and not overrides:
        return _apply(model, active)
    given = {}
    if active is not None:  # what enable() was given stays; the overrides go over it
        given = {k: v for k, v in active.as_dict().items() if active.sources.get(k) == "enable()"}
    return _apply(model, load_config(**given, **overrides))
