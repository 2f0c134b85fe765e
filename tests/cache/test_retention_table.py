"""RetentionTable on its own: refresh, supersede, trimming for the namespace budget and the server cap
(the fewest blocks, from the oldest retention's end, never a whole retention for less), giving way for
memory and expiry; and, over any sequence of those, the budgets, check() and the references `Retentions`
owns, and that one namespace's retains never take more of the others' blocks than they add. The
manager's side is tests/engine/test_retention.py.
"""

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.manager import CacheConfig, KVCacheManager
from kvserve.cache.retention import (
    DROPPED_BUDGET,
    DROPPED_MEMORY,
    DROPPED_SERVER_CAP,
    MAX_RETENTION_TTL_S,
    Retention,
    Retentions,
    RetentionTable,
    retention_ttl,
)

BS = 2


_IDS: dict[tuple[str, tuple[int, ...]], int] = {}


def blocks_of(namespace: str, prefix: tuple[int, ...]) -> list[int]:
    """Stand-in block ids, one per block of the prefix: as the tree's, one id per namespace and prefix."""
    keys = [(namespace, prefix[: (j + 1) * BS]) for j in range(len(prefix) // BS)]
    return [_IDS.setdefault(key, len(_IDS)) for key in keys]


def make(
    table: RetentionTable, namespace: str, prefix: tuple[int, ...], expires_at: float = 100.0
) -> Retention:
    return table.retain(namespace, prefix, blocks_of(namespace, prefix), expires_at)


def test_a_retention_holds_whole_blocks_up_to_its_namespace_budget() -> None:
    table = RetentionTable(max_blocks=8, max_blocks_per_namespace=3, block_size=BS)
    assert table.retainable([1, 2, 3]) == (1, 2)
    assert table.retainable([1]) == ()
    assert table.retainable(list(range(20))) == tuple(range(6)), "a longer prefix keeps its first blocks"
    assert not RetentionTable(8, 0, BS).enabled and RetentionTable(0, 3, BS).max_blocks_per_namespace == 0


def test_retaining_a_prefix_again_refreshes_it_and_never_shortens_it() -> None:
    table = RetentionTable(max_blocks=8, max_blocks_per_namespace=8, block_size=BS)
    first = table.retain("a", (1, 2), [1], 10.0)
    other = table.retain("a", (5, 5), [2], 10.0)
    again = table.retain("a", (1, 2), [1], 20.0)
    assert again is first and first.expires_at == 20.0 and first.used > other.used
    assert table.retain("a", (1, 2), [1], 5.0).expires_at == 20.0
    assert table.retain("b", (1, 2), [3], 5.0) is not first, "namespaces hold their own"


def test_a_longer_prefix_supersedes_the_shorter_ones_it_outlasts() -> None:
    table = RetentionTable(max_blocks=8, max_blocks_per_namespace=8, block_size=BS)
    system = table.retain("a", (1, 1), [1], 3600.0)
    turn1 = table.retain("a", (1, 1, 2, 2), [1, 2], 300.0)
    # The system prompt outlasts the turn: both stay. The next turn supersedes the first.
    turn2 = table.retain("a", (1, 1, 2, 2, 3, 3), [1, 2, 3], 300.0)
    assert table.of("a") == [system, turn2] and turn1 not in table.all()
    # A covered prefix the longer one outlasts refreshes the longer one.
    assert table.retain("a", (1, 1, 2, 2), [1, 2], 200.0) is turn2
    assert table.num_blocks_in("a") == 3
    table.check()


def test_a_namespace_over_its_budget_loses_its_own_oldest_retention_first() -> None:
    table = RetentionTable(max_blocks=100, max_blocks_per_namespace=4, block_size=BS)
    old = table.retain("a", (1, 1, 1, 1), [1, 2], 100.0)
    mid = table.retain("a", (2, 2), [3], 100.0)
    theirs = table.retain("b", (1, 1, 1, 1), [11, 12], 100.0)
    table.retain("a", (1, 1, 1, 1), [1, 2], 100.0)  # refreshed: now newer than `mid`
    new = table.retain("a", (3, 3, 3, 3), [4, 5], 100.0)
    assert table.of("a") == [old, new] and mid not in table.all()
    assert table.of("b") == [theirs], "another namespace's retention is never touched for a budget"
    assert table.dropped == {DROPPED_BUDGET: 1}
    table.check()


def test_past_the_server_cap_the_oldest_retention_gives_up_only_the_blocks_over() -> None:
    table = RetentionTable(max_blocks=6, max_blocks_per_namespace=4, block_size=BS)
    old = make(table, "b", (1, 1, 2, 2, 3, 3))
    small = make(table, "a", (1, 1))
    newer = make(table, "b", (5, 5))
    # 5 + 2 blocks > 6: the oldest retention ("b"'s first) keeps its first two blocks.
    new = make(table, "c", (1, 1, 1, 1))
    assert table.all() == [old, newer, small, new] and old.tokens == (1, 1, 2, 2)
    assert old.blocks == blocks_of("b", (1, 1, 2, 2)) and table.num_blocks == 6
    assert table.dropped_blocks == {DROPPED_SERVER_CAP: 1} and not table.dropped
    # Two more over: the rest of the oldest, which is then removed.
    make(table, "c", (7, 7, 7, 7))
    assert old not in table.all() and table.num_blocks == 6
    assert table.dropped_blocks == {DROPPED_SERVER_CAP: 3} and table.dropped == {DROPPED_SERVER_CAP: 1}
    # Past its budget, "c" trims its own oldest; under the cap, that leaves the others alone.
    make(table, "c", (6, 6))
    assert new.tokens == (1, 1) and table.dropped_blocks[DROPPED_BUDGET] == 1
    # A namespace's own older retention is trimmed like anyone's: "a"'s first is now the oldest.
    make(table, "a", (4, 4))
    assert small not in table.all() and newer in table.all() and new.tokens == (1, 1)
    assert table.dropped_blocks[DROPPED_SERVER_CAP] == 4
    table.check()


@pytest.mark.parametrize("first", ["alice", "bob"])
def test_three_tenants_a_small_breakpoint_costs_the_oldest_one_block(first: str) -> None:
    """The review's scenario: alice and bob at 22 blocks each under a cap of 45; carol's 2-block
    breakpoint trims one block from whichever of them retained first (never decided by name), where
    it used to drop all 22 of one of them."""
    table = RetentionTable(max_blocks=45, max_blocks_per_namespace=22, block_size=BS)
    second = "bob" if first == "alice" else "alice"
    held = {}
    for who in (first, second):
        prefix = tuple(range(100, 100 + 22 * BS))
        held[who] = table.retain(who, prefix, blocks_of(who, prefix), 3600.0)
    table.retain("carol", (1, 1, 2, 2), blocks_of("carol", (1, 1, 2, 2)), 300.0)
    assert [table.num_blocks_in(who) for who in (first, second, "carol")] == [21, 22, 2]
    assert held[first].tokens == tuple(range(100, 100 + 21 * BS)) and held[second] in table.all()
    assert table.dropped_blocks == {DROPPED_SERVER_CAP: 1} and not table.dropped
    # The next block over comes from the oldest again: the same retention, until its tenant refreshes it.
    table.retain("carol", (3, 3), blocks_of("carol", (3, 3)), 300.0)
    assert table.num_blocks_in(first) == 20
    table.retain(first, held[first].tokens, held[first].blocks, 3600.0)
    table.retain("carol", (4, 4), blocks_of("carol", (4, 4)), 300.0)
    assert [table.num_blocks_in(who) for who in (first, second)] == [20, 21]
    table.check()


def test_a_retention_under_a_longer_one_is_cut_only_once_the_longer_one_is() -> None:
    """A system prompt retained for an hour under a conversation retained for five minutes: cutting
    the system prompt's end would free nothing (the conversation holds it), so the conversation is cut,
    and once it is no longer than the system prompt it is removed, its prefix held as long."""
    table = RetentionTable(max_blocks=5, max_blocks_per_namespace=5, block_size=BS)
    system = make(table, "a", (1, 1, 2, 2), 3600.0)
    chat = make(table, "a", (1, 1, 2, 2, 3, 3, 4, 4), 300.0)
    assert table.num_blocks_in("a") == 4
    make(table, "b", (9, 9, 9, 9))
    assert table.of("a") == [system, chat] and chat.tokens == (1, 1, 2, 2, 3, 3)
    make(table, "b", (8, 8))
    assert table.of("a") == [system] and system.tokens == (1, 1, 2, 2)
    assert table.dropped_blocks == {DROPPED_SERVER_CAP: 2} and not table.dropped
    table.check()


def test_giving_way_and_expiry() -> None:
    table = RetentionTable(max_blocks=10, max_blocks_per_namespace=10, block_size=BS)
    assert not table.give_way()
    a = table.retain("a", (1, 1), [1], 10.0)
    b_old = table.retain("b", (1, 1, 2, 2), [11, 12], 20.0)
    b_new = table.retain("b", (3, 3), [13], 20.0)
    # A block at a time, from the oldest retention's end.
    assert table.give_way() and table.all() == [b_old, b_new]
    assert table.give_way() and b_old.tokens == (1, 1) and b_old.blocks == [11]
    assert table.dropped == {DROPPED_MEMORY: 1} and table.dropped_blocks == {DROPPED_MEMORY: 2}
    assert table.expire(19.9) == 0 and table.expire(20.0) == 2 and table.num_blocks == 0
    assert table.give_way() is False and a.expires_at == 10.0


@pytest.mark.parametrize(
    ("ttl", "held"),
    [
        (300, 300.0),
        (3600.0, 3600.0),
        (1e9, MAX_RETENTION_TTL_S),
        (0, None),
        (-5, None),
        (float("nan"), None),
        (float("inf"), None),
        (True, None),
        ("5m", None),
        (None, None),
    ],
)
def test_a_ttl_is_a_positive_finite_number_held_at_most_an_hour(ttl: object, held: float | None) -> None:
    assert retention_ttl(ttl) == held


@dataclass
class Tree:
    """The tree's side of the references: one on every block a retention may hold."""

    pool: BlockPool = field(default_factory=lambda: BlockPool(3000))
    ids: dict[tuple[str, tuple[int, ...]], int] = field(default_factory=dict)

    def blocks(self, namespace: str, prefix: tuple[int, ...]) -> list[int]:
        out = []
        for j in range(len(prefix) // BS):
            key = (namespace, prefix[: (j + 1) * BS])
            if key not in self.ids:
                (self.ids[key],) = self.pool.allocate(1)
            out.append(self.ids[key])
        return out


NAMESPACES = st.sampled_from(["a", "b", "c"])
PREFIXES = st.lists(st.integers(0, 2), min_size=0, max_size=8).map(
    lambda xs: tuple(x for x in xs for _ in range(BS))
)
OPS = st.one_of(
    st.tuples(st.just("retain"), NAMESPACES, PREFIXES, st.sampled_from([300.0, 3600.0, 5.0])),
    st.tuples(st.just("flood"), NAMESPACES, st.integers(1, 12)),
    st.tuples(st.just("advance"), st.floats(0, 4000)),
    st.tuples(st.just("give_way")),
)


@settings(max_examples=150, deadline=None)
@given(
    max_blocks=st.integers(0, 12),
    budget=st.integers(0, 8),
    ops=st.lists(OPS, max_size=40),
)
def test_any_sequence_keeps_the_budgets_the_invariants_and_the_references(
    max_blocks: int, budget: int, ops: list[tuple[object, ...]]
) -> None:
    tree = Tree()
    table = Retentions(tree.pool, max_blocks, budget, BS)
    now = 0.0
    for op in ops:
        before = {ns: [(r, r.tokens) for r in table.of(ns)] for ns in "abc"}
        capped = table.dropped_blocks[DROPPED_SERVER_CAP]
        if op[0] == "retain":
            _, ns, tokens, ttl = op
            assert isinstance(ns, str) and isinstance(tokens, tuple) and isinstance(ttl, float)
            prefix = table.retainable(tokens)
            if prefix:
                held = table.retain(ns, prefix, tree.blocks(ns, prefix), now + ttl)
                assert held in table.of(ns) and held.tokens[: len(prefix)] == prefix
                assert held.expires_at >= now + ttl
                if table.dropped_blocks[DROPPED_SERVER_CAP] == capped:
                    # Unless the server's cap made it, retaining in one namespace never touches another's.
                    after = {o: [(r, r.tokens) for r in table.of(o)] for o in "abc"}
                    assert all(after[other] == before[other] for other in "abc" if other != ns)
        elif op[0] == "flood":
            _, ns, count = op
            assert isinstance(ns, str) and isinstance(count, int)
            for k in range(count):
                prefix = table.retainable((9, 9, 3 + k % 3, 3 + k % 3) * (1 + k % 2))
                if prefix:
                    table.retain(ns, prefix, tree.blocks(ns, prefix), now + 300.0)
        elif op[0] == "advance":
            assert isinstance(op[1], float)
            now += op[1]
            table.expire(now)
            assert all(r.expires_at > now for r in table.all())
        else:
            table.give_way()
        table.check()
        assert table.num_blocks <= max_blocks
        assert all(table.num_blocks_in(ns) <= budget for ns in "abc")
        refs = table.references()
        for block in tree.ids.values():
            assert tree.pool.ref_count(block) == 1 + refs[block]


TTL_CHOICES = st.sampled_from([300.0, 3600.0, 5.0])


@settings(max_examples=200, deadline=None)
@given(
    max_blocks=st.integers(1, 14),
    budget=st.integers(1, 8),
    others=st.lists(st.tuples(st.sampled_from(["a", "b"]), PREFIXES, TTL_CHOICES), max_size=12),
    mine=st.lists(st.tuples(PREFIXES, TTL_CHOICES), min_size=1, max_size=16),
)
def test_one_namespaces_retains_never_take_more_of_the_others_blocks_than_they_add(
    max_blocks: int,
    budget: int,
    others: list[tuple[str, tuple[int, ...], float]],
    mine: list[tuple[tuple[int, ...], float]],
) -> None:
    """After any retentions of "a" and "b", any sequence of retains by "c": each takes from the others
    at most the blocks it adds to "c" (so the sequence, at most what "c" grew by), a retention of
    theirs goes only when the blocks it loses were needed and a retention as long holds the rest, the
    cap holds, and so do the invariants and the references."""
    tree = Tree()
    table = Retentions(tree.pool, max_blocks, budget, BS)
    for ns, tokens, ttl in others:
        prefix = table.retainable(tokens)
        if prefix:
            table.retain(ns, prefix, tree.blocks(ns, prefix), ttl)

    def theirs() -> set[int]:
        return {b for ns in "ab" for r in table.of(ns) for b in r.blocks}

    start = table.num_blocks_in("c")
    before_all = theirs()
    for tokens, ttl in mine:
        prefix = table.retainable(tokens)
        if not prefix:
            continue
        before, mine_before = theirs(), table.num_blocks_in("c")
        held_before = [(r, r.tokens) for ns in "ab" for r in table.of(ns)]
        table.retain("c", prefix, tree.blocks("c", prefix), ttl)
        after = theirs()
        grew = table.num_blocks_in("c") - mine_before
        assert after <= before and len(before - after) <= grew
        for r, tokens_before in held_before:
            if r not in table.all():
                # Gone: what it held that is no longer held was needed, and the rest another of its
                # namespace holds as long.
                kept = table.held(r.namespace, tokens_before)
                assert (len(tokens_before) - kept) // BS <= grew
                assert not kept or any(
                    o.tokens[:kept] == tokens_before[:kept] and o.expires_at >= r.expires_at
                    for o in table.of(r.namespace)
                )
        table.check()
        assert table.num_blocks <= max_blocks and table.num_blocks_in("c") <= budget
        refs = table.references()
        assert all(tree.pool.ref_count(b) == 1 + refs[b] for b in tree.ids.values())
    assert len(before_all - theirs()) <= table.num_blocks_in("c") - start <= budget


MANAGER_BLOCKS = 12
PROMPTS = st.lists(st.integers(0, 2), min_size=1, max_size=MANAGER_BLOCKS * BS)
TTLS = st.sampled_from([300.0, 3600.0, 0.0])
MANAGER_OPS = st.one_of(
    st.tuples(st.just("request"), NAMESPACES, PROMPTS),
    # A request of the whole pool, sharing nothing: every retained block must give way to it.
    st.tuples(st.just("request"), NAMESPACES, st.just([3] * MANAGER_BLOCKS * BS)),
    st.tuples(
        st.just("retain"),
        st.integers(0, 100),
        st.lists(st.tuples(st.integers(-2, MANAGER_BLOCKS * BS + 2), TTLS), max_size=4),
    ),
    st.tuples(st.just("advance"), st.floats(0, 4000)),
)


@settings(max_examples=150, deadline=None)
@given(
    max_retained=st.integers(0, MANAGER_BLOCKS - 1),
    budget=st.integers(0, MANAGER_BLOCKS),
    ops=st.lists(MANAGER_OPS, max_size=30),
)
def test_with_any_retentions_a_request_that_fits_the_pool_is_admitted(
    max_retained: int, budget: int, ops: list[tuple[object, ...]]
) -> None:
    """Retentions never cost a request its admission, and the manager's invariants (references
    included) hold after each request, retention and expiry. A retention holds an earlier request's
    prompt (by index), up to each of its breakpoints, valid or not."""
    clock = [0.0]
    kv = KVCacheManager(
        CacheConfig(
            MANAGER_BLOCKS,
            BS,
            max_retained_blocks=max_retained,
            max_retained_blocks_per_namespace=budget,
        ),
        clock=lambda: clock[0],
    )
    done: list[tuple[str, list[int]]] = []
    for op in ops:
        if op[0] == "request":
            _, ns, prompt = op
            assert isinstance(ns, str) and isinstance(prompt, list)
            admission = kv.admit(ns, prompt, len(prompt))
            assert admission is not None, "a request alone that fits the pool is always admitted"
            kv.publish(admission.seq, prompt, len(prompt))
            kv.check()
            kv.release(admission.seq, prompt, len(prompt))
            done.append((ns, prompt))
        elif op[0] == "retain":
            _, which, breakpoints = op
            assert isinstance(which, int) and isinstance(breakpoints, list)
            if done:
                ns, prompt = done[which % len(done)]
                held = kv.retain(ns, prompt, breakpoints)
                assert all(n % BS == 0 and n <= budget * BS for n in held)
        else:
            assert isinstance(op[1], float)
            clock[0] += op[1]
            kv.expire_retentions()
        kv.check()
        usage = kv.usage()
        assert usage.num_retained <= max_retained
        assert all(kv.namespace_usage(ns).num_retained <= min(budget, max_retained) for ns in "abc")
