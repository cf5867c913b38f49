"""The prefix cache: KV blocks of finished prompts kept across calls, found by token content.

A cached block is a node of a chain: its key is (the node before it, its block_tokens token ids),
so a block's key stands for every token before it as well as its own -- a chained hash whose
collisions are ruled out, because the dict compares the tuples it hashed. Only whole blocks are
kept (block-aligned); the node holds one reference on its block, so a cached block stays while a
sequence that found it shares it (copy-on-write, as forks do: `SequenceBlocks.reserve`).

Namespaces keep apart K/V that equal tokens do not make equal: another model's weights, another
precision. The cache is bounded by `budget` blocks; when full, and when the pool runs out of free
blocks, blocks held by the cache alone are dropped in LRU-K order (kv/lruk.py), leaves first
(a node's children are unreachable without it).

Not thread-safe by itself: every method runs under the owning pool's lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence

from .block_manager import BlockManager
from .lruk import AccessHistory


class _Node:
    __slots__ = ("id", "key", "parent", "block", "children", "hist")

    def __init__(self, id: int, key: tuple, parent: int, block: int, now: int):
        self.id, self.key, self.parent, self.block = id, key, parent, block
        self.children: set[int] = set()
        self.hist = AccessHistory(now)


class PrefixCache:
    def __init__(self, manager: BlockManager, block_tokens: int, budget: int):
        self.manager, self.block_tokens, self.budget = manager, block_tokens, budget
        self._nodes: dict[tuple, _Node] = {}  # (parent id, token tuple) -> node
        self._by_id: dict[int, _Node] = {}
        self._roots: dict[Hashable, int] = {}  # namespace -> root id (a node with no block)
        self._next_id = 0
        self.clock = 0
        self.counts = dict(lookups=0, hits=0, misses=0, hit_tokens=0, inserted=0, evicted=0)

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _root(self, ns: Hashable) -> int:
        if ns not in self._roots:
            self._roots[ns] = self._new_id()
        return self._roots[ns]

    def __len__(self) -> int:
        return len(self._nodes)

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    # --- finding and keeping ---------------------------------------------------------------

    def _chain(self, ns: Hashable, tokens: Sequence[int]):
        """(key, node or None) of each whole block of `tokens`; past a miss it goes on only if
        the caller made that node meanwhile (insert), else it stops."""
        bt, parent = self.block_tokens, self._root(ns)
        for i in range(len(tokens) // bt):
            key = (parent, tuple(tokens[i * bt : (i + 1) * bt]))
            yield key, self._nodes.get(key)
            node = self._nodes.get(key)
            if node is None:
                return
            parent = node.id

    def peek(self, ns: Hashable, tokens: Sequence[int]) -> list[int]:
        """Blocks of the longest cached block-aligned prefix of `tokens` (no stats, no touch)."""
        return [n.block for _, n in self._chain(ns, tokens) if n is not None]

    def lookup(self, ns: Hashable, tokens: Sequence[int], use: int | None = None) -> list[int]:
        """Like peek, counted as one lookup and touching the blocks; `use` (tokens) is how many
        of the found tokens the caller will really take (the stats count those)."""
        now, found = self.tick(), []
        for _, node in self._chain(ns, tokens):
            if node is None:
                break
            node.hist.touch(now)
            found.append(node.block)
        took = len(found) * self.block_tokens if use is None else min(use, len(tokens))
        self.counts["lookups"] += 1
        self.counts["hits" if took > 0 else "misses"] += 1
        self.counts["hit_tokens"] += max(took, 0)
        return found

    def insert(self, ns: Hashable, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Keeps the whole blocks of a sequence holding `tokens` in `blocks` (a reference each);
        returns how many nodes were added. A block already cached under the same key stays (the
        new copy is freed with its sequence); past the budget, cold blocks make room or the
        rest is not kept."""
        if self.budget <= 0:
            return 0
        now, added, path = self.tick(), 0, set()
        parent = self._root(ns)
        for i, (key, node) in enumerate(self._chain(ns, tokens)):
            if i >= len(blocks):
                break
            if node is None:
                if len(self._nodes) >= self.budget and not self.evict(1, protect=path):
                    break
                node = _Node(self._new_id(), key, parent, blocks[i], now)
                self.manager.incref([node.block])
                self._nodes[key], self._by_id[node.id] = node, node
                if parent in self._by_id:
                    self._by_id[parent].children.add(node.id)
                added += 1
            node.hist.touch(now)
            path.add(node.id)
            parent = node.id
        self.counts["inserted"] += added
        return added

    # --- giving blocks back ------------------------------------------------------------------

    def _free_subtrees(self) -> set[int]:
        """Ids of nodes whose block and every descendant's block only the cache holds."""
        busy: set[int] = set()
        for node in sorted(self._by_id.values(), key=lambda n: -n.id):  # children first
            if node.id in busy or self.manager.refcount(node.block) > 1:
                busy.add(node.id)
                if node.parent in self._by_id:
                    busy.add(node.parent)
        return set(self._by_id) - busy

    def reclaimable(self) -> int:
        """Blocks the cache would give back if the pool needed them."""
        return len(self._free_subtrees())

    def evict(self, n: int, protect: set[int] = frozenset()) -> int:
        """Drops up to n blocks only the cache holds, leaves first, in LRU-K order."""
        free = self._free_subtrees() - set(protect)
        order = sorted((self._by_id[i].hist.key(), i) for i in free if not self._by_id[i].children)
        gone = 0
        while order and gone < n:
            _, nid = order.pop(0)
            node = self._by_id.pop(nid)
            del self._nodes[node.key]
            parent = self._by_id.get(node.parent)
            if parent is not None:
                parent.children.discard(nid)
                if not parent.children and parent.id in free:
                    bisect.insort(order, (parent.hist.key(), parent.id))
            self.manager.decref([node.block])
            gone += 1
        self.counts["evicted"] += gone
        return gone

    def clear(self) -> int:
        """Drops every node (blocks still shared by sequences stay theirs)."""
        blocks = [n.block for n in self._by_id.values()]
        self._nodes.clear()
        self._by_id.clear()
        if blocks:
            self.manager.decref(blocks)
        return len(blocks)

    def stats(self) -> dict:
        return {
            **self.counts,
            "cached_blocks": len(self._nodes),
            "budget_blocks": self.budget,
            "reclaimable_blocks": self.reclaimable(),
        }
