"""A reply's text deltas as OpenAI's chunk deltas under a tool-call format."""

import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.server.core.tool_formats.layout import CallLayout, json_end


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallStream:
    """Turns one choice's text deltas into OpenAI's chunk deltas: `content` for a plain reply, or
    `tool_calls` entries (first the id and name with empty arguments, then argument pieces). A call's
    arguments go out as they come, up to where their JSON value ends once it has, so the closing
    markup never reaches the client."""

    layout: CallLayout
    text: str = ""
    mode: str | None = None
    num_calls: int = 0
    ids: list[str] = field(default_factory=list)
    _pos: int | None = None
    _args_start: int | None = None
    _sent: int = 0

    def push(self, delta: str) -> dict[str, Any]:
        self.text += delta
        if self.mode is None and self.text.strip():
            self.mode = "calls" if self.layout.is_call_text(self.text) else "text"
            if self.mode == "text":
                return {"content": self.text}
        if self.mode != "calls":
            return {"content": delta} if self.mode == "text" and delta else {}
        entries: dict[int, dict[str, Any]] = {}
        if self._pos is None:
            self._pos = self.layout.match_open(self.text, 0)
        while self._pos is not None:
            if self._args_start is None:
                if self.num_calls:
                    after = self.layout.match_sep(self.text, self._pos)
                    if after is None:
                        break
                    self._pos = after
                head = self.layout.match_head(self.text, self._pos)
                if head is None:
                    break
                self.ids.append(new_call_id())
                entries[self.num_calls] = {
                    "index": self.num_calls,
                    "id": self.ids[-1],
                    "type": "function",
                    "function": {"name": head[0], "arguments": ""},
                }
                self._args_start = self._sent = head[1]
            end = json_end(self.text, self._args_start)
            # Until its value is complete, everything after the head is arguments.
            upto = len(self.text) if end is None else end
            if upto > self._sent:
                entry = entries.setdefault(
                    self.num_calls, {"index": self.num_calls, "function": {"arguments": ""}}
                )
                entry["function"]["arguments"] += self.text[self._sent : upto]
                self._sent = upto
            parsed = self.layout.parse_call(self.text, self._pos)
            if parsed is None:
                break
            self.num_calls += 1
            self._pos = parsed[2]
            self._args_start = None
        return {"tool_calls": list(entries.values())} if entries else {}

    def finish(self) -> str:
        """Nothing is held back: a reply's first characters decide between text and calls."""
        return ""
