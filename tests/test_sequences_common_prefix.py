"""common_prefix_len against the plain item-by-item count, over lists, tuples, mixes and strings."""

from hypothesis import given
from hypothesis import strategies as st

from kvserve.sequences import common_prefix_len


def _plain(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(
    st.lists(st.integers(0, 3), max_size=40),
    st.lists(st.integers(0, 3), max_size=40),
    st.none() | st.integers(0, 50),
    st.sampled_from(["list", "tuple", "mixed", "str"]),
)
def test_it_counts_the_shared_leading_items(a: list[int], b: list[int], limit: int | None, kind: str) -> None:
    want = _plain(a, b) if limit is None else min(_plain(a, b), limit)
    if kind == "str":
        got = common_prefix_len("".join(map(str, a)), "".join(map(str, b)), limit)
    elif kind == "tuple":
        got = common_prefix_len(tuple(a), tuple(b), limit)
    elif kind == "mixed":
        got = common_prefix_len(tuple(a), b, limit)
    else:
        got = common_prefix_len(a, b, limit)
    assert got == want
