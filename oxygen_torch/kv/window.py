"""Sliding-window layers keep only their window in the pool: a PagedKVCore whose every layer
attends to the last `window` tokens gives back each row's blocks that lie wholly before that
window, plus a margin, at the start of each step. Their table entries become GUARD_BLOCK; the
paged kernels never read a key before the window start (paged_decode `lo`, paged_prefill
`lo_true`), so they never read those entries.

The margin (one block) keeps a few tokens behind the window, so that a small crop (assisted
decoding rejects a few draft tokens) still finds every key its window needs. One table serves
every layer, so a model with any full-attention layer (hybrid: Gemma-2/3, Qwen with
max_window_layers > 0) keeps every block: its cache gets no window.
"""

from __future__ import annotations

from .storage import GUARD_BLOCK


class WindowMixin:
    """Part of PagedKVCore: `window` (tokens every layer attends to, None: some layer sees
    everything), `seqs`, `_table_host`, `pool`."""

    def _window_start(self, n: int) -> int:
        """The first token position a row holding n tokens keeps: its next query (position n)
        reads keys from n - window + 1; the margin keeps one block more."""
        return n - self.window + 1 - self.block_tokens

    def _drop_behind_window(self) -> None:
        """Gives back every row's blocks wholly before its kept window (call before a step
        reserves: those blocks can serve the step's new tokens)."""
        if self.window is None or self.seqs is None:
            return
        bt, seqs = self.block_tokens, self.seqs
        due = [b for b, n in enumerate(seqs.lens) if self._window_start(n) // bt > seqs.dropped[b]]
        if not due:
            return
        freed, cols = 0, []
        with self.pool.lock:
            first = [b for b in due if not seqs.dropped[b]]
            if first and self.before_drop is not None:
                self.before_drop(self, first)
            for b in due:
                c, f = seqs.drop_before(b, self._window_start(seqs.lens[b]))
                freed += f
                cols.extend((b, col) for col in c)
            self.pool.window_freed_blocks += freed
        if cols:
            rows, columns = zip(*cols)
            self._table_host[list(rows), list(columns)] = GUARD_BLOCK
            self._mark_dirty(min(columns))
            self._mark_dirty(max(columns))

    def _check_crop(self, remove: int) -> None:
        """crop(remove) must leave every row the keys its next window reads."""
        if self.window is None:
            return
        bt, seqs = self.block_tokens, self.seqs
        for b, (n, d) in enumerate(zip(seqs.lens, seqs.dropped)):
            first = max(0, n - remove) - self.window + 1  # the next query's first key
            if d and first < d * bt:
                raise NotImplementedError(
                    f"PagedKVCache.crop: cannot cut {remove} tokens: row {b}'s sliding window "
                    f"of {self.window} tokens would start at token {max(first, 0)}, but its "
                    f"first {d * bt} tokens ({d} blocks, behind the window) were given back"
                )

    def _check_window(self, sliding_window: int | None) -> None:
        """A layer attends with another window than the cache's: keep every block from now
        on, or fail where some were given back already."""
        if self.window is None or sliding_window == self.window:
            return
        if self.seqs is not None and any(self.seqs.dropped):
            raise NotImplementedError(
                f"PagedKVCache: a layer attends with sliding_window={sliding_window}, but the "
                f"cache gave back blocks behind every layer's window of {self.window} tokens"
            )
        self.window = None
