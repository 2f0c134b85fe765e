"""PinTable on its own: what a pin holds, its caps (refused before anything is recorded), extension,
expiry and namespaces. The references pins own are taken by `Pins` (tests/engine/test_pinning.py)."""

import pytest

from kvserve.cache.pins import PinRefused, PinTable

BS = 4


def test_a_pin_holds_the_full_blocks_of_its_prefix() -> None:
    table = PinTable(max_blocks=3, max_blocks_per_namespace=None, block_size=BS)
    assert table.pinnable_prefix(list(range(9))) == tuple(range(8))
    with pytest.raises(PinRefused, match="shorter than one KV block"):
        table.pinnable_prefix([1, 2, 3])
    with pytest.raises(PinRefused, match="over the cap"):
        table.pinnable_prefix(list(range(4 * BS)))


def test_a_pin_over_a_cap_is_refused_and_nothing_is_recorded() -> None:
    table = PinTable(max_blocks=3, max_blocks_per_namespace=2, block_size=BS)
    a = table.add("a", tuple(range(8)), [1, 2], 10.0)
    with pytest.raises(PinRefused, match="in this namespace"):
        table.add("a", tuple(range(100, 104)), [3], 10.0)
    # Blocks shared with a pin already held cost nothing more.
    shared = table.add("a", tuple(range(4)), [1], 10.0)
    table.add("b", tuple(range(200, 204)), [3], 10.0)
    with pytest.raises(PinRefused, match="pinned tokens, over the cap"):
        table.add("b", tuple(range(300, 304)), [4], 10.0)
    assert table.blocks() == {1, 2, 3} and table.blocks_in("a") == {1, 2}
    assert table.references() == {1: 2, 2: 1, 3: 1}
    assert {p.pin_id for p in table.of("a")} == {a.pin_id, shared.pin_id}
    table.check()


def test_pinning_a_prefix_again_extends_its_pin_and_never_shortens_it() -> None:
    table = PinTable(max_blocks=3, max_blocks_per_namespace=None, block_size=BS)
    pin = table.add("a", tuple(range(4)), [1], 10.0)
    assert table.extend("a", tuple(range(4)), 20.0) is pin and pin.expires_at == 20.0
    assert table.extend("a", tuple(range(4)), 5.0) is pin and pin.expires_at == 20.0
    assert table.extend("b", tuple(range(4)), 30.0) is None


def test_expired_pins_and_removal_by_namespace() -> None:
    table = PinTable(max_blocks=3, max_blocks_per_namespace=None, block_size=BS)
    early = table.add("a", tuple(range(4)), [1], 10.0)
    late = table.add("b", tuple(range(4, 8)), [2], 20.0)
    assert table.expired(10.0) == [early]
    assert table.remove("b", early.pin_id) is None, "another namespace's pin"
    assert table.remove("a", early.pin_id) is early and table.remove("a", early.pin_id) is None
    assert table.all() == [late] and table.blocks() == {2}
