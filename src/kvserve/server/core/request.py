"""The neutral chat request: what every API's request becomes before it is planned.

Each API converts its body to a `ChatRequest` in its own `convert.py` (server/openai/convert.py,
server/anthropic/convert.py, server/responses/convert.py), the one place its defaults live; the plan
(server/core/plan.py) renders, tokenizes and checks it the same way whichever API it came from.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvserve.engine.sampling_params import SamplingParams
from kvserve.server.core.messages import ChatMessage
from kvserve.server.core.tools import ToolUse


class OverContext(Enum):
    """What a request's max_tokens becomes when the prompt leaves less room than it asks for: each API
    states its rule in its convert.py and picks one of these."""

    # Kept as given: the engine's check refuses prompt + max_tokens over the context (a 400).
    REFUSE = "refuse"
    # No limit: the reply may fill the room the prompt leaves.
    FILL = "fill"
    # The room the prompt leaves, at least 1 (a prompt that fills the context is refused for its length).
    CLAMP = "clamp"


@dataclass(frozen=True)
class ChatRequest:
    """A conversation to answer: its messages, its sampling (the API's defaults applied, `max_tokens`
    None for "up to the context"), its tools, the chat template's variables, the rule for a max_tokens
    over the room the prompt leaves, the field an error on the prompt names, and whether a system prompt
    came apart from the messages."""

    messages: tuple[ChatMessage, ...]
    params: SamplingParams
    tools: ToolUse | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    over_context: OverContext = OverContext.REFUSE
    prompt_param: str = "messages"
    # The API's reasoning effort, which a harmony chat's template takes (server/core/prompts.py).
    reasoning_effort: str | None = None
    # Its first message is a system prompt its API sends apart from the messages (cache_report.py).
    system_apart: bool = False

    def max_tokens(self, prompt_tokens: int, max_model_len: int) -> int | None:
        """The max_tokens the engine gets for a prompt of `prompt_tokens`, under `over_context`."""
        asked = self.params.max_tokens
        room = max_model_len - prompt_tokens
        if asked is None or asked <= room or self.over_context is OverContext.REFUSE:
            return asked
        return None if self.over_context is OverContext.FILL else max(1, room)
