"""RecentPrefixes: what each namespace's sequences began with lately, by hash, to tell a miss from new text.

The prefix tree forgets a prefix when it evicts it; this index remembers that the namespace saw it, so
that a prefill of text seen before is told from text never seen, and where a prompt parts from what was
seen is known to the token. It keeps no token and no KV: per namespace, an LRU of chained block keys
(`key(j+1) = blake2b(key(j) || tokens of block j)`, the root's key 0), each with the fingerprints of the
tokens that last followed it (up to a block, 16 bits each), plus a flag set when a retention that held
the block expired.

`seen(namespace, tokens)` walks the keys of `tokens` while the namespace holds them, then compares the
fingerprints of the continuation stored at the last key with the prompt's next tokens: the seen prefix
ends at the first that differs (or where the stored continuation ends). When the stored continuation
went on past that point with other tokens, the prompt diverged there; how much of the prompt after
that point the namespace had seen anyway (`realigned`) comes from a second kind of key, unchained:
the hash of each content-defined chunk of what it saw (a chunk ends after a token whose fingerprint's
low 4 bits are 0, or at 64 tokens), so that text after a change is found again whatever it shifted by.

Invariants (`check`): a namespace holds at most `max_entries_per_namespace` keys and all namespaces at
most `max_entries` (past either bound the least recently used keys go, of the namespace that is over,
or of the least recently used namespace; a sequence's deepest keys are its least recently used, so the
prefixes left stay walkable from the root); a namespace's keys are found only by that namespace (one
table per namespace, never a shared one); the memory this costs is bounded by the entries (one int key
and one bytes value of at most ENTRY_BYTES each).
"""

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Keys per namespace, and in all: a chain key and about one chunk key per 16 tokens, so 8,192 keys are
# about 65,536 tokens of distinct text at 16 a block.
MAX_ENTRIES_PER_NAMESPACE = 8192
MAX_ENTRIES = 131072

# A value: flags (1 byte), then 2 bytes per token of the continuation.
_HEADER = struct.Struct("<B")
_EXPIRED = 1
# An odd multiplier's high bits: a token's 16-bit fingerprint (two tokens share one with odds 2**-16).
_MIX = np.uint64(0x9E3779B97F4A7C15)
# Content-defined chunks: about 16 tokens on average, at most 64. Their keys lie above the chain keys'
# 64 bits, so the two kinds never meet.
_CHUNK_MASK = 15
_MAX_CHUNK = 64
_CHUNK_SPACE = 1 << 64


def entry_bytes(block_size: int) -> int:
    """The largest value an entry holds."""
    return _HEADER.size + 2 * block_size


@dataclass(frozen=True)
class Seen:
    """What a namespace saw of a prompt: its first `tokens` tokens, and `diverged` when what it saw went
    on past them with other tokens (`realigned`: the prompt's tokens after that point in chunks the
    namespace saw)."""

    tokens: int
    diverged: bool = False
    realigned: int = 0


def _fingerprints(tokens: Sequence[int]) -> bytes:
    if not tokens:
        return b""
    mixed = np.asarray(tokens, dtype=np.uint64) * _MIX
    return (mixed >> np.uint64(48)).astype("<u2").tobytes()


def _chunks(tokens: Sequence[int], prints: bytes) -> list[tuple[int, int]]:
    """The content-defined chunks of `tokens` as (start, end), the last one cut where the tokens end."""
    low = np.frombuffer(prints, dtype="<u2") & _CHUNK_MASK
    out, start = [], 0
    for end in (np.flatnonzero(low == 0) + 1).tolist():
        while end - start > _MAX_CHUNK:
            out.append((start, start + _MAX_CHUNK))
            start += _MAX_CHUNK
        out.append((start, end))
        start = end
    while start < len(tokens):
        out.append((start, min(len(tokens), start + _MAX_CHUNK)))
        start += _MAX_CHUNK
    return out


def _chunk_keys(tokens: Sequence[int], chunks: Sequence[tuple[int, int]]) -> list[int]:
    data = np.asarray(tokens, dtype="<u4").tobytes()
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    return [
        _CHUNK_SPACE | from_bytes(blake2b(data[4 * start : 4 * end], digest_size=8).digest(), "little")
        for start, end in chunks
    ]


class NoRecentPrefixes:
    """No prefix cache, so nothing to tell a miss from: every prompt is never seen."""

    enabled = False

    def remember(self, namespace: str, tokens: Sequence[int]) -> None:
        """The namespace saw `tokens`."""

    def seen(self, namespace: str, tokens: Sequence[int]) -> Seen:
        """How much of `tokens` the namespace saw lately."""
        return Seen(0)

    def expired(self, namespace: str, tokens: Sequence[int], start: int) -> bool:
        """Whether a retention that ended held the block of `tokens` holding token `start`."""
        return False

    def mark_expired(self, namespace: str, tokens: Sequence[int]) -> None:
        """A retention of `tokens` (whole blocks) ended."""


class RecentPrefixes(NoRecentPrefixes):
    enabled = True

    def __init__(
        self,
        block_size: int,
        max_entries_per_namespace: int = MAX_ENTRIES_PER_NAMESPACE,
        max_entries: int = MAX_ENTRIES,
    ) -> None:
        if block_size < 1 or max_entries_per_namespace < 1 or max_entries < 1:
            raise ValueError("the recent-prefix index needs a positive block size and bounds")
        self.block_size = block_size
        self.max_entries_per_namespace = min(max_entries_per_namespace, max_entries)
        self.max_entries = max_entries
        # Namespaces least recently used first; each its keys least recently used first.
        self._of: OrderedDict[str, OrderedDict[int, bytes]] = OrderedDict()
        self.num_entries = 0

    def keys(self, tokens: Sequence[int]) -> list[int]:
        """The chained key of each full block's prefix of `tokens`, the root's (0) first."""
        bs = self.block_size
        keys = [0]
        data = np.asarray(tokens[: len(tokens) // bs * bs], dtype="<u4").tobytes()
        step = 4 * bs
        blake2b, from_bytes = hashlib.blake2b, int.from_bytes
        for j in range(len(tokens) // bs):
            h = blake2b(keys[-1].to_bytes(8, "little"), digest_size=8)
            h.update(data[j * step : (j + 1) * step])
            keys.append(from_bytes(h.digest(), "little"))
        return keys

    def remember(self, namespace: str, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        keys = self.keys(tokens)
        table = self._of.get(namespace)
        if table is None:
            table = self._of[namespace] = OrderedDict()
        self._of.move_to_end(namespace)
        bs = self.block_size
        header = _HEADER.pack(0)
        prints = _fingerprints(tokens)
        # Chunks first, then the chain from its deepest key to the root: the root and the shallow keys,
        # which every later prompt walks first, are the last to go.
        for chunk in _chunk_keys(tokens, _chunks(tokens, prints)):
            self._touch(table, chunk, b"")
        for j in reversed(range(len(keys))):
            self._touch(table, keys[j], header + prints[2 * j * bs : 2 * (j + 1) * bs])
        self._bound(namespace)

    def _touch(self, table: OrderedDict[int, bytes], key: int, value: bytes) -> None:
        if key not in table:
            self.num_entries += 1
        table[key] = value
        table.move_to_end(key)

    def _bound(self, namespace: str) -> None:
        table = self._of[namespace]
        while len(table) > self.max_entries_per_namespace:
            table.popitem(last=False)
            self.num_entries -= 1
        while self.num_entries > self.max_entries:
            oldest = next(iter(self._of))
            victim = self._of[oldest]
            victim.popitem(last=False)
            self.num_entries -= 1
            if not victim:
                del self._of[oldest]

    def seen(self, namespace: str, tokens: Sequence[int]) -> Seen:
        """See the module docstring; nothing is changed."""
        table = self._of.get(namespace)
        if table is None or 0 not in table:
            return Seen(0)
        keys = self.keys(tokens)
        j = 0
        while j + 1 < len(keys) and keys[j + 1] in table:
            j += 1
        value = table[keys[j]]
        stored = value[_HEADER.size :]
        bs = self.block_size
        mine = _fingerprints(tokens[j * bs : (j + 1) * bs])
        m = 0
        while 2 * m < min(len(stored), len(mine)) and stored[2 * m : 2 * m + 2] == mine[2 * m : 2 * m + 2]:
            m += 1
        # Diverged: what was seen goes on past the common part, and so does the prompt, otherwise.
        common = j * bs + m
        diverged = 2 * m < len(stored) and common < len(tokens)
        if not diverged:
            return Seen(common)
        # The prompt's chunks after the first boundary past the common part, as the namespace chunked
        # what it saw (a chunk's bounds depend only on its tokens).
        rest = tokens[common:]
        chunks = _chunks(rest, _fingerprints(rest))[1:]
        found = zip(chunks, _chunk_keys(rest, chunks), strict=True)
        realigned = sum(end - start for (start, end), key in found if key in table)
        return Seen(common, True, realigned)

    def expired(self, namespace: str, tokens: Sequence[int], start: int) -> bool:
        table = self._of.get(namespace)
        end = (start // self.block_size + 1) * self.block_size
        if table is None or end > len(tokens):
            return False
        value = table.get(self.keys(tokens[:end])[-1])
        return value is not None and bool(value[0] & _EXPIRED)

    def mark_expired(self, namespace: str, tokens: Sequence[int]) -> None:
        # Its blocks, should they go, went for that.
        table = self._of.get(namespace)
        if table is None:
            return
        for key in self.keys(tokens)[1:]:
            value = table.get(key)
            if value is not None:
                table[key] = bytes([value[0] | _EXPIRED]) + value[1:]

    def num_entries_in(self, namespace: str) -> int:
        table = self._of.get(namespace)
        return 0 if table is None else len(table)

    def check(self) -> None:
        """Assert the bounds of the module docstring."""
        if sum(len(t) for t in self._of.values()) != self.num_entries:
            raise AssertionError("the recent-prefix entry count drifted")
        if self.num_entries > self.max_entries:
            raise AssertionError("the recent-prefix index is over its bound")
        limit = entry_bytes(self.block_size)
        for namespace, table in self._of.items():
            if any(key >= _CHUNK_SPACE and value for key, value in table.items()):
                raise AssertionError("a chunk key holds a value")
            if not table or len(table) > self.max_entries_per_namespace:
                raise AssertionError(f"namespace {namespace!r} is empty or over its bound")
            if any(len(v) > limit for v in table.values()):
                raise AssertionError("an entry is over its size")
