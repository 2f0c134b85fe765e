"""ReplyMemory: the token ids generated for recent replies, keyed by namespace and text.

Chat clients send a reply back as text in the next turn. Tokenizing that text again can give other ids
than the ones generated (BPE is not unique), which would break the cached prefix right at the reply; the
exact ids are looked up here instead. Entries are per namespace like the prefix cache: a tenant never
finds another tenant's reply (members of a shared group share their group's namespace, and so its
replies). The memory is bounded in bytes, not entries, because replies range from one token to the whole
context.

Bounds go by tenant (the API key's tenant, `Request.tenant`; not the namespace, which `cache_salt`
mints at will): each entry is its writer's, a tenant holds at most `tenant_bytes` and loses its own least
recently used entries past that, and the whole memory holds at most `capacity_bytes`, past which the
tenant holding the most loses its least recently used entries (the writer on a tie, else the tenant
least recently used). That tenant holds more than its share (the capacity over the tenants holding
entries), so a tenant within its share never loses an entry to another's traffic.

A reasoning reply comes back split: its think block as reasoning_content, the rest as content. The
server then remembers the rest as a part of the whole reply (`remember_part`), so that a later turn
whose template renders the block again, right before the content, gets the whole reply's ids
(`lookup_reply`), block included.
"""

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.engine.request import DEFAULT_TENANT
from kvserve.model.tokenizer import KnownReply

# Everyone's entries (the bound of old, when one store served every tenant), and one tenant's: two
# tenants at their bound fit the total, and beyond that the total is shared.
DEFAULT_CAPACITY_BYTES = 64 * 2**20
DEFAULT_TENANT_BYTES = 32 * 2**20
# Per entry: the dict slots, the key tuple and the object headers, roughly.
_ENTRY_OVERHEAD = 200

Key = tuple[str, str]  # (namespace, text)


def entry_bytes(namespace: str, text: str, value: Sequence[int] | str) -> int:
    """About what an entry costs in memory: a character and an id take up to 4 and 8 bytes (a part's
    entry holds the whole reply's text)."""
    size = 4 * len(value) if isinstance(value, str) else 8 * len(value)
    return _ENTRY_OVERHEAD + len(namespace) + 4 * len(text) + size


@dataclass
class _Entry:
    tenant: str  # whose bytes it counts in
    value: tuple[int, ...] | str  # a reply's ids, or, for a part of a reply, the whole reply's text
    cost: int


class ReplyMemory:
    def __init__(
        self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES, tenant_bytes: int = DEFAULT_TENANT_BYTES
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.tenant_bytes = min(tenant_bytes, capacity_bytes)
        self._entries: dict[Key, _Entry] = {}
        # tenant -> its entries' keys, both least recently used first.
        self._tenants: OrderedDict[str, OrderedDict[Key, None]] = OrderedDict()
        self._held: dict[str, int] = {}
        self._bytes = 0
        # The engine thread remembers while server threads look up.
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def held(self, tenant: str) -> int:
        """The bytes of `tenant`'s entries."""
        return self._held.get(tenant, 0)

    def __len__(self) -> int:
        return len(self._entries)

    def remember(
        self, namespace: str, text: str, token_ids: Sequence[int], tenant: str = DEFAULT_TENANT
    ) -> None:
        if not text or not token_ids:
            return
        self._store(tenant, (namespace, text), tuple(token_ids), replace=True)

    def remember_part(self, namespace: str, part: str, whole: str, tenant: str = DEFAULT_TENANT) -> None:
        """`part` is the end of the remembered reply `whole` (its content after its think block); a reply
        remembered as `part` itself keeps its own entry."""
        if part and whole != part and whole.endswith(part):
            self._store(tenant, (namespace, part), whole, replace=False)

    def _store(self, tenant: str, key: Key, value: tuple[int, ...] | str, replace: bool) -> None:
        cost = entry_bytes(*key, value)
        if cost > self.tenant_bytes:
            return
        with self._lock:
            old = self._entries.get(key)
            if old is not None and not replace and not isinstance(old.value, str):
                return
            if old is not None:
                self._drop(key)
            self._entries[key] = _Entry(tenant, value, cost)
            self._tenants.setdefault(tenant, OrderedDict())[key] = None
            self._tenants.move_to_end(tenant)
            self._held[tenant] = self._held.get(tenant, 0) + cost
            self._bytes += cost
            while self._held[tenant] > self.tenant_bytes:
                self._drop(next(iter(self._tenants[tenant])))
            while self._bytes > self.capacity_bytes:
                most = max(self._held.values())
                victim = tenant
                if self._held[tenant] != most:
                    victim = next(t for t in self._tenants if self._held[t] == most)
                self._drop(next(iter(self._tenants[victim])))

    def _drop(self, key: Key) -> None:
        entry = self._entries.pop(key)
        keys = self._tenants[entry.tenant]
        del keys[key]
        self._held[entry.tenant] -= entry.cost
        self._bytes -= entry.cost
        if not keys:
            del self._tenants[entry.tenant], self._held[entry.tenant]

    def _get(self, key: Key) -> tuple[int, ...] | str | None:
        """The entry's value, marked as used (lock held)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._tenants[entry.tenant].move_to_end(key)
        self._tenants.move_to_end(entry.tenant)
        return entry.value

    def lookup(self, namespace: str, text: str) -> list[int] | None:
        with self._lock:
            ids = self._get((namespace, text))
        return None if ids is None or isinstance(ids, str) else list(ids)

    def lookup_reply(self, namespace: str, text: str) -> KnownReply | None:
        """The ids of the reply `text` is, or, for a remembered part, of the whole reply with the text
        before the part as its lead."""
        with self._lock:
            value = self._get((namespace, text))
            if not isinstance(value, str):
                return None if value is None else KnownReply(value)
            whole = self._get((namespace, value))
        if whole is None or isinstance(whole, str):
            return None
        return KnownReply(whole, value[: len(value) - len(text)])
