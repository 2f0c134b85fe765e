"""Reasoning models' `<think>...</think>` blocks: split off a reply as its `reasoning_content`.

Qwen3 and SmolLM3 write their reasoning first, inside `<think>...</think>`, then the answer; some
templates (Qwen3's thinking-only models, DeepSeek-R1's) open the block in the generation prompt, so
the reply starts inside it (`opened`). The reasoning is the block's text without surrounding
whitespace; the content is what follows the block, without leading whitespace. A block never closed
(a reply cut short) is all reasoning. Nothing here raises on any text.
"""

from dataclasses import dataclass, field

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# What a constrained reply writes between the block and the answer (Qwen3's layout).
THINK_SEP = "\n\n"


@dataclass(frozen=True)
class Split:
    """A reply split: its reasoning (None without a block) and its content."""

    reasoning: str | None
    content: str


def opens_reasoning(prompt_tail: str) -> bool:
    """Whether a prompt ending in `prompt_tail` leaves a think block open for the reply: its generation
    prompt ends with the open tag (and whitespace)."""
    return prompt_tail.rstrip().endswith(THINK_OPEN)


def closes_reasoning(prompt_tail: str) -> bool:
    """Whether a prompt's generation prompt closed a think block already, as Qwen3's does with
    `enable_thinking=false`: the reply then answers without one."""
    return prompt_tail.rstrip().endswith(THINK_CLOSE)


def split(text: str, opened: bool) -> Split:
    if opened:
        start = 0
    else:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return Split(None, text)
        start = len(text) - len(stripped) + len(THINK_OPEN)
    end = text.find(THINK_CLOSE, start)
    if end < 0:
        return Split(text[start:].strip(), "")
    return Split(text[start:end].strip(), text[end + len(THINK_CLOSE) :].lstrip())


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReasoningStream:
    """Splits a reply's text deltas into reasoning and content deltas as they come, with the same
    result as `split` once `finish` has flushed what was held back (what may still be a tag, or
    whitespace that may end the reasoning)."""

    opened: bool
    _state: str = field(init=False)
    _held: str = ""

    def __post_init__(self) -> None:
        self._state = "reasoning_start" if self.opened else "start"

    def push(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) of this delta."""
        self._held += delta
        reasoning = content = ""
        while True:
            text = self._held
            if self._state == "start":
                stripped = text.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._state, self._held = "reasoning_start", stripped[len(THINK_OPEN) :]
                    continue
                if not stripped or THINK_OPEN.startswith(stripped):
                    break
                self._state, self._held = "content", ""
                content += text
                break
            if self._state == "reasoning_start":
                stripped = text.lstrip()
                if not stripped:
                    self._held = ""
                    break
                self._state, self._held = "reasoning", stripped
                continue
            if self._state == "reasoning":
                end = text.find(THINK_CLOSE)
                if end >= 0:
                    reasoning += text[:end].rstrip()
                    self._state, self._held = "content_start", text[end + len(THINK_CLOSE) :]
                    continue
                keep = _partial_suffix(text, THINK_CLOSE)
                body = text[: len(text) - keep]
                kept_space = len(body) - len(body.rstrip())
                reasoning += body[: len(body) - kept_space]
                self._held = text[len(body) - kept_space :]
                break
            if self._state == "content_start":
                stripped = text.lstrip()
                if stripped:
                    self._state = "content"
                    content += stripped
                self._held = ""
                break
            content += text
            self._held = ""
            break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply has ended."""
        held, self._held = self._held, ""
        if self._state == "start":
            return "", held
        if self._state == "reasoning":
            return held.rstrip(), ""
        return "", ""
