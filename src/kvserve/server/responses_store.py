"""Stored responses (the Responses API's `store`): what a later `previous_response_id` continues from.

A stored response keeps its response object (GET /v1/responses/{id}), its input items (GET .../input_items),
its conversation as chat messages without instructions (OpenAI does not carry instructions over), and its
exact token ids: the prompt's and the reply's, with the text they stand for, so that the next turn
continues from those ids and prefills only its new items (server/prompts.py:continued_chat_prompt).

Each tenant has its own store, bounded in count, bytes (a response's JSON) and age (TTL), least
recently used first: a tenant's responses never push out another's, and one tenant never sees another's
(a lookup is by tenant and id; another tenant's id is the same miss as an unknown one). Ids are 192
random bits (`secrets`). With a persistent backend (server/responses_persist.py: the --kv-disk folder or
the --kv-remote Redis) every stored response is also written there, sealed, and a miss in memory reads
it back, so a restarted replica, or another one, continues the conversation.
"""

import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from kvserve.server.protocol import ChatMessage
from kvserve.server.responses_protocol import ResponseObject

log = logging.getLogger("kvserve.server")

ID_PREFIX = "resp_"
ID_BYTES = 24


def new_response_id() -> str:
    return ID_PREFIX + secrets.token_hex(ID_BYTES)


class StoredResponse(BaseModel):
    """One stored response. `continuation_*` are None when its reply cannot be continued token for
    token (a stop string cut its text from its ids)."""

    id: str
    tenant: str
    expires_at: float
    response: ResponseObject
    input_items: list[dict[str, Any]]
    messages: list[ChatMessage]
    continuation_ids: list[int] | None = None
    continuation_content: str | None = None
    continuation_lead: str | None = None


class Backend(Protocol):
    """Where stored responses outlive the process: `save` and `delete` may fail (logged, the memory
    copy stays), `load` answers None for anything it cannot trust."""

    def save(self, tenant: str, response_id: str, data: bytes, ttl_s: float) -> None: ...

    def load(self, tenant: str, response_id: str, max_bytes: int) -> bytes | None: ...

    def delete(self, tenant: str, response_id: str) -> None: ...


@dataclass(frozen=True)
class StoreLimits:
    """Per tenant: at most `max_count` responses of `max_bytes` in all, each kept `ttl_s` seconds."""

    max_count: int
    max_bytes: int
    ttl_s: float


@dataclass
class _TenantStore:
    entries: "OrderedDict[str, tuple[StoredResponse, int]]" = field(default_factory=OrderedDict)
    num_bytes: int = 0


class ResponseStore:
    """The stored responses of every tenant, in memory, in front of an optional backend. Thread-safe:
    plans (preparation threads) read it while the event loop stores."""

    def __init__(self, limits: StoreLimits, backend: Backend | None = None) -> None:
        self.limits = limits
        self.backend = backend
        self._tenants: dict[str, _TenantStore] = {}
        self._lock = threading.Lock()

    def expiry(self) -> float:
        return time.time() + self.limits.ttl_s

    def put(self, stored: StoredResponse) -> None:
        data = stored.model_dump_json().encode()
        if len(data) > self.limits.max_bytes:
            log.warning(
                "responses: %s is %d bytes, more than a tenant's whole store (%d); not stored",
                stored.id,
                len(data),
                self.limits.max_bytes,
            )
            return
        with self._lock:
            evicted = self._insert(stored, len(data))
        if self.backend is not None:
            self.backend.save(stored.tenant, stored.id, data, self.limits.ttl_s)
            self._forget(stored.tenant, evicted)

    def get(self, tenant_name: str, response_id: str) -> StoredResponse | None:
        """The tenant's response of that id, or None (unknown, expired, deleted, or another tenant's)."""
        now = time.time()
        with self._lock:
            tenant = self._tenants.get(tenant_name)
            found = tenant.entries.get(response_id) if tenant is not None else None
            if tenant is not None and found is not None:
                if found[0].expires_at > now:
                    tenant.entries.move_to_end(response_id)
                    return found[0]
                self._remove(tenant, response_id)
        if found is not None:
            self._forget(tenant_name, [response_id])
            return None
        return self._load(tenant_name, response_id, now)

    def _load(self, tenant_name: str, response_id: str, now: float) -> StoredResponse | None:
        if self.backend is None or not response_id.startswith(ID_PREFIX):
            return None
        data = self.backend.load(tenant_name, response_id, self.limits.max_bytes)
        if data is None:
            return None
        try:
            stored = StoredResponse.model_validate_json(data)
        except ValueError as e:
            log.warning("responses: refused stored response %s: %s", response_id[:16], type(e).__name__)
            return None
        if stored.id != response_id or stored.tenant != tenant_name or stored.expires_at <= now:
            self._forget(tenant_name, [response_id])
            return None
        with self._lock:
            evicted = self._insert(stored, len(data))
        self._forget(tenant_name, evicted)
        return stored

    def delete(self, tenant_name: str, response_id: str) -> bool:
        """Forget the tenant's response of that id; False when it has none."""
        found = self.get(tenant_name, response_id) is not None
        if found:
            with self._lock:
                tenant = self._tenants.get(tenant_name)
                if tenant is not None:
                    self._remove(tenant, response_id)
            if self.backend is not None:
                self.backend.delete(tenant_name, response_id)
        return found

    def num_stored(self, tenant_name: str) -> int:
        with self._lock:
            tenant = self._tenants.get(tenant_name)
            return 0 if tenant is None else len(tenant.entries)

    def _insert(self, stored: StoredResponse, size: int) -> list[str]:
        """Keep `stored` as the tenant's most recently used, then evict its least recently used ones
        until its store is within the limits (caller holds the lock); the ids evicted."""
        tenant = self._tenants.setdefault(stored.tenant, _TenantStore())
        self._remove(tenant, stored.id)
        tenant.entries[stored.id] = (stored, size)
        tenant.num_bytes += size
        evicted = []
        while len(tenant.entries) > self.limits.max_count or tenant.num_bytes > self.limits.max_bytes:
            gone, (_, gone_size) = tenant.entries.popitem(last=False)
            tenant.num_bytes -= gone_size
            evicted.append(gone)
        return evicted

    def _forget(self, tenant_name: str, response_ids: list[str]) -> None:
        """Delete from the backend what memory no longer keeps (evicted, expired): its bounds hold there
        too, for the responses this process has seen."""
        if self.backend is not None:
            for response_id in response_ids:
                self.backend.delete(tenant_name, response_id)

    @staticmethod
    def _remove(tenant: _TenantStore, response_id: str) -> None:
        old = tenant.entries.pop(response_id, None)
        if old is not None:
            tenant.num_bytes -= old[1]
