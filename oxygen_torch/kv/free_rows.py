"""A set of free row numbers kept as sorted runs, for the CPU tier's rows (kv/tier.py).

A move takes its rows as the lowest free ones and gives them back together, so the free rows are
a few runs of consecutive numbers. Kept as runs, taking n rows touches the first runs only, and
giving back a move's rows merges them as runs: a few list operations where a heap popped and
pushed every row (512 heap operations a 256-block cycle, half the cycle's host time on the CPU:
benchmarks/profile_tier_host.py).
"""

from __future__ import annotations

from bisect import bisect_left


class FreeRows:
    """Free rows as disjoint runs [start, end), sorted and never adjacent (merged)."""

    def __init__(self, n: int = 0):
        self._starts: list[int] = [0] if n else []
        self._ends: list[int] = [n] if n else []
        self._count = n

    def __len__(self) -> int:
        return self._count

    def __contains__(self, row: int) -> bool:
        i = bisect_left(self._ends, row + 1)
        return i < len(self._starts) and self._starts[i] <= row

    def __iter__(self):
        for s, e in zip(self._starts, self._ends):
            yield from range(s, e)

    def take(self, n: int) -> list[int]:
        """The n lowest free rows, taken out (ascending). ValueError: fewer than n are free."""
        if n > self._count:
            raise ValueError(f"{n} rows asked, {self._count} free")
        out: list[int] = []
        starts, ends, k = self._starts, self._ends, 0
        while len(out) < n:
            s, e = starts[k], ends[k]
            m = min(e - s, n - len(out))
            out.extend(range(s, s + m))
            if s + m == e:
                k += 1
            else:
                starts[k] = s + m
        del starts[:k], ends[:k]
        self._count -= n
        return out

    def give(self, rows) -> None:
        """Rows back (in any order). ValueError, nothing given back: a row already free, or
        given twice."""
        rows = sorted(rows)
        if not rows:
            return
        if rows[0] < 0:
            raise ValueError(f"row {rows[0]} is not a row")
        first, n = rows[0], len(rows)
        if rows[-1] - first == n - 1 and rows == list(range(first, first + n)):
            runs = [(first, first + n)]  # one run (a move's rows mostly are): compared in C
        else:
            runs = _runs(rows)
        starts, ends = self._starts, self._ends
        for s, e in runs:  # each checked before any is merged
            i = bisect_left(ends, s + 1)  # the first run that ends past s
            if i < len(starts) and starts[i] < e:
                raise ValueError(f"a row of {s}..{e - 1} is already free")
        for s, e in runs:
            i = bisect_left(ends, s)  # the first run ending at or past s: it ends at s or after e
            if i < len(starts) and ends[i] == s:  # joins the run before it
                ends[i] = e
                if i + 1 < len(starts) and starts[i + 1] == e:  # ... and the one after
                    ends[i] = ends[i + 1]
                    del starts[i + 1], ends[i + 1]
            elif i < len(starts) and starts[i] == e:  # joins the run after it
                starts[i] = s
            else:
                starts.insert(i, s)
                ends.insert(i, e)
        self._count += len(rows)


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """The runs [start, end) of sorted rows (ValueError: a row twice)."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        elif runs and runs[-1][1] > r:
            raise ValueError(f"row {r} given back twice")
        else:
            runs.append((r, r + 1))
    return runs
