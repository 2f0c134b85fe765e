"""Bodies counted, then validated from their bytes (server/http/json_body.py): the count is exact on any JSON
document, whatever its strings hold, and fields a model does not know never become Python objects."""

import json
import tracemalloc
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.errors import InvalidRequestError
from kvserve.server.http.errors import BodyError
from kvserve.server.http.json_body import JSONBounds, check_shape, parse_body
from kvserve.server.openai.protocol import ChatCompletionRequest

# Strings full of what the count must not see: quotes, backslashes, brackets, commas, escapes.
TEXT = st.text(alphabet=st.sampled_from(list('"\\[]{},: ab\n\u00e9\U0001f600')), max_size=12)
DOCUMENTS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(TEXT, children, max_size=5),
    max_leaves=40,
)


def shape(document: Any) -> tuple[int, int]:
    """(containers, values + empty containers): commas + containers + 1 counts each value of a
    non-empty container once and an empty one twice."""
    if isinstance(document, list | dict):
        children = list(document.values()) if isinstance(document, dict) else document
        containers, values = 1, 1 if children else 2
        for child in children:
            c, v = shape(child)
            containers, values = containers + c, values + v
        return containers, values
    return 0, 1


@given(document=DOCUMENTS, ascii_only=st.booleans())
def test_the_count_is_exact_whatever_the_strings_hold(document: Any, ascii_only: bool) -> None:
    body = json.dumps(document, ensure_ascii=ascii_only).encode()
    containers, values = shape(document)
    check_shape(body, JSONBounds(containers, values))
    if containers:
        with pytest.raises(InvalidRequestError, match="arrays and objects"):
            check_shape(body, JSONBounds(containers - 1, values))
    with pytest.raises(InvalidRequestError, match="values"):
        check_shape(body, JSONBounds(containers, values - 1))


@pytest.mark.parametrize(
    "body",
    [b'"' + b'\\"[,' * 100_000, b'"[,[,\\', b'["' + b"\\\\[," * 50_000, b'{"a": "' + b"[," * 100_000 + b'"}'],
    ids=["unterminated escapes", "lone backslash", "escaped backslashes", "brackets in a string"],
)
def test_hostile_strings_are_counted_in_one_pass(body: bytes) -> None:
    """Their raw counts are over the bounds, so their strings are masked: linearly (a quadratic pass
    would not end), and to nothing but the structure around them."""
    check_shape(body, JSONBounds(max_containers=2, max_values=3))


def test_an_ignored_field_makes_no_python_objects() -> None:
    """100,000 ignored `{}`: the standard json module made 100,000 dicts (about 7 MB) before the model
    dropped them; validated from the bytes, Python allocates next to nothing for them."""
    body = b'{"messages": [{"role": "user", "content": "Hi"}], "junk": [' + b"{}," * 99_999 + b"{}]}"
    tracemalloc.start()
    try:
        request = parse_body(body, ChatCompletionRequest, JSONBounds())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert request.messages[0].text == "Hi"
    assert peak < 256 * 1024, peak


def test_errors_read_as_the_body_errors_always_did() -> None:
    with pytest.raises(BodyError) as invalid:
        parse_body(b"{", ChatCompletionRequest, JSONBounds())
    assert invalid.value.error.status == 400
    assert "not valid JSON" in invalid.value.error.detail.message
    with pytest.raises(BodyError) as field:
        parse_body(b'{"messages": [{"role": "robot"}]}', ChatCompletionRequest, JSONBounds())
    assert field.value.error.detail.param == "messages.0.role"
    with pytest.raises(BodyError) as deep:
        parse_body(b"[" * 5000 + b"]" * 5000, ChatCompletionRequest, JSONBounds())
    assert deep.value.error.status == 400
    with pytest.raises(BodyError) as complex_:
        parse_body(b"[" + b"[]," * 10 + b"[]]", ChatCompletionRequest, JSONBounds(max_containers=5))
    assert complex_.value.error.detail.code == "request_too_complex"
