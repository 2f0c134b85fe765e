"""Structured outputs: what a request's text must match, compiled once, matched token by token.

A `StructuredOutputs` names one constraint (a JSON schema, any JSON object, a regex, a choice of strings,
or a Lark grammar); `GrammarCompiler` turns it into a compiled grammar through llguidance (see
docs/design.md, *Structured outputs*, for why llguidance), cached by source in a bounded LRU and safe to
call from any thread; each engine request (each sample of n) gets its own `GrammarState`, which fills the
request's row of the token bitmask and advances as tokens are appended.

Compiling happens where requests are validated (`validate_request`), on the caller's thread: the server
validates on a worker thread, so a slow schema never stalls the engine thread's step.
"""

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from kvserve.errors import InvalidRequestError

# Compiled grammars kept for reuse, by source: a tool-calling client sends the same schema every turn.
MAX_CACHED_GRAMMARS = 256
# A source bigger than this is refused before the library sees it (a schema is a few kilobytes).
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024


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
    """A constraint compiled for one tokenizer: a matcher at the start, copied for each request."""

    def __init__(self, key: tuple[str, str], template: llguidance.LLMatcher, vocab_size: int) -> None:
        self.key = key
        self._template = template
        self.vocab_size = vocab_size

    def start(self) -> "GrammarState":
        return GrammarState(self._template.deep_copy(), self.vocab_size)


class GrammarState:
    """One request's position in its grammar. It advances with every token the request appends, and
    is rebuilt from the request's output tokens if it ever falls out of step with them."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.num_tokens = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (one bit per token of the tokenizer)."""
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by one token; False if the grammar forbids it (the state is then in error)."""
        self.num_tokens += 1
        return bool(self._matcher.consume_token(token))

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
    text = str(message).split("\n<state>", 1)[0].strip()
    return text if len(text) <= limit else text[:limit] + "..."


# The library's view of a tokenizer, shared by the engines of one tokenizer (tests build many).
_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], llguidance.LLTokenizer]]" = (
    weakref.WeakKeyDictionary()
)
_TOKENIZERS_LOCK = threading.Lock()


def _library_tokenizer(hf_tokenizer: Any, vocab_size: int, eos: tuple[int, ...]) -> llguidance.LLTokenizer:
    with _TOKENIZERS_LOCK:
        built = _TOKENIZERS.setdefault(hf_tokenizer, {})
        if (vocab_size, eos) not in built:
            built[vocab_size, eos] = llguidance.hf.from_tokenizer(
                hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos)
            )
        return built[vocab_size, eos]


class GrammarCompiler:
    """Compiles constraints for one tokenizer, caching the results by source (LRU, bounded).

    Thread-safe. The library's view of the tokenizer costs about a second to build, so it is built on
    the first constraint, not at engine start. `vocab_size` is the tokenizer's; `eos_token_ids` end a
    constrained request where its grammar accepts."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._max_cached = max_cached
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """The compiled grammar of `spec`, from the cache when its source was compiled before; raises
        ConstraintRejected naming the problem when the library rejects it."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        tokenizer = _library_tokenizer(self._hf, self.vocab_size, self.eos_token_ids)
        grammar = spec.to_llguidance()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintRejected(
                f"the {spec.kind} constraint was rejected: {_brief(matcher.get_error())}", spec.kind
            )
        # The first mask builds the lexer's first states; computing it here keeps that off the step.
        mask = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        if matcher.is_error() or not bool(mask.any()):
            problem = _brief(matcher.get_error()) or "no token can start it"
            raise ConstraintRejected(f"the {spec.kind} constraint admits no output: {problem}", spec.kind)
        compiled = CompiledGrammar(key, matcher, self.vocab_size)
        with self._lock:
            self.compiled += 1
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._cache)


def token_mask(states: Sequence[GrammarState], width: int) -> torch.Tensor:
    """[len(states), width] bool: the tokens each state allows next. Tokens past the tokenizer's
    vocabulary (a padded output layer) are never allowed; a tokenizer larger than the layer is cut."""
    vocab_size = states[0].vocab_size
    bitmask = llguidance.torch.allocate_token_bitmask(len(states), vocab_size)
    for row, state in enumerate(states):
        state.fill_bitmask(bitmask, row)
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]
    if width <= vocab_size:
        return allowed[:, :width]
    return torch.cat([allowed, torch.zeros(len(states), width - vocab_size, dtype=torch.bool)], dim=1)
