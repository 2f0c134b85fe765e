"""PrefixCache: a radix tree over token ids whose nodes own KV blocks.

Each edge is one block's worth of tokens, so a node is exactly one KV block: a full block (block_size
tokens) or, at a leaf, a partial block (fewer tokens, e.g. the tail of a finished reply). Children are
found by their exact token tuple; a partial match is found by the longest common prefix among the
children, and is reported so that the caller copies that block before writing into it (copy on write).
Hits are therefore exact to the token, not rounded down to a block boundary.
"""

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.cache.block_pool import BlockPool


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
    """

    blocks: tuple[int, ...] = ()
    num_tokens: int = 0
    partial_block: int | None = None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Maps token prefixes, per namespace, to the KV blocks that hold them.

    Invariants:
    - The tree owns one pool reference to every block of its nodes; a block whose only reference is the
      tree's is unlocked, any other reference (a running request) locks it.
    - Only leaves whose block is unlocked are evicted, least recently used first, and only by `evict`.
    - Partial blocks are only ever leaves; a match never crosses namespaces.
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
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

    def match(self, namespace: str, tokens: Sequence[int], record_hit: bool = True) -> MatchResult:
        """Longest cached prefix of `tokens`; marks the matched nodes as recently used and, with
        `record_hit`, counts a hit where the match ended.

        Full blocks are followed by exact token tuple; the rest is matched against the last full node's
        children by longest common prefix, ties to the most recently used child.
        """
        bs = self.block_size
        node = self._roots.get(namespace)
        if node is None:
            return MatchResult()
        now = next(self._clock)
        blocks: list[int] = []
        i = 0
        while i + bs <= len(tokens):
            child = node.children.get(tuple(tokens[i : i + bs]))
            if child is None:
                break
            child.last_access = now
            blocks.append(child.block)
            node = child
            i += bs
        best, best_node = 0, None
        rest = tokens[i : i + bs]
        for child in node.children.values():
            n = _common_prefix(child.tokens, rest)
            # Ties go to the most recently used child, so that which block is copied (and kept warm) is
            # a rule, not an accident of dict order.
            if n > best or (
                n == best and best_node is not None and child.last_access > best_node.last_access
            ):
                best, best_node = n, child
        if best_node is None:
            if i and record_hit:
                self._record_hit(node)
            return MatchResult(tuple(blocks), i)
        best_node.last_access = now
        if record_hit:
            self._record_hit(best_node)
        return MatchResult(tuple(blocks), i + best, best_node.block)

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

    def insert(self, namespace: str, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Record that blocks[j] holds tokens[j*bs : (j+1)*bs] (the last block may be partial).

        Every token must already have its KV computed. Blocks the tree lacks gain a tree reference;
        where the tree already holds the same tokens, its own block stays. Returns the number of new nodes.
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
        self.num_nodes -= 1
        self._nodes_in[node.namespace] -= 1
        if not self._nodes_in[node.namespace]:
            del self._nodes_in[node.namespace]

    def _evictable(self, node: _Node) -> bool:
        return node.parent is not None and not node.children and self.pool.ref_count(node.block) == 1

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` unlocked leaf blocks, least recently used first; returns how many."""
        heap = [(n.last_access, id(n), n) for n in self._leaves if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_blocks:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self._remove(node)
            freed += 1
            if parent is not None and self._evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.num_evicted += freed
        return freed

    def reset(self) -> int:
        """Evict every unlocked block; returns how many were freed."""
        freed = self.evict(self.num_nodes)
        self.num_evicted -= freed
        return freed

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
