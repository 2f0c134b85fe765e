"""The drafter of speculative decoding: drafts are real continuations of the sequence's own text or of its
own namespace's retained replies, incremental indexing changes nothing, and the length follows the
acceptance estimate and the step's load."""

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.drafting import NAMESPACE_COST, ORDERS, REPLY_COST, Drafter, row_share


def occurs_followed_by(source: Sequence[int], suffix: Sequence[int], draft: Sequence[int], end: int) -> bool:
    """Whether `suffix` ends at some position p < end of `source` with `draft` following it, reading
    `source` extended by the draft itself (what a periodic continuation reads)."""
    text = list(source) + list(draft)
    n = len(suffix)
    for p in range(n - 1, end):
        if text[p - n + 1 : p + 1] == list(suffix) and text[p + 1 : p + 1 + len(draft)] == list(draft):
            return True
    return False


def is_real_continuation(
    tokens: Sequence[int], draft: Sequence[int], replies: Sequence[Sequence[int]]
) -> bool:
    """A draft continues an earlier occurrence of the text's last ORDERS[0] tokens (at least): in the text
    itself (before its end) or within one of the replies."""
    suffix = list(tokens[-ORDERS[0] :])
    if occurs_followed_by(tokens, suffix, draft, len(tokens) - 1):
        return True
    n = len(suffix)
    return any(
        list(reply[p - n + 1 : p + 1]) == suffix and list(reply[p + 1 : p + 1 + len(draft)]) == list(draft)
        for reply in replies
        for p in range(n - 1, len(reply) - len(draft))
    )


# A list the prompt holds, which the output copies.
LISTING = list(range(500, 560))
PROMPT = [7, 8, 9, *LISTING, 10, 11, 12]


def test_copying_a_list_from_the_prompt_drafts_its_next_items() -> None:
    drafter = Drafter(8)
    tokens = PROMPT + LISTING[:20]
    draft = drafter.propose("r", "ns", tokens, 8, 1)
    assert draft and draft == LISTING[20 : 20 + len(draft)]


def test_a_greedy_loop_drafts_its_continuation() -> None:
    drafter = Drafter(8)
    assert drafter.propose("r", "ns", [1, 2, 3] * 5 + [1, 2], 8, 1)[:2] == [3, 1]
    # A long loop is a long match: the whole draft, read through the current end.
    loop = [4, 5, 6] * 20 + [4]
    draft = drafter.propose("s", "ns", loop, 8, 1)
    assert len(draft) >= 5 and draft == [5, 6, 4, 5, 6, 4, 5, 6][: len(draft)]


def test_nothing_matches_no_draft() -> None:
    drafter = Drafter(8)
    assert drafter.propose("r", "ns", list(range(100)), 8, 1) == []
    assert drafter.propose("e", "ns", [], 8, 1) == []
    assert drafter.propose("o", "ns", [3], 8, 1) == []


def test_limit_and_max_tokens_bound_the_draft() -> None:
    loop = [4, 5, 6] * 20
    assert len(Drafter(8).propose("r", "ns", loop, 3, 1)) == 3
    assert len(Drafter(2).propose("r", "ns", loop, 8, 1)) == 2
    assert Drafter(8).propose("r", "ns", loop, 0, 1) == []
    assert Drafter(8).propose("r", "ns", loop, -5, 1) == []


def test_drafts_from_the_namespace_replies_and_stops_at_a_reply_boundary() -> None:
    drafter = Drafter(8)
    first = list(range(100, 140))
    second = list(range(200, 240))
    drafter.finished("old", "ns", first)
    drafter.finished("older", "ns", second)
    draft = drafter.propose("r", "ns", [1, 2, *first[:32]], 8, 1)
    assert len(draft) >= 4 and draft == first[32 : 32 + len(draft)]
    # The first reply's last three tokens: only what is left of it, never the next reply's start.
    assert drafter.propose("s", "ns", [1, 2, *first[-12:-2]], 8, 1) == first[-2:]
    # The key is forgotten once finished, and its stats with it.
    drafter.finished("r", "ns", [])
    assert "r" not in drafter._sequences


def test_namespaces_are_isolated() -> None:
    drafter = Drafter(8)
    secret = list(range(9000, 9040))  # tokens that appear nowhere else
    drafter.finished("a-1", "a", secret)
    tokens = [1, 2, 3, *secret[:16]]
    other = drafter.propose("b-1", "b", tokens, 8, 1)
    assert not set(other) & set(secret)
    own = drafter.propose("a-2", "a", tokens, 8, 1)
    assert own and own == secret[16 : 16 + len(own)]


def test_hostile_ids_and_arguments_never_raise() -> None:
    drafter = Drafter(8)
    opening = [2**70, -(2**71) + 3, -1, 2**63 - 1, 12_345, 2**65 + 9, -5]
    huge = [*opening, 2**63, 2**64 - 1, 0, *opening]
    for load in (0, -3, 1, 10**400):
        for limit in (-(10**30), 0, 1, 10**30):
            draft = drafter.propose("h", "ns", huge, limit, load)
            assert len(draft) <= max(min(limit, 8), 0)
    # The text ends as it began: what followed is drafted, huge ids and all.
    assert drafter.propose("h2", "ns", huge, 8, 1)[:1] == [2**63]
    loop = [4, 5, 6] * 20
    # Any sequence of ids: a tuple, numpy arrays.
    inputs: list[Any] = [tuple(loop), np.array(loop), np.array(loop, dtype=np.uint64)]
    for i, ids in enumerate(inputs):
        draft = drafter.propose(f"k{i}", "ns", ids, 8, 1)
        assert len(draft) >= 5 and draft == [4, 5, 6, 4, 5, 6, 4, 5][: len(draft)]
    drafter.verified("h", 10**30, -(10**30))
    drafter.verified("unknown", 3, 1)
    drafter.finished("h", "ns", huge)  # ids no model generates are not kept
    drafter.finished("never-proposed", "ns", [])
    assert drafter.retained() == {}


def test_a_busy_step_drafts_less_and_a_very_busy_one_nothing() -> None:
    loop = [4, 5, 6] * 11 + [4]  # a 32-token match
    lengths = [len(Drafter(16).propose("r", "ns", loop, 16, load)) for load in (1, 2, 4, 8, 16, 64, 10**6)]
    assert lengths == sorted(lengths, reverse=True)
    assert lengths[0] > lengths[2] > 0 and lengths[-1] == 0
    assert row_share(1) == 0.5 and row_share(4) == 0.8 and 0.88 < row_share(8) < 0.9


def test_rejected_drafts_stop_short_matches_but_not_a_loop() -> None:
    drafter = Drafter(8)
    text = [*range(40), 1, 2, 3, 4, 5, 6]  # a 6-token match
    rounds = []
    for _ in range(10):
        draft = drafter.propose("r", "ns", text, 8, 1)
        rounds.append(len(draft))
        drafter.verified("r", len(draft), 0)
    assert rounds[0] > 0 and rounds[-1] == 0
    # The same sequence falls into a loop: a long match is evidence of its own.
    looping = text + [50, 51, 52] * 12
    assert len(drafter.propose("r", "ns", looping, 8, 1)) >= 5


def test_failures_fade_and_the_sequence_tries_again() -> None:
    drafter = Drafter(8)
    text = [*range(40), 1, 2, 3, 4, 5, 6]
    for _ in range(10):
        drafter.verified("r", len(drafter.propose("r", "ns", text, 8, 1)), 0)
    assert drafter.propose("r", "ns", text, 8, 1) == []
    assert any(drafter.propose("r", "ns", text, 8, 1) for _ in range(200))


def test_accepted_drafts_grow_to_max_tokens() -> None:
    drafter = Drafter(8)
    text = list(range(40)) + list(range(20, 28))  # an 8-token match: a few tokens at first
    first = drafter.propose("r", "ns", text, 8, 1)
    assert 0 < len(first) < 8
    draft = first
    for _ in range(10):
        drafter.verified("r", len(draft), len(draft))
        draft = drafter.propose("r", "ns", text, 8, 1)
    assert draft == list(range(28, 36))


texts = st.lists(st.integers(0, 3), min_size=0, max_size=120)


@settings(max_examples=150, deadline=None)
@given(tokens=texts, limit=st.integers(-2, 12), load=st.integers(1, 6))
def test_every_draft_continues_an_earlier_occurrence(tokens: list[int], limit: int, load: int) -> None:
    draft = Drafter(8).propose("r", "ns", tokens, limit, load)
    assert len(draft) <= max(min(limit, 8), 0)
    if draft:
        assert is_real_continuation(tokens, draft, [])


# (tenant, namespace) pairs: the same namespace name under two tenants is two namespaces.
OWNERS = [("alice", "a"), ("alice", "b"), ("bob", "a")]


@settings(max_examples=150, deadline=None)
@given(
    replies=st.lists(
        st.tuples(st.sampled_from(OWNERS), st.lists(st.integers(0, 3), min_size=3, max_size=40)),
        min_size=1,
        max_size=12,
    ),
    tokens=st.lists(st.integers(0, 3), max_size=40),
    owner=st.sampled_from(OWNERS),
    copied=st.tuples(st.integers(0, 11), st.integers(0, 39), st.integers(2, 20)),
)
def test_namespace_drafts_come_from_that_tenants_namespace_only(
    replies: list[tuple[tuple[str, str], list[int]]],
    tokens: list[int],
    owner: tuple[str, str],
    copied: tuple[int, int, int],
) -> None:
    """Each (tenant, namespace)'s replies use ids 0-3 shifted by its own offset. A sequence's text ends
    with a piece of any reply (any owner's): a draft may continue it only from the replies of its own
    tenant in its own namespace."""
    shift = {pair: 10 * (i + 1) for i, pair in enumerate(OWNERS)}
    drafter = Drafter(8, namespace_tokens=100)
    kept: dict[tuple[str, str], list[list[int]]] = {pair: [] for pair in OWNERS}
    for i, ((tenant, ns), reply) in enumerate(replies):
        shifted = [t + shift[tenant, ns] for t in reply]
        drafter.finished(f"done-{i}", ns, shifted, tenant)
        kept[tenant, ns].append(shifted)
    which, start, length = copied
    source_owner, source = replies[which % len(replies)]
    piece = [t + shift[source_owner] for t in source[start % len(source) :][:length]]
    text = [t + shift[owner] for t in tokens] + piece
    draft = drafter.propose("r", owner[1], text, 8, 1, owner[0])
    if draft:
        assert is_real_continuation(text, draft, kept[owner])


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32), length=st.integers(0, 900), alphabet=st.integers(2, 6))
def test_incremental_indexing_proposes_what_a_fresh_drafter_does(
    seed: int, length: int, alphabet: int
) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(alphabet) for _ in range(length)]
    incremental = Drafter(16)
    fed = 0
    while fed < length:
        # Mostly small steps (decoding), sometimes a big chunk (a prompt): both ways of indexing.
        fed = min(length, fed + (rng.randrange(1, 400) if rng.random() < 0.1 else rng.randrange(1, 4)))
        draft = incremental.propose("r", "ns", tokens[:fed], 16, 1)
        assert draft == Drafter(16).propose("r", "ns", tokens[:fed], 16, 1)
        if draft:
            assert is_real_continuation(tokens[:fed], draft, [])


@settings(max_examples=150, deadline=None)
@given(
    operations=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(0, 60), st.booleans()), max_size=50
    ),
    capacity=st.integers(1, 150),
    tenant_tokens=st.integers(0, 400),
    total_tokens=st.integers(0, 900),
)
def test_a_tenants_replies_go_only_to_its_own_traffic_and_bounds_hold(
    operations: list[tuple[int, int, int, bool]], capacity: int, tenant_tokens: int, total_tokens: int
) -> None:
    """Random (tenant, salt, reply) insertions and drafts. Bounds: a namespace's tokens, a tenant's cost
    and the total. Isolation: another tenant's insertion takes replies only from a tenant holding more
    than its share of the total (total / tenants holding replies), hence never while every tenant's bound
    fits the total together; a draft touches no other tenant."""
    drafter = Drafter(8, namespace_tokens=capacity, tenant_tokens=tenant_tokens, total_tokens=total_tokens)
    for i, (who, salt, length, finish) in enumerate(operations):
        tenant, namespace = f"t{who}", f"salt-{salt}"
        tokens = [(i * k) % 4 for k in range(length)]
        before = drafter.retained()
        held = {t: drafter.held(t) for t in before}
        if finish:
            drafter.finished(f"k{i}", namespace, tokens, tenant)
        else:
            drafter.propose(f"k{i}", namespace, tokens, 8, 1, tenant)
            drafter.finished(f"k{i}", namespace, [], tenant)
        after = drafter.retained()
        holding = len(set(before) | {tenant})
        for other, replies in before.items():
            if other != tenant and after.get(other) != replies:
                assert finish and held[other] * holding > total_tokens
                assert tenant_tokens * holding > total_tokens
        assert all(0 < count <= capacity for replies in after.values() for count in replies.values())
        assert all(drafter.held(t) <= tenant_tokens for t in after)
        assert drafter.total_held == sum(drafter.held(t) for t in after) <= total_tokens
    assert not drafter._sequences


def test_replies_drafted_from_are_kept_longest() -> None:
    drafter = Drafter(8, namespace_tokens=80)
    first, second, third = (list(range(base, base + 40)) for base in (100, 200, 300))
    drafter.finished("1", "ns", first)
    drafter.finished("2", "ns", second)
    assert drafter.propose("r", "ns", first[:20], 8, 1)  # drafting from the first reply uses it
    drafter.finished("3", "ns", third)  # the second goes, least recently used
    assert drafter.propose("s", "ns", first[:20], 8, 1)
    assert drafter.propose("t", "ns", second[:20], 8, 1) == []
    assert drafter.retained() == {"default": {"ns": 80}}


def test_a_tenants_namespaces_go_least_recently_used_first() -> None:
    reply = list(range(100, 140))
    # A namespace holding one 40-token reply costs 40 + REPLY_COST + NAMESPACE_COST units: two fit.
    drafter = Drafter(8, tenant_tokens=2 * (40 + REPLY_COST + NAMESPACE_COST))
    for namespace in ("a", "b", "c"):
        drafter.finished(namespace, namespace, reply, "alice")
    assert set(drafter.retained()["alice"]) == {"b", "c"}
    assert drafter.propose("r", "a", reply[:20], 8, 1, "alice") == []


def test_the_same_namespace_name_under_another_tenant_drafts_nothing() -> None:
    drafter = Drafter(8)
    secret = list(range(9000, 9040))
    drafter.finished("a-1", "ns", secret, "alice")
    tokens = [1, 2, 3, *secret[:16]]
    assert drafter.propose("b-1", "ns", tokens, 8, 1, "bob") == []
    own = drafter.propose("a-2", "ns", tokens, 8, 1, "alice")
    assert own and own == secret[16 : 16 + len(own)]


def test_another_tenants_salted_flood_evicts_none_of_alices_replies() -> None:
    """The review's probe at the drafter: alice's reply, then bob's 4-token replies in 1,000 salted
    namespaces (the old drafter kept 64 namespaces for everyone). Alice drafts the same; bob's flood is
    bounded by his own budget."""
    drafter = Drafter(8, tenant_tokens=4_096, total_tokens=16_384)
    reply = list(range(100, 200))
    drafter.finished("a-1", "alice-salt", reply, "alice")
    first = drafter.propose("a-2", "alice-salt", [1, 2, *reply[:40]], 8, 1, "alice")
    held = drafter.held("alice")
    for i in range(1_000):
        drafter.finished(f"b-{i}", f"bob-salt-{i}", [7, 8, 9, i], "bob")
    assert drafter.retained()["alice"] == {"alice-salt": 100} and drafter.held("alice") == held
    assert first and first == reply[40 : 40 + len(first)]
    assert drafter.propose("a-3", "alice-salt", [1, 2, *reply[:40]], 8, 1, "alice") == first
    assert drafter.held("bob") <= 4_096


def test_past_the_total_the_tenant_holding_most_is_trimmed() -> None:
    reply = list(range(100, 140))
    cost = 40 + REPLY_COST + NAMESPACE_COST
    drafter = Drafter(8, tenant_tokens=10 * cost, total_tokens=4 * cost)
    for i in range(3):
        drafter.finished(f"b-{i}", f"b{i}", reply, "bob")
    drafter.finished("a", "a", reply, "alice")
    # Bob holds three shares of four; carol's one reply is taken from bob's oldest, not from alice's.
    drafter.finished("c", "c", reply, "carol")
    assert drafter.retained() == {"bob": {"b1": 40, "b2": 40}, "alice": {"a": 40}, "carol": {"c": 40}}
    # On a tie among those holding the most, the tenant adding pays.
    drafter.finished("a2", "a2", reply, "alice")
    assert drafter.retained()["alice"] == {"a2": 40} and drafter.held("bob") == 2 * cost


def test_a_reply_longer_than_the_namespace_keeps_its_start() -> None:
    drafter = Drafter(8, namespace_tokens=30)
    reply = list(range(100, 140))
    drafter.finished("1", "ns", reply)
    assert drafter.retained() == {"default": {"ns": 30}}
    draft = drafter.propose("r", "ns", reply[:20], 8, 1)
    assert draft and draft == reply[20 : 20 + len(draft)] and 20 + len(draft) <= 30


def test_positions_renumbered_after_four_billion_tokens_still_draft() -> None:
    drafter = Drafter(8)
    first, second = list(range(100, 140)), list(range(200, 240))
    drafter.finished("1", "ns", first)
    index = drafter._replies.get("default", "ns")
    assert index is not None
    index._next_base = 2**32 - 20  # as after 4e9 tokens of replies: the next one does not fit
    drafter.finished("2", "ns", second)
    assert index._next_base == 80
    for reply in (first, second):
        draft = drafter.propose(f"r{reply[0]}", "ns", reply[:20], 8, 1)
        assert draft and draft == reply[20 : 20 + len(draft)]


def test_a_key_given_another_text_starts_again() -> None:
    drafter = Drafter(8)
    loop = [4, 5, 6] * 20
    assert drafter.propose("r", "ns", loop, 8, 1)
    assert drafter.propose("r", "ns", list(range(10)), 8, 1) == []  # shorter: not the text indexed
    assert drafter.propose("r", "other", loop, 8, 1)  # another namespace: a new sequence


hostile_ids = st.sampled_from(
    [0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**64), 2**100]
)


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(hostile_ids, max_size=60),
    replies=st.lists(st.lists(hostile_ids, max_size=30), max_size=4),
    limit=st.integers(-(2**70), 2**70),
    load=st.integers(-(2**70), 2**70),
    verdict=st.tuples(st.integers(-(2**70), 2**70), st.integers(-(2**70), 2**70)),
)
def test_any_ids_and_arguments_never_raise(
    tokens: list[int], replies: list[list[int]], limit: int, load: int, verdict: tuple[int, int]
) -> None:
    drafter = Drafter(8, namespace_tokens=50)
    for i, reply in enumerate(replies):
        drafter.finished(f"done-{i}", "ns", reply)
    draft = drafter.propose("r", "ns", tokens, limit, load)
    assert len(draft) <= max(min(limit, 8), 0)
    if draft:
        assert is_real_continuation(tokens, draft, replies)
    drafter.verified("r", *verdict)
    drafter.propose("r", "ns", tokens, 8, 1)
    drafter.finished("r", "ns", tokens)
    assert not drafter._sequences
