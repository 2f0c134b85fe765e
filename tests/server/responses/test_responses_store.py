"""The stored responses' bounds, per tenant: count, bytes and age, least recently used first; one
tenant's responses are another's unknown ids, and ids are unguessable."""

import time

import pytest

from kvserve.server.core.messages import ChatMessage
from kvserve.server.responses.protocol import ResponseObject
from kvserve.server.responses.store import ResponseStore, StoredResponse, StoreLimits, new_response_id


def _stored(store: ResponseStore, tenant: str, text: str = "hi") -> StoredResponse:
    response_id = new_response_id()
    stored = StoredResponse(
        id=response_id,
        tenant=tenant,
        expires_at=store.expiry(),
        response=ResponseObject(id=response_id, created_at=0, status="completed", model="m"),
        input_items=[],
        messages=[ChatMessage(role="user", content=text)],
    )
    store.put(stored)
    return stored


def test_count_bound_evicts_the_least_recently_used_of_that_tenant_only() -> None:
    store = ResponseStore(StoreLimits(max_count=3, max_bytes=2**20, ttl_s=60))
    a = [_stored(store, "a") for _ in range(3)]
    b = _stored(store, "b")
    assert store.get("a", a[0].id) is not None  # now the most recently used
    _stored(store, "a")
    assert store.get("a", a[1].id) is None
    assert store.get("a", a[0].id) is not None and store.get("a", a[2].id) is not None
    assert store.num_stored("a") == 3 and store.get("b", b.id) is not None


def test_byte_bound() -> None:
    store = ResponseStore(StoreLimits(max_count=100, max_bytes=6000, ttl_s=60))
    first = _stored(store, "a", "x" * 1500)
    _stored(store, "a", "y" * 1500)
    _stored(store, "a", "z" * 1500)
    assert store.get("a", first.id) is None and store.num_stored("a") == 2
    # A response over the tenant's whole budget is not kept, and evicts nothing.
    too_big = _stored(store, "a", "w" * 7000)
    assert store.get("a", too_big.id) is None and store.num_stored("a") == 2


def test_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    store = ResponseStore(StoreLimits(max_count=10, max_bytes=2**20, ttl_s=5))
    stored = _stored(store, "a")
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 6)
    assert store.get("a", stored.id) is None and store.num_stored("a") == 0


def test_another_tenant_cannot_see_or_delete() -> None:
    store = ResponseStore(StoreLimits(max_count=10, max_bytes=2**20, ttl_s=60))
    stored = _stored(store, "a")
    assert store.get("b", stored.id) is None
    assert not store.delete("b", stored.id)
    assert store.get("a", stored.id) is not None
    assert store.delete("a", stored.id) and store.get("a", stored.id) is None


def test_ids_are_unguessable() -> None:
    ids = {new_response_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(i.startswith("resp_") and len(i) == len("resp_") + 48 for i in ids)
