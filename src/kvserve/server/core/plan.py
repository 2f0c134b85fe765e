"""One plan per request: what an API request asks of the engine, built and checked whole.

A plan builder turns one API's request body into a `RequestPlan`, in one trip to a worker thread (a
preparation job of the caller's tenant, server/core/preparation.py): render and tokenize the prompts, map the
body to SamplingParams, add the tools' constraint, and validate once (`AsyncEngine.validate`: the token
ids, lengths, caps and the constraint, compiled there and only there). The engine's door then queues each
prompt with each of the plan's samples as they are, checking nothing again. There is one builder per API,
each producing the same plan: `chat_plan`, `completion_plan`, `pin_plan`, `responses_plan` (OpenAI's
Responses API, over chat's prompt and constraints), `messages_plan` (Anthropic's Messages API); a new API
is one more function beside them.

The route has already done what needs no work: the body's fields alone (model, unsupported fields) and
room in the engine's queue for the request's sequences (`AsyncEngine.reserve`).
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.engine.grammar import ConstraintRejected, StructuredOutputs
from kvserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from kvserve.engine.validation import CheckedPrompt
from kvserve.errors import InvalidRequestError
from kvserve.server.anthropic.convert import AnthropicChat, anthropic_chat
from kvserve.server.anthropic.protocol import MAX_MAX_TOKENS, MessagesBase, MessagesRequest
from kvserve.server.core.context import ServerContext
from kvserve.server.core.prompts import (
    Continuation,
    chat_prompt,
    continued_chat_prompt,
    prompt_batch,
    template_kwargs,
    text_prompt,
)
from kvserve.server.core.reasoning import closes_reasoning, opens_reasoning
from kvserve.server.core.structured import structured_outputs
from kvserve.server.core.tools import IN_THINK, MAY_THINK, NO_THINK, ToolUse, constraint, tool_use
from kvserve.server.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    PinRequest,
    SamplingRequest,
)
from kvserve.server.responses.convert import (
    chat_tool_choice,
    chat_tools,
    check_fields,
    input_messages,
    response_format,
    response_tools,
)
from kvserve.server.responses.protocol import ResponsesRequest

# The legacy completions route reports at most this many alternatives per token, as OpenAI's does.
MAX_COMPLETION_LOGPROBS = 5
# A prompt's last tokens that say whether its generation prompt opened a think block (`<think>\n`) or
# closed one (`<think>\n\n</think>\n\n`).
_PROMPT_TAIL_TOKENS = 8
# A pin computes its prefix with one generated token, which leaves the whole prompt's KV in the cache.
PIN_PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class PlannedPrompt:
    """One prompt of a plan: the engine's proof of it (token ids, effective max_tokens, compiled
    constraint) and the text an echo shows."""

    checked: CheckedPrompt
    text: str = ""

    @property
    def token_ids(self) -> list[int]:
        return self.checked.token_ids


@dataclass(frozen=True, order=True)
class CacheBreakpoint:
    """A prefix of the prompt a client asked to keep: its first `tokens` tokens, for `ttl_s` seconds."""

    tokens: int
    ttl_s: float


@dataclass(frozen=True)
class RequestPlan:
    """A request as the engine will run it: every prompt checked with the request's params, and the
    params of each of its n samples (`samples[j]`, built once and shared by every prompt), for the cache
    namespace its KV lives in. Each prompt with each sample is one engine request, which the door queues
    without checking it again."""

    prompts: tuple[PlannedPrompt, ...]
    samples: tuple[SamplingParams, ...]
    namespace: str
    # A chat whose prompt opened a think block: its replies start inside it.
    opens_reasoning: bool = False
    # A chat's tools, by name: only calls of these are its replies' tool calls.
    tool_names: frozenset[str] | None = None
    # Where an Anthropic request's cache breakpoints fall, first to last: the prefixes to keep, for the
    # retention that keeps them.
    breakpoints: tuple[CacheBreakpoint, ...] = ()

    @property
    def n(self) -> int:
        return len(self.samples)


def _plan(
    ctx: ServerContext, token_ids: list[list[int]], params: SamplingParams, namespace: str
) -> RequestPlan:
    """The one check of the request, then its n samples' params."""
    checked = ctx.async_engine.validate(token_ids, params, namespace)
    samples = tuple(params.for_sample(j) for j in range(params.n))
    return RequestPlan(tuple(PlannedPrompt(c) for c in checked), samples, namespace)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise InvalidRequestError("logit_bias keys must be token ids", "logit_bias") from None


def sampling_params(
    body: SamplingRequest,
    max_tokens: int | None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """OpenAI's defaults for unset values; SamplingParams raises InvalidRequestError on a bad one."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        seed=body.seed,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []),
        include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        skip_special_tokens=body.skip_special_tokens,
        n=body.n,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias),
        structured_outputs=structured_outputs(body),
    )


def chat_plan(ctx: ServerContext, body: ChatCompletionRequest, namespace: str) -> RequestPlan:
    """A chat completion's plan: the conversation with its tools rendered and tokenized, and the tools'
    grammar as the output constraint unless tool_choice is "none". An error on the prompt names
    `messages`, and a constraint the grammar library rejects that came from the tools names `tools`."""
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs set to true.", "top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}.", "top_logprobs")
    max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    if max_tokens is not None and max_tokens < 1:
        # Only completions' echo has a use for a reply of no tokens.
        raise InvalidRequestError("max_tokens must be at least 1.", "max_tokens")
    tools = tool_use(body)
    kwargs = template_kwargs(body.chat_template_kwargs)
    token_ids = chat_prompt(
        ctx.async_engine, ctx.prompt_guard, body.messages, namespace, True, tools, ctx.chat, kwargs
    )
    params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    return _chat_plan(ctx, token_ids, params, tools, namespace)


def _chat_plan(
    ctx: ServerContext,
    token_ids: list[int],
    params: SamplingParams,
    tools: ToolUse | None,
    namespace: str,
    prompt_param: str = "messages",
) -> RequestPlan:
    """A rendered chat's plan, whichever API it came from: whether the prompt opened or closed a think
    block, the tools' grammar as the output constraint unless tool_choice is "none", and the one check.
    An error on the prompt names `prompt_param`, and a constraint the grammar library rejects that came from
    the tools names `tools`."""
    tail = ctx.async_engine.tokenizer.decode(token_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    opened = ctx.chat.reasoning and opens_reasoning(tail)
    may_think = ctx.chat.reasoning and not closes_reasoning(tail)
    tools_constrain = False
    if tools is not None and params.structured_outputs is None:
        think = IN_THINK if opened else MAY_THINK if may_think else NO_THINK
        params = dataclasses.replace(
            params,
            structured_outputs=constraint(tools, ctx.chat.tools.layout, think),
            # The format's markup must stay in the text to be parsed, special tokens or not.
            skip_special_tokens=params.skip_special_tokens and not ctx.chat.keep_special_tokens,
        )
        tools_constrain = True
    elif tools is not None and tools.choice != "none":
        # With tool_choice "none" the request's own constraint applies; otherwise the tools' does.
        raise InvalidRequestError("tools cannot be combined with an output constraint.", "tools")
    try:
        plan = _plan(ctx, [token_ids], params, namespace)
        names = None if tools is None else frozenset(t.name for t in tools.tools)
        return dataclasses.replace(plan, opens_reasoning=opened, tool_names=names)
    except ConstraintRejected as e:
        if not tools_constrain:
            raise
        raise InvalidRequestError(f"the tools' schemas are rejected: {e.message}", "tools") from None
    except InvalidRequestError as e:
        if e.param != "prompt":
            raise
        raise InvalidRequestError(e.message, prompt_param) from None


@dataclass(frozen=True)
class PreviousResponse:
    """What a stored response hands the next turn: its conversation (without its instructions, which
    are not carried over) and its exact token ids, when its reply can be continued token for token."""

    messages: tuple[ChatMessage, ...]
    continuation: Continuation | None


@dataclass(frozen=True)
class ResponsesPlan:
    """A Responses request's plan, with what storing its response needs: the conversation it renders
    (without instructions) and the text its prompt stands for."""

    plan: RequestPlan
    messages: tuple[ChatMessage, ...]
    prompt_text: str
    tools: ToolUse | None
    # The names of the tools that are custom tools: their calls are answered as custom_tool_call items.
    custom_tools: frozenset[str] = frozenset()
    # The request's tools as its response lists them: those offered, without what nothing here reads.
    response_tools: tuple[dict[str, Any], ...] = ()


def responses_plan(
    ctx: ServerContext, body: ResponsesRequest, namespace: str, previous: PreviousResponse | None
) -> ResponsesPlan:
    """A Responses request's plan: its items after the previous response's conversation (continuing
    that response's exact token ids: only the new items are rendered into new tokens), its instructions
    first, its tools and text format as chat's, and max_output_tokens clamped to the room the prompt
    leaves in the context. An error on the prompt names `input`."""
    check_fields(body)
    listed = chat_tools(body.tools, body.input)
    history = previous.messages if previous is not None else ()
    conversation = (*history, *input_messages(body.input, history))
    if not conversation:
        raise InvalidRequestError("input is empty: give a message", "input")
    instructions = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    chat = ChatCompletionRequest.model_construct(
        messages=[*instructions, *conversation],
        tools=listed.tools,
        tool_choice=chat_tool_choice(body.tool_choice, listed.tools),
        parallel_tool_calls=body.parallel_tool_calls,
        temperature=body.temperature,
        top_p=body.top_p,
        response_format=response_format(body.text.format if body.text is not None else None),
    )
    tools = tool_use(chat)
    token_ids, prompt_text = continued_chat_prompt(
        ctx.async_engine,
        ctx.prompt_guard,
        chat.messages,
        namespace,
        tools,
        ctx.chat,
        previous.continuation if previous is not None else None,
    )
    max_tokens = body.max_output_tokens
    if max_tokens is not None and len(token_ids) + max_tokens > ctx.max_model_len:
        # Clamped: no limit is the room the prompt leaves (the engine's rule).
        max_tokens = None
    params = sampling_params(chat, max_tokens, None)
    plan = _chat_plan(ctx, token_ids, params, tools, namespace, "input")
    return ResponsesPlan(
        plan, conversation, prompt_text, tools, listed.custom, tuple(response_tools(body.tools))
    )


def _anthropic_tokens(
    ctx: ServerContext, chat: AnthropicChat, messages: Sequence[ChatMessage], namespace: str, reply: bool
) -> list[int]:
    return chat_prompt(
        ctx.async_engine, ctx.prompt_guard, messages, namespace, reply, chat.tools, ctx.chat, chat.kwargs
    )


def messages_tokens(ctx: ServerContext, body: MessagesBase, namespace: str) -> list[int]:
    """The prompt an Anthropic message request prefills (what count_tokens counts)."""
    chat = anthropic_chat(body, ctx.chat.reasoning)
    return _anthropic_tokens(ctx, chat, chat.messages, namespace, True)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _breakpoints(
    ctx: ServerContext, chat: AnthropicChat, token_ids: list[int], namespace: str
) -> tuple[CacheBreakpoint, ...]:
    """Each breakpoint's offset in the prompt: its conversation rendered on its own, followed by an
    empty user turn (some templates refuse a conversation without a user query, and a turn after it
    makes every template close the breakpoint's), and compared with the whole prompt token by token.
    The offset is where the two part, at the block's end give or take the few tokens of markup both
    share; it is always a prefix of the prompt."""
    found: list[CacheBreakpoint] = []
    for b in chat.breakpoints:
        if not b.messages:
            continue
        try:
            ids = _anthropic_tokens(
                ctx, chat, [*b.messages, ChatMessage(role="user", content="")], namespace, False
            )
        except InvalidRequestError:
            # A template that cannot render the conversation cut at this block: the breakpoint keeps
            # nothing, and the request goes on.
            continue
        tokens = _common_prefix(ids, token_ids)
        if tokens:
            found.append(CacheBreakpoint(tokens, b.ttl_s))
    return tuple(sorted(found, key=lambda b: b.tokens))


def _output_format(body: MessagesRequest) -> StructuredOutputs | None:
    spec = (body.output_config or {}).get("format")
    if spec is None:
        return None
    if (
        not isinstance(spec, dict)
        or spec.get("type") != "json_schema"
        or not isinstance(spec.get("schema"), dict)
    ):
        raise InvalidRequestError(
            "output_config.format must be {type: json_schema, schema: {...}}", "output_config.format"
        )
    return StructuredOutputs(json=spec["schema"])


def messages_plan(ctx: ServerContext, body: MessagesRequest, namespace: str) -> RequestPlan:
    """An Anthropic message's plan: the request rendered as a chat (server/anthropic/convert.py) and
    planned as one, max_tokens clamped to the room the prompt leaves in the context, and where its
    cache breakpoints fall."""
    if not 1 <= body.max_tokens <= MAX_MAX_TOKENS:
        raise InvalidRequestError(f"max_tokens must be between 1 and {MAX_MAX_TOKENS}", "max_tokens")
    chat = anthropic_chat(body, ctx.chat.reasoning)
    token_ids = _anthropic_tokens(ctx, chat, chat.messages, namespace, True)
    # A prompt that fills the context keeps max_tokens 1, and the check refuses it for its length.
    max_tokens = max(1, min(body.max_tokens, ctx.max_model_len - len(token_ids)))
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        stop=list(body.stop_sequences or []),
        structured_outputs=_output_format(body),
    )
    plan = _chat_plan(ctx, token_ids, params, chat.tools, namespace)
    return dataclasses.replace(plan, breakpoints=_breakpoints(ctx, chat, token_ids, namespace))


def completion_plan(ctx: ServerContext, body: CompletionRequest, namespace: str) -> RequestPlan:
    """A text completion's plan: each prompt of the batch tokenized (or its ids taken), then each
    echo text decoded from the checked ids (the tokenizer cannot decode ids out of range)."""
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}.", "logprobs")
    batch = prompt_batch(body.prompt)
    texts = [p for p in batch if isinstance(p, str)]
    if texts:
        ctx.prompt_guard.check(texts, "prompt")
    tokenizer = ctx.async_engine.tokenizer
    token_ids = [text_prompt(tokenizer, p) for p in batch]
    # An echo with logprobs scores the prompt too, as evaluation harnesses expect.
    prompt_logprobs = body.logprobs if body.echo else None
    params = sampling_params(body, body.max_tokens, body.logprobs, prompt_logprobs)
    plan = _plan(ctx, token_ids, params, namespace)
    prompts = tuple(
        PlannedPrompt(p.checked, given if isinstance(given, str) else tokenizer.decode(p.token_ids, False))
        for given, p in zip(batch, plan.prompts, strict=True)
    )
    return dataclasses.replace(plan, prompts=prompts)


def pin_plan(ctx: ServerContext, body: PinRequest, namespace: str) -> RequestPlan:
    """A pin's plan: the prefix to pin (rendered chat messages without the generation prompt, tokenized
    text or the ids given) as one prompt, with the params that compute its KV if it is not cached."""
    if body.messages is not None:
        token_ids = chat_prompt(
            ctx.async_engine, ctx.prompt_guard, body.messages, namespace, False, setup=ctx.chat
        )
    elif isinstance(body.prompt, str):
        ctx.prompt_guard.check([body.prompt], "prompt")
        token_ids = text_prompt(ctx.async_engine.tokenizer, body.prompt)
    else:
        token_ids = list(body.prompt or [])
    return _plan(ctx, [token_ids], PIN_PREFILL, namespace)
