"""OpenAI's prompt-cache fields (chat completions and Responses) as kvserve's retention: the one place
their rules live (server/core/retention.py makes the retentions, cache/retention.py bounds them).

- `prompt_cache_retention`: `in_memory` is the default, the prefix cache's own eviction; `24h` retains
  the whole prompt like an Anthropic breakpoint of the longest TTL retention takes (one hour), within
  the tenant's retention budget, whatever `prompt_cache_options.mode` says.
- `prompt_cache_options`: `mode` `implicit` (the default) puts one breakpoint at the prompt's end,
  `explicit` none; `ttl` (`30m`, or `12h`) is every breakpoint's TTL unless its own says otherwise.
  `prewarm: true` makes the request a pre-warm (max_tokens 0: the prompt computed and kept, no
  output), as OpenAI documents it. `comparison_response_id` is the
  Responses writer's (its diagnostics).
- `prompt_cache_breakpoint` on a content part (`{"mode": "explicit", "ttl": ...}`, both optional)
  retains the prompt up to that part, for its TTL; the latest four are written (three with the
  implicit one), as OpenAI writes them, the older ones ignored.
- `prompt_cache_key`: at most MAX_CACHE_KEY_CHARS characters; never rendered. A router that routes on
  the body (SMG does) reads it there; kvserve itself routes every request to its one engine.

A breakpoint's offset is found as Anthropic's are: the conversation cut at its part, rendered on its
own with an empty user turn after it, compared with the prompt token by token.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.sequences import common_prefix_len
from kvserve.server.core.messages import ChatMessage
from kvserve.server.core.plan import CacheBreakpoint

MAX_CACHE_KEY_CHARS = 1024
# OpenAI writes at most this many breakpoints per request, the implicit one included.
MAX_WRITTEN_BREAKPOINTS = 4
# Held for at most MAX_RETENTION_TTL_S (cache/retention.py) whatever is asked.
TTL_S = {"30m": 1800.0, "12h": 43200.0}
RETENTION_24H_S = 86400.0
RETENTIONS = ("in_memory", "24h")
MODES = ("implicit", "explicit")


@dataclass(frozen=True)
class CachePolicy:
    """What a request's cache fields ask: a breakpoint at the prompt's end (its TTL, or None), and the
    TTL of a part's breakpoint that names none; whether the request only pre-warms the cache."""

    whole_prompt_ttl_s: float | None = None
    default_ttl_s: float = TTL_S["30m"]
    prewarm: bool = False


def _ttl(value: Any, param: str) -> float:
    if value not in TTL_S:
        raise InvalidRequestError(
            f"{param} must be one of {', '.join(TTL_S)}, not {str(value)[:32]!r}", param
        )
    return TTL_S[value]


def cache_policy(retention: Any, key: Any, options: Any) -> CachePolicy:
    """The request's cache fields checked (a 400 naming the field), as a policy."""
    if key is not None and (not isinstance(key, str) or len(key) > MAX_CACHE_KEY_CHARS):
        raise InvalidRequestError(
            f"prompt_cache_key must be a string of at most {MAX_CACHE_KEY_CHARS} characters",
            "prompt_cache_key",
        )
    if retention is not None and retention not in RETENTIONS:
        raise InvalidRequestError(
            f"prompt_cache_retention must be 'in_memory' or '24h', not {str(retention)[:32]!r}",
            "prompt_cache_retention",
        )
    retained = RETENTION_24H_S if retention == "24h" else None
    if options is None:
        return CachePolicy(retained)
    if not isinstance(options, dict):
        raise InvalidRequestError("prompt_cache_options must be an object", "prompt_cache_options")
    mode = options.get("mode", "implicit")
    if mode not in MODES:
        raise InvalidRequestError(
            f"prompt_cache_options.mode must be 'implicit' or 'explicit', not {str(mode)[:32]!r}",
            "prompt_cache_options.mode",
        )
    ttl = _ttl(options.get("ttl") or "30m", "prompt_cache_options.ttl")
    prewarm = options.get("prewarm", False)
    if not isinstance(prewarm, bool):
        raise InvalidRequestError(
            "prompt_cache_options.prewarm must be a boolean", "prompt_cache_options.prewarm"
        )
    # A minimum lifetime and a maximum retention policy, independent as OpenAI documents them: the
    # implicit breakpoint is held for the longer.
    implicit = max(ttl, retained or 0.0) if mode == "implicit" else retained
    return CachePolicy(implicit, ttl, prewarm)


def marker_ttl(marker: Any, param: str, policy: CachePolicy) -> float | None:
    """A content part's `prompt_cache_breakpoint` as its TTL; None when the part has none."""
    if marker is None:
        return None
    if not isinstance(marker, dict) or marker.get("mode", "explicit") != "explicit":
        raise InvalidRequestError(
            f"{param} must be an object {{mode: 'explicit', ttl?: '30m' | '12h'}}", param
        )
    return policy.default_ttl_s if marker.get("ttl") is None else _ttl(marker["ttl"], f"{param}.ttl")


@dataclass(frozen=True)
class Marker:
    """A breakpoint a content part asked for: the conversation up to and including that part."""

    messages: tuple[ChatMessage, ...]
    ttl_s: float


def chat_markers(messages: Sequence[ChatMessage], policy: CachePolicy) -> list[Marker]:
    """The breakpoints the parts of chat messages carry, first to last: each cuts its message after
    its part."""
    found: list[Marker] = []
    for k, m in enumerate(messages):
        if isinstance(m.content, str) or m.content is None:
            continue
        for j, part in enumerate(m.content):
            param = f"messages[{k}].content[{j}].prompt_cache_breakpoint"
            ttl = marker_ttl(part.prompt_cache_breakpoint, param, policy)
            if ttl is not None:
                cut = m.model_copy(update={"content": m.content[: j + 1]})
                found.append(Marker((*messages[:k], cut), ttl))
    return found


def cache_breakpoints(
    policy: CachePolicy,
    markers: Sequence[Marker],
    token_ids: Sequence[int],
    render: Callable[[Sequence[ChatMessage]], list[int]],
) -> tuple[CacheBreakpoint, ...]:
    """The breakpoints to write, shortest prefix first: the implicit one at the prompt's end, and the
    latest markers (`render` tokenizes a conversation without a reply turn; a conversation it cannot
    render, InvalidRequestError, keeps nothing)."""
    found: list[CacheBreakpoint] = []
    if policy.whole_prompt_ttl_s is not None:
        found.append(CacheBreakpoint(len(token_ids), policy.whole_prompt_ttl_s))
    for marker in list(markers)[len(found) - MAX_WRITTEN_BREAKPOINTS :]:
        at = breakpoint_at(marker.messages, marker.ttl_s, token_ids, render)
        if at is not None:
            found.append(at)
    return tuple(sorted(found, key=lambda b: b.tokens))


def breakpoint_at(
    messages: Sequence[ChatMessage],
    ttl_s: float,
    token_ids: Sequence[int],
    render: Callable[[Sequence[ChatMessage]], list[int]],
) -> CacheBreakpoint | None:
    """A breakpoint at the end of `messages` (a conversation cut at its block), every API's the same
    way: the cut rendered on its own, followed by an empty user turn (some templates refuse a
    conversation without a user query, and a turn after it makes every template close the cut's),
    compared with the whole prompt token by token. The offset is where the two part, at the block's
    end give or take the few tokens of markup both share; it is always a prefix of the prompt. None
    when nothing is shared, or when the template cannot render the cut (the request goes on)."""
    if not messages:
        return None
    try:
        ids = render([*messages, ChatMessage(role="user", content="")])
    except InvalidRequestError:
        return None
    tokens = common_prefix_len(ids, token_ids)
    return CacheBreakpoint(tokens, ttl_s) if tokens else None
