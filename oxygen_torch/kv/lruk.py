"""LRU-K (K = 2) ordering: the block whose K-th most recent access is oldest goes first.

O'Neil, O'Neil and Weikum's LRU-K: a block read once (a scan, a one-off prompt) has no K-th
access and goes before any block read twice, so a burst of one-off prompts cannot push out a
system prompt that every request shares. Ties (and blocks read fewer than K times) fall back to
the most recent access, as plain LRU. Times are a logical clock (an int that the owner advances),
so scripted tests do not depend on the wall clock.
"""

from __future__ import annotations

K = 2
NEVER = -1  # "no K-th access": older than any real time


class AccessHistory:
    """The last K access times of one block, newest last."""

    __slots__ = ("times",)

    def __init__(self, now: int | None = None):
        self.times: list[int] = [] if now is None else [now]

    def touch(self, now: int) -> None:
        if self.times and self.times[-1] == now:
            return  # one access per tick: a block read by every layer counts once a step
        self.times.append(now)
        if len(self.times) > K:
            del self.times[0]

    def key(self) -> tuple[int, int]:
        """Eviction order: the smallest key goes first (K-th last access, then last access)."""
        kth = self.times[-K] if len(self.times) >= K else NEVER
        last = self.times[-1] if self.times else NEVER
        return kth, last
