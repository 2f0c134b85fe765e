"""ReplyMemory: the token ids generated for recent replies, keyed by namespace and text.

Chat clients send a reply back as text in the next turn. Tokenizing that text again can give other ids
than the ones generated (BPE is not unique), which would break the cached prefix right at the reply; the
exact ids are looked up here instead. Entries are per namespace like the prefix cache: a tenant never
finds another tenant's reply. The memory is bounded in bytes, not entries, because replies range from
one token to the whole context: least recently used entries go first.
"""

import threading
from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_CAPACITY_BYTES = 64 * 2**20
# Per entry: the dict slot, the key tuple and the object headers, roughly.
_ENTRY_OVERHEAD = 200


def entry_bytes(namespace: str, text: str, token_ids: Sequence[int]) -> int:
    """About what an entry costs in memory: a character and an id take up to 4 and 8 bytes."""
    return _ENTRY_OVERHEAD + len(namespace) + 4 * len(text) + 8 * len(token_ids)


class ReplyMemory:
    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        self.capacity_bytes = capacity_bytes
        self._ids: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._bytes = 0
        # The engine thread remembers while server threads look up.
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._ids)

    def remember(self, namespace: str, text: str, token_ids: Sequence[int]) -> None:
        if not text or not token_ids:
            return
        cost = entry_bytes(namespace, text, token_ids)
        if cost > self.capacity_bytes:
            return
        key = (namespace, text)
        with self._lock:
            old = self._ids.pop(key, None)
            if old is not None:
                self._bytes -= entry_bytes(namespace, text, old)
            self._ids[key] = tuple(token_ids)
            self._bytes += cost
            while self._bytes > self.capacity_bytes:
                (ns, txt), ids = self._ids.popitem(last=False)
                self._bytes -= entry_bytes(ns, txt, ids)

    def lookup(self, namespace: str, text: str) -> list[int] | None:
        with self._lock:
            ids = self._ids.get((namespace, text))
        return None if ids is None else list(ids)
