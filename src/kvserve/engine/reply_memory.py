"""ReplyMemory: the token ids generated for recent replies, keyed by namespace and text.

Chat clients send a reply back as text in the next turn. Tokenizing that text again can give other ids
than the ones generated (BPE is not unique), which would break the cached prefix right at the reply; the
exact ids are looked up here instead. Entries are per namespace like the prefix cache: a tenant never
finds another tenant's reply. The memory is bounded in bytes, not entries, because replies range from
one token to the whole context: least recently used entries go first.

A reasoning reply comes back split: its think block as reasoning_content, the rest as content. The
server then remembers the rest as a part of the whole reply (`remember_part`), so that a later turn
whose template renders the block again, right before the content, gets the whole reply's ids
(`lookup_reply`), block included.
"""

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvserve.model.tokenizer import KnownReply

DEFAULT_CAPACITY_BYTES = 64 * 2**20
# Per entry: the dict slot, the key tuple and the object headers, roughly.
_ENTRY_OVERHEAD = 200


def entry_bytes(namespace: str, text: str, value: Sequence[int] | str) -> int:
    """About what an entry costs in memory: a character and an id take up to 4 and 8 bytes (a part's
    entry holds the whole reply's text)."""
    size = 4 * len(value) if isinstance(value, str) else 8 * len(value)
    return _ENTRY_OVERHEAD + len(namespace) + 4 * len(text) + size


class ReplyMemory:
    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        self.capacity_bytes = capacity_bytes
        # A reply's ids by its text, or, for a part of a reply, the whole reply's text.
        self._ids: OrderedDict[tuple[str, str], tuple[int, ...] | str] = OrderedDict()
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
        self._store(namespace, text, tuple(token_ids), replace=True)

    def remember_part(self, namespace: str, part: str, whole: str) -> None:
        """`part` is the end of the remembered reply `whole` (its content after its think block); a reply
        remembered as `part` itself keeps its own entry."""
        if part and whole != part and whole.endswith(part):
            self._store(namespace, part, whole, replace=False)

    def _store(self, namespace: str, text: str, value: tuple[int, ...] | str, replace: bool) -> None:
        cost = entry_bytes(namespace, text, value)
        if cost > self.capacity_bytes:
            return
        key = (namespace, text)
        with self._lock:
            old = self._ids.get(key)
            if old is not None and not replace and not isinstance(old, str):
                return
            if old is not None:
                del self._ids[key]
                self._bytes -= entry_bytes(namespace, text, old)
            self._ids[key] = value
            self._bytes += cost
            while self._bytes > self.capacity_bytes:
                (ns, txt), evicted = self._ids.popitem(last=False)
                self._bytes -= entry_bytes(ns, txt, evicted)

    def lookup(self, namespace: str, text: str) -> list[int] | None:
        with self._lock:
            ids = self._ids.get((namespace, text))
        return None if ids is None or isinstance(ids, str) else list(ids)

    def lookup_reply(self, namespace: str, text: str) -> KnownReply | None:
        """The ids of the reply `text` is, or, for a remembered part, of the whole reply with the text
        before the part as its lead."""
        with self._lock:
            value = self._ids.get((namespace, text))
            if not isinstance(value, str):
                return None if value is None else KnownReply(value)
            whole = self._ids.get((namespace, value))
        if whole is None or isinstance(whole, str):
            return None
        return KnownReply(whole, value[: len(value) - len(text)])
