"""Sliding-window layers keep only their window in the pool.

When every layer attends to the last `window` tokens, each row gives back its blocks that lie
wholly before that window, plus a margin, at the start of each step. Their table entries become
GUARD_BLOCK; the paged kernels never read a key before the window start (paged_decode `lo`,
paged_prefill `lo_true`), so they never read those entries.

A hybrid model (Gemma-2/3, gpt-oss, Qwen with max_window_layers: some layers slide, the others
see every token) keeps those blocks for its full-attention layers, in the same table, but
*narrows* its references to them (`narrow_window`, `window_layers`): once no reference reads a
block through a sliding layer, the storage unmaps the block's pages in the sliding layers'
regions when no other such block lies on them (kv/storage.py). The kernels of a sliding layer
read nothing before its window, so they never touch those pages; nothing else may read them
either: a swap-out of a row that narrowed blocks is refused (the engine recomputes it), and the
dense read-back of another attention implementation fails. Whole 2 MiB pages go, so the saving
is one of long rows: 4,096 tokens a page at the Llama-1.1B shape.

The margin (one block) keeps a few tokens behind the window, so that a small crop (assisted
decoding rejects a few draft tokens) still finds every key its window needs.
"""

from __future__ import annotations

from .storage import GUARD_BLOCK


class WindowMixin:
    """Part of PagedKVCore: `window` (tokens every layer attends to, None: some layer sees
    everything), `narrow_window` and `window_layers` (a hybrid model's), `seqs`, `_table_host`,
    `pool`."""

    def _window_start(self, n: int, window: int) -> int:
        """The first token position a row holding n tokens keeps: its next query (position n)
        reads keys from n - window + 1; the margin keeps one block more."""
        return n - window + 1 - self.block_tokens

    def _behind(self) -> list[int]:
        """Per row, its leading columns no sliding layer reads: given back or narrowed."""
        seqs = self.seqs
        return seqs.dropped if self.window is not None else seqs.narrowed

    def _drop_behind_window(self) -> None:
        """Gives back (or narrows) every row's blocks wholly before its kept window (call
        before a step reserves: blocks given back can serve the step's new tokens)."""
        window = self.window or self.narrow_window
        if window is None or self.seqs is None:
            return
        bt, seqs, done = self.block_tokens, self.seqs, self._behind()
        due = [b for b, n in enumerate(seqs.lens) if self._window_start(n, window) // bt > done[b]]
        if not due:
            return
        if self.window is None:
            with self.pool.lock:
                self._before_first(due)
                self.pool.window_narrowed_blocks += sum(
                    seqs.narrow_before(b, self._window_start(seqs.lens[b], window)) for b in due
                )
            return
        freed, cols = 0, []
        with self.pool.lock:
            self._before_first(due)
            for b in due:
                c, f = seqs.drop_before(b, self._window_start(seqs.lens[b], window))
                freed += f
                cols.extend((b, col) for col in c)
            self.pool.window_freed_blocks += freed
        if cols:
            rows, columns = zip(*cols)
            self._table_host[list(rows), list(columns)] = GUARD_BLOCK
            self._mark_dirty(min(columns))
            self._mark_dirty(max(columns))

    def _before_first(self, due: list[int]) -> None:
        first = [b for b in due if not self._behind()[b]]
        if first and self.before_drop is not None:
            self.before_drop(self, first)

    def _check_crop(self, remove: int) -> None:
        """crop(remove) must leave every row the keys its next window reads."""
        window = self.window or self.narrow_window
        if window is None:
            return
        bt, seqs = self.block_tokens, self.seqs
        for b, (n, d) in enumerate(zip(seqs.lens, self._behind())):
            first = max(0, n - remove) - window + 1  # the next query's first key
            if d and first < d * bt:
                raise NotImplementedError(
                    f"PagedKVCache.crop: cannot cut {remove} tokens: row {b}'s sliding window "
                    f"of {window} tokens would start at token {max(first, 0)}, but its "
                    f"first {d * bt} tokens ({d} blocks, behind the window) were "
                    + ("given back" if self.window is not None else "narrowed")
                )

    def _check_window(self, layer: int, sliding_window: int | None) -> None:
        """A layer attends with another window than the cache's: keep every block from now
        on, or fail where some were given back (or narrowed) already."""
        if self.window is not None:
            if sliding_window == self.window:
                return
            if self.seqs is not None and any(self.seqs.dropped):
                raise NotImplementedError(
                    f"PagedKVCache: a layer attends with sliding_window={sliding_window}, but "
                    f"the cache gave back blocks behind every layer's window of {self.window} "
                    "tokens"
                )
            self.window = None
        elif self.narrow_window is not None and layer in self.window_layers:
            if sliding_window is not None and sliding_window <= self.narrow_window:
                return
            if self.seqs is not None and any(self.seqs.narrowed):
                raise NotImplementedError(
                    f"PagedKVCache: layer {layer} attends with sliding_window={sliding_window}, "
                    f"but the cache narrowed the blocks behind its sliding layers' window of "
                    f"{self.narrow_window} tokens (their pages are unmapped)"
                )
            self.narrow_window = None


def narrowed_window(cores) -> int | None:
    """The narrowest window behind which any of these cores narrowed blocks (None: none did);
    the merged step computes it once a step, after its cores reserved (kv/merged.py)."""
    return min(
        (c.narrow_window for c in cores if c.narrow_window and any(c.seqs.narrowed)), default=None
    )


def check_narrow_window(layer: int, sliding_window: int | None, narrowed: int, layers) -> None:
    """The merged step's guard: a sliding layer (one of `layers`) of a hybrid pool must not read
    further back than `narrowed`, the narrowest window a call narrowed its blocks behind."""
    if layer in layers and (sliding_window is None or sliding_window > narrowed):
        raise NotImplementedError(
            f"oxygen merged step: layer {layer} attends with sliding_window={sliding_window}, "
            f"but a call narrowed the blocks behind its window of {narrowed} tokens (their "
            "sliding layers' pages are unmapped)"
        )
