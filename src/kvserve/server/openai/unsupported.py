"""Refuse, by name, request fields that would change the answer and that kvserve does not implement.

Ignoring them would answer a different question than the one asked (an image, audio, a legacy
function call), so each is a 400 naming the field. Structured outputs and tools are served
(server/core/structured.py, server/core/tools.py). Fields that change nothing here (`user`, `store`,
`metadata`, ...) are ignored; docs/api.md lists them.
"""

from kvserve.errors import InvalidRequestError
from kvserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest


def _refuse(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{message}; kvserve does not support '{param}' yet.", param)


def check_chat(body: ChatCompletionRequest) -> None:
    if body.functions:
        raise _refuse("functions", "functions were given")
    if body.function_call not in (None, "none"):
        raise _refuse("function_call", "a function_call was given")
    for i, message in enumerate(body.messages):
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            param = f"messages[{i}].content"
            raise InvalidRequestError(
                f"{param} is missing; only an assistant message with tool_calls may omit it.",
                param,
            )
        if message.content is None or isinstance(message.content, str):
            continue
        for j, part in enumerate(message.content):
            if part.type != "text" or part.text is None:
                param = f"messages[{i}].content[{j}]"
                raise _refuse(param, f"{param} is a content part of type {part.type!r}; only text is read")


def check_completion(body: CompletionRequest) -> None:
    if body.suffix:
        raise _refuse("suffix", "a suffix was given")
    if body.best_of is not None and body.best_of != body.n:
        raise _refuse("best_of", "best_of differs from n")
