"""PagedKVCore: a batch of sequences' KV cache in pool blocks, framework-agnostic.

The caller appends each layer's new K/V; the first layer to see a new step (one forward pass)
plans it for all layers: blocks are reserved on the host (plain ints), the slot of every new
token and the new lengths are computed there, and they go to the device in small copies from
pinned memory, so the per-token path never waits for the GPU.

Padding is never stored: a padded token gets slot -1 and each sequence keeps only its real
tokens, packed from position 0. Attention over a sequence then needs no mask, and the result for
real tokens equals attention over the padded layout with the padding masked (positions are
already in the rotary embedding of K). `length` still counts padding, as transformers does.

When every layer attends to the same sliding window, each step first gives back the blocks
behind it; when only some do (a hybrid model), it narrows them: the sliding layers' pages of
those blocks go, the full-attention layers keep them (kv/window.py).
"""

from __future__ import annotations

import torch

from ..triton_kernels.precision import KV_DTYPES, PrecisionMode
from . import engine_streams, swap, transfer
from .attention import Tiles, kv_write
from .block_manager import SequenceBlocks
from .fresh import check_setting
from .graph_step import GraphStepMixin
from .history import History
from .plan import StepPlan
from .pool import KVPool, PoolKey, get_pool
from .step_attention import AttendMixin
from .storage import GUARD_BLOCK, debug_checks_enabled
from .swap import resident
from .table import BlockTableMixin
from .transfer import to_device
from .window import WindowMixin

MiB = 1 << 20


class PagedKVCore(AttendMixin, BlockTableMixin, GraphStepMixin, WindowMixin):
    """KV cache of a batch of sequences in a shared KVPool. One table serves all layers.

    window: the sliding window every layer attends with (None: some layer, or all, attend to
    every token); the blocks behind it are given back (kv/window.py).
    narrow_window, window_layers: a hybrid model's sliding window and the layers that attend
    with it (the others see every token); the blocks behind it are narrowed (kv/window.py)."""

    def __init__(
        self,
        num_layers: int,
        *,
        block_tokens: int = 16,
        backing: str = "auto",
        arena_bytes: int = 0,
        page_size: int = 2 * MiB,
        debug: bool = False,
        precision: PrecisionMode = PrecisionMode.AUTO_MIXED,
        kv_dtype: str = "auto",
        tiles: Tiles | None = None,
        fresh_prefill: str = "auto",
        window: int | None = None,
        narrow_window: int | None = None,
        window_layers: tuple[int, ...] = (),
    ):
        for name, w in (("window", window), ("narrow_window", narrow_window)):
            if w is not None and w < 1:
                raise ValueError(f"PagedKVCore: {name} {w} is not a positive token count")
        if narrow_window is not None and (
            window is not None
            or not window_layers
            or not all(0 <= i < num_layers for i in window_layers)
        ):
            raise ValueError(
                f"PagedKVCore: narrow_window needs window_layers among {num_layers} layers and "
                f"no uniform window (got window={window}, window_layers={window_layers})"
            )
        if kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"PagedKVCore: kv_dtype {kv_dtype!r} is not allowed; allowed: "
                f"{', '.join(KV_DTYPES)}"
            )
        self.kv_dtype = kv_dtype
        self.num_layers = num_layers
        self.block_tokens = block_tokens
        self.backing, self.arena_bytes, self.page_size = backing, arena_bytes, page_size
        self.debug, self.precision = debug_checks_enabled(debug), precision
        self.tiles = tiles  # the kernels' tiles (kernel.block_m/n, attention_type, profile)
        self.fresh_prefill = check_setting("PagedKVCore", fresh_prefill)  # kv.fresh_prefill
        self.window = window
        self.narrow_window = narrow_window
        self.window_layers = tuple(sorted(set(window_layers))) if narrow_window else ()
        # callable(core, rows) run (pool lock held) before rows first give blocks back behind the
        # window: the prefix cache keeps their prompt's blocks then (integrations/hf/prefix.py)
        self.before_drop = None
        self.pool: KVPool | None = None
        self.seqs: SequenceBlocks | None = None
        self.history: History | None = None  # tokens held, kept for a recompute (the engine)
        self._unbind()

    def _unbind(self) -> None:
        self.length = 0  # tokens per sequence as transformers counts them (padding included)
        self._layer_len = [0] * self.num_layers
        self._plan: StepPlan | None = None
        self._pad_frontier = 0  # crop may not cut below the last step that skipped padding
        self.table: torch.Tensor | None = None  # [B, cap] int32, device
        self._table_host: torch.Tensor | None = None  # [B, cap] int32, cpu mirror
        self.seq_lens: torch.Tensor | None = None  # [B] int32, device
        self._dirty: tuple[int, int] | None = None  # table columns not yet copied to the device
        self._lent = False  # table/seq_lens are a decode graph's buffers (see begin_graph_step)
        self._swapped = None  # kv/swap.py's Swapped while the KV is in the CPU tier
        self._ready = None  # the copy's event of a swap-in ahead of the next step (kv/swap.py)

    # --- binding to a pool ----------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return len(self.seqs) if self.seqs is not None else -1

    @property
    def device(self) -> torch.device | None:
        return self.pool.key.device if self.pool is not None else None

    def _bind(self, k: torch.Tensor) -> None:
        # k: [B, Hkv, q, D]
        self.bind(k.shape[0], k.shape[1], k.shape[3], k.dtype, k.device)

    def pool_key(self, hkv: int, d: int, dtype: torch.dtype, device: torch.device) -> PoolKey:
        """The pool this core's K/V of that geometry live in (every core with the same key
        shares it: block ids are the pool's)."""
        stored = KV_DTYPES[self.kv_dtype]
        if stored is not None and stored != dtype and stored != torch.float8_e4m3fn:
            raise ValueError(
                f"PagedKVCache: kv.kv_dtype={self.kv_dtype!r} with a {dtype} model: the cache "
                "stores the model's dtype (auto) or fp8_e4m3"
            )
        return PoolKey(
            device, self.num_layers, hkv, d, stored or dtype, self.block_tokens, self.backing,
            self.arena_bytes, self.page_size, self.window_layers,
        )  # fmt: skip

    def bind(
        self, batch: int, hkv: int, d: int, dtype: torch.dtype, device, device_table: bool = True
    ) -> None:
        """Binds an empty core to its pool for `batch` sequences (the first write does this).
        device_table=False: no device table until the core's own first step (an engine row's
        steps build theirs from every row's blocks: two copies a row saved)."""
        key = self.pool_key(hkv, d, dtype, torch.device(device))
        self.model_dtype = dtype
        self.pool = get_pool(key)
        self.seqs = SequenceBlocks(self.pool.manager, self.block_tokens, batch)
        self._table_host = torch.full((batch, 16), GUARD_BLOCK, dtype=torch.int32)
        if not device_table:
            self._lent = True  # (see _reload: table and lengths from the host at a step)
            return
        self.table = self._to_device(self._table_host)
        self.seq_lens = self._to_device(torch.zeros(batch, dtype=torch.int32))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t.clone()
        return to_device(t, self.device)  # the host waits neither for the copy nor queued kernels

    def _check_geometry(self, k: torch.Tensor) -> None:
        key = self.pool.key
        if (k.shape[0], k.shape[1], k.shape[3]) != (len(self.seqs), key.num_kv_heads, key.head_dim):
            raise ValueError(
                f"PagedKVCache: new keys {list(k.shape)} do not match the cache (batch "
                f"{len(self.seqs)}, {key.num_kv_heads} kv heads, head_dim {key.head_dim})"
            )
        if k.dtype != self.model_dtype or k.device != key.device:
            raise ValueError(
                f"PagedKVCache: keys are {k.dtype} on {k.device}, the cache takes "
                f"{self.model_dtype} on {key.device}"
            )

    # --- writing --------------------------------------------------------------------------

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, real_fn=None) -> StepPlan:
        """Stores layer `layer`'s new k, v ([B, Hkv, q, D]).

        real_fn() -> host bool [B, q] (True = real token) or None (all real); called only when
        this write starts a new step and q > 1 (decode tokens are always real)."""
        if self.pool is None:
            self._bind(k)
        self._check_geometry(k)
        q = k.shape[2]
        if all(n == self.length for n in self._layer_len):  # every layer caught up: new step
            real = real_fn() if (real_fn is not None and q > 1) else None
            self._plan = self._begin_step(q, real)
            self.length += q
        elif self._plan is None or self._layer_len[layer] + q != self.length:
            raise RuntimeError(
                f"PagedKVCache: layer {layer} holds {self._layer_len[layer]} tokens, the cache "
                f"{self.length}: layers must each append once per forward pass"
            )
        self._layer_len[layer] += q
        plan = self._plan
        st = self.pool.storage
        if q == 1:
            kk, vv = k[:, :, 0], v[:, :, 0]  # [B, Hkv, D] views, no copy
        else:
            kk = k.transpose(1, 2).reshape(-1, k.shape[1], k.shape[3])  # [B*q, Hkv, D]
            vv = v.transpose(1, 2).reshape(-1, v.shape[1], v.shape[3])
        if self.debug:
            st.check_blocks(self.table)
        pool = self.pool
        kv_write(
            kk, vv, st.k[layer], st.v[layer], plan.slot_mapping,
            pool.k_scale(layer), pool.v_scale(layer),
        )  # fmt: skip
        return plan

    def _begin_step(self, q: int, real: torch.Tensor | None) -> StepPlan:
        transfer.note_step(self.pool.key.device)  # (the tier's moves meanwhile yield the link)
        engine_streams.after_engines(self.pool.key.device)  # (blocks an engine wrote or freed)
        resident(self)
        if self._lent:
            self._reload()
        lens0 = list(self.seqs.lens)
        counts = [q] * len(lens0) if real is None else real.sum(1).tolist()
        self._reserve(counts)
        self._flush_table()
        if self.pool.heat is not None:  # the step's attention reads every block in the table
            self.pool.heat.touch(self._table_host)
        if real is not None:
            self._pad_frontier = self.length + q
        if q == 1:
            return self._decode_plan(lens0)
        return self._prefill_plan(q, lens0, counts, real)

    def _reserve(self, counts: list[int]) -> None:
        """Blocks for counts[b] more tokens of each sequence, in the host table (marked dirty);
        shared last blocks are copied first (copy-on-write)."""
        self._drop_behind_window()
        seqs = self.seqs
        cows, added = [], []
        with self.pool.lock:
            # all or nothing: a row short of blocks used to leave the rows before it with their
            # new blocks and lengths (a forward that runs again then found them advanced)
            need = seqs.blocks_needed_all(counts)
            m = self.pool.manager  # (the free count first: a cache's share walks its nodes)
            if need > m.num_free and need > m.num_available:
                raise m.full(need)
            for b, n in enumerate(counts):
                new, cow = seqs.reserve(b, n)
                added.extend((b, col, blk) for col, blk in new)
                if cow is not None:
                    cows.append(cow)
        self._grow_table(seqs.max_blocks())
        if added:  # (numpy's element writes: a few torch ops a row cost ~0.1 ms of host time)
            host = self._table_host.numpy()
            for b, col, blk in added:
                host[b, col] = blk
            self._mark_dirty(min(col for _, col, _ in added))
            self._mark_dirty(max(col for _, col, _ in added))
        if cows:
            self._copy_blocks(cows)

    def _decode_slots(self, lens0: list[int]) -> list[int]:
        bt, blocks = self.block_tokens, self.seqs.blocks
        return [blocks[b][p // bt] * bt + p % bt for b, p in enumerate(lens0)]

    def _decode_plan(self, lens0: list[int]) -> StepPlan:
        slots = self._decode_slots(lens0)
        lens = self.seqs.lens
        ints, at = transfer.packed_int32([slots, lens])  # (aligned: one kernel build)
        buf = self._to_device(ints)
        self.seq_lens = buf[at[1] : at[1] + len(lens)]
        return StepPlan(1, buf[: len(slots)], None, None)

    def _prefill_plan(self, q, lens0, counts, real) -> StepPlan:
        bt, batch = self.block_tokens, len(lens0)
        if real is None:
            rank = torch.arange(q, dtype=torch.int64).expand(batch, q)
        else:
            rank = real.to(torch.int64).cumsum(1) - 1
        pos = torch.tensor(lens0, dtype=torch.int64)[:, None] + rank  # [B, q]
        blk = self._table_host.to(torch.int64).gather(1, pos.clamp(min=0) // bt)
        slots = blk * bt + pos % bt
        q_index = None
        if real is not None:
            slots = torch.where(real, slots, -1)
            q_index = self._to_device(real.flatten().nonzero().squeeze(1))
        cu = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        # no sequence held a token before this step: its attention may skip the paged read
        fresh = not any(lens0)
        parts = [
            slots.flatten().to(torch.int32),
            cu,
            torch.tensor(self.seqs.lens, dtype=torch.int32),
        ]
        keep_real = fresh and real is not None and self.fresh_prefill != "paged"
        if keep_real:  # the dense path's padding mask, in the same copy
            parts.append(real.flatten().to(torch.int32))
        # each part starts 16-byte aligned: one kernel build whatever the counts (transfer.aligned)
        ints, at = transfer.packed_int32(parts)
        buf = self._to_device(ints)
        n = batch * q
        self.seq_lens = buf[at[2] : at[2] + batch]
        dense_real = buf[at[3] : at[3] + n].view(batch, q).bool() if keep_real else None
        return StepPlan(q, buf[:n], buf[at[1] : at[1] + batch + 1], q_index, fresh, dense_real)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst of every layer's K and V becomes a copy of block src."""
        idx = self._to_device(torch.tensor(pairs, dtype=torch.int64).t().contiguous())
        src, dst = idx[0], idx[1]
        for st in (self.pool.storage, self.pool.scales):
            for cache in (*st.k, *st.v) if st is not None else ():
                raw = cache.view(torch.uint8)  # bytes: index_copy_ has no fp8 kernel
                raw.index_copy_(0, dst, raw.index_select(0, src))

    # --- sequence operations --------------------------------------------------------------

    def select(self, order: list[int]) -> None:
        """Sequence i becomes old sequence order[i] (beam reorder, repeat_interleave, select)."""
        if self.seqs is None:
            return
        swap.settle(self)
        with self.pool.lock:
            if self._swapped is not None:
                swap.select(self, order)
            else:
                self.seqs.select(order)
        if self.history is not None and not self.history.select(order):
            self.history = None  # a step went unrecorded: this core cannot be recomputed
        self._table_host = self._table_host[torch.tensor(order, dtype=torch.int64)]
        self._reload()

    def crop(self, remove: int) -> None:
        """Drops the last `remove` tokens of every sequence."""
        if remove <= 0 or self.seqs is None:
            return
        resident(self)
        new_len = self.length - remove
        if new_len < self._pad_frontier:
            raise NotImplementedError(
                f"PagedKVCache.crop: cannot cut to {new_len} tokens, inside a step whose "
                f"padding was skipped (first {self._pad_frontier} tokens)"
            )
        self._check_crop(remove)
        with self.pool.lock:
            for b, n in enumerate(self.seqs.lens):
                self.seqs.truncate(b, max(0, n - remove))
        for b, n in enumerate(self.seqs.lens if self.history is not None else ()):
            self.history.truncate(b, n)
        for b, blocks in enumerate(self.seqs.blocks):
            self._table_host[b, len(blocks) :] = GUARD_BLOCK
        self.length = new_len
        self._layer_len = [min(n, new_len) for n in self._layer_len]
        self._plan = None
        self._reload()

    def fork(self) -> PagedKVCore:
        """A new core holding the same tokens; blocks are shared until written (copy-on-write)."""
        other = PagedKVCore(
            self.num_layers,
            block_tokens=self.block_tokens,
            backing=self.backing,
            arena_bytes=self.arena_bytes,
            page_size=self.page_size,
            debug=self.debug,
            precision=self.precision,
            kv_dtype=self.kv_dtype,
            tiles=self.tiles,
            fresh_prefill=self.fresh_prefill,
            window=self.window,
            narrow_window=self.narrow_window,
            window_layers=self.window_layers,
        )
        if self.seqs is None:
            return other
        resident(self)
        other.pool, other.model_dtype = self.pool, self.model_dtype
        other.seqs = SequenceBlocks(self.pool.manager, self.block_tokens)
        with self.pool.lock:
            other.seqs.blocks = [list(b) for b in self.seqs.blocks]
            other.seqs.lens = list(self.seqs.lens)
            other.seqs.dropped = list(self.seqs.dropped)
            other.seqs.narrowed = list(self.seqs.narrowed)
            for b in range(len(other.seqs)):
                narrow, whole = self.seqs.refs(b)
                self.pool.manager.incref(narrow, narrowed=True)
                self.pool.manager.incref(whole)
        other.length, other._layer_len = self.length, list(self._layer_len)
        other._pad_frontier = self._pad_frontier
        other.history = self.history.copy() if self.history is not None else None
        other._table_host = self._table_host.clone()
        other._reload()
        return other

    def adopt(self, rows: list[PagedKVCore], length: int, frontier: int = 0) -> None:
        """An empty core takes over the one sequence of each core in `rows`, in order (their
        blocks move, no copy: those cores are left empty). transformers' length becomes
        `length`; crop may not cut below `frontier` (the last step that skipped padding)."""
        if self.seqs is not None or not rows:
            raise RuntimeError("PagedKVCore.adopt: an empty core takes over bound rows")
        first = rows[0]
        self.pool, self.model_dtype = first.pool, first.model_dtype
        seqs = self.seqs = SequenceBlocks(self.pool.manager, self.block_tokens)
        with self.pool.lock:
            for c in rows:
                if c.pool is not self.pool or len(c.seqs) != 1:
                    raise RuntimeError("PagedKVCore.adopt: rows of one sequence in one pool")
                swap.settle(c)
                if c._swapped is not None:
                    swap.release(c)
                s = c.seqs
                seqs.blocks.append(s.blocks[0])
                seqs.lens.append(s.lens[0])
                seqs.dropped.append(s.dropped[0])
                seqs.narrowed.append(s.narrowed[0])
                s.blocks, s.lens, s.dropped, s.narrowed = [[]], [0], [0], [0]
        width = max(16, seqs.max_blocks())
        self._table_host = torch.full((len(rows), width), GUARD_BLOCK, dtype=torch.int32)
        for b, blocks in enumerate(seqs.blocks):
            self._table_host[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.length, self._layer_len = length, [length] * self.num_layers
        self._pad_frontier = frontier
        self._reload()

    def drop_kv(self) -> None:
        """Frees every block but keeps the sequences and transformers' length: the K/V are
        recomputed later (a preempted call of the multi-task engine)."""
        if self.seqs is None:
            return
        batch = len(self.seqs)
        swap.settle(self)
        with self.pool.lock:
            if self._swapped is not None:
                swap.release(self)
            self.seqs.release()
            self.seqs = SequenceBlocks(self.pool.manager, self.block_tokens, batch)
        self._table_host.fill_(GUARD_BLOCK)
        self._lent = True  # the device table is reloaded from the host at the next step

    def release(self) -> None:
        """Gives every block back to the pool and forgets the sequences."""
        if self.seqs is not None:
            swap.settle(self)
            with self.pool.lock:
                if self._swapped is not None:
                    swap.release(self)
                self.seqs.release()
        self.seqs = None
        self.pool = None
        self.history = None
        self._unbind()
