"""Drafter: drafts for speculative decoding from text already seen (suffix drafting, no draft model).

A decoding sequence's next tokens are often already written: in its own prompt (a file being edited, a
quoted tool output), in its own output (a greedy loop), or in a recent reply of its cache namespace (an
earlier answer asked for again). Each step the engine asks for a draft per sequence, verifies it as extra
rows of the step and reports how much was accepted.

- Own text: an index per sequence of the n-grams (n in ORDERS) of its prompt and output, each mapped to
  its most recent end position that has a follower. The longest indexed suffix of the text found earlier
  gives the draft: what followed that occurrence, read through the current end when the match runs into
  it (the continuation of a loop is the loop).
- Namespace replies: the same n-grams over the recent replies of the sequence's tenant in its namespace,
  bounded per namespace, per tenant and in all (`_Replies`), least recently used first. Never across
  namespaces or tenants (the acceptance rate shows in timing), never across the boundary between two
  replies.
- Length: a draft token is worth its extra row while its chance of acceptance exceeds the row's share of
  the step (`StepCosts.row_share`, from what steps at that load measured on this machine and model:
  `costs`, which the engine keeps up to date, engine/step_cost.py). The chance is a per-token estimate
  (`acceptance`): a prior from the match length, updated by the sequence's own verified drafts, per class
  of match length, with evidence that fades.

Everything depends only on this object's state (`costs` included): no clock, no randomness, so a run
given the same costs replays alike.
"""

import bisect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvserve.engine.request import DEFAULT_TENANT
from kvserve.engine.step_cost import RowShares, StepCosts

Keys = npt.NDArray[np.uint64]

# The n-gram lengths indexed; a match is then extended backwards up to MAX_MATCH tokens. Powers of two
# (which `_keys` builds by doubling) keep ingest to five sorts while a match of any length from 2 to 32
# is still found (by a shorter order).
ORDERS = (2, 4, 8, 16, 32)
MAX_MATCH = ORDERS[-1]

DEFAULT_NAMESPACE_TOKENS = 16_384
# What replies cost is counted in units of one indexed token (48 bytes: the id and a key per order); a
# reply's objects cost about 8 more, a namespace's index about 32 (tracemalloc, docs/benchmarks.md), so that a
# flood of tiny replies or namespaces is bounded by what it holds too.
REPLY_COST = 8
NAMESPACE_COST = 32
# A tenant's replies, all its namespaces together (about 12 MiB), and everyone's (about 48 MiB): four
# tenants at their bound fit the total, and beyond that the total is shared (see `_Replies`).
DEFAULT_TENANT_TOKENS = 262_144
DEFAULT_TOTAL_TOKENS = 1_048_576

# The cost of a row relative to a step's fixed part before anything is measured (a drafter built
# outside an engine; an engine replaces it with the startup probe's figures, then its steps'). Above the
# measured figures (docs/benchmarks.md) because replies in flight together wait on each other's rows.
ROW_COST = 1.0
DEFAULT_COSTS = StepCosts.relative(ROW_COST)
# The prior per-token acceptance after an m-token match is m / (m + PRIOR_HALF): 0.33 after 2 tokens,
# 0.67 after 8, 0.89 after 32. It weighs as much as PRIOR_WEIGHT verified tokens.
PRIOR_HALF = 4.0
PRIOR_WEIGHT = 4.0
# Evidence is kept per class of match length (below 4 tokens, below 16, longer): short matches failing
# says little about a long copy or a loop.
CLASS_BOUNDS = (4, 16)
# The longest match of each class: the estimate grows with the match within a class.
_CLASS_TOPS = (*(bound - 1 for bound in CLASS_BOUNDS), MAX_MATCH)
# Each propose call multiplies the evidence by DECAY: it reflects about the last 50 steps, and a sequence
# that stopped drafting tries again once its failures have faded.
DECAY = 0.98
_MASK = (1 << 64) - 1
_LOW = (1 << 32) - 1
_HIGH = _MASK ^ _LOW
# Tokens are mixed by a multiplicative hash, an n-gram hashes as sum(mixed[end - k] * BASE**k), mod 2**64.
# An index keeps the hash's high 32 bits packed with the end position in the low 32 bits, so that sorted
# keys put an n-gram's occurrences together, latest last. A hash collision only costs a miss: every match
# is checked against the tokens themselves.
_MIX = 0x9E3779B97F4A7C15
_BASE = 0xC2B2AE3D27D4EB4F
_POWERS = [pow(_BASE, k, 1 << 64) for k in range(MAX_MATCH)]
# Appends of more positions than this (a prompt) are indexed by numpy in one pass, fewer one by one.
_BULK_MIN = 256
# The tail's hashes are rolled on over at most this many new tokens, computed afresh beyond.
_ROLL_MAX = 8
_EMPTY: Keys = np.zeros(0, dtype=np.uint64)


def row_share(load: int, costs: StepCosts = DEFAULT_COSTS) -> float:
    """What one more draft row costs in a step of `load` rows, as a share of what one sequence's token
    costs there (`StepCosts.row_share`). A draft token pays while its chance of acceptance exceeds this."""
    return costs.row_share(load)


def prior(match: int) -> float:
    return match / (match + PRIOR_HALF)


def match_class(match: int) -> int:
    return bisect.bisect_right(CLASS_BOUNDS, match)


def _mixed(tokens: Sequence[int] | npt.NDArray[np.int64]) -> Keys:
    """The tokens' mixed 64-bit values (ids taken mod 2**64)."""
    try:
        values = np.asarray(tokens, dtype=np.int64).view(np.uint64)
    except (OverflowError, TypeError, ValueError):
        values = np.array([int(t) & _MASK for t in tokens], dtype=np.uint64)
    mixed: Keys = values * np.uint64(_MIX)
    return mixed


def _keys(mixed: Keys, stop: int, shift: int) -> list[Keys]:
    """Per order, the sorted keys of the n-grams of `mixed` ending before position `stop`; positions are
    stored plus `shift`."""
    out: list[Keys] = []
    # hashes[j] is the n-gram ending at position j + n - 1; an n-gram of 2n tokens is two of n:
    # H_2n(i) = H_n(i) + BASE**n * H_n(i - n), so each order is one vector operation.
    hashes = mixed
    n = 1
    for order in ORDERS:
        while n < order and len(hashes) > n:
            hashes = hashes[n:] + hashes[: len(hashes) - n] * np.uint64(_POWERS[n])
            n *= 2
        if n < order or n - 1 >= stop:
            out.append(_EMPTY)
            continue
        high = hashes[: stop - n + 1] & np.uint64(_HIGH)
        out.append(np.sort(high | np.arange(n - 1 + shift, stop + shift, dtype=np.uint64)))
    return out


def _suffix_hashes(tokens: Sequence[int], end: int) -> list[int]:
    """The hashes of the n-grams ending at `end`, one per order that fits (`_keys` stores their high 32
    bits)."""
    mixed = [(int(t) & _MASK) * _MIX & _MASK for t in tokens[max(end - MAX_MATCH + 1, 0) : end + 1]]
    mixed.reverse()  # mixed[k] is the token at end - k
    out: list[int] = []
    total = 0
    k = 0
    for order in ORDERS:
        if order > len(mixed):
            break
        while k < order:
            total = (total + mixed[k] * _POWERS[k]) & _MASK
            k += 1
        out.append(total)
    return out


def _rolled(hashes: list[int], tokens: Sequence[int], end: int) -> list[int]:
    """The hashes of the n-grams ending at `end` from those ending at end - 1 (every order):
    H_n(end) = mixed(end) + BASE * (H_n(end - 1) - mixed(end - n) * BASE**(n - 1))."""
    new = (int(tokens[end]) & _MASK) * _MIX
    return [
        (new + _BASE * (hashed - ((int(tokens[end - n]) & _MASK) * _MIX & _MASK) * _POWERS[n - 1])) & _MASK
        for n, hashed in zip(ORDERS, hashes, strict=True)
    ]


def _latest(keys: Keys, hashed: int) -> int:
    """The latest position stored with this hash, or -1."""
    # A uint64 scalar: a Python int below 2**63 would compare as int64 and convert the whole array.
    i = int(keys.searchsorted(np.uint64((hashed << 32) | _LOW), side="right")) - 1
    if i >= 0:
        key = int(keys[i])
        if key >> 32 == hashed:
            return key & _LOW
    return -1


def _extend(left: Sequence[int], right: Sequence[int], i: int, j: int, m: int) -> int:
    """How many tokens left[..i] and right[..j] share backwards, up to MAX_MATCH, given that they share
    the last m."""
    while m < MAX_MATCH and i - m >= 0 and j - m >= 0 and left[i - m] == right[j - m]:
        m += 1
    return m


class _SequenceIndex:
    """The n-grams of one sequence's tokens, by their latest end position that has a follower. The bulk
    (the prompt) is sorted keys built by numpy; later positions go to dicts until they outnumber the bulk,
    when the bulk is rebuilt (so ingest is amortized O(log n) per token)."""

    def __init__(self) -> None:
        self.indexed = 0  # positions 0..indexed-1 are indexed (each has a follower)
        self._bulk: list[Keys] = [_EMPTY] * len(ORDERS)
        self._bulk_positions = 0
        self._recent: list[dict[int, int]] = [{} for _ in ORDERS]
        # The hashes of the n-grams ending at position _tail_end (the last token seen), rolled on to the
        # next positions (a few operations per order instead of a sum over 32 tokens).
        self._tail_end = -1
        self._tail: list[int] = []

    def update(self, tokens: Sequence[int]) -> list[int]:
        """Index the positions that gained a follower; return the hashes of the n-grams ending at the
        last token."""
        followed = max(len(tokens) - 1, 0)
        added = followed - self.indexed
        recent = self.indexed - self._bulk_positions
        if added > _BULK_MIN or recent + added > max(_BULK_MIN, self._bulk_positions):
            self._bulk = _keys(_mixed(tokens[: followed + 1]), followed, 0)
            self._bulk_positions = followed
            self._recent = [{} for _ in ORDERS]
        else:
            for end in range(self.indexed, followed):
                for order, hashed in enumerate(self._hashes(tokens, end)):
                    self._recent[order][hashed >> 32] = end
        self.indexed = max(followed, self.indexed)
        return [hashed >> 32 for hashed in self._hashes(tokens, len(tokens) - 1)]

    def _hashes(self, tokens: Sequence[int], end: int) -> list[int]:
        if end != self._tail_end:
            if len(self._tail) == len(ORDERS) and self._tail_end < end <= self._tail_end + _ROLL_MAX:
                for position in range(self._tail_end + 1, end + 1):
                    self._tail = _rolled(self._tail, tokens, position)
            else:
                self._tail = _suffix_hashes(tokens, end)
            self._tail_end = end
        return self._tail

    def latest(self, order: int, hashed: int) -> int:
        position = self._recent[order].get(hashed)
        return _latest(self._bulk[order], hashed) if position is None else position


@dataclass(eq=False)
class _Reply:
    tokens: npt.NDArray[np.int64]
    base: int  # its first token's position in the namespace's key space


class _NamespaceIndex:
    """A namespace's recent replies and their n-grams: one sorted key array per order, where a reply's keys
    are inserted and deleted (O(total) per reply, no rebuild)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tokens = 0
        self._lru: OrderedDict[int, _Reply] = OrderedDict()  # by base, least recently used first
        self._bases: list[int] = []  # ascending, with _replies
        self._replies: list[_Reply] = []
        self._keys: list[Keys] = [_EMPTY] * len(ORDERS)
        self._next_base = 0

    def clear(self) -> None:
        self.tokens = 0
        self._lru.clear()
        self._bases.clear()
        self._replies.clear()
        self._keys = [_EMPTY] * len(ORDERS)
        self._next_base = 0

    def add(self, reply: npt.NDArray[np.int64]) -> None:
        reply = reply[: self.capacity]
        while self._lru and self.tokens + len(reply) > self.capacity:
            self._remove(self._lru.popitem(last=False)[1])
        if self._next_base + len(reply) > _LOW:
            self._renumber()
        entry = _Reply(reply, self._next_base)
        self._next_base += len(reply)
        self._lru[entry.base] = entry
        self._bases.append(entry.base)
        self._replies.append(entry)
        self.tokens += len(reply)
        for order, new in enumerate(self._reply_keys(entry)):
            keys = self._keys[order]
            self._keys[order] = np.insert(keys, np.searchsorted(keys, new), new)

    def find(self, order: int, hashed: int) -> tuple[_Reply, int] | None:
        position = _latest(self._keys[order], hashed)
        if position < 0:
            return None
        reply = self._replies[bisect.bisect_right(self._bases, position) - 1]
        return reply, position - reply.base

    def touch(self, reply: _Reply) -> None:
        self._lru.move_to_end(reply.base)

    @property
    def cost(self) -> int:
        """What the index holds, in token units (see REPLY_COST)."""
        return NAMESPACE_COST + self.tokens + REPLY_COST * len(self._replies)

    def pop_oldest(self) -> None:
        """Drop the least recently used reply (there is one)."""
        self._remove(self._lru.popitem(last=False)[1])

    def __len__(self) -> int:
        return len(self._replies)

    @staticmethod
    def _reply_keys(reply: _Reply) -> list[Keys]:
        return _keys(_mixed(reply.tokens), len(reply.tokens) - 1, reply.base)

    def _remove(self, reply: _Reply) -> None:
        i = bisect.bisect_left(self._bases, reply.base)
        del self._bases[i], self._replies[i]
        self.tokens -= len(reply.tokens)
        for order, old in enumerate(self._reply_keys(reply)):
            keys = self._keys[order]
            self._keys[order] = np.delete(keys, np.searchsorted(keys, old))

    def _renumber(self) -> None:
        """Give the replies fresh bases from 0 (after 2**32 tokens added), in their LRU order."""
        replies = list(self._lru.values())
        self.clear()
        for reply in replies:
            self.add(reply.tokens)


class _Replies:
    """Every tenant's recent replies: per tenant, its namespaces' indexes, least recently used first.

    A tenant's salted namespaces are its own (the server mints them), so bounds go by tenant, not by
    namespace: a namespace holds at most `namespace_tokens`, a tenant at most `tenant_tokens` over all
    its namespaces, least recently used namespace's oldest reply first, and a tenant's additions evict
    only its own replies. The total is bounded by `total_tokens` as well (units: see REPLY_COST): past it,
    the tenant holding the most loses its oldest replies (the one adding, on a tie; else the tenant least
    recently used). That tenant holds more than the total over the tenants holding replies, so a tenant
    within that share never loses a reply to another's traffic; nor does any while `tenant_tokens` times
    the tenants holding replies fits the total."""

    def __init__(self, namespace_tokens: int, tenant_tokens: int, total_tokens: int) -> None:
        self.namespace_tokens = namespace_tokens
        self.tenant_tokens = tenant_tokens
        self.total_tokens = total_tokens
        # tenant -> namespace -> index, both least recently used first.
        self._tenants: OrderedDict[str, OrderedDict[str, _NamespaceIndex]] = OrderedDict()
        self._costs: dict[str, int] = {}
        self.total = 0

    def get(self, tenant: str, namespace: str) -> _NamespaceIndex | None:
        namespaces = self._tenants.get(tenant)
        return None if namespaces is None else namespaces.get(namespace)

    def add(self, tenant: str, namespace: str, reply: npt.NDArray[np.int64]) -> None:
        namespaces = self._tenants.get(tenant)
        if namespaces is None:
            namespaces = self._tenants[tenant] = OrderedDict()
            self._costs[tenant] = 0
        index = namespaces.get(namespace)
        before = 0 if index is None else index.cost
        if index is None:
            index = namespaces[namespace] = _NamespaceIndex(self.namespace_tokens)
        index.add(reply)
        self._charge(tenant, index.cost - before)
        self.touch(tenant, namespace)
        while self._costs.get(tenant, 0) > self.tenant_tokens:
            self._evict(tenant)
        while self.total > self.total_tokens:
            most = max(self._costs.values())
            victim = tenant
            if self._costs.get(tenant) != most:
                victim = next(t for t in self._tenants if self._costs[t] == most)
            self._evict(victim)

    def touch(self, tenant: str, namespace: str, reply: _Reply | None = None) -> None:
        self._tenants.move_to_end(tenant)
        self._tenants[tenant].move_to_end(namespace)
        if reply is not None:
            self._tenants[tenant][namespace].touch(reply)

    def retained(self) -> dict[str, dict[str, int]]:
        return {
            tenant: {namespace: index.tokens for namespace, index in namespaces.items()}
            for tenant, namespaces in self._tenants.items()
        }

    def cost(self, tenant: str) -> int:
        return self._costs.get(tenant, 0)

    def _charge(self, tenant: str, cost: int) -> None:
        self._costs[tenant] += cost
        self.total += cost

    def _evict(self, tenant: str) -> None:
        """Drop `tenant`'s least recently used namespace's oldest reply, and what is left empty."""
        namespaces = self._tenants[tenant]
        namespace, index = next(iter(namespaces.items()))
        before = index.cost
        index.pop_oldest()
        if len(index):
            self._charge(tenant, index.cost - before)
            return
        del namespaces[namespace]
        self._charge(tenant, -before)
        if not namespaces:
            del self._tenants[tenant], self._costs[tenant]


@dataclass
class _Sequence:
    namespace: str
    index: _SequenceIndex = field(default_factory=_SequenceIndex)
    # Decayed counts per match class: tokens accepted, drafts cut short by a rejection.
    accepted: list[float] = field(default_factory=lambda: [0.0] * (len(CLASS_BOUNDS) + 1))
    rejected: list[float] = field(default_factory=lambda: [0.0] * (len(CLASS_BOUNDS) + 1))
    last_class: int = 0
    last_length: int = 0

    def acceptance(self, match: int) -> float:
        """The per-token acceptance estimate after an m-token match: the Beta posterior mean of the prior
        and this class's verified tokens."""
        c = match_class(match)
        accepted = self.accepted[c]
        return (PRIOR_WEIGHT * prior(match) + accepted) / (PRIOR_WEIGHT + accepted + self.rejected[c])


@dataclass
class _Match:
    length: int
    position: int  # the matched occurrence's last token
    reply: _Reply | None  # None: in the sequence's own tokens


class Drafter:
    """Drafts for the sequences of one engine; engine thread only."""

    def __init__(
        self,
        max_tokens: int,
        namespace_tokens: int = DEFAULT_NAMESPACE_TOKENS,
        tenant_tokens: int = DEFAULT_TENANT_TOKENS,
        total_tokens: int = DEFAULT_TOTAL_TOKENS,
    ) -> None:
        self.max_tokens = max_tokens
        self._sequences: dict[str, _Sequence] = {}
        self._replies = _Replies(max(namespace_tokens, 0), max(tenant_tokens, 0), max(total_tokens, 0))
        # What a step and its rows cost; the engine sets the measured figures (per load).
        self.costs: RowShares = DEFAULT_COSTS

    def propose(
        self,
        key: str,
        namespace: str,
        tokens: Sequence[int],
        limit: int,
        load: int,
        tenant: str = DEFAULT_TENANT,
    ) -> list[int]:
        """At most min(limit, max_tokens) tokens to verify after `tokens` (sequence `key`'s prompt and
        output so far; the list only grows between calls for one key) of `tenant` in cache namespace
        `namespace`, in a step that decodes `load` sequences (load >= 1); [] when drafting would not pay.
        Never raises for any token ids."""
        sequence = self._sequences.get(key)
        if sequence is None or sequence.namespace != namespace:
            sequence = self._sequences[key] = _Sequence(namespace)
        for counts in (sequence.accepted, sequence.rejected):
            counts[:] = [count * DECAY for count in counts]
        if len(tokens) - 1 < sequence.index.indexed:  # shorter than before: not the text indexed
            sequence.index = _SequenceIndex()
        hashes = sequence.index.update(tokens)
        sequence.last_length = 0
        cap = min(limit, self.max_tokens)
        share = self.costs.row_share(load)
        if cap <= 0 or len(tokens) < ORDERS[0] + 1:
            return []
        if all(sequence.acceptance(top) <= share for top in _CLASS_TOPS):
            return []  # no match could pay in this step: spare the lookups
        match = self._own_match(sequence.index, tokens, hashes)
        if match is None or match.length < MAX_MATCH:
            found = self._namespace_match(self._replies.get(tenant, namespace), tokens, hashes)
            if found is not None and (match is None or found.length > match.length):
                match = found
        if match is None:
            return []
        length = _draft_length(sequence.acceptance(match.length), share, cap)
        if length == 0:
            return []
        if match.reply is None:
            draft = _continuation(tokens, match.position, length)
        else:
            start = match.position + 1
            draft = match.reply.tokens[start : start + length].tolist()
            self._replies.touch(tenant, namespace, match.reply)
        sequence.last_class = match_class(match.length)
        sequence.last_length = len(draft)
        return draft

    def verified(self, key: str, drafted: int, accepted: int) -> None:
        """The step verified the first `drafted` tokens of `key`'s last proposal and accepted the first
        `accepted` of them (0 <= accepted <= drafted)."""
        sequence = self._sequences.get(key)
        if sequence is None:
            return
        drafted = min(max(drafted, 0), sequence.last_length)
        accepted = min(max(accepted, 0), drafted)
        sequence.accepted[sequence.last_class] += accepted
        if accepted < drafted:
            sequence.rejected[sequence.last_class] += 1
        sequence.last_length = 0

    def finished(self, key: str, namespace: str, output: Sequence[int], tenant: str = DEFAULT_TENANT) -> None:
        """Sequence `key` ended: forget its own index and stats; `output` (its reply's token ids) joins
        `tenant`'s recent replies in `namespace`."""
        self._sequences.pop(key, None)
        if len(output) < ORDERS[0] + 1 or self._replies.namespace_tokens == 0:
            return
        try:
            reply = np.asarray(output, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            return  # ids no model generates
        self._replies.add(tenant, namespace, reply)

    def retained(self) -> dict[str, dict[str, int]]:
        """The tokens of replies held per tenant and namespace."""
        return self._replies.retained()

    def held(self, tenant: str) -> int:
        """What `tenant`'s replies cost, in token units (see REPLY_COST)."""
        return self._replies.cost(tenant)

    @property
    def total_held(self) -> int:
        return self._replies.total

    @staticmethod
    def _own_match(index: _SequenceIndex, tokens: Sequence[int], hashes: list[int]) -> _Match | None:
        # An n-gram found implies its own suffixes were found, so orders are tried upwards and the walk
        # stops at the first miss: one lookup when nothing matches (the common case).
        end = len(tokens) - 1
        found = -1
        for order, hashed in enumerate(hashes):
            position = index.latest(order, hashed)
            n = ORDERS[order]
            if position < 0 or list(tokens[position - n + 1 : position + 1]) != list(tokens[end - n + 1 :]):
                break
            found = order
            latest = position
        if found < 0:
            return None
        return _Match(_extend(tokens, tokens, latest, end, ORDERS[found]), latest, None)

    @staticmethod
    def _namespace_match(
        index: _NamespaceIndex | None, tokens: Sequence[int], hashes: list[int]
    ) -> _Match | None:
        if index is None:
            return None
        end = len(tokens) - 1
        best: tuple[int, _Reply, int] | None = None
        for order, hashed in enumerate(hashes):
            found = index.find(order, hashed)
            n = ORDERS[order]
            if found is None or found[0].tokens[found[1] - n + 1 : found[1] + 1].tolist() != list(
                tokens[end - n + 1 :]
            ):
                break
            best = (n, *found)
        if best is None:
            return None
        n, reply, position = best
        window = reply.tokens[max(position - MAX_MATCH + 1, 0) : position + 1].tolist()
        return _Match(_extend(window, tokens, len(window) - 1, end, n), position, reply)


def _draft_length(acceptance: float, share: float, cap: int) -> int:
    """The most tokens j <= cap with acceptance**j above the row's share of the step."""
    chance = acceptance
    length = 0
    while length < cap and chance > share:
        length += 1
        chance *= acceptance
    return length


def _continuation(tokens: Sequence[int], position: int, length: int) -> list[int]:
    """What followed `position`, read on through the draft itself where it reaches the end (periodic)."""
    end = len(tokens)
    draft: list[int] = []
    for j in range(position + 1, position + 1 + length):
        draft.append(int(tokens[j]) if j < end else draft[j - end])
    return draft
