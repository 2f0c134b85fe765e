"""Structured outputs: what a request's text must match, compiled once, matched token by token.

A `StructuredOutputs` names one constraint (a JSON schema, any JSON object, a regex, a choice of strings,
or a Lark grammar); `GrammarCompiler` turns it into the library's grammar text through llguidance (see
docs/design.md, *Structured outputs with llguidance*, for why), cached by namespace and source in an LRU
bounded in entries and bytes, safe to call from any thread. Each validated request gets a matcher of its
own (`RequestGrammar`), built fresh under the server's `GrammarLimits`, so whatever its lexer grows is
its own; each engine request (each sample of n) gets a `GrammarState` from it, which fills the request's
row of the token bitmask (engine/masks.py) and advances as tokens are appended.

Compiling happens where requests are validated (`validate_request`), on the caller's thread: the server
validates on a preparation thread, so a slow schema never stalls the engine thread's step.
"""

import hashlib
import json
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import llguidance
import torch
from tokenizers import Tokenizer as RustTokenizer

from kvserve.config import (
    DEFAULT_GRAMMAR_CACHE_BYTES,
    GRAMMAR_INITIAL_LEXER_FUEL,
    GRAMMAR_MAX_LEXER_STATES,
    GRAMMAR_MAX_SIZE,
    GRAMMAR_STEP_LEXER_FUEL,
    GRAMMAR_STEP_MAX_ITEMS,
    EngineConfig,
)
from kvserve.engine.bitmask import fill_row, new_bitmask
from kvserve.errors import InvalidRequestError
from kvserve.model.tokenizer import grammar_view

# Compiled grammars kept for reuse, by namespace and source: a tool-calling client sends the same schema
# every turn. Bounded in bytes too (EngineConfig.grammar_cache_bytes).
MAX_CACHED_GRAMMARS = 256
# Rejected constraints remembered (by namespace), and for how long.
MAX_REJECTIONS = 1024
REJECTION_TTL_S = 60.0
# The library's branching cap for one grammar row (its default), set here so that every limit is ours.
MAX_ITEMS_IN_ROW = 2000
# A source bigger than this is refused before the library sees it (a schema is a few kilobytes).
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024


@dataclass(frozen=True)
class GrammarLimits:
    """The grammar library's limits, set explicitly (EngineConfig's grammar options; docs/options.md
    says what each bounds). A constraint over them at compile time is
    refused (ConstraintRejected); one that reaches them while generating ends that request alone, with
    "grammar_limit". `max_lexer_states` bounds one request's lexer (about 0.65 KB a state:
    docs/benchmarks.md), `step_lexer_fuel` and `step_max_items` the work of one token's mask,
    `initial_lexer_fuel` and `max_grammar_size` the work of building a matcher."""

    max_lexer_states: int = GRAMMAR_MAX_LEXER_STATES
    step_lexer_fuel: int = GRAMMAR_STEP_LEXER_FUEL
    step_max_items: int = GRAMMAR_STEP_MAX_ITEMS
    initial_lexer_fuel: int = GRAMMAR_INITIAL_LEXER_FUEL
    max_grammar_size: int = GRAMMAR_MAX_SIZE

    @classmethod
    def from_config(cls, config: EngineConfig) -> "GrammarLimits":
        return cls(
            max_lexer_states=config.grammar_max_lexer_states,
            step_lexer_fuel=config.grammar_step_lexer_fuel,
            step_max_items=config.grammar_step_max_items,
            initial_lexer_fuel=config.grammar_initial_lexer_fuel,
            max_grammar_size=config.grammar_max_size,
        )

    def library(self) -> llguidance.LLParserLimits:
        # verbose_errors off: the library's messages would carry the parser's state and the grammar.
        return llguidance.LLParserLimits(
            max_items_in_row=MAX_ITEMS_IN_ROW,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size,
            precompute_large_lexemes=True,
            verbose_errors=False,
        )


class ConstraintRejected(InvalidRequestError):
    """The grammar library rejects a constraint (or it admits no output): raised where it is compiled,
    so that a caller that built the constraint (the chat route, from the tools) can name its source
    without compiling it again."""


def _is_str_list(value: object) -> bool:
    return isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: `json` (a JSON schema, as a dict or its JSON text), `json_object` (any JSON
    object), `regex` (the whole output matches it), `choice` (the output is one of these strings),
    `grammar` (a Lark grammar, llguidance's dialect, which also embeds JSON schemas with `%json`).
    Shaped like vLLM's StructuredOutputsParams."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured outputs take exactly one of json, json_object, regex, choice, grammar "
                f"(got {', '.join(given) or 'none'})",
                "structured_outputs",
            )
        if self.json is not None and not isinstance(self.json, dict | str):
            raise InvalidRequestError("a JSON schema must be an object", "structured_outputs.json")
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError("json_object must be a boolean", "structured_outputs.json_object")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequestError(f"{name} must be a string", f"structured_outputs.{name}")
        if self.choice is not None:
            if not _is_str_list(self.choice) or not self.choice or len(self.choice) > MAX_CHOICES:
                raise InvalidRequestError(
                    f"choice must be 1 to {MAX_CHOICES} strings", "structured_outputs.choice"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(
                f"the constraint is {len(self.source)} characters; at most {MAX_GRAMMAR_CHARS} are accepted",
                "structured_outputs",
            )

    @property
    def kind(self) -> str:
        if self.json is not None:
            return "json"
        if self.json_object:
            return "json_object"
        if self.regex is not None:
            return "regex"
        if self.choice is not None:
            return "choice"
        return "grammar"

    @cached_property
    def source(self) -> str:
        """The constraint as text: its cache key (with `kind`) and what the library compiles."""
        if isinstance(self.json, dict):
            try:
                # Keys keep their order: the output lists properties in the schema's order.
                return json.dumps(self.json, separators=(",", ":"))
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(f"the JSON schema cannot be serialized: {e}", "json") from None
        if self.json is not None:
            return self.json
        if self.regex is not None:
            return self.regex
        if self.choice is not None:
            return json.dumps(list(self.choice))
        return self.grammar or ""

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.source

    def to_llguidance(self) -> str:
        """The constraint in llguidance's grammar form; raises InvalidRequestError if it is malformed."""
        kind = self.kind
        if kind == "json" or kind == "json_object":
            schema: str | dict[str, Any] = self.source if kind == "json" else {"type": "object"}
            try:
                # Compact JSON unless the schema's "x-guidance" asks otherwise: with free whitespace a
                # model can pad forever, and every byte of padding is a token paid for.
                return str(
                    llguidance.LLMatcher.grammar_from_json_schema(
                        schema, defaults={"whitespace_flexible": False}
                    )
                )
            except ValueError as e:
                raise ConstraintRejected(f"invalid JSON schema: {e}", "json") from None
        if kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(self.source))
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in self.choice or ())
            return str(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}"))
        return str(llguidance.LLMatcher.grammar_from_lark(self.source))


class CompiledGrammar:
    """A constraint as the library's grammar text, checked once: what the compiled-grammar cache holds.

    Immutable and text only: no matcher (and so no lexer, whose states grow as masks are computed) is
    kept here, so an entry never grows after it is stored and no request's work lands in it. `nbytes`
    is the entry's honest size: the source and the library's text it was compiled to, plus a fixed
    overhead for the key and the objects around them."""

    # The key tuple, the entry, the OrderedDict slot and the str headers: a few hundred bytes.
    OVERHEAD_BYTES = 512

    def __init__(self, key: tuple[str, str], grammar: str) -> None:
        self.key = key
        self.grammar = grammar
        source, text = (part.encode("utf-8", "surrogatepass") for part in (key[1], grammar))
        self.nbytes = len(key[0]) + len(source) + len(text) + self.OVERHEAD_BYTES


class RequestGrammar:
    """One request's own matcher of a compiled constraint, built fresh from its text for that request.

    The library's copies of a matcher share its lexer (a cache of DFA states that grows with every mask
    computed); a matcher built here is new, so what it grows is this request's alone, bounded by the
    limits, and freed with it. The samples of the request (`start`, one copy each) share it, so that
    the request's n samples grow one lexer, not n."""

    def __init__(self, key: tuple[str, str], matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.key = key
        self._matcher = matcher
        self.vocab_size = vocab_size

    def start(self) -> "GrammarState":
        return GrammarState(self._matcher.deep_copy(), self.vocab_size)


class GrammarState:
    """One engine request's position in its grammar. It advances with every token the request appends,
    and is rebuilt from the request's output tokens if it ever falls out of step with them.

    `failure` is set when the matcher fails on its own (a limit reached while computing a mask or
    taking an allowed token): the request then ends with "grammar_limit". `forced_end` is set by the
    sampler on a row left with no token of the model's vocabulary, which gets the end of sequence
    instead (the grammar may refuse it)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.num_tokens = 0
        self.failure: str | None = None
        self.forced_end = False

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (one bit per token of the tokenizer)."""
        fill_row(self._matcher, bitmask, row)
        self.check_failure()

    def check_failure(self) -> None:
        """Record the matcher's error, after a mask: no allowed token can have caused it."""
        if self.failure is None and self._matcher.is_error():
            self.failure = _brief(self._matcher.get_error())

    def accept(self, token: int) -> bool:
        """Advance by one token; False if the grammar refuses it (the state is then in error). Refusing
        a token its mask allowed is the matcher failing (a limit), which sets `failure`."""
        self.num_tokens += 1
        accepted = bool(self._matcher.consume_token(token))
        if not accepted and not self.forced_end:
            self.check_failure()
        return accepted

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar would take one after another from here, its state unchanged:
        a draft is cut there, since the rows after a token the mask forbids could never be kept."""
        if not tokens or self.failure is not None or self.finished:
            return 0
        try:
            n = int(self._matcher.validate_tokens(list(tokens)))
        except (ValueError, RuntimeError, OverflowError, TypeError):
            return 0
        return max(0, min(n, len(tokens)))

    def forced(self, limit: int) -> list[int]:
        """At most `limit` tokens the grammar forces from here (the library's tokenization of the only
        bytes it allows next), its state unchanged; [] where it allows a choice. A draft that costs
        nothing to find and that greedy and sampled rows alike keep, unless the model spells the same
        bytes with other tokens."""
        if limit <= 0 or self.failure is not None or self.finished:
            return []
        try:
            tokens = [int(t) for t in self._matcher.compute_ff_tokens()[:limit]]
        except (ValueError, RuntimeError, OverflowError, TypeError):
            return []
        if self._matcher.is_error():
            self.check_failure()
            return []
        # The tokenizer may name ids past the model's vocabulary; a draft holds model tokens only.
        for i, token in enumerate(tokens):
            if not 0 <= token < self.vocab_size:
                return tokens[:i]
        return tokens

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Replay the request's output from the start if this state has not seen exactly those tokens."""
        if self.num_tokens == len(output_token_ids):
            return
        self._matcher.reset()
        self._matcher.consume_tokens(list(output_token_ids))
        self.num_tokens = len(output_token_ids)

    @property
    def finished(self) -> bool:
        """The grammar ended (its end token was consumed) or broke: no token may follow."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return _brief(self._matcher.get_error())


def _brief(message: str, limit: int = 500) -> str:
    """The library's message without the parser state and grammar it appends (they can be long)."""
    text = str(message).split("\n<", 1)[0].strip()
    return text if len(text) <= limit else text[:limit] + "..."


# The library's view of a tokenizer, shared by the engines of one tokenizer (tests build many).
_Built = dict[tuple[int, tuple[int, ...]], llguidance.LLTokenizer]
_TOKENIZERS: "weakref.WeakKeyDictionary[RustTokenizer, _Built]" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def _library_tokenizer(
    tokenizer: RustTokenizer, vocab_size: int, eos: tuple[int, ...]
) -> llguidance.LLTokenizer:
    with _TOKENIZERS_LOCK:
        built = _TOKENIZERS.setdefault(tokenizer, {})
        if (vocab_size, eos) not in built:
            built[vocab_size, eos] = llguidance.LLTokenizer(
                grammar_view(tokenizer), n_vocab=vocab_size, eos_token=list(eos)
            )
        return built[vocab_size, eos]


class _Rejections:
    """Constraints the library rejected, by namespace, for `ttl_s` seconds: the same failing constraint
    sent again is refused without compiling it again. Bounded in entries (least recently added go
    first); an entry is a digest and the message, so its size does not depend on the source."""

    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self._max_entries = max_entries
        self._ttl_s = ttl_s
        self._entries: OrderedDict[bytes, tuple[float, str, str | None]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _digest(namespace: str, key: tuple[str, str]) -> bytes:
        h = hashlib.sha256()
        for part in (namespace, *key):
            data = part.encode("utf-8", "surrogatepass")
            h.update(len(data).to_bytes(8, "little") + data)
        return h.digest()

    def check(self, namespace: str, key: tuple[str, str]) -> None:
        """Raise the rejection remembered for this constraint in this namespace, if it is still fresh."""
        digest = self._digest(namespace, key)
        now = time.monotonic()
        with self._lock:
            found = self._entries.get(digest)
            if found is None:
                return
            expires, message, param = found
            if expires <= now:
                del self._entries[digest]
                return
        raise ConstraintRejected(message, param)

    def add(self, namespace: str, key: tuple[str, str], rejected: ConstraintRejected) -> None:
        digest = self._digest(namespace, key)
        with self._lock:
            self._entries[digest] = (time.monotonic() + self._ttl_s, rejected.message, rejected.param)
            self._entries.move_to_end(digest)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class GrammarCompiler:
    """Compiles constraints for one tokenizer under `limits`, caching the compiled text by (cache
    namespace, kind, source) in an LRU bounded in entries and in bytes (`CompiledGrammar.nbytes`).

    The namespace is part of the key, so one tenant's constraints are never another's cache hits (a
    hit is faster than a miss, which would tell one tenant what schemas another sends). A constraint
    the library rejects is remembered, by namespace, for REJECTION_TTL_S seconds.

    `compile` returns the request's own matcher (`RequestGrammar`), built fresh from the cached text
    whether it hit or not: the cache holds no state a request could grow.

    Thread-safe. The library's view of the tokenizer costs about a second to build, so it is built on
    the first constraint, not at engine start. `vocab_size` is the tokenizer's; `eos_token_ids` end a
    constrained request where its grammar accepts."""

    def __init__(
        self,
        tokenizer: RustTokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_cached: int = MAX_CACHED_GRAMMARS,
        max_cached_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
        limits: GrammarLimits | None = None,
        rejection_ttl_s: float = REJECTION_TTL_S,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._max_cached = max_cached
        self._max_cached_bytes = max_cached_bytes
        self.limits = limits or GrammarLimits()
        self._library_limits = self.limits.library()
        self._cache: OrderedDict[tuple[str, str, str], CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0
        self._rejections = _Rejections(MAX_REJECTIONS, rejection_ttl_s)
        self._lock = threading.Lock()
        self.compiled = 0

    def compile(self, spec: StructuredOutputs, namespace: str = "") -> RequestGrammar:
        """A new matcher of `spec` for one request in `namespace`, from the cached text when this
        namespace compiled the same source before; raises ConstraintRejected naming the problem when
        the library rejects it (remembered for a while: the same constraint is then refused at once)."""
        key = spec.key
        self._rejections.check(namespace, key)
        cache_key = (namespace, *key)
        with self._lock:
            hit = self._cache.get(cache_key)
            if hit is not None:
                self._cache.move_to_end(cache_key)
        try:
            if hit is not None:
                return self._instantiate(key, hit.grammar, spec.kind)
            text = spec.to_llguidance()
            grammar = self._instantiate(key, text, spec.kind)
        except ConstraintRejected as rejected:
            self._rejections.add(namespace, key, rejected)
            raise
        self._store(cache_key, CompiledGrammar(key, text))
        return grammar

    def _instantiate(self, key: tuple[str, str], text: str, kind: str) -> RequestGrammar:
        """A fresh matcher of `text`, checked: the library accepts it, and its first mask (computed
        here, so that the lexer's first states are not built during a step) allows some token."""
        tokenizer = _library_tokenizer(self._tokenizer, self.vocab_size, self.eos_token_ids)
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=self._library_limits)
        if matcher.is_error():
            raise ConstraintRejected(
                f"the {kind} constraint was rejected: {_brief(matcher.get_error())}", kind
            )
        mask = new_bitmask(1, self.vocab_size)
        fill_row(matcher, mask, 0)
        if matcher.is_error():
            raise ConstraintRejected(
                f"the {kind} constraint is over this server's grammar limits at its first token: "
                f"{_brief(matcher.get_error())}",
                kind,
            )
        if not bool(mask.any()):
            raise ConstraintRejected(f"the {kind} constraint admits no output: no token can start it", kind)
        return RequestGrammar(key, matcher, self.vocab_size)

    def _store(self, cache_key: tuple[str, str, str], compiled: CompiledGrammar) -> None:
        if compiled.nbytes > self._max_cached_bytes:
            return
        with self._lock:
            old = self._cache.pop(cache_key, None)
            if old is None:
                self.compiled += 1
            else:
                self._cached_bytes -= old.nbytes
            self._cache[cache_key] = compiled
            self._cached_bytes += compiled.nbytes
            while len(self._cache) > self._max_cached or self._cached_bytes > self._max_cached_bytes:
                _, evicted = self._cache.popitem(last=False)
                self._cached_bytes -= evicted.nbytes

    @property
    def cached_bytes(self) -> int:
        """What the cached entries hold, by their `nbytes`."""
        return self._cached_bytes

    def __len__(self) -> int:
        return len(self._cache)
