"""The prefix cache: KV blocks of finished prompts kept across calls, found by token content.

A cached block is a node of a chain: its key is (the node before it, its block_tokens token ids),
so a block's key stands for every token before it as well as its own -- a chained hash whose
collisions are ruled out, because the dict compares the tuples it hashed. Only whole blocks are
kept (block-aligned); the node holds one reference on its block, so a cached block stays while a
sequence that found it shares it (copy-on-write, as forks do: `SequenceBlocks.reserve`).

Namespaces keep apart K/V that equal tokens do not make equal: another model's weights, another
precision. The cache is bounded by `budget` device blocks; when full, and when the pool runs out
of free blocks, blocks held by the cache alone are given back in LRU-K order (kv/lruk.py).

Hot and cold (with a CPU tier attached, `attach`): a node is hot (its K/V in a device block) or
cold (in a tier slot, no device block). Giving a block back moves it down to the tier, many in
one transfer; without a tier, or when the tier holds no more, it is dropped, leaves first (a
node's children are unreachable without it). A full tier drops its cold nodes in LRU-K order to
take newer ones, and gives them up at once to a swap-out (kv/swap.py), which comes first. A
lookup only ever returns device blocks: `promote` brings a chain's cold nodes up first. The zone
sweep (`sweep`) moves the coldest down when the pool's device use passes `threshold`, until it is
at most `hot_ratio`; a chain's first block goes down last.

Walks are memoized: a generate() call asks about the same rows several times (promote, peek,
lookup, then insert with the generated tokens appended), later calls start with the same system
prompt, and walking a 2,000-token prompt builds and hashes a key per block. `_walk` keeps the
last walks until a node is removed; a node added (the `version` counter) leaves them right as
far as they go, so a walk remembered before it goes on past its end instead of being returned.
A walk's nodes are live objects, so a node going cold or warm (its block or slot) does not
invalidate it -- callers read `slot` as they go.

Not thread-safe by itself: every method runs under the owning pool's lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence

from .. import _patching
from .block_manager import BlockManager, KVCacheFull
from .lruk import AccessHistory
from .transfer import int64

COLD = -1  # node.block of a node whose K/V is in a tier slot
WALKS = 32  # walks memoized (rows of the last calls); a batch larger than this just re-walks


class _Node:
    __slots__ = ("id", "key", "parent", "block", "slot", "promoted", "children", "hist")

    def __init__(self, id: int, key: tuple, parent: int, block: int, now: int):
        self.id, self.key, self.parent, self.block = id, key, parent, block
        self.slot: int | None = None  # the tier slot of a cold node
        self.promoted = False  # came up from the tier since its last lookup (a CPU-tier hit)
        self.children: set[int] = set()
        self.hist = AccessHistory(now)


class PrefixCache:
    def __init__(self, manager: BlockManager, block_tokens: int, budget: int):
        self.manager, self.block_tokens, self.budget = manager, block_tokens, budget
        self._nodes: dict[tuple, _Node] = {}  # (parent id, token tuple) -> node
        self._by_id: dict[int, _Node] = {}
        self._hot_nodes: dict[int, _Node] = {}  # nodes holding a device block (not in a tier)
        self._roots: dict[Hashable, int] = {}  # namespace -> root id (a node with no block)
        self._next_id = 0
        self._pinned: set[int] = set()  # nodes a promotion is bringing up: not given back
        self._cold = 0  # nodes in a tier slot
        self.version = 0  # bumped whenever a node is added or removed
        # memoized walks: (ns, tokens, nodes, the version they were walked at); cleared when a
        # node is removed
        self._walks: list[tuple[Hashable, list[int], list[_Node], int]] = []
        self.clock = 0
        self.tier = None  # kv/tier.py CPUTier: cold nodes live there (None: no cold zone)
        self.heat = None  # kv/heat.py Heat of the pool's blocks (with the tier)
        self.threshold, self.hot_ratio = 0.8, 0.6  # pool.migration_threshold, .hot_zone_ratio
        self.counts = dict(
            lookups=0, hits=0, misses=0, hit_tokens=0, inserted=0, evicted=0,
            gpu_hit_blocks=0, cpu_hit_blocks=0, demoted=0, promoted=0,
        )  # fmt: skip

    def attach(self, tier, heat) -> None:
        """The pool's CPU tier (and its blocks' heat): from now on, blocks given back go cold."""
        self.tier, self.heat = tier, heat

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _root(self, ns: Hashable) -> int:
        if ns not in self._roots:
            self._roots[ns] = self._new_id()
        return self._roots[ns]

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def num_hot(self) -> int:
        """Nodes holding a device block (the budget counts these)."""
        return len(self._nodes) - self._cold

    @property
    def num_cold(self) -> int:
        """Nodes in a tier slot."""
        return self._cold

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    # --- finding and keeping ---------------------------------------------------------------

    def _added(self) -> None:
        """A node was added: a memoized walk may now stop short (it is still right as far as it
        goes)."""
        self.version += 1

    def _removed(self) -> None:
        """A node was removed: every memoized walk may be wrong."""
        self.version += 1
        self._walks.clear()

    def _walk(self, ns: Hashable, tokens: Sequence[int]) -> list[_Node]:
        """The cached nodes (hot or cold) of `tokens`' whole blocks, from the first up to the
        first block not cached. Memoized: a walk of tokens that start with a remembered walk's
        found blocks goes on from its last node; a walk of the same tokens with no node added
        since is the answer. The list is shared: do not change it."""
        bt = self.block_tokens
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        nodes: list[_Node] = []
        for w_ns, w_tokens, w_nodes, w_version in reversed(self._walks):  # the newest first
            n = len(w_nodes) * bt
            if w_ns != ns or n <= len(nodes) * bt or len(tokens) < n:
                continue
            # its last found block first: another prompt's walk differs there, mostly
            if tokens[n - bt : n] == w_tokens[n - bt : n] and tokens[:n] == w_tokens[:n]:
                if w_version == self.version and tokens[n:] == w_tokens[n:]:
                    return w_nodes
                nodes = w_nodes
        nodes = list(nodes)
        parent = nodes[-1].id if nodes else self._root(ns)
        for i in range(len(nodes), len(tokens) // bt):
            node = self._nodes.get((parent, tuple(tokens[i * bt : (i + 1) * bt])))
            if node is None:
                break
            nodes.append(node)
            parent = node.id
        if len(self._walks) >= WALKS:
            del self._walks[0]
        self._walks.append((ns, list(tokens), nodes, self.version))
        return nodes

    def _hot(self, ns: Hashable, tokens: Sequence[int]) -> list[_Node]:
        """The chain's nodes up to its first miss or cold node."""
        out = []
        for node in self._walk(ns, tokens):
            if node.slot is not None:
                break
            out.append(node)
        return out

    def peek(self, ns: Hashable, tokens: Sequence[int]) -> list[int]:
        """Device blocks of the longest cached block-aligned prefix of `tokens` (no stats, no
        touch); it ends at a cold node."""
        return [n.block for n in self._hot(ns, tokens)]

    def lookup(self, ns: Hashable, tokens: Sequence[int], use: int | None = None) -> list[int]:
        """Like peek, counted as one lookup and touching the blocks; `use` (tokens) is how many
        of the found tokens the caller will really take (the stats count those)."""
        now, nodes = self.tick(), self._hot(ns, tokens)
        took = len(nodes) * self.block_tokens if use is None else min(use, len(tokens))
        counted = -(-max(took, 0) // self.block_tokens)  # blocks the caller takes (part or all)
        for i, node in enumerate(nodes):
            node.hist.touch(now)
            if i < counted:
                self.counts["cpu_hit_blocks" if node.promoted else "gpu_hit_blocks"] += 1
            node.promoted = False
        self.counts["lookups"] += 1
        self.counts["hits" if took > 0 else "misses"] += 1
        self.counts["hit_tokens"] += max(took, 0)
        return [n.block for n in nodes]

    def insert(self, ns: Hashable, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Keeps the whole blocks of a sequence holding `tokens` in `blocks` (a reference each);
        returns how many nodes were added. A block already cached under the same key stays (the
        new copy is freed with its sequence) -- a cold one takes the new copy as its device
        block instead; past the budget, cold blocks make room or the rest is not kept."""
        return self.insert_many([(ns, tokens, blocks)])

    def insert_many(self, items: Sequence[tuple[Hashable, Sequence[int], Sequence[int]]]) -> int:
        """`insert` for several sequences (ns, tokens, blocks) at once -- the rows that end at
        one engine step -- with the room past the budget made once for all of them: one order
        of the cache, one move down to the tier (64 rows ending together made 64 of each, one
        sort of every hot block apiece). Returns how many nodes were added."""
        if self.budget <= 0 or not items:
            return 0
        now, bt = self.tick(), self.block_tokens
        plans, fresh, warm, protect = [], set(), set(), set()
        for ns, tokens, blocks in items:
            count = min(len(tokens) // bt, len(blocks))
            walked = self._walk(ns, tokens)[:count]
            plans.append((ns, tokens, blocks, count))
            protect.update(nd.id for nd in walked)
            warm.update(nd.id for nd in walked if nd.slot is not None)
            # the blocks past the cached chain, keyed by a chained hash of their tokens: rows
            # of one prompt that end together count its new blocks once (a collision only
            # counts one block too few: the loop below still stops at the budget)
            h = hash((ns, walked[-1].id if walked else None))
            for i in range(len(walked), count):
                h = hash((h, tuple(tokens[i * bt : (i + 1) * bt])))
                fresh.add(h)
        # room for the blocks these sequences add or warm past the budget, made in one go, not
        # a block at a time: a sequence of a thousand new blocks into a full cache took seconds
        # that way (64 ending calls of ~450 tokens, 256 MiB, a 1B shape on the H200: 3.9-6.5 s
        # after their last step)
        need = len(fresh) + len(warm)
        if need > 0 and self.num_hot + need > self.budget:
            # (no more than the hot blocks: asking past them would drop cold ones for nothing)
            over = min(self.num_hot + need - self.budget, self.num_hot)
            self.evict(over, protect=protect)
        added = sum(self._keep_chain(ns, t, b, count, now) for ns, t, b, count in plans)
        self.counts["inserted"] += added
        return added

    def _keep_chain(self, ns: Hashable, tokens, blocks, count: int, now: int) -> int:
        """insert_many's nodes of one sequence's first `count` blocks, room already made."""
        added, parent, bt = 0, self._root(ns), self.block_tokens
        # walked again: the room-making may have dropped a cold leaf of the chain found before
        # (drop_cold, making tier room, does not know the protected ids)
        walked = self._walk(ns, tokens)[:count]
        for i in range(count):
            if i < len(walked):
                node = walked[i]
                key = node.key
            else:
                key = (parent, tuple(tokens[i * bt : (i + 1) * bt]))
                node = self._nodes.get(key)
            if (node is None or node.slot is not None) and self.num_hot >= self.budget:
                break  # (what eviction could not make room for is not kept)
            if node is None:
                node = _Node(self._new_id(), key, parent, blocks[i], now)
                self.manager.incref([node.block])
                self._nodes[key], self._by_id[node.id] = node, node
                self._hot_nodes[node.id] = node
                if parent in self._by_id:
                    self._by_id[parent].children.add(node.id)
                self._added()
                added += 1
            elif node.slot is not None:  # warm again for free: the sequence computed it
                self.manager.incref([blocks[i]])
                self.tier.release([node.slot])
                node.block, node.slot = blocks[i], None
                self._hot_nodes[node.id] = node
                self._cold -= 1
            node.hist.touch(now)
            parent = node.id
        return added

    # --- the cold zone ---------------------------------------------------------------------

    def promote(self, ns: Hashable, rows: Sequence[Sequence[int]]) -> int:
        """Brings the cold nodes of each row's chain up to fresh device blocks (one transfer),
        shallowest first; where the pool has no room, the rest stays cold (a chain is cut at
        its first cold node). Returns the blocks brought up."""
        if self.tier is None or not self._cold:
            return 0  # (nothing cold anywhere: no walk needed to know)
        depth: dict[int, int] = {}
        for tokens in rows:
            for d, node in enumerate(self._walk(ns, tokens)):
                depth[node.id] = d
        cold = sorted((d, i) for i, d in depth.items() if self._by_id[i].slot is not None)
        if not cold:
            return 0
        self._pinned = set(depth)
        try:
            try:
                blocks = self.manager.allocate(len(cold))
            except KVCacheFull:  # (it made what room it could first)
                blocks = self.manager.allocate(self.manager.num_free)
        finally:
            self._pinned = set()
        nodes = [self._by_id[i] for _, i in cold[: len(blocks)]]
        slots = [n.slot for n in nodes]
        try:
            self.tier.up(slots, blocks)
        except BaseException:
            self.manager.decref(blocks)
            raise
        self.tier.release(slots)
        for node, block in zip(nodes, blocks):
            node.block, node.slot, node.promoted = block, None, True
            self._hot_nodes[node.id] = node
        self._cold -= len(nodes)
        self.counts["promoted"] += len(nodes)
        return len(nodes)

    def _order(self, nodes: list[_Node]) -> list[_Node]:
        """Hot nodes coldest first (heat counter, then LRU-K); chain heads after all others."""
        heat, by_id = self.heat, self._by_id
        if heat is None or not nodes:
            counters = [0] * len(nodes)
        else:  # one gather of the counters, not a tensor index per node
            counters = heat.counter[int64([n.block for n in nodes])].tolist()
        keyed = sorted(
            range(len(nodes)),
            key=lambda i: (nodes[i].parent not in by_id, counters[i], nodes[i].hist.key()),
        )
        return [nodes[i] for i in keyed]

    def demote(self, n: int, protect: set[int] = frozenset()) -> int:
        """Moves up to n hot blocks only the cache holds down to the tier, coldest first (cold
        nodes dropped, LRU-K, where the tier lacks room); returns the device blocks freed."""
        if self.tier is None or n <= 0:
            return 0
        skip = set(protect) | self._pinned
        free = [
            nd for nd in self._hot_nodes.values()
            if nd.id not in skip and self.manager.refcount(nd.block) == 1
        ]  # fmt: skip
        nodes = self._order(free)[:n]
        if len(nodes) > self.tier.num_free:
            self.drop_cold(len(nodes) - self.tier.num_free)
        if len(nodes) > self.tier.num_free:
            _patching.warn_once(
                "oxygen_torch: the KV CPU tier is full (pool.cpu_tier_bytes); prefix-cache "
                "blocks are dropped instead of kept cold"
            )
            nodes = nodes[: self.tier.num_free]
        if not nodes:
            return 0
        blocks = [nd.block for nd in nodes]
        for nd, slot in zip(nodes, self.tier.down(blocks)):
            nd.block, nd.slot, nd.promoted = COLD, slot, False
            del self._hot_nodes[nd.id]
        self.manager.decref(blocks, after=self.tier.fence())  # freed behind the copy
        if self.heat is not None:
            self.heat.forget(blocks)
        self._cold += len(nodes)
        self.counts["demoted"] += len(nodes)
        return len(nodes)

    def drop_cold(self, n: int) -> int:
        """Frees up to n tier slots: cold nodes with no children go, LRU-K order (a parent left
        childless may follow); returns the slots freed."""
        order = sorted(
            (nd.hist.key(), nd.id) for nd in self._by_id.values()
            if nd.slot is not None and not nd.children and nd.id not in self._pinned
        )  # fmt: skip
        gone = 0
        while order and gone < n:
            _, nid = order.pop(0)
            node = self._remove(nid)
            parent = self._by_id.get(node.parent)
            if parent is not None and parent.slot is not None and not parent.children:
                if parent.id not in self._pinned:
                    bisect.insort(order, (parent.hist.key(), parent.id))
            gone += 1
        self.counts["evicted"] += gone
        return gone

    def sweep(self) -> int:
        """The zones: when the pool's device use is above `threshold` of its blocks, the
        coldest cached blocks go down until it is at most `hot_ratio`; returns how many."""
        if self.tier is None:
            return 0
        m = self.manager
        total = m.num_blocks - m.first_id
        if m.num_used <= self.threshold * total:
            return 0
        return self.demote(m.num_used - int(self.hot_ratio * total))

    # --- giving blocks back ------------------------------------------------------------------

    def _remove(self, nid: int) -> _Node:
        """Takes node nid out (a leaf): its device reference or tier slot goes back."""
        node = self._by_id.pop(nid)
        self._hot_nodes.pop(nid, None)
        del self._nodes[node.key]
        self._removed()
        parent = self._by_id.get(node.parent)
        if parent is not None:
            parent.children.discard(nid)
        if node.slot is not None:
            self.tier.release([node.slot])
            self._cold -= 1
        else:
            self.manager.decref([node.block])
        return node

    def _busy(self) -> set[int]:
        """Ids of the nodes a sequence shares (a device block with another reference) and of
        their ancestors: every other node's block and its descendants' only the cache holds.
        Walks up from the shared hot nodes only (a cold node is never shared): the engine asks
        every step (reclaimable), and the cold zone may hold thousands of nodes."""
        busy: set[int] = set()
        refcount, by_id = self.manager.refcount, self._by_id
        for node in self._hot_nodes.values():
            if refcount(node.block) > 1:
                while node is not None and node.id not in busy:
                    busy.add(node.id)
                    node = by_id.get(node.parent)
        return busy

    def _free_subtrees(self) -> set[int]:
        """Ids of nodes whose block and every descendant's block only the cache holds."""
        return set(self._by_id) - self._busy()

    def reclaimable(self) -> int:
        """Device blocks the cache would give back if the pool needed them."""
        busy = self._busy()
        drop = sum(i not in busy for i in self._hot_nodes)
        if self.tier is None:
            return drop
        refcount = self.manager.refcount
        single = sum(refcount(n.block) == 1 for n in self._hot_nodes.values())
        room = self.tier.num_free
        if room < single:  # (the cold leaves' count matters only then: it walks the cold zone)
            room += sum(n.slot is not None and not n.children for n in self._by_id.values())
        return max(drop, min(single, room))

    def evict(self, n: int, protect: set[int] = frozenset()) -> int:
        """Gives back up to n device blocks only the cache holds: down to the tier when there
        is one with room, else dropped, leaves first, in LRU-K order."""
        down = self.demote(n, protect)
        if down >= n:
            return down
        free = self._free_subtrees() - set(protect) - self._pinned
        order = sorted((self._by_id[i].hist.key(), i) for i in free if not self._by_id[i].children)
        gone = 0
        while order and gone < n - down:
            _, nid = order.pop(0)
            node = self._remove(nid)
            parent = self._by_id.get(node.parent)
            if parent is not None and not parent.children and parent.id in free:
                bisect.insort(order, (parent.hist.key(), parent.id))
            gone += node.slot is None
            self.counts["evicted"] += 1
        return down + gone

    def clear(self) -> int:
        """Drops every node (blocks still shared by sequences stay theirs)."""
        blocks = [nd.block for nd in self._by_id.values() if nd.slot is None]
        slots = [nd.slot for nd in self._by_id.values() if nd.slot is not None]
        n, self._cold = len(self._by_id), 0
        self._nodes.clear()
        self._by_id.clear()
        self._hot_nodes.clear()
        self._removed()
        if slots:
            self.tier.release(slots)
        if blocks:
            self.manager.decref(blocks)
        return n

    def stats(self) -> dict:
        c = self.counts
        hit = c["gpu_hit_blocks"] + c["cpu_hit_blocks"]
        hot = self.num_hot
        return {
            **c,
            "cached_blocks": len(self._nodes),
            "hot_blocks": hot,
            "cold_blocks": len(self._nodes) - hot,
            "budget_blocks": self.budget,
            "reclaimable_blocks": self.reclaimable(),
            "hot_zone_hit_ratio": c["gpu_hit_blocks"] / hit if hit else None,
        }
