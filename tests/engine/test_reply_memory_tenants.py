"""The reply memory is bounded per tenant (the API key's tenant, not the namespace `cache_salt` mints):
one tenant's replies, in as many namespaces as it likes, never evict another tenant's while that tenant
holds no more than its share, and the whole memory stays within its bytes."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.reply_memory import ReplyMemory, entry_bytes
from kvserve.model.tokenizer import KnownReply

TENANTS = ("alice", "bob", "carol", "dave")

# (tenant, namespace, text, reply length, kind): kind 0 remembers a reply, 1 a part of one (its last
# word), 2 looks the text up (which marks it used).
_ops = st.lists(
    st.tuples(
        st.sampled_from(TENANTS),
        st.integers(0, 3),
        st.integers(0, 7),
        st.integers(1, 40),
        st.integers(0, 2),
    ),
    max_size=150,
)


def _text(tenant: str, namespace: int, text: int) -> tuple[str, str]:
    # A tenant's namespaces are its own (the server derives them from its key and cache_salt).
    return f"{tenant}/ns{namespace}", f"reply {text} of {tenant}"


@settings(max_examples=150, deadline=None)
@given(_ops, st.integers(300, 3_000), st.integers(150, 3_000))
def test_no_tenant_within_its_share_loses_an_entry_to_another(
    ops: list[tuple[str, int, int, int, int]], capacity: int, tenant_bytes: int
) -> None:
    memory = ReplyMemory(capacity_bytes=capacity, tenant_bytes=tenant_bytes)
    for tenant, ns, t, length, kind in ops:
        namespace, text = _text(tenant, ns, t)
        before = {u: memory.held(u) for u in TENANTS}
        holders = {u for u, held in before.items() if held} | {tenant}
        if kind == 0:
            memory.remember(namespace, text, list(range(length)), tenant)
        elif kind == 1:
            memory.remember_part(namespace, text.split()[-1], text, tenant)
        else:
            found = memory.lookup_reply(namespace, text)
            assert found is None or found.ids == tuple(range(len(found.ids)))
        for other in TENANTS:
            if other != tenant and before[other] * len(holders) <= memory.capacity_bytes:
                assert memory.held(other) == before[other], (other, before, holders)
        assert memory.num_bytes == sum(memory.held(u) for u in TENANTS) <= memory.capacity_bytes
        assert all(memory.held(u) <= memory.tenant_bytes for u in TENANTS)


def test_a_salted_flood_leaves_another_tenants_reply() -> None:
    # The review's flood in small: bob's replies in a fresh namespace each, many times the memory.
    one = entry_bytes("ns-alice", "alice's reply", range(100))
    memory = ReplyMemory(capacity_bytes=20 * one, tenant_bytes=10 * one)
    memory.remember("ns-alice", "alice's reply", range(100), "alice")
    for i in range(500):
        memory.remember(f"ns-bob-salt-{i}", f"bob's reply {i}", range(100), "bob")
    assert memory.lookup_reply("ns-alice", "alice's reply") == KnownReply(tuple(range(100)))
    assert memory.held("bob") <= memory.tenant_bytes and memory.num_bytes <= memory.capacity_bytes
    # bob keeps his most recent replies, and his least recently used go first.
    assert memory.lookup("ns-bob-salt-499", "bob's reply 499") is not None
    assert memory.lookup("ns-bob-salt-0", "bob's reply 0") is None
    # Lookups stay within the namespace: alice's text is no reply in bob's namespaces.
    assert memory.lookup("ns-bob-salt-499", "alice's reply") is None


def test_over_the_total_the_tenant_over_its_share_gives_way() -> None:
    one = entry_bytes("ns-x", "reply 00", range(10))
    memory = ReplyMemory(capacity_bytes=6 * one, tenant_bytes=4 * one)
    for i in range(4):
        memory.remember("ns-b", f"reply {i:02}", range(10), "bob")
    memory.remember("ns-a", "reply 00", range(10), "alice")
    memory.remember("ns-c", "reply 00", range(10), "carol")
    # Full: carol's next reply takes bob's oldest (bob holds 4 of 6, over his share of 2).
    memory.remember("ns-c", "reply 01", range(10), "carol")
    assert memory.held("bob") == 3 * one and memory.lookup("ns-b", "reply 00") is None
    assert memory.held("alice") == one and memory.held("carol") == 2 * one
