"""generate()'s prefix cache (kv.prefix_cache): a call starts on the cached blocks of its prompt.

Before the call, each prompt row's real tokens are looked up in its pool's PrefixCache
(kv/prefix.py). transformers' cache length is one number for the batch (padding counted), so the
cached part is the same column count L for every row: row b, padded by p_b, takes its first
max(0, L - p_b) real tokens from the cache, and L is the largest count every row can take, at
most the prompt's length - 1 (the last column is always computed: it gives the logits). The
call's PagedKVCache then holds those blocks (shared, copy-on-write where a row takes part of a
block), and generate() -- which slices the inputs it feeds by the cache's length -- computes only
the rest. Exact with left padding: positions come from the attention mask (real token j of a
row is at position j whatever its padding), and padding is never stored. A row padded anywhere
but on the left, inputs_embeds, position_ids given, assisted decoding: the call neither uses
nor fills the cache.

After the call, each row's whole blocks are kept: the prompt's, and without beams also the
tokens it generated (the next turn of a chat starts with them). A row that gives back blocks
behind its sliding window (kv/window.py) keeps its prompt's whole blocks (those computed by
then) just before it first does, and nothing after the call: a chain starts at token 0. Keys
carry the model (one id per model object: another model of the same shape shares the pool, not
its K/V), the precision and the tiles. The cache assumes a model's weights do not change;
`oxygen_torch.clear_prefix_cache()` drops it after they do.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...kv.history import History
from ...kv.pool import KVPool, get_pool
from ...kv.storage import GUARD_BLOCK
from ...kv.swap import settle
from .cache import PagedKVCache

_serials: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_serial_lock = threading.Lock()
_next_serial = itertools.count(1)
_NOT_WITH = ("inputs_embeds", "position_ids", "assistant_model", "prompt_lookup_num_tokens")


def _serial(model) -> int:
    with _serial_lock:
        if model not in _serials:
            _serials[model] = next(_next_serial)
        return _serials[model]


@dataclass
class Prompt:
    """A call's prompt as the prefix cache sees it."""

    ns: tuple  # the namespace of its K/V: (model serial, precision, tiles)
    rows: list[list[int]]  # each row's real tokens
    pads: list[int]  # each row's left padding
    width: int  # columns of the prompt (padding included)
    expand: int  # rows of the cache per prompt row (beams, num_return_sequences)
    beams: bool
    pool: KVPool
    cached: int = 0  # columns the cache gave (L)


def prompt_of(model, call, cache: PagedKVCache, geometry) -> Prompt | None:
    """The call's prompt when the prefix cache serves it, else None."""
    kv = cache.cfg.kv
    if not kv.prefix_cache or any(call.opt(k) is not None for k in _NOT_WITH):
        return None
    ids = call.inputs
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 2:
        return None
    mask = call.kwargs.get("attention_mask")
    if mask is None:  # transformers infers padding from the pad token: only a prompt with none
        pad = call.opt("pad_token_id")
        if pad is not None and bool((ids == pad).any()):
            return None
        pads = [0] * ids.shape[0]
    else:
        pads = _left_padding(mask, ids.shape)
        if pads is None:
            return None
    pool = get_pool(cache._core.pool_key(*geometry))
    pc = pool.prefix_cache(kv.prefix_cache_bytes)
    if pc is None:
        return None
    zones = cache.cfg.pool
    # the cold zone (pool.cpu_tier_bytes; the last call's zones stand), made (pinned) outside
    # the pool's lock: the pool's other users go on meanwhile
    pool.cpu_tier_of(zones)
    with pool.lock:
        pc.threshold, pc.hot_ratio = zones.migration_threshold, zones.hot_zone_ratio
    core = cache._core
    beams = (call.opt("num_beams") or 1) > 1
    expand = max(call.opt("num_beams") or 1, call.opt("num_return_sequences") or 1)
    rows = [r[p:] for r, p in zip(ids.detach().cpu().tolist(), pads)]
    ns = (_serial(model), int(core.precision), core.tiles, core.kv_dtype)
    return Prompt(ns, rows, pads, ids.shape[1], expand, beams, pool)


def _left_padding(mask: torch.Tensor, shape) -> list[int] | None:
    """Each row's left padding by its attention mask; None when a row is padded anywhere but on
    the left, or is padding only."""
    if mask.shape != shape:
        return None
    mask = mask.detach().to("cpu", torch.bool)
    if bool(mask.all()):  # no padding (a single prompt, mostly): one op says so
        return [0] * shape[0]
    if bool((mask.to(torch.int8).diff(dim=1) < 0).any()) or not bool(mask[:, -1].all()):
        return None
    return (~mask).sum(1).tolist()


def _columns(prompt: Prompt) -> tuple[int, list[int]]:
    """(L, the block-aligned tokens the cache holds of each row), under the pool lock; the
    rows' cold cached blocks come up from the CPU tier first, as far as the pool has room."""
    pc, bt = prompt.pool.prefix, prompt.pool.key.block_tokens
    pc.promote(prompt.ns, prompt.rows)
    found = [len(pc.peek(prompt.ns, row)) * bt for row in prompt.rows]
    cols = min(p + h for p, h in zip(prompt.pads, found))
    return max(0, min(cols, prompt.width - 1)), found


def start_on_cache(
    prompt: Prompt, cache: PagedKVCache, geometry, *, chunked: Callable[[int], bool], record: bool
) -> int:
    """Puts the columns L the cache holds of every row into the call's fresh cache, in one pass
    under the pool lock, and counts the lookups; returns L (0: a miss, the cache left
    untouched). `chunked(L)`: whether the suffix after L columns would still be prefilled in
    chunks; such a call takes none (transformers' chunked prefill starts from column 0).
    `record`: the engine may preempt the call, so its core's History starts with the cached
    tokens."""
    pool, pc = prompt.pool, prompt.pool.prefix
    bt, core = pool.key.block_tokens, cache._core
    with pool.lock:
        cols = _columns(prompt)[0]
        if cols and chunked(cols):
            cols = 0
        takes = [max(0, cols - p) for p in prompt.pads]
        blocks = [pc.lookup(prompt.ns, row, use=m) for row, m in zip(prompt.rows, takes)]
        if cols == 0:
            pc.sweep()
            return 0
        rows = len(prompt.rows) * prompt.expand
        core.bind(rows, *geometry)
        seqs = core.seqs
        core._grow_table(max(-(-m // bt) for m in takes) or 1)
        for r in range(rows):
            b = r // prompt.expand
            mine = blocks[b][: -(-takes[b] // bt)]
            pool.manager.incref(mine)
            seqs.blocks[r], seqs.lens[r] = list(mine), takes[b]
            core._table_host[r, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
            core._table_host[r, len(mine) :] = GUARD_BLOCK
        pc.sweep()  # (the blocks it took are the call's now: not moved)
    core.length = cols
    core._layer_len = [cols] * core.num_layers
    core._pad_frontier = cols if any(m != cols for m in takes) else 0
    core._reload()
    if record:
        core.history = History(rows)
        for r in range(rows):
            m = takes[r // prompt.expand]
            core.history.ids[r] = list(prompt.rows[r // prompt.expand][:m])
            core.history.pos[r] = list(range(m))
    prompt.cached = cols
    return cols


def keep(prompt: Prompt, cache: PagedKVCache, out) -> None:
    """After a call that finished: each row's whole blocks join the prefix cache (the prompt's,
    and without beams the generated tokens' too)."""
    core = cache._core
    seqs = core.seqs
    if seqs is None or core.pool is not prompt.pool:
        return
    settle(core)  # a swap-in ahead still copying: the blocks' next reader comes after it
    sequences = getattr(out, "sequences", out)
    gen = None
    if not prompt.beams and isinstance(sequences, torch.Tensor) and sequences.dim() == 2:
        if sequences.shape[0] == len(seqs):
            gen = sequences[:, prompt.width :].cpu().tolist()
    if len(seqs) != len(prompt.rows) * prompt.expand:
        return  # rows added or dropped by someone else: which row is which is unknown
    with prompt.pool.lock:
        pc = prompt.pool.prefix
        for r in range(len(seqs)):
            b = r // prompt.expand
            if gen is None and r % prompt.expand:
                continue  # beams: every row of a prompt starts with the same prompt blocks
            if seqs.dropped[r] or seqs.narrowed[r]:
                continue  # its first blocks went behind the sliding window
            tokens = prompt.rows[b] + (gen[r] if gen is not None else [])
            n = min(len(tokens), seqs.lens[r])
            pc.insert(prompt.ns, tokens[:n], seqs.blocks[r])
        pc.sweep()


def keep_prompt(prompt: Prompt, core, rows: list[int]) -> None:
    """A core's before_drop (pool lock held): rows about to give their first blocks back
    behind the window keep their prompt's whole blocks computed so far."""
    seqs, pc = core.seqs, prompt.pool.prefix
    if pc is None or core.pool is not prompt.pool or len(seqs) != len(prompt.rows) * prompt.expand:
        return
    for r in rows:
        if r % prompt.expand:
            continue  # every row of a prompt starts with the same prompt blocks
        tokens = prompt.rows[r // prompt.expand]
        pc.insert(prompt.ns, tokens[: min(len(tokens), seqs.lens[r])], seqs.blocks[r])


def clear() -> int:
    """Drops every pool's prefix cache; returns the blocks it held."""
    from ...kv.pool import _pools, _pools_lock

    with _pools_lock:
        pools = list(_pools.values())
    return sum(p.drop_prefix_cache() for p in pools)
