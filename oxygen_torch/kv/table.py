"""The block table of a PagedKVCore on the device: a host mirror ([B, cap] int32, plain ints the
planner writes) and the device copy the kernels read, refreshed by the dirty columns only."""

from __future__ import annotations

import torch

from .storage import GUARD_BLOCK


class BlockTableMixin:
    """Part of PagedKVCore: `_table_host`, `table`, `seq_lens`, `_dirty`, `_lent`."""

    def _grow_table(self, need: int) -> None:
        cap = self._table_host.shape[1]
        if need <= cap:
            return
        while cap < need:
            cap *= 2
        grown = torch.full((self._table_host.shape[0], cap), GUARD_BLOCK, dtype=torch.int32)
        grown[:, : self._table_host.shape[1]] = self._table_host
        self._table_host = grown
        self._dirty = None
        if not self._lent:  # a lent table is reloaded whole at the next eager step
            self.table = self._to_device(grown)

    def _mark_dirty(self, col: int) -> None:
        c0, c1 = self._dirty if self._dirty is not None else (col, col + 1)
        self._dirty = (min(c0, col), max(c1, col + 1))

    def _flush_table(self) -> None:
        if self._dirty is None:
            return
        c0, c1 = self._dirty
        self._dirty = None
        if self.device.type == "cpu":
            self.table[:, c0:c1] = self._table_host[:, c0:c1]
        else:
            part = self._to_device(self._table_host[:, c0:c1].contiguous())
            self.table[:, c0:c1].copy_(part)

    def _reload(self) -> None:
        """The whole table and the lengths to the device (after select/crop, or after decode
        graph steps, whose table lived in the graph's buffers)."""
        self._dirty, self._lent = None, False
        self.table = self._to_device(self._table_host)
        self.seq_lens = self._to_device(torch.tensor(self.seqs.lens, dtype=torch.int32))
