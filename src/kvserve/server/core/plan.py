"""One plan per request: what an API request asks of the engine, built and checked whole.

An API's converter (its convert.py) turns its body into a neutral `ChatRequest` (server/core/request.py);
`chat_plan` then builds the `RequestPlan`, in one trip to a worker thread (a preparation job of the
caller's tenant, server/core/preparation.py): render and tokenize the prompt, apply the request's rule
for a max_tokens over the room left, add the tools' constraint, and validate once
(`AsyncEngine.validate`: the token ids, lengths, caps and the constraint, compiled there and only there).
The engine's door then queues each prompt with each of the plan's samples as they are, checking nothing
again. Requests that are not chats (text completions, pins) are planned by `plan_prompts` directly.

The route has already done what needs no work: the body's fields alone (model, unsupported fields) and
room in the engine's queue for the request's sequences (`AsyncEngine.reserve`).
"""

import dataclasses
from dataclasses import dataclass

from kvserve.engine.grammar import ConstraintRejected
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.validation import CheckedPrompt
from kvserve.errors import InvalidRequestError
from kvserve.server.core import harmony
from kvserve.server.core.cache_report import PromptParts
from kvserve.server.core.context import ServerContext
from kvserve.server.core.prompts import chat_prompt, reply_turn_start
from kvserve.server.core.reasoning import closes_reasoning, opens_reasoning
from kvserve.server.core.request import ChatRequest
from kvserve.server.core.tool_formats.syntax import CallSyntax
from kvserve.server.core.tools import IN_THINK, MAY_THINK, NO_THINK, constraint

# A prompt's last tokens that say whether its generation prompt opened a think block (`<think>\n`) or
# closed one (`<think>\n\n</think>\n\n`).
_PROMPT_TAIL_TOKENS = 8


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
    # How its replies' calls are read: the server's call syntax bound to its tools (None without).
    call_syntax: CallSyntax | None = None
    # Where a request's cache breakpoints fall (Anthropic's or OpenAI's), first to last: the prefixes
    # to keep, for the retention that keeps them.
    breakpoints: tuple[CacheBreakpoint, ...] = ()
    # A chat's parts, to name where a changed prompt parts from what its namespace saw.
    parts: PromptParts | None = None
    # A hybrid model's chat: where its generation prompt parts from the reply's turn as the next turn
    # renders it (server/core/prompts.py), kept as a state checkpoint.
    reply_turn_start: int | None = None

    @property
    def state_checkpoints(self) -> list[int]:
        """The prompt positions a hybrid model keeps its state at, besides those the engine finds: the
        breakpoints and the reply turn's start."""
        ends = [b.tokens for b in self.breakpoints]
        return ends if self.reply_turn_start is None else [*ends, self.reply_turn_start]

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def prewarm(self) -> bool:
        """A chat asked for no reply (max_tokens 0): its prompt is computed and kept in the cache, as
        any prompt is, and answered with usage alone."""
        return all(p.checked.max_tokens == 0 for p in self.prompts)


def plan_prompts(
    ctx: ServerContext, token_ids: list[list[int]], params: SamplingParams, namespace: str
) -> RequestPlan:
    """The one check of the request, then its n samples' params."""
    checked = ctx.async_engine.validate(token_ids, params, namespace)
    samples = tuple(params.for_sample(j) for j in range(params.n))
    return RequestPlan(tuple(PlannedPrompt(c) for c in checked), samples, namespace)


def chat_plan(ctx: ServerContext, request: ChatRequest, namespace: str) -> RequestPlan:
    """A chat's plan: its conversation with its tools rendered and tokenized, then planned
    (`rendered_chat_plan`)."""
    token_ids = chat_prompt(
        ctx.async_engine,
        ctx.prompt_guard,
        request.messages,
        namespace,
        True,
        request.tools,
        ctx.chat,
        request.template_kwargs,
        request.reasoning_effort,
    )
    return rendered_chat_plan(ctx, request, token_ids, namespace)


def rendered_chat_plan(
    ctx: ServerContext, request: ChatRequest, token_ids: list[int], namespace: str
) -> RequestPlan:
    """A rendered chat's plan, whichever API it came from: max_tokens under the request's rule for the
    room the prompt leaves, whether the prompt opened or closed a think block, the tools' grammar as the
    output constraint unless tool_choice is "none", and the one check. An error on the prompt names the
    request's `prompt_param`, and a constraint the grammar library rejects that came from the tools names
    `tools`."""
    params = request.params
    max_tokens = request.max_tokens(len(token_ids), ctx.max_model_len)
    if max_tokens != params.max_tokens:
        params = dataclasses.replace(params, max_tokens=max_tokens)
    tools = request.tools
    tail = ctx.async_engine.tokenizer.decode(token_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    harmony_chat = ctx.chat.harmony
    opened = ctx.chat.reasoning and not harmony_chat and opens_reasoning(tail)
    may_think = ctx.chat.reasoning and not closes_reasoning(tail)
    tools_constrain = False
    if harmony_chat:
        # A harmony reply's channels are its markup: it stays in the text to be parsed; tools constrain
        # the reply to an analysis and a call in the model's own header form (or a final answer).
        params = dataclasses.replace(params, skip_special_tokens=False)
        if tools is not None and tools.choice != "none":
            if params.structured_outputs is not None:
                raise InvalidRequestError("tools cannot be combined with an output constraint.", "tools")
            named = [
                (t.name, t.parameters) for t in tools.tools if tools.choice in ("auto", "required", t.name)
            ]
            params = dataclasses.replace(params, structured_outputs=harmony.constraint(named, tools.choice))
            tools_constrain = True
    elif tools is not None and params.structured_outputs is None:
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
        plan = plan_prompts(ctx, [token_ids], params, namespace)
        names = None if tools is None else frozenset(t.name for t in tools.tools)
        syntax = (
            None
            if tools is None
            else ctx.chat.tools.layout.bind([(t.name, t.parameters) for t in tools.tools])
        )
        parts = PromptParts(
            request.messages, request.tools, ctx.chat, request.template_kwargs, request.system_apart
        )
        start = reply_turn_start(
            ctx.async_engine,
            ctx.prompt_guard,
            request.messages,
            tools,
            ctx.chat,
            request.template_kwargs,
            token_ids,
        )
        return dataclasses.replace(
            plan,
            opens_reasoning=opened,
            tool_names=names,
            call_syntax=syntax,
            parts=parts,
            reply_turn_start=start,
        )
    except ConstraintRejected as e:
        if not tools_constrain:
            raise
        raise InvalidRequestError(f"the tools' schemas are rejected: {e.message}", "tools") from None
    except InvalidRequestError as e:
        if e.param != "prompt":
            raise
        raise InvalidRequestError(e.message, request.prompt_param) from None
