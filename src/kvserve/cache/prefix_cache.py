"""PrefixCache: a radix tree over token ids whose nodes own KV blocks.

Each edge is one block's worth of tokens, so a node is exactly one KV block: a full block (block_size
tokens) or, at a leaf, a partial block (fewer tokens, e.g. the tail of a finished reply). Children are
found by their exact token tuple; a partial match is found by the longest common prefix among the
children, and is reported so that the caller copies that block before writing into it (copy on write).
Hits are therefore exact to the token, not rounded down to a block boundary.

With a sliding pool (a model whose sliding layers hold their KV in blocks of their own), a node also
keeps the sliding layers' block of its positions, or a tombstone (`sliding` None) once that block was
freed. A cached prefix is usable only where its last window still has its sliding blocks: `match` cuts
a match back to the last prefix whose window is whole (the rule is sliding_pool.py's `usable`).
"""

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.cache.block_pool import RELEASED, BlockPool
from kvserve.cache.sliding_pool import NO_SLIDING_POOL, NoSlidingPool
from kvserve.cache.state_pool import NoStatePool
from kvserve.sequences import common_prefix_len

NO_STATE_POOL = NoStatePool()


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    block: int
    parent: "_Node | None"
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    last_access: int = 0
    # Length of the prefix that ends at this node, and how often a match ended here (for `hot_branches`).
    depth: int = 0
    namespace: str = ""
    hits: int = 0
    last_hit: float = 0.0
    # The sliding layers' block of the same positions (with a sliding pool); None: a tombstone.
    sliding: int | None = None
    # A hybrid model's state checkpoints at this node: the state after its first k tokens, by k (1 to
    # len(tokens)), as a StatePool slot.
    checkpoints: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Branch:
    """A cached prefix that requests hit: `num_tokens` long, hit `hits` times, last at `last_hit` (Unix
    time). As a tree: `parent` is the index, in the same list, of the longest listed prefix that this one
    extends (None: none), `start` that prefix's length (0 without one), and `head` the first tokens after
    it, where this branch parts from its parent."""

    namespace: str
    num_tokens: int
    hits: int
    last_hit: float
    head: tuple[int, ...]
    parent: int | None = None
    start: int = 0


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix of a token sequence.

    `blocks` are full blocks holding tokens [0, len(blocks) * block_size). If `partial_block` is set, its
    first `num_tokens - len(blocks) * block_size` tokens hold the rest of the match; it belongs to the
    cache and must be copied, never written. The result holds no reference: lock what you use at once.

    With a sliding pool, `sliding[j]` is the sliding block of `blocks[j]` for the blocks that the next
    token's window reads (from `SlidingPool.first_read(num_tokens)` on), RELEASED before them, and
    `partial_sliding` the partial block's sliding block.
    """

    blocks: tuple[int, ...] = ()
    num_tokens: int = 0
    partial_block: int | None = None
    sliding: tuple[int, ...] = ()
    partial_sliding: int | None = None
    # With `checkpointed` matching: the slot of the state after `num_tokens` tokens (None: none, the
    # match is empty), and the tokens the KV match held past it, which the request recomputes.
    checkpoint: int | None = None
    recomputed: int = 0


class PrefixCache:
    """Maps token prefixes, per namespace, to the KV blocks that hold them.

    Invariants:
    - The tree owns one pool reference to every block of its nodes; a block whose only reference is the
      tree's is unlocked, any other reference (a running request) locks it.
    - Only leaves whose block is unlocked are evicted, least recently used first, and only by `evict`.
    - Partial blocks are only ever leaves; a match never crosses namespaces.

    With a sliding pool (`sliding`, see sliding_pool.py):
    - Every node holds its global block; its sliding block, when it has one, is another tree reference
      (in the sliding pool), and no two nodes share one. A node whose sliding block only the tree holds
      may be tombstoned (`evict_sliding`): the block is freed, the node stays.
    - A prefix of length P is usable when the nodes that the next token's window reads, those holding
      positions from `sliding.first_read(P)` on, all hold their sliding blocks. `match` returns the
      longest usable prefix of its walk (`sliding.usable`): a match past a tombstone inside the last
      window is cut back to the tombstone's block, and a partial leaf is used only if its own window is
      whole.
    - Tombstoning takes unlocked sliding blocks in `sliding.tombstone_order`; evicting a leaf frees its
      sliding block with it, and leaves that are tombstones (no match can end there) go first.
    """

    enabled = True

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        sliding: NoSlidingPool = NO_SLIDING_POOL,
        states: NoStatePool = NO_STATE_POOL,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.sliding = sliding
        self.states = states
        # Every checkpoint in the tree by slot: its node, its length in the node and when it was last
        # matched or made (the tree's clock).
        self._checkpoints: dict[int, tuple[_Node, int]] = {}
        self._checkpoint_use: dict[int, int] = {}
        self.num_checkpoints_evicted = 0
        self.num_tombstoned = 0
        self._roots: dict[str, _Node] = {}
        self._clock = itertools.count(1)
        # Eviction only ever looks at leaves; in chat workloads they are few next to the inner nodes.
        self._leaves: set[_Node] = set()
        self.num_nodes = 0
        # Nodes per namespace, so that a tenant is shown its own count without a tree walk.
        self._nodes_in: Counter[str] = Counter()
        self.num_evicted = 0
        # Nodes where a match ended, kept so that the heaviest branches are found without a tree walk;
        # pruned to HOT_LIMIT by score (tokens x hits) whenever it doubles.
        self._hot: dict[_Node, None] = {}

    def _root(self, namespace: str) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node((), -1, None, namespace=namespace)
        return root

    def match(
        self,
        namespace: str,
        tokens: Sequence[int],
        record_hit: bool = True,
        partial: bool = True,
        checkpointed: bool = False,
    ) -> MatchResult:
        """Longest usable cached prefix of `tokens`; marks the matched nodes as recently used and, with
        `record_hit`, counts a hit where the match ended. `partial` False: whole blocks only.
        `checkpointed` (a hybrid model's admission): the match is cut back to the last state checkpoint
        at or before its end (`_checkpointed`), and names it.

        Full blocks are followed by exact token tuple; the rest is matched against the last full node's
        children by longest common prefix, ties to the most recently used child. With a sliding pool the
        match is then cut back to its longest usable prefix (the class docstring's rule).
        """
        bs = self.block_size
        node = self._roots.get(namespace)
        if node is None:
            return MatchResult()
        now = next(self._clock)
        path: list[_Node] = []
        i = 0
        while i + bs <= len(tokens):
            child = node.children.get(tuple(tokens[i : i + bs]))
            if child is None:
                break
            child.last_access = now
            path.append(child)
            node = child
            i += bs
        best, best_node = 0, None
        rest = tokens[i : i + bs] if partial else ()
        for child in node.children.values():
            n = common_prefix_len(child.tokens, rest)
            # Ties go to the most recently used child, so that which block is copied (and kept warm) is
            # a rule, not an accident of dict order.
            if n > best or (
                n == best and best_node is not None and child.last_access > best_node.last_access
            ):
                best, best_node = n, child
        if best_node is not None:
            best_node.last_access = now
        path, best_node, best = self._usable(path, best_node, best)
        if checkpointed:
            root = self._roots[namespace]
            return self._checkpointed(root, tokens, path, best_node, best, partial, now, record_hit)
        blocks = tuple(n.block for n in path)
        end = len(path) * bs + best
        window = self.sliding.window_blocks([n.sliding for n in path], end)
        if best_node is None:
            if path and record_hit:
                self._record_hit(path[-1])
            return MatchResult(blocks, end, sliding=window)
        if record_hit:
            self._record_hit(best_node)
        return MatchResult(blocks, end, best_node.block, window, best_node.sliding)

    def _checkpointed(
        self,
        root: _Node,
        tokens: Sequence[int],
        path: list[_Node],
        partial: _Node | None,
        n_partial: int,
        allow_partial: bool,
        now: int,
        hit: bool,
    ) -> MatchResult:
        """The match (full nodes `path` under `root`, then `n_partial` tokens of `partial`) cut back to
        its last state checkpoint: the longest prefix P of it with a checkpoint at P. A checkpoint inside
        a block may sit at any node that begins with the same tokens (the sequence that made it may have
        gone on otherwise than this match): that node's block is then the partial block, copied on
        write. `allow_partial` False: only checkpoints at a block's end count."""
        bs = self.block_size
        end = len(path) * bs + (n_partial if partial is not None else 0)
        top = len(path) if partial is not None else len(path) - 1
        for j in range(top, -1, -1):
            parent = path[j - 1] if j else root
            limit = bs if j < len(path) else n_partial
            level = tokens[j * bs : j * bs + limit]
            best: tuple[int, _Node] | None = None
            for child in parent.children.values():
                if not child.checkpoints:
                    continue
                n = common_prefix_len(child.tokens, level)
                for k in child.checkpoints:
                    if k <= n and (allow_partial or k == bs) and (best is None or k > best[0]):
                        best = (k, child)
            if best is None:
                continue
            k, node = best
            slot = node.checkpoints[k]
            self._checkpoint_use[slot] = now
            if hit:
                self._record_hit(node)
            full = path[:j] + ([node] if k == bs else [])
            at = j * bs + k
            window = self.sliding.window_blocks([n.sliding for n in full], at)
            blocks = tuple(n.block for n in full)
            if k < bs:
                return MatchResult(blocks, at, node.block, window, node.sliding, slot, end - at)
            return MatchResult(blocks, at, sliding=window, checkpoint=slot, recomputed=end - at)
        return MatchResult(recomputed=end)

    def add_checkpoint(self, namespace: str, tokens: Sequence[int], slot: int) -> bool:
        """Keep `slot` as the state after `tokens`, at the node that holds their last token; False (the
        caller frees the slot) where no node holds it yet or a checkpoint of that prefix exists."""
        bs = self.block_size
        node = self._roots.get(namespace)
        if node is None or not tokens:
            return False
        full, rest = divmod(len(tokens), bs)
        if rest == 0:
            full, rest = full - 1, bs
        for j in range(full):
            child = node.children.get(tuple(tokens[j * bs : (j + 1) * bs]))
            if child is None:
                return False
            node = child
        key = tuple(tokens[full * bs :])
        holder = next((c for c in node.children.values() if c.tokens[:rest] == key), None)
        if holder is None or rest in holder.checkpoints:
            if holder is not None:
                self._checkpoint_use[holder.checkpoints[rest]] = next(self._clock)
            return False
        holder.checkpoints[rest] = slot
        self._checkpoints[slot] = (holder, rest)
        self._checkpoint_use[slot] = next(self._clock)
        return True

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpoints)

    def checkpoint_slots(self) -> list[int]:
        return list(self._checkpoints)

    def evict_checkpoint(self) -> bool:
        """Free the least valuable checkpoint: those at nodes only the tree holds before those a sequence,
        a pin or a retention holds too, each least recently used first. False when there is none."""
        if not self._checkpoints:
            return False

        def key(slot: int) -> tuple[bool, int]:
            node, _ = self._checkpoints[slot]
            return (self.pool.ref_count(node.block) > 1, self._checkpoint_use[slot])

        slot = min(self._checkpoints, key=key)
        self.num_checkpoints_evicted += 1
        node, k = self._checkpoints.pop(slot)
        del node.checkpoints[k]
        del self._checkpoint_use[slot]
        self.states.free_checkpoint(slot)
        return True

    def _drop_checkpoints(self, node: _Node) -> None:
        for slot in node.checkpoints.values():
            del self._checkpoints[slot]
            del self._checkpoint_use[slot]
            self.states.free_checkpoint(slot)
        node.checkpoints = {}

    def check_checkpoints(self) -> None:
        """Every checkpoint is at a node of the tree, within its tokens, and listed once."""
        listed = 0
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                for k, slot in node.checkpoints.items():
                    assert 1 <= k <= len(node.tokens), "a checkpoint lies past its node's tokens"
                    assert self._checkpoints.get(slot) == (node, k), "a checkpoint is not listed"
                    listed += 1
                stack.extend(node.children.values())
        assert listed == len(self._checkpoints), "a listed checkpoint is not in the tree"

    def _usable(
        self, path: list[_Node], partial: _Node | None, n_partial: int
    ) -> tuple[list[_Node], _Node | None, int]:
        """The longest usable prefix of a match (full nodes `path`, then `n_partial` tokens of
        `partial`), after the sliding pool's rule."""
        nodes = path + ([partial] if partial is not None else [])
        end = len(path) * self.block_size + (n_partial if partial is not None else 0)
        m = self.sliding.usable([n.sliding is None for n in nodes], end)
        if m > len(path):
            return path, partial, n_partial
        return path[:m], None, 0

    HOT_LIMIT = 1024

    def _record_hit(self, node: _Node) -> None:
        node.hits += 1
        node.last_hit = time.time()
        self._hot[node] = None
        if len(self._hot) > 2 * self.HOT_LIMIT:
            keep = heapq.nlargest(self.HOT_LIMIT, self._hot, key=lambda n: n.depth * n.hits)
            self._hot = dict.fromkeys(keep)

    def hot_branches(self, limit: int, namespace: str | None = None) -> list[Branch]:
        """The `limit` heaviest hit prefixes by tokens x hits (of one namespace, or all), heaviest first,
        then the prefixes where their paths part (fewer than `limit`), so that they form a tree: a shared
        system prompt is one trunk even when no match ended exactly at its end.

        Costs the number of distinct prefixes hit lately (at most 2 x HOT_LIMIT) plus the listed
        prefixes' lengths in blocks, not the tree's size. A partial hit counts for the whole node it
        matched into.
        """
        nodes = (n for n in self._hot if namespace is None or n.namespace == namespace)
        hot = heapq.nlargest(limit, nodes, key=lambda n: n.depth * n.hits)
        # Each hot node's path up to its namespace's root (which has no parent), shared parts walked once.
        children: dict[_Node, set[_Node]] = {}
        for node in hot:
            child = node
            while child.parent is not None and child.parent.parent is not None:
                below = children.setdefault(child.parent, set())
                if child in below:
                    break
                below.add(child)
                child = child.parent
        listed = dict.fromkeys(hot)
        listed.update((n, None) for n, below in children.items() if len(below) > 1 and n not in listed)
        index = {n: i for i, n in enumerate(listed)}
        out = []
        for node in listed:
            first, up = node, node.parent
            while up is not None and up.parent is not None and up not in index:
                first, up = up, up.parent
            parent = index.get(up) if up is not None else None
            start = up.depth if up is not None and parent is not None else 0
            out.append(
                Branch(node.namespace, node.depth, node.hits, node.last_hit, first.tokens, parent, start)
            )
        return out

    def insert(
        self,
        namespace: str,
        tokens: Sequence[int],
        blocks: Sequence[int],
        sliding: Sequence[int] | None = None,
    ) -> int:
        """Record that blocks[j] holds tokens[j*bs : (j+1)*bs] (the last block may be partial), and with
        a sliding pool that sliding[j] holds the same positions in the sliding layers (RELEASED: the
        caller let it go, the node is a tombstone).

        Every token must already have its KV computed. Blocks the tree lacks gain a tree reference;
        where the tree already holds the same tokens, its own block stays, and a tombstone there takes
        the given sliding block. Returns the number of new nodes.
        """
        bs = self.block_size
        if len(blocks) != -(-len(tokens) // bs):
            raise ValueError(f"{len(tokens)} tokens need {-(-len(tokens) // bs)} blocks, got {len(blocks)}")
        node = self._root(namespace)
        now = next(self._clock)
        added = 0
        for j, block in enumerate(blocks):
            key = tuple(tokens[j * bs : (j + 1) * bs])
            child = node.children.get(key)
            if child is None and len(key) < bs and self._covered(node, key):
                return added
            if child is None:
                child = _Node(key, block, node, depth=node.depth + len(key), namespace=namespace)
                self._drop_covered_partials(node, child)
                node.children[key] = child
                self._leaves.discard(node)
                self._leaves.add(child)
                self.pool.ref(block)
                self.num_nodes += 1
                self._nodes_in[namespace] += 1
                added += 1
            if child.sliding is None and sliding is not None and sliding[j] != RELEASED:
                child.sliding = sliding[j]
                self.sliding.ref_all([sliding[j]])
            child.last_access = now
            node = child
        return added

    def num_nodes_in(self, namespace: str) -> int:
        """The blocks one namespace's prefixes hold."""
        return self._nodes_in[namespace]

    def _covered(self, node: _Node, key: tuple[int, ...]) -> bool:
        return any(len(c.tokens) >= len(key) and c.tokens[: len(key)] == key for c in node.children.values())

    def _drop_covered_partials(self, node: _Node, new: _Node) -> None:
        """A partial leaf whose tokens begin the new node's holds nothing the new node lacks: free it
        if unused. Its hits carry over to the new node (it is the same prefix, grown)."""
        key = new.tokens
        for k, child in list(node.children.items()):
            if len(k) < len(key) and key[: len(k)] == k and self.pool.ref_count(child.block) == 1:
                # Its checkpoints are of prefixes the new node holds: they move there.
                for at, slot in child.checkpoints.items():
                    if at in new.checkpoints:
                        self._checkpoints.pop(slot)
                        self._checkpoint_use.pop(slot)
                        self.states.free_checkpoint(slot)
                    else:
                        new.checkpoints[at] = slot
                        self._checkpoints[slot] = (new, at)
                child.checkpoints = {}
                if child.hits:
                    new.hits += child.hits
                    new.last_hit = max(new.last_hit, child.last_hit)
                    self._hot[new] = None
                self._remove(child)

    def _remove(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.tokens]
        self._leaves.discard(node)
        self._hot.pop(node, None)
        if not parent.children and parent.parent is not None:
            self._leaves.add(parent)
        self.pool.release(node.block)
        self._drop_checkpoints(node)
        if node.sliding is not None:
            self.sliding.release_all([node.sliding])
        self.num_nodes -= 1
        self._nodes_in[node.namespace] -= 1
        if not self._nodes_in[node.namespace]:
            del self._nodes_in[node.namespace]

    def _evictable(self, node: _Node) -> bool:
        return node.parent is not None and not node.children and self.pool.ref_count(node.block) == 1

    def _eviction_key(self, node: _Node) -> tuple[bool, int, int]:
        # With a sliding pool a tombstoned leaf goes first: no match can end there.
        return (not self.sliding.enabled or node.sliding is not None, node.last_access, id(node))

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` unlocked leaf blocks, least recently used first (tombstoned leaves
        before the others); returns how many."""
        heap = [(self._eviction_key(n), n) for n in self._leaves if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, node = heapq.heappop(heap)
            parent = node.parent
            self._remove(node)
            freed += 1
            if parent is not None and self._evictable(parent):
                heapq.heappush(heap, (self._eviction_key(parent), parent))
        self.num_evicted += freed
        return freed

    def evict_sliding(self, num_blocks: int) -> int:
        """Free up to `num_blocks` sliding blocks that only the tree holds, tombstoning their nodes: old
        positions first (nodes that no leaf below reads in its last window), each kind least recently
        used first, and among equally recent ones the earlier positions first. Returns how many; walks
        the tree (called only when the sliding pool is short)."""
        if not self.sliding.enabled:
            return 0
        candidates: list[tuple[bool, int, int, int, _Node]] = []
        for root in self._roots.values():
            order: list[_Node] = []
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                order.append(node)
                stack.extend(node.children.values())
            # The shallowest leaf below each node, children before parents.
            lowest: dict[_Node, int] = {}
            for node in reversed(order):
                lowest[node] = min((lowest[c] for c in node.children.values()), default=node.depth)
            for node in order:
                if node.sliding is not None and self.sliding.only_tree_holds(node.sliding):
                    order_key = self.sliding.tombstone_order(node.depth, lowest[node], node.last_access)
                    candidates.append((*order_key, id(node), node))
        freed = 0
        for *_, node in heapq.nsmallest(num_blocks, candidates):
            assert node.sliding is not None
            self.sliding.release_all([node.sliding])
            node.sliding = None
            freed += 1
        self.num_tombstoned += freed
        return freed

    def reset(self) -> int:
        """Evict every unlocked block; returns how many were freed."""
        freed = self.evict(self.num_nodes)
        self.num_evicted -= freed
        return freed

    def sliding_entries(self) -> dict[tuple[str, tuple[int, ...]], int | None]:
        """Every node's sliding block (None: a tombstone, or no sliding pool) by (namespace, tokens from
        the root through the node)."""
        out: dict[tuple[str, tuple[int, ...]], int | None] = {}
        for namespace, root in self._roots.items():
            stack = [(child, child.tokens) for child in root.children.values()]
            while stack:
                node, path = stack.pop()
                out[(namespace, path)] = node.sliding
                stack.extend((c, path + c.tokens) for c in node.children.values())
        return out

    def entries(self) -> list[tuple[str, tuple[int, ...], int]]:
        """Every node as (namespace, tokens from the root through this node, block)."""
        out: list[tuple[str, tuple[int, ...], int]] = []
        for namespace, root in self._roots.items():
            stack = [(child, child.tokens) for child in root.children.values()]
            while stack:
                node, path = stack.pop()
                out.append((namespace, path, node.block))
                stack.extend((c, path + c.tokens) for c in node.children.values())
        return out
