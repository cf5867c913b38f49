"""Decode steps replayed from a CUDA graph: the PagedKVCore side. The step is planned on the
host before the forward, the graph reads the table, lengths and slots from its own buffers
(`lend`), and the step context tells the compiled oxygen::paged_step which core it serves."""

from __future__ import annotations

import torch

from .. import context
from . import engine_streams, transfer
from .plan import StepPlan
from .swap import resident


class GraphStepMixin:
    """Part of PagedKVCore (see core.py)."""

    def _reserve_one_each(self) -> None:
        """_reserve of one token per sequence; without the block manager when every sequence's
        last block has room and is its own (15 steps in 16 at 16-token blocks)."""
        self._drop_behind_window()  # (the graph copies the whole host table: no flush needed)
        bt, seqs, refcount = self.block_tokens, self.seqs, self.pool.manager.refcount
        if all(n % bt and refcount(b[-1]) == 1 for n, b in zip(seqs.lens, seqs.blocks)):
            seqs.lens[:] = [n + 1 for n in seqs.lens]
        else:
            self._reserve([1] * len(seqs.lens))

    def begin_graph_step(self, width: int) -> tuple[torch.Tensor, list[int]]:
        """Plans one decode step (one token per sequence) on the host, for a graph that reads
        the block table, lengths and slots from its own buffers.

        Returns (table columns [B, width] int32 on the host, lengths + slots as one list of 2B
        ints); the caller copies them into the graph's buffers and calls `lend` with them. The
        step is begun: layers then append once each (forward or capture), or `end_graph_step`
        marks them appended (replay)."""
        if self.seqs is None:
            raise RuntimeError("PagedKVCache: a decode graph step needs a prefilled cache")
        transfer.note_step(self.pool.key.device)
        engine_streams.after_engines(self.pool.key.device)  # (blocks an engine wrote or freed)
        resident(self)  # preempted to the CPU tier: back first (kv/swap.py)
        if not all(n == self.length for n in self._layer_len):
            raise RuntimeError("PagedKVCache: the previous step did not reach every layer")
        lens0 = list(self.seqs.lens)
        need = -(-(max(lens0, default=0) + 1) // self.block_tokens)
        if need > width:
            raise ValueError(
                f"PagedKVCache: {need} blocks do not fit a decode graph {width} blocks wide"
            )
        self._reserve_one_each()
        self._grow_table(width)
        if self.pool.heat is not None:  # the step's attention reads every block in the table
            self.pool.heat.touch(self._table_host)
        self.length += 1
        return self._table_host[:, :width], self.seqs.lens + self._decode_slots(lens0)

    def lend(self, table: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor) -> None:
        """The step begun by begin_graph_step reads these device buffers (the graph's); the
        cache's own table is reloaded from the host at its next eager step."""
        self.table, self.seq_lens, self._lent = table, seq_lens, True
        self._plan = StepPlan(1, slots, None, None)
        self._layer_len = [self.length - 1] * self.num_layers
        context.lend(self)

    def end_graph_step(self) -> None:
        """Every layer appended this step (a replayed graph does not run the Python forward)."""
        self._layer_len = [self.length] * self.num_layers
        context.forget(self)

    def step(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """One layer of a one-token step: stores k/v ([B, Hkv, 1, D]) and attends q
        ([B, Hq, 1, D]) -> [B, 1, Hq, D]. Decode tokens are never padding."""
        plan = self.write(layer, k, v)
        return self.attend(layer, q, plan, scale=scale, sliding_window=sliding_window)
