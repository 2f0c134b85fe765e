"""Stored responses by what they cost: a response is held as compact bytes whose count is the memory it
holds (tracemalloc agrees), bounded per tenant and across tenants: any sequence of stores keeps every
bound, a tenant's stores evict only its own responses while the server is within its bound, and past it
the least recently used of any tenant go first, exactly as a plain model of those rules says. The
persisted bytes read back whole, and an older format is refused by name."""

import gc
import logging
import tracemalloc
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.cli import build_parser
from kvserve.errors import ConfigError
from kvserve.flags import from_flags
from kvserve.options import ServerOptions
from kvserve.server.core.messages import ChatMessage
from kvserve.server.responses.persist import DiskBackend
from kvserve.server.responses.protocol import ResponseObject
from kvserve.server.responses.store import (
    HeldResponse,
    ResponseStore,
    StoredResponse,
    StoreLimits,
    new_response_id,
)

TENANTS = ("a", "b", "c")
SECRET = bytes(range(32))


def _response(tenant: str, text: str, ids: int = 0, expires_at: float = 2e9) -> StoredResponse:
    response_id = new_response_id()
    return StoredResponse(
        id=response_id,
        tenant=tenant,
        expires_at=expires_at,
        response=ResponseObject(id=response_id, created_at=0, status="completed", model="m"),
        input_items=[{"id": "msg_1", "type": "message", "role": "user", "content": text}],
        messages=[ChatMessage(role="user", content=text), ChatMessage(role="assistant", content="ok")],
        continuation_ids=list(range(1000, 1000 + ids)) if ids else None,
        continuation_content="ok" if ids else None,
        continuation_lead=text if ids else None,
    )


class _Model:
    """The rules, plainly: each tenant's responses least recently used first, and everyone's."""

    def __init__(self, limits: StoreLimits) -> None:
        self.limits = limits
        self.tenants: dict[str, OrderedDict[str, int]] = {}
        self.order: OrderedDict[tuple[str, str], int] = OrderedDict()

    def put(self, tenant: str, response_id: str, size: int) -> None:
        total = self.limits.max_total_bytes
        if size > self.limits.max_bytes or (total is not None and size > total):
            return
        own = self.tenants.setdefault(tenant, OrderedDict())
        own[response_id] = size
        self.order[(tenant, response_id)] = size
        while len(own) > self.limits.max_count or sum(own.values()) > self.limits.max_bytes:
            self._drop((tenant, next(iter(own))))
        while total is not None and sum(self.order.values()) > total:
            self._drop(next(iter(self.order)))

    def touch(self, tenant: str, response_id: str) -> None:
        self.tenants[tenant].move_to_end(response_id)
        self.order.move_to_end((tenant, response_id))

    def _drop(self, key: tuple[str, str]) -> None:
        del self.order[key]
        del self.tenants[key[0]][key[1]]
        if not self.tenants[key[0]]:
            del self.tenants[key[0]]

    def held(self) -> dict[str, list[str]]:
        return {tenant: list(ids) for tenant, ids in self.tenants.items()}


# (tenant, text length, continuation ids, whether a get of one of the tenant's responses comes first)
_OPS = st.lists(
    st.tuples(st.sampled_from(TENANTS), st.integers(0, 2500), st.integers(0, 300), st.integers(-1, 6)),
    max_size=40,
)


def _run(limits: StoreLimits, ops: list[tuple[str, int, int, int]]) -> None:
    store = ResponseStore(limits)
    model = _Model(limits)
    for tenant, text, ids, touch in ops:
        mine = store.held().get(tenant, [])
        if 0 <= touch < len(mine):
            assert store.get(tenant, mine[touch]) is not None
            model.touch(tenant, mine[touch])
        before = store.held()
        stored = _response(tenant, "x" * text, ids)
        store.put(stored)
        model.put(tenant, stored.id, HeldResponse.of(stored).size)
        after = store.held()
        assert after == model.held()
        total = limits.max_total_bytes
        assert total is None or store.num_bytes() <= total
        for name in TENANTS:
            assert store.num_bytes(name) <= limits.max_bytes
            assert len(after.get(name, [])) <= limits.max_count
        assert store.num_bytes() == sum(store.num_bytes(name) for name in TENANTS)
        if total is None or total >= len(TENANTS) * limits.max_bytes:
            # Within the server's bound, a tenant's store evicts none of another's responses.
            for name in set(TENANTS) - {tenant}:
                assert after.get(name, []) == before.get(name, [])


@settings(max_examples=150, deadline=None)
@given(ops=_OPS)
def test_past_the_server_bound_the_least_recently_used_of_anyone_go_first(
    ops: list[tuple[str, int, int, int]],
) -> None:
    _run(StoreLimits(max_count=5, max_bytes=12_000, ttl_s=60, max_total_bytes=20_000), ops)


@settings(max_examples=100, deadline=None)
@given(ops=_OPS)
def test_within_the_server_bound_a_tenant_evicts_only_its_own(ops: list[tuple[str, int, int, int]]) -> None:
    _run(StoreLimits(max_count=5, max_bytes=12_000, ttl_s=60, max_total_bytes=36_000), ops)


def test_a_response_over_the_server_bound_is_not_stored_and_evicts_nothing() -> None:
    store = ResponseStore(StoreLimits(max_count=10, max_bytes=2**20, ttl_s=60, max_total_bytes=8000))
    kept = _response("b", "y" * 100)
    store.put(kept)
    big = _response("a", "x" * 9000)
    assert store.put(big) == big.response.model_dump_json().encode()
    assert store.held() == {"b": [kept.id]}


def test_the_count_is_the_memory_held() -> None:
    """tracemalloc's count of what the store holds after many stores is what the store counts, give or
    take its estimate of the containers' overhead: never more, and not much less."""
    store = ResponseStore(StoreLimits(max_count=10_000, max_bytes=2**30, ttl_s=60))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(300):
            # Made here and dropped once stored, as the server does (a str kept alive would keep the
            # UTF-8 copy its serialization caches in it).
            store.put(_response(TENANTS[i % 3], "é" * (i * 37 % 4000) + "x" * (i % 50), i * 13 % 2000))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    counted = store.num_bytes()
    assert 0.85 * counted <= held <= counted, (held, counted)


def test_held_bytes_read_back_whole() -> None:
    stored = _response("a", "Grüße " * 50, ids=40)
    held = HeldResponse.of(stored)
    again = HeldResponse.decode(held.encode())
    assert again == held
    assert again.continuation_ids() == tuple(stored.continuation_ids or ())
    replay = again.read_replay()
    assert replay.messages == stored.messages and replay.input_items == stored.input_items
    assert replay.continuation_lead == stored.continuation_lead
    data = held.encode()
    replay_at = data.index(b'{"input_items"')
    huge_id = data[:8] + (2**31).to_bytes(4, "little") + data[12:]
    not_json = data[:replay_at] + b"[" + data[replay_at + 1 :]
    for broken in (data[:10], data[:-1], data + b"\x00", huge_id, not_json):
        with pytest.raises(ValueError):
            HeldResponse.decode(broken)


def test_an_older_format_on_disk_is_refused_by_name(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    backend = DiskBackend(str(tmp_path), SECRET, ttl_s=60)
    stored = _response("a", "hi")
    store = ResponseStore(StoreLimits(max_count=10, max_bytes=2**20, ttl_s=60), backend)
    store.put(stored)
    assert ResponseStore(store.limits, backend).get("a", stored.id) is not None
    # What kvserve wrote before this format (KVSRESP1: the response's JSON model), sealed as it was.
    name = backend._sealed.name("a", stored.id)
    old = backend._sealed._seal.seal(name.encode(), b"KVSRESP1", stored.model_dump_json().encode())
    path = tmp_path / "responses" / (name + ".resp")
    path.write_bytes(bytes(old))
    with caplog.at_level(logging.WARNING, "kvserve.server"):
        assert ResponseStore(store.limits, backend).get("a", stored.id) is None
    assert "another kvserve version (format '1')" in caplog.text and not path.exists()


def test_the_server_bound_is_an_option() -> None:
    args = build_parser().parse_args(["serve", "--responses-max-total-bytes", "2GiB"])
    assert from_flags(ServerOptions, args).responses_max_total_bytes == 2 * 2**30
    with pytest.raises(ConfigError, match="responses_max_total_bytes"):
        ServerOptions(responses_max_total_bytes=0)
