"""Texts of an exact number of tokens, counted by the target's own tokenizer.

Workload sizes are given in tokens because that is what prefill costs; characters or words would make
the same workload a different size on every model.
"""

import random
from collections.abc import Callable, Iterator, Sequence

import httpx

from kvserve_bench.client import Target
from kvserve_bench.errors import BenchError

TokenCounter = Callable[[str], int]
# A text's token ids (special tokens the tokenizer adds included).
TokenIds = Callable[[str], list[int]]

# Common English words that are one token each, with or without a leading space, in SmolLM2's tokenizer
# and in the other BPE tokenizers we have looked at. Counting stays additive (n words -> n tokens), so a
# text of n tokens takes one or two /tokenize calls; random draws from 200 words make unrelated texts
# share no prefix beyond their first word or two.
_WORD_LIST = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community "
    "name president team minute idea kid body information back parent face others level office door "
    "health person art war history party result change reason research girl moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death experience "
    "effect class control care field development role rate heart drug show leader light voice wife mind "
    "price report decision son view relationship town road arm difference value building action model "
    "season tax director position player record paper space ground form event official matter center site "
    "project activity star table need court oil cost industry figure street image phone data picture "
    "practice piece land product doctor wall patient worker news test movie north love support technology "
    "step baby computer type attention film tree source organization hair window evidence population "
    "truth song energy river stone bridge letter summer winter spring forest ocean castle bread apple"
)
WORDS = tuple(_WORD_LIST.split())

# A word every tokenizer encodes as one token: counting it reveals the special tokens (BOS, ...) that a
# tokenizer adds to every text, which are not part of the text's size.
_PROBE = "the"
# Each call either lands on n or moves closer; more calls than this means the counter is not additive.
_MAX_COUNT_CALLS = 20


def text_of_tokens(n: int, key: str, count: TokenCounter) -> str:
    """Random words (seeded by `key`) that `count` measures at exactly `n` tokens."""
    if n < 0:
        raise BenchError(f"a text cannot have {n} tokens")
    words = _word_stream(key)
    chosen: list[str] = []
    size = 0
    for _ in range(_MAX_COUNT_CALLS):
        if size == n:
            return " ".join(chosen)
        if size < n:
            chosen += [next(words) for _ in range(n - size)]
        else:
            # Drop the excess from the end; fresh words, not the dropped ones, fill any gap this leaves, so
            # a word that is several tokens is not picked again at the same place.
            del chosen[n - size :]
        size = count(" ".join(chosen))
    raise BenchError(f"could not build a text of exactly {n} tokens with this tokenizer")


def _word_stream(key: str) -> Iterator[str]:
    rng = random.Random(key)
    while True:
        yield rng.choice(WORDS)


def text_only(raw_count: TokenCounter) -> TokenCounter:
    """Wraps a tokenizer's count so that it leaves out the special tokens it adds to every text."""
    overhead = raw_count(_PROBE) - 1
    return lambda text: raw_count(text) - overhead


def remote_counter(client: httpx.Client, base_url: str) -> TokenCounter | None:
    """Counts with the server's `POST /tokenize`; None when the server has no such route."""
    ids = remote_token_ids(client, base_url)
    return None if ids is None else lambda text: len(ids(text))


def remote_token_ids(client: httpx.Client, base_url: str) -> TokenIds | None:
    """Tokenizes with the server's `POST /tokenize` (vLLM's and kvserve's shape: {"prompt": text} in,
    "tokens" out); None when the server has no such route."""

    def ids(text: str) -> list[int]:
        response = client.post(f"{base_url}/tokenize", json={"prompt": text})
        if response.status_code != 200:
            raise BenchError(f"{base_url}/tokenize answered {response.status_code}: {response.text[:200]}")
        try:
            return [int(t) for t in response.json()["tokens"]]
        except (ValueError, KeyError, TypeError) as e:
            raise BenchError(f"{base_url}/tokenize answered without a list of tokens: {e}") from e

    try:
        probe = client.post(f"{base_url}/tokenize", json={"prompt": _PROBE})
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {base_url}/tokenize: {e}") from e
    if probe.status_code in (404, 405):
        return None
    return ids


def local_counter() -> TokenCounter:
    """Counts with kvserve's default model tokenizer, for targets without /tokenize."""
    ids = local_token_ids()
    return lambda text: len(ids(text))


def local_token_ids() -> TokenIds:
    """kvserve's default model tokenizer, for targets without /tokenize."""
    # Imported here so that the bench layer stays HTTP-only unless a target cannot count tokens itself.
    from kvserve.model.loader import load_default_tokenizer

    return load_default_tokenizer().encode


def choose_tokenizer(client: httpx.Client, targets: Sequence[Target]) -> tuple[TokenIds, str]:
    """The first target's tokenizer that has /tokenize, else the local one; and a name for the report."""
    for target in targets:
        ids = remote_token_ids(client, target.url)
        if ids is not None:
            return ids, f"{target.name} /tokenize"
    return local_token_ids(), "local kvserve tokenizer"


def choose_counter(client: httpx.Client, targets: Sequence[Target]) -> tuple[TokenCounter, str]:
    """Counts text tokens (special tokens left out) with `choose_tokenizer`'s tokenizer."""
    ids, name = choose_tokenizer(client, targets)
    return text_only(lambda text: len(ids(text))), name
