"""Request.append on its own: each stop rule, with the real tokenizer's incremental detokenizer."""

from typing import Any

import pytest

from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.text_stream import TextStream
from kvserve.model.loader import LoadedModel
from kvserve.model.tokenizer import Tokenizer

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: LoadedModel) -> Tokenizer:
    return tiny_model.tokenizer


def request(
    tokenizer: Tokenizer, max_tokens: int = 8, max_model_len: int | None = None, **params: Any
) -> Request:
    p = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    stream = TextStream(tokenizer.decode_stream(p.skip_special_tokens), p.stop, p.include_stop_str_in_output)
    return Request(
        "r", PROMPT, p, max_tokens, stream, eos_token_ids=tokenizer.eos_token_ids, max_model_len=max_model_len
    )


def words(tokenizer: Tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    return ids


def feed(r: Request, tokens: list[int]) -> tuple[str, list[str | None]]:
    """Append each token; the text shown and the finish reason after each."""
    text, reasons = "", []
    for t in tokens:
        appended = r.append(t)
        text += appended.text
        reasons.append(appended.finish_reason)
        if appended.finish_reason is not None:
            break
    return text, reasons


def test_end_of_sequence_stops_and_its_text_is_not_shown(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_ids[0]
    hello = words(tokenizer, "Hello world")
    r = request(tokenizer)
    text, reasons = feed(r, [*hello, eos, *hello])
    assert reasons == [None] * len(hello) + ["stop"]
    assert text == "Hello world"
    assert r.output_token_ids == [*hello, eos] and r.reply_token_ids == hello


def test_ignore_eos_goes_on_to_max_tokens(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_ids[0]
    r = request(tokenizer, max_tokens=3, ignore_eos=True)
    _, reasons = feed(r, [eos, eos, eos, eos])
    assert reasons == [None, None, "length"]
    assert r.reply_token_ids == [eos, eos, eos]


def test_no_stop_applies_before_min_tokens_and_every_stop_from_there(tokenizer: Tokenizer) -> None:
    hello = words(tokenizer, "Hello world")
    stop_id = hello[0]
    # "Hello" is a stop token and a stop string: the first output is before min_tokens, the second is not.
    r = request(tokenizer, min_tokens=2, stop_token_ids=[stop_id], stop=["Hello"])
    _, reasons = feed(r, [stop_id, stop_id, stop_id])
    assert reasons == [None, "stop"]
    r = request(tokenizer, min_tokens=2, stop=["Hello"])
    text, reasons = feed(r, [stop_id, *hello])
    assert reasons == [None, "stop"] and text == "Hello"


def test_a_stop_token_is_shown_only_when_asked(tokenizer: Tokenizer) -> None:
    hello = words(tokenizer, "Hello world")
    for include, want in ((False, tokenizer.decode(hello[:-1])), (True, "Hello world")):
        r = request(tokenizer, stop_token_ids=[hello[-1]], include_stop_str_in_output=include)
        text, reasons = feed(r, hello)
        assert reasons[-1] == "stop" and text == want
        assert r.reply_token_ids == hello[:-1]


def test_a_stop_string_cuts_the_text_and_the_reply_keeps_its_tokens(tokenizer: Tokenizer) -> None:
    ids = words(tokenizer, "one two three four")
    r = request(tokenizer, max_tokens=20, stop=[" three"])
    text, reasons = feed(r, ids)
    assert reasons[-1] == "stop" and text == "one two"
    assert r.text_stream.stopped and r.reply_token_ids == r.output_token_ids


def test_max_tokens_and_a_full_context_end_with_length_and_flush_held_text(tokenizer: Tokenizer) -> None:
    ids = words(tokenizer, "one two three four")
    # Held back: the stop string's first letters could still follow; the end shows them.
    r = request(tokenizer, max_tokens=2, stop=["xyz never"])
    text, reasons = feed(r, ids)
    assert reasons == [None, "length"] and text == tokenizer.decode(ids[:2])
    r = request(tokenizer, max_tokens=20, max_model_len=len(PROMPT) + 3)
    _, reasons = feed(r, ids)
    assert reasons == [None, None, "length"]


def test_max_tokens_zero_takes_no_token(tokenizer: Tokenizer) -> None:
    r = request(tokenizer, max_tokens=0)
    appended = r.append(5)
    assert (appended.token_ids, appended.text, appended.finish_reason) == ([], "", "length")
    assert r.num_output_tokens == 0 and r.first_token_time is None
