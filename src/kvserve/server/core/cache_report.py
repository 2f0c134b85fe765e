"""A request's cache report: what it found cached, what it computed again that its namespace had seen,
and why (the engine's CacheMiss, cache/cache_miss.py), with the part of the request where a changed
prompt parts from what was seen; the header every API sends it in; and the log of a namespace's last
misses that the dashboard and the diagnoses read.

The part is found from the server's own render, only for a diverged miss: the token position becomes a
character offset of the rendered prompt (the decoded tokens before it), and that offset falls in the
tools (the span the tools add to the render), in a message (between the renders of the messages before
it and through it, found by bisection), or after the last message (`template`: the generation prompt).

A report compares only with what the request's own namespace saw: another tenant's identical prompt
reads exactly as a never-seen one (reason `none`).
"""

import threading
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.cache.cache_miss import MISS_DIVERGED, CacheMiss
from kvserve.engine.outputs import PromptOutputs
from kvserve.model.tokenizer import TemplateArgs, Tokenizer
from kvserve.sequences import common_prefix_len
from kvserve.server.core.chat_setup import ChatSetup
from kvserve.server.core.messages import ChatMessage
from kvserve.server.core.tools import ToolUse, conversation, template_tools

# The response header of every API: `cached=N; missed=M; reason=R` (and `position`, `part` for a
# diverged prompt).
CACHE_HEADER = "x-kvserve-cache"
# A report without a miss.
NO_MISS = "none"
# The parts a position falls in (a message is `message k`).
PART_SYSTEM = "system"
PART_TOOLS = "tools"
PART_TEMPLATE = "template"
# Misses a namespace's log keeps, and namespaces, and response ids a diagnosis may compare with.
MISSES_PER_NAMESPACE = 20
MAX_NAMESPACES = 1024
MAX_RESPONSE_IDS = 16384
# Tokens of text shown on each side of a diverging position (with --dashboard-show-text only).
CONTEXT_TOKENS = 8


@dataclass(frozen=True)
class CacheReport:
    """A prompt's cache figures: `cached_tokens` found, `missed_tokens` computed again that its namespace
    had seen, the `reason` (NO_MISS, or one of cache/cache_miss.py's), and for a diverged prompt the
    first differing token's `position` and its `part` (system, tools, message k, template)."""

    cached_tokens: int
    missed_tokens: int = 0
    reason: str = NO_MISS
    position: int | None = None
    part: str | None = None

    def header(self) -> str:
        fields = [f"cached={self.cached_tokens}", f"missed={self.missed_tokens}", f"reason={self.reason}"]
        if self.position is not None:
            fields.append(f"position={self.position}")
        if self.part is not None:
            fields.append(f"part={self.part.replace(' ', '-')}")
        return "; ".join(fields)

    def as_dict(self) -> dict[str, Any]:
        return {
            "cached_tokens": self.cached_tokens,
            "missed_tokens": self.missed_tokens,
            "reason": self.reason,
            "position": self.position,
            "part": self.part,
        }


@dataclass(frozen=True)
class PromptParts:
    """What a chat prompt was rendered from, to name the part of a position: its messages and tools,
    the template's setup and variables, and whether its first message is a system prompt the API
    takes apart from the messages (Messages' `system`, Responses' `instructions`): messages are
    numbered as the client numbers its list."""

    messages: tuple[ChatMessage, ...]
    tools: ToolUse | None
    setup: ChatSetup
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    system_apart: bool = False

    def _render(
        self, tokenizer: Tokenizer, messages: Sequence[ChatMessage], tools: ToolUse | None, end: bool
    ) -> str:
        turns = conversation(messages, tools, self.setup.tools)
        listed = template_tools(tools) if tools is not None and self.setup.tools.in_template else None
        args = TemplateArgs(source=self.setup.template, tools=listed, kwargs=dict(self.kwargs))
        return tokenizer.render_chat(turns, end, args)

    def part_at(self, tokenizer: Tokenizer, token_ids: Sequence[int], position: int) -> str:
        """The part of the prompt `token_ids` (rendered from these parts) holding token `position`."""
        offset = len(tokenizer.decode(list(token_ids[:position]), skip_special_tokens=False))
        whole = self._render(tokenizer, self.messages, self.tools, True)
        if self.tools is not None:
            bare = self._render(tokenizer, self.messages, None, True)
            start = common_prefix_len(whole, bare)
            if start <= offset < start + max(0, len(whole) - len(bare)):
                return PART_TOOLS

        def end_of(k: int) -> int:
            """Where the render of the first k messages parts from the whole (its end, mostly)."""
            return common_prefix_len(self._render(tokenizer, self.messages[:k], self.tools, False), whole)

        lo, hi = 1, len(self.messages)
        if not self.messages or offset >= end_of(hi):
            return PART_TEMPLATE
        while lo < hi:
            mid = (lo + hi) // 2
            if offset < end_of(mid):
                hi = mid
            else:
                lo = mid + 1
        k = lo - 1
        if self.messages[k].role == "system" and all(m.role == "system" for m in self.messages[:k]):
            return PART_SYSTEM
        first = 1 if self.system_apart and self.messages[0].role == "system" else 0
        return f"message {k - first}"


def cache_report(
    outputs: PromptOutputs, token_ids: Sequence[int], parts: PromptParts | None, tokenizer: Tokenizer
) -> CacheReport:
    """The report of one prompt's outputs (after its first delta); names the part of a diverged miss
    when the prompt is a chat (`parts`). Renders the chat again: off the event loop."""
    miss: CacheMiss | None = outputs.cache_miss
    cached = outputs.num_cached_tokens
    if miss is None:
        return CacheReport(cached)
    part = None
    position = None
    if miss.reason == MISS_DIVERGED:
        position = miss.position
        if parts is not None:
            try:
                part = parts.part_at(tokenizer, token_ids, position)
            except Exception:  # a template that cannot render a cut of the chat names no part
                part = None
    return CacheReport(cached, miss.missed_tokens, miss.reason, position, part)


@dataclass(frozen=True)
class MissRecord:
    """One miss of a namespace, as the dashboard shows it: when, why, how much, where, and the text on
    each side of the position (only where the server shows prompt text)."""

    time: float
    reason: str
    missed_tokens: int
    cached_tokens: int
    position: int | None
    part: str | None
    before: str | None = None
    after: str | None = None


class MissLog:
    """Each namespace's last misses (at most MISSES_PER_NAMESPACE, of the MAX_NAMESPACES most recent
    namespaces) and the response ids a diagnosis may compare with (MAX_RESPONSE_IDS in all, each filed
    under its namespace: another's id is never found). Any thread."""

    def __init__(self) -> None:
        self._misses: OrderedDict[str, deque[MissRecord]] = OrderedDict()
        self._ids: OrderedDict[tuple[str, str], CacheReport] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, namespace: str, record: MissRecord) -> None:
        with self._lock:
            log = self._misses.get(namespace)
            if log is None:
                log = self._misses[namespace] = deque(maxlen=MISSES_PER_NAMESPACE)
            self._misses.move_to_end(namespace)
            log.append(record)
            while len(self._misses) > MAX_NAMESPACES:
                self._misses.popitem(last=False)

    def misses(self, namespace: str) -> list[MissRecord]:
        """The namespace's last misses, the newest first."""
        with self._lock:
            return list(reversed(self._misses.get(namespace, ())))

    def answered(self, namespace: str, response_id: str, report: CacheReport) -> None:
        """The namespace was answered `response_id`, whose prompt was reported `report`."""
        with self._lock:
            self._ids[(namespace, response_id)] = report
            self._ids.move_to_end((namespace, response_id))
            while len(self._ids) > MAX_RESPONSE_IDS:
                self._ids.popitem(last=False)

    def known(self, namespace: str, response_id: str) -> bool:
        with self._lock:
            return (namespace, response_id) in self._ids


def miss_record(
    report: CacheReport, now: float, token_ids: Sequence[int], tokenizer: Tokenizer | None
) -> MissRecord:
    """The log's record of a report with a miss; with `tokenizer` (the server shows prompt text), the
    text of CONTEXT_TOKENS tokens on each side of its position."""
    before = after = None
    at = report.position if report.position is not None else report.cached_tokens
    if tokenizer is not None:
        before = tokenizer.decode(
            list(token_ids[max(0, at - CONTEXT_TOKENS) : at]), skip_special_tokens=False
        )
        after = tokenizer.decode(list(token_ids[at : at + CONTEXT_TOKENS]), skip_special_tokens=False)
    return MissRecord(
        now,
        report.reason,
        report.missed_tokens,
        report.cached_tokens,
        report.position,
        report.part,
        before,
        after,
    )
