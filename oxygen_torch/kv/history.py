"""The tokens each sequence of a core holds (ids and positions), so that its KV can be recomputed
after the multi-task engine preempted it. Every step's new tokens (merged, or run alone with
decode graphs) are kept as the tensors they came in and read back only when needed (a
preemption, a reorder), so recording costs a step no host sync."""

from __future__ import annotations

import torch


class History:
    def __init__(self, batch: int):
        self.ids: list[list[int]] = [[] for _ in range(batch)]
        self.pos: list[list[int]] = [[] for _ in range(batch)]
        # (ids [B, q], real [B, q] bool or None, positions [B, q]): not read from the device yet
        self._pending: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []

    def rows(self, n: int) -> None:
        """At least n sequences (the first step names the batch)."""
        while len(self.ids) < n:
            self.ids.append([])
            self.pos.append([])

    def add_later(self, ids: torch.Tensor, real: torch.Tensor | None, pos: torch.Tensor) -> None:
        """One step's new tokens ([B, q] each, any device): read when next needed."""
        self._pending.append((ids, real, pos))

    def settle(self) -> None:
        """Reads the steps kept on the device (one host sync for all of them)."""
        pending, self._pending = self._pending, []
        for ids, real, pos in pending:
            ids, pos = ids.tolist(), pos.expand(len(ids), -1).tolist()
            self.rows(len(ids))
            keep = real.tolist() if real is not None else None
            for b in range(len(ids)):
                for j, (t, p) in enumerate(zip(ids[b], pos[b])):
                    if keep is None or keep[b][j]:
                        self.ids[b].append(t)
                        self.pos[b].append(p)

    def select(self, order: list[int]) -> bool:
        """Row i becomes old row order[i]; False (nothing changed) where a row was never
        recorded: the record is incomplete, the caller drops it."""
        self.settle()
        if any(j >= len(self.ids) for j in order):
            return False
        self.ids = [list(self.ids[j]) for j in order]
        self.pos = [list(self.pos[j]) for j in order]
        return True

    def truncate(self, row: int, n: int) -> None:
        self.settle()
        del self.ids[row][n:], self.pos[row][n:]

    def copy(self) -> History:
        self.settle()
        other = History(0)
        other.ids = [list(r) for r in self.ids]
        other.pos = [list(r) for r in self.pos]
        return other
