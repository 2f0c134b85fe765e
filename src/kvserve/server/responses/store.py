"""Stored responses (the Responses API's `store`): what a later `previous_response_id` continues from.

A stored response keeps its response object (GET /v1/responses/{id}), its input items (GET .../input_items),
its conversation as chat messages without instructions (OpenAI does not carry instructions over), and its
exact token ids: the prompt's and the reply's, with the text they stand for, so that the next turn
continues from those ids and prefills only its new items (server/core/prompts.py:continued_chat_prompt).

It is held compact (`HeldResponse`): the response object as the very JSON bytes the POST answered (a GET
sends them as they are, parsing nothing), the rest as JSON bytes parsed only when a later turn or
input_items reads it (off the event loop), and the token ids as 4 bytes each. Its size is what those
objects take in memory, plus a fixed cost per entry, so the bounds are the memory held, not a guess.

Each tenant has its own store, bounded in count, bytes and age (TTL), least recently used first: a
tenant's responses never push out another's while the server's bound across tenants (`max_total_bytes`)
holds; past it, the least recently used responses of any tenant go first. One tenant never sees another's
(a lookup is by tenant and id; another tenant's id is the same miss as an unknown one). Ids are 192
random bits (`secrets`). With a persistent backend (server/responses/persist.py: the --kv-disk folder or
the --kv-remote Redis) every stored response is also written there, sealed, and a miss in memory reads
it back, so a restarted replica, or another one, continues the conversation.
"""

import logging
import secrets
import struct
import sys
import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from kvserve.server.core.messages import ChatMessage
from kvserve.server.responses.protocol import ResponseObject

log = logging.getLogger("kvserve.server")

ID_PREFIX = "resp_"
ID_BYTES = 24
# What an entry costs beside its fields' objects: the HeldResponse itself, its float, and its nodes in
# the tenant's and the server's LRU orders (tests/server/responses/test_responses_store.py measures it).
ENTRY_OVERHEAD = 640
# A held response as the backends keep it: expires_at, then the lengths of the id, the tenant, the
# response and the replay record; then those bytes, then the token ids (int32, little-endian).
_LAYOUT = struct.Struct("<dIIII")
_TOKEN = "i"


def new_response_id() -> str:
    return ID_PREFIX + secrets.token_hex(ID_BYTES)


class StoredResponse(BaseModel):
    """One response to store, as the Responses writer hands it over. `continuation_*` are None when
    its reply cannot be continued token for token (a stop string cut its text from its ids)."""

    id: str
    tenant: str
    expires_at: float
    response: ResponseObject
    input_items: list[dict[str, Any]]
    messages: list[ChatMessage]
    continuation_ids: list[int] | None = None
    continuation_content: str | None = None
    continuation_lead: str | None = None


class Replay(BaseModel):
    """What a later turn (the conversation and its continuation's text) and input_items read back."""

    input_items: list[dict[str, Any]]
    messages: list[ChatMessage]
    continuation_content: str | None = None
    continuation_lead: str | None = None


@dataclass(frozen=True, slots=True)
class HeldResponse:
    """A stored response as memory holds it: `response` is the JSON the POST answered, `replay` a
    Replay's JSON, `token_ids` the continuation's ids (empty when there is none)."""

    id: str
    tenant: str
    expires_at: float
    response: bytes
    replay: bytes
    token_ids: bytes

    @staticmethod
    def of(stored: StoredResponse) -> "HeldResponse":
        replay = Replay(
            input_items=stored.input_items,
            messages=stored.messages,
            continuation_content=stored.continuation_content,
            continuation_lead=stored.continuation_lead,
        )
        ids = stored.continuation_ids if stored.continuation_content is not None else None
        return HeldResponse(
            stored.id,
            stored.tenant,
            stored.expires_at,
            stored.response.model_dump_json().encode(),
            replay.model_dump_json(exclude_none=True).encode(),
            array(_TOKEN, ids or ()).tobytes(),
        )

    @property
    def size(self) -> int:
        """The bytes it holds in memory."""
        fields = (self.id, self.tenant, self.response, self.replay, self.token_ids)
        return ENTRY_OVERHEAD + sum(sys.getsizeof(f) for f in fields)

    def read_replay(self) -> Replay:
        return Replay.model_validate_json(self.replay)

    def continuation_ids(self) -> tuple[int, ...]:
        ids = array(_TOKEN)
        ids.frombytes(self.token_ids)
        return tuple(ids)

    def encode(self) -> bytes:
        """Its bytes for a backend (HeldResponse.decode reads them back)."""
        name, tenant = self.id.encode(), self.tenant.encode()
        lengths = _LAYOUT.pack(self.expires_at, len(name), len(tenant), len(self.response), len(self.replay))
        return b"".join((lengths, name, tenant, self.response, self.replay, self.token_ids))

    @staticmethod
    def decode(data: bytes) -> "HeldResponse":
        """The response `encode` wrote; ValueError for anything else (its replay record included)."""
        if len(data) < _LAYOUT.size:
            raise ValueError("shorter than its header")
        expires_at, *lengths = _LAYOUT.unpack_from(data)
        ends = []
        end = _LAYOUT.size
        for length in lengths:
            end += length
            ends.append(end)
        if end > len(data) or (len(data) - end) % array(_TOKEN).itemsize:
            raise ValueError("its lengths do not match its size")
        view = memoryview(data)
        held = HeldResponse(
            bytes(view[_LAYOUT.size : ends[0]]).decode(),
            bytes(view[ends[0] : ends[1]]).decode(),
            expires_at,
            bytes(view[ends[1] : ends[2]]),
            bytes(view[ends[2] : ends[3]]),
            bytes(view[ends[3] :]),
        )
        held.read_replay()
        return held


class Backend(Protocol):
    """Where stored responses outlive the process: `save` and `delete` may fail (logged, the memory
    copy stays), `load` answers None for anything it cannot trust."""

    def save(self, tenant: str, response_id: str, data: bytes, ttl_s: float) -> None: ...

    def load(self, tenant: str, response_id: str, max_bytes: int) -> bytes | None: ...

    def delete(self, tenant: str, response_id: str) -> None: ...


@dataclass(frozen=True)
class StoreLimits:
    """Per tenant: at most `max_count` responses of `max_bytes` in all, each kept `ttl_s` seconds; and
    at most `max_total_bytes` across tenants (None: no bound but the tenants')."""

    max_count: int
    max_bytes: int
    ttl_s: float
    max_total_bytes: int | None = None


@dataclass
class _TenantStore:
    entries: "OrderedDict[str, HeldResponse]" = field(default_factory=OrderedDict)
    num_bytes: int = 0


Key = tuple[str, str]


class ResponseStore:
    """The stored responses of every tenant, in memory, in front of an optional backend. Thread-safe:
    plans (preparation threads) read it while others store."""

    def __init__(self, limits: StoreLimits, backend: Backend | None = None) -> None:
        self.limits = limits
        self.backend = backend
        self._tenants: dict[str, _TenantStore] = {}
        # Every (tenant, id) held, least recently used first: the order of eviction past max_total_bytes.
        self._order: OrderedDict[Key, None] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()

    def expiry(self) -> float:
        return time.time() + self.limits.ttl_s

    def put(self, stored: StoredResponse) -> bytes:
        """Keep `stored` (and write it to the backend); the response's JSON, as kept and as the POST
        answers it."""
        held = HeldResponse.of(stored)
        bound = min(self.limits.max_bytes, self.limits.max_total_bytes or self.limits.max_bytes)
        if held.size > bound:
            log.warning(
                "responses: %s holds %d bytes, more than a whole store (%d); not stored",
                stored.id,
                held.size,
                bound,
            )
            return held.response
        with self._lock:
            evicted = self._insert(held)
        if self.backend is not None:
            self.backend.save(held.tenant, held.id, held.encode(), self.limits.ttl_s)
            self._forget(evicted)
        return held.response

    def get(self, tenant_name: str, response_id: str) -> HeldResponse | None:
        """The tenant's response of that id, or None (unknown, expired, deleted, or another tenant's)."""
        now = time.time()
        key = (tenant_name, response_id)
        with self._lock:
            tenant = self._tenants.get(tenant_name)
            found = tenant.entries.get(response_id) if tenant is not None else None
            if tenant is not None and found is not None:
                if found.expires_at > now:
                    tenant.entries.move_to_end(response_id)
                    self._order.move_to_end(key)
                    return found
                self._remove(key)
        if found is not None:
            self._forget([key])
            return None
        return self._load(tenant_name, response_id, now)

    def _load(self, tenant_name: str, response_id: str, now: float) -> HeldResponse | None:
        if self.backend is None or not response_id.startswith(ID_PREFIX):
            return None
        data = self.backend.load(tenant_name, response_id, self.limits.max_bytes)
        if data is None:
            return None
        try:
            held = HeldResponse.decode(data)
        except ValueError as e:
            log.warning("responses: refused stored response %s: %s", response_id[:16], type(e).__name__)
            return None
        if held.id != response_id or held.tenant != tenant_name or held.expires_at <= now:
            self._forget([(tenant_name, response_id)])
            return None
        with self._lock:
            evicted = self._insert(held)
        self._forget(evicted)
        return held

    def delete(self, tenant_name: str, response_id: str) -> bool:
        """Forget the tenant's response of that id; False when it has none."""
        found = self.get(tenant_name, response_id) is not None
        if found:
            with self._lock:
                self._remove((tenant_name, response_id))
            if self.backend is not None:
                self.backend.delete(tenant_name, response_id)
        return found

    def num_stored(self, tenant_name: str) -> int:
        with self._lock:
            tenant = self._tenants.get(tenant_name)
            return 0 if tenant is None else len(tenant.entries)

    def num_bytes(self, tenant_name: str | None = None) -> int:
        """The bytes held for one tenant, or for all."""
        with self._lock:
            if tenant_name is None:
                return self._num_bytes
            tenant = self._tenants.get(tenant_name)
            return 0 if tenant is None else tenant.num_bytes

    def held(self) -> dict[str, list[str]]:
        """Each tenant's ids, least recently used first."""
        with self._lock:
            return {name: list(tenant.entries) for name, tenant in self._tenants.items()}

    def _insert(self, held: HeldResponse) -> list[Key]:
        """Keep `held` as the most recently used, then evict the tenant's least recently used ones until
        its store is within its limits, then anyone's least recently used until the server's is (caller
        holds the lock); the keys evicted."""
        key = (held.tenant, held.id)
        self._remove(key)
        tenant = self._tenants.setdefault(held.tenant, _TenantStore())
        tenant.entries[held.id] = held
        tenant.num_bytes += held.size
        self._order[key] = None
        self._num_bytes += held.size
        evicted = []
        while len(tenant.entries) > self.limits.max_count or tenant.num_bytes > self.limits.max_bytes:
            evicted.append((held.tenant, next(iter(tenant.entries))))
            self._remove(evicted[-1])
        total = self.limits.max_total_bytes
        while total is not None and self._num_bytes > total:
            evicted.append(next(iter(self._order)))
            self._remove(evicted[-1])
        return evicted

    def _forget(self, keys: list[Key]) -> None:
        """Delete from the backend what memory no longer keeps (evicted, expired): its bounds hold there
        too, for the responses this process has seen."""
        if self.backend is not None:
            for tenant_name, response_id in keys:
                self.backend.delete(tenant_name, response_id)

    def _remove(self, key: Key) -> None:
        tenant = self._tenants.get(key[0])
        old = tenant.entries.pop(key[1], None) if tenant is not None else None
        if tenant is None or old is None:
            return
        tenant.num_bytes -= old.size
        self._num_bytes -= old.size
        del self._order[key]
        if not tenant.entries:
            del self._tenants[key[0]]
