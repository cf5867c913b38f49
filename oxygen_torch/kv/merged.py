"""One forward over the sequences of several PagedKVCores of one pool: a merged step.

Several generate() calls on one model each own a PagedKVCore; their block ids all come from the
same KVPool, so one kernel launch can attend over all of them: the rows of every core side by
side in one block table, their new real tokens packed one after another (padding is never
stored, so it is never packed either). The step plans every core's blocks on the host (each
core's own reservation, copy-on-write included), then writes and attends like a core does, and
`commit()` leaves each core as its own eager step would have (lengths, layer counts; its device
table is reloaded at its next eager step). The engine decides which cores' tokens go in a step.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from functools import lru_cache
from itertools import groupby

import numpy as np
import torch

from . import engine_streams, transfer
from . import fresh as _fresh
from .attention import kv_write, paged_attention
from .core import PagedKVCore
from .plan import StepPlan
from .storage import GUARD_BLOCK
from .swap import resident
from .window import check_narrow_window, narrowed_window


@lru_cache(maxsize=256)
def _pad(n: int) -> tuple[int, ...]:
    return (GUARD_BLOCK,) * n


def part_blocks(core: PagedKVCore, counts: list[int]) -> int:
    """Fresh blocks `counts[b]` new tokens of each row b of a bound core take in a merged step:
    a core swapped out to the CPU tier comes back first, its new tokens on top of the tokens
    its rows come back with; copy-on-write included."""
    sw = core._swapped
    if sw is not None:
        return sw.blocks_needed_with(counts, core.block_tokens, core.pool.manager.refcount)
    return sum(core.seqs.blocks_needed(b, n) for b, n in enumerate(counts))


@dataclass
class Part:
    """One core's share of the step: `counts[b]` new real tokens of its row b (packed in row
    order), `columns` the positions transformers counts for the step (padding included), and
    whether padding was skipped (crop may not cut below this step then)."""

    core: PagedKVCore
    counts: list[int]
    columns: int
    padded: bool = False


class MergedStep:
    """The duck-typed core of a merged forward (what PagedKVCache's attention path calls)."""

    length = 0  # the merged forward's cache counts nothing itself (the mask reads no length)
    seqs = None

    def __init__(self, parts: list[Part]):
        if not parts:
            raise ValueError("MergedStep: no part")
        pools = {id(p.core.pool) for p in parts}
        if None in {p.core.pool for p in parts} or len(pools) != 1:
            raise ValueError("MergedStep: every core must be bound to the same KV pool")
        self.parts = parts
        self.pool = parts[0].core.pool
        first = parts[0].core
        self.precision, self.tiles, self.debug = first.precision, first.tiles, first.debug
        self.tokens = sum(sum(p.counts) for p in parts)
        self._plan: StepPlan | None = None
        self._starts: list[list[int]] = []
        self._rows: list[int] = []  # every row's new tokens, packed in this order
        self._fresh = False  # no row with new tokens held a token before the step
        self._fresh_shape = (0, 0)  # a fresh step's shortest row and runs of one length
        self._masks: dict[int, dict] = {}  # the dense path's window masks, by row length
        self._narrowed: int | None = None  # the narrowest window a part narrowed behind

    # --- planning (host) ---------------------------------------------------------------------

    def blocks_needed(self) -> int:
        """Fresh blocks the step takes (each sequence's new tokens, copy-on-write included)."""
        return sum(part_blocks(p.core, p.counts) for p in self.parts)

    def reserve(self, *, build: bool = True) -> None:
        """Reserves every core's blocks (under the pool lock: all or, on KVCacheFull, none
        taken here: call `blocks_needed` first), then builds the step's table and slots on the
        device (`build`; a merged decode graph copies `host_plan()` into its own buffers)."""
        if self.parts:
            transfer.note_step(self.parts[0].core.pool.key.device)
            engine_streams.after_engines(self.pool.key.device)  # (a caller's merged step)
        for p in self.parts:  # back from the CPU tier first (kv/swap.py)
            if p.core._swapped is not None or p.core._ready is not None:
                resident(p.core)
        self._starts = [list(p.core.seqs.lens) for p in self.parts]
        self._rows = [n for p in self.parts for n in p.counts]
        self._fresh = all(
            n0 == 0 for p, st in zip(self.parts, self._starts) for n0, n in zip(st, p.counts) if n
        )
        if self._fresh:  # (once a step, not a layer: what kv/fresh.py's choice reads)
            self._fresh_shape = (
                min((n for n in self._rows if n), default=0),
                sum(1 for n, _ in groupby(self._rows) if n),
            )
        for p in self.parts:
            if p.counts == [1]:  # one token of one row (the engine's decodes): mostly no block
                p.core._reserve_one_each()
            else:
                p.core._reserve(p.counts)
        self._narrowed = narrowed_window([p.core for p in self.parts])
        if build:
            self.build()

    def host_plan(self) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
        """The reserved step on the host: block table [R, W] (int32, every row's blocks side by
        side, GUARD_BLOCK beyond), then per new token its slot, and per row its length after the
        step and its new tokens. Built from the rows' block lists (plain ints; a core's host
        table mirrors them) in one conversion."""
        bt = self.pool.key.block_tokens
        lists = [blocks for p in self.parts for blocks in p.core.seqs.blocks]
        width = max(map(len, lists))
        table = torch.frombuffer(
            array("i", [b for blocks in lists for b in (*blocks, *_pad(width - len(blocks)))]),
            dtype=torch.int32,
        ).view(len(lists), width)  # [R, W]
        lens, counts, slots = [], [], []
        for p, start in zip(self.parts, self._starts):
            blocks = p.core.seqs.blocks
            for b, (n0, n) in enumerate(zip(start, p.counts)):
                row = blocks[b]
                if n == 1:
                    slots.append(row[n0 // bt] * bt + n0 % bt)
                elif n < 64:
                    slots.extend(row[t // bt] * bt + t % bt for t in range(n0, n0 + n))
                else:  # (a prompt's chunk: numpy, not a Python step a token)
                    t = np.arange(n0, n0 + n, dtype=np.int64)
                    slots.extend((np.asarray(row, dtype=np.int64)[t // bt] * bt + t % bt).tolist())
                lens.append(n0 + n)
                counts.append(n)
        if self.pool.heat is not None:  # the step's attention reads every block in the table
            self.pool.heat.touch(table)
        return table, slots, lens, counts

    def build(self) -> None:
        """The reserved step's table, lengths and slots on the device (what attend reads)."""
        table, slots, lens, counts = self.host_plan()
        decode = all(n == 1 for n in counts)
        t, r = len(slots), len(lens)
        ints, at = transfer.packed_int32([slots, lens] + ([] if decode else [[0] + counts]))
        device = self.pool.key.device

        def to_device(t):  # pinned copies, not waited for (a CPU pool: the tensor itself)
            return t.clone() if device.type == "cpu" else transfer.to_device(t, device)

        buf = to_device(ints)
        self.table = to_device(table.contiguous())
        self.seq_lens = buf[at[1] : at[1] + r]
        cu = None if decode else buf[at[2] : at[2] + r + 1].cumsum(0, dtype=torch.int32)
        self._plan = StepPlan(1 if decode else 0, buf[:t], cu, None)

    # --- what the attention path calls ---------------------------------------------------------

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, real_fn=None) -> StepPlan:
        """k, v: [1, Hkv, T, D], the step's packed new tokens."""
        if self._plan is None:
            raise RuntimeError("MergedStep: reserve() before the forward")
        if k.shape[0] != 1 or k.shape[2] != self.tokens:
            raise ValueError(
                f"MergedStep: keys {list(k.shape)} are not the step's {self.tokens} packed tokens"
            )
        st, pool = self.pool.storage, self.pool
        kk = k[0].transpose(0, 1)  # [T, Hkv, D]
        vv = v[0].transpose(0, 1)
        if self.debug:
            st.check_blocks(self.table)
        kv_write(
            kk, vv, st.k[layer], st.v[layer], self._plan.slot_mapping,
            pool.k_scale(layer), pool.v_scale(layer),
        )  # fmt: skip
        return self._plan

    def step(self, layer, q, k, v, *, scale, sliding_window) -> torch.Tensor:
        """One layer as a compiled forward's oxygen::paged_step runs it (kv.prefill_compile):
        stores the packed k/v ([1, Hkv, T, D]) and attends q ([1, Hq, T, D]) -> [1, T, Hq, D],
        as the eager layer does through PagedKVCache.attend (no padding in a merged step)."""
        plan = self.write(layer, k, v)
        return self.attend(layer, q, plan, scale=scale, sliding_window=sliding_window, k=k, v=v)

    def attend(self, layer, q, plan, *, scale, sliding_window, k=None, v=None) -> torch.Tensor:
        """q: [1, Hq, T, D] -> [1, T, Hq, D]. Every row attends over the blocks, where write()
        stored its new K/V, except in a step of fresh prompts that kv.fresh_prefill sends to the
        dense path: k, v (the packed new K/V, [1, Hkv, T, D]) are attended directly there."""
        if self._narrowed is not None:  # a hybrid pool: the kernel may not read narrowed pages
            check_narrow_window(layer, sliding_window, self._narrowed, self.pool.key.window_layers)
        st = self.pool.storage
        if plan.cu_seqlens_q is not None:
            path, why = self._prefill_path(q, sliding_window, k is not None)
            _fresh.count(path, why, layer)
            if path == "dense":
                return self._dense(q, k, v, scale, sliding_window)
        qq = q[0].transpose(0, 1)  # [T, Hq, D]
        out = paged_attention(
            qq, st.k[layer], st.v[layer], self.table, self.seq_lens, plan.cu_seqlens_q,
            scale=scale, sliding_window=sliding_window, precision=self.precision,
            k_scale=self.pool.k_scale(layer), v_scale=self.pool.v_scale(layer), tiles=self.tiles,
        )  # fmt: skip
        return out.unsqueeze(0)

    def _prefill_path(self, q, sliding_window, have_kv: bool) -> tuple[str, str]:
        """kv/fresh.py's choice for a prefill step. Only a step whose every row is a fresh
        prompt (no cached prefix, no decode row beside it) may attend its own K/V; its columns
        are its shortest row's tokens, so every row is at least the size an auto entry was
        measured on; its runs, the SDPA calls the dense path would make (`_dense`)."""
        first = self.parts[0].core
        return _fresh.choose(
            first.fresh_prefill, fresh=self._fresh and have_kv, device=q.device, dtype=q.dtype,
            head_dim=q.shape[-1], columns=self._fresh_shape[0], padded=False,
            window=sliding_window, kv_dtype=first.kv_dtype, precision=self.precision,
            runs=self._fresh_shape[1],
        )  # fmt: skip

    def _dense(self, q, k, v, scale, sliding_window) -> torch.Tensor:
        """Every row's prompt attends its own K/V (q: [1, Hq, T, D], k/v: [1, Hkv, T, D], the
        rows packed): SDPA once per run of consecutive rows of one length (a run is a batch of
        equal prompts) -> [1, T, Hq, D]."""
        outs, at = [], 0
        for n, run in groupby(self._rows):
            g = len(list(run))
            if not n:
                continue
            qkv = [x[0, :, at : at + g * n].unflatten(1, (g, n)).transpose(0, 1) for x in (q, k, v)]
            o = _fresh.dense_attention(  # [g, n, Hq, D]; a window's mask made once a step
                *qkv,
                real=None,
                scale=scale,
                sliding_window=sliding_window,
                precision=self.precision,
                masks=self._masks.setdefault(n, {}),
            )
            outs.append(o.reshape(1, g * n, *o.shape[2:]))
            at += g * n
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    # --- after the forward ---------------------------------------------------------------------

    def commit(self) -> None:
        """Each core as its own step would leave it: transformers' length advanced by the
        step's columns, every layer caught up, its device table reloaded before its next
        eager step (the merged step wrote a table of its own)."""
        for p in self.parts:
            core = p.core
            core.length += p.columns
            core._layer_len = [core.length] * core.num_layers
            core._plan = None
            core._lent = True  # (see _reload: table and lengths from the host next time)
            if p.padded:
                core._pad_frontier = core.length

    def abandon(self) -> None:
        """The forward failed after reserve(): the tokens it reserved are given back (the cores
        keep what they held before the step)."""
        for p in self.parts:
            core = p.core
            with core.pool.lock:
                for b, n in enumerate(p.counts):
                    core.seqs.truncate(b, core.seqs.lens[b] - n)
            core._lent = True
