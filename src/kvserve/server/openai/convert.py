"""OpenAI's chat and text completion bodies as the engine's requests: the one place their defaults and
their max_tokens rule live.

Defaults: an unset sampling value is OpenAI's (temperature 1, top_p 1, no top_k, no min_p, no
penalties); SamplingParams judges every value's range and raises InvalidRequestError on a bad one.
`stop` is a string or a list; `logit_bias` keys are token ids as strings; structured outputs come in
OpenAI's and vLLM's dialects (server/core/structured.py). A chat's tools and tool_choice are OpenAI's
shapes (server/core/tools.py).

max_tokens:
- chat: `max_completion_tokens`, else `max_tokens`; below 0 is a 400; unset is "up to the context"; a
  prompt plus max_tokens over the context is refused by the engine's check (a 400), never cut
  (`OverContext.REFUSE`). 0 is a pre-warm, the equivalent of Anthropic's `max_tokens: 0`: the prompt is
  computed and kept in the cache like any request's, and each choice is an empty assistant message
  (content "") with finish_reason `length`; usage shows the prompt and what of it the cache held
  (`prompt_tokens_details.cached_tokens`), `completion_tokens` 0. `prompt_cache_options.prewarm: true`
  (OpenAI's own spelling) is the same pre-warm whatever max_tokens says.
- text completions: 16 unless given (OpenAI's legacy default), an explicit null is "up to the context";
  0 computes only the prompt (an echo's logprobs); over the context the engine refuses it too.
"""

import dataclasses
from collections.abc import Sequence

from kvserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.server.core.context import ServerContext
from kvserve.server.core.messages import ChatMessage
from kvserve.server.core.plan import PlannedPrompt, RequestPlan, chat_plan, plan_prompts
from kvserve.server.core.prompt_cache import cache_breakpoints, cache_policy, chat_markers
from kvserve.server.core.prompts import chat_prompt, prompt_batch, template_kwargs, text_prompt
from kvserve.server.core.request import ChatRequest
from kvserve.server.core.structured import structured_outputs
from kvserve.server.core.tools import ToolUse, offered_tools
from kvserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

# The legacy completions route reports at most this many alternatives per token, as OpenAI's does.
MAX_COMPLETION_LOGPROBS = 5


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
        structured_outputs=structured_outputs(
            body.response_format,
            body.structured_outputs,
            {
                "json": body.guided_json,
                "regex": body.guided_regex,
                "choice": body.guided_choice,
                "grammar": body.guided_grammar,
            },
        ),
    )


def tool_use(body: ChatCompletionRequest) -> ToolUse | None:
    """The request's tools and tool_choice, checked; None when it offers none."""
    return offered_tools(body.tools, body.tool_choice, body.parallel_tool_calls)


def chat_request(body: ChatCompletionRequest) -> ChatRequest:
    """A chat completion as the neutral request: its messages, tools, template variables and sampling.
    The tools' grammar is the output constraint unless tool_choice is "none"; an error on the prompt
    names `messages`."""
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs set to true.", "top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}.", "top_logprobs")
    max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    if max_tokens is not None and max_tokens < 0:
        raise InvalidRequestError("max_tokens must be at least 0.", "max_tokens")
    tools = tool_use(body)
    kwargs = template_kwargs(body.chat_template_kwargs)
    params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    return ChatRequest(tuple(body.messages), params, tools, kwargs, reasoning_effort=body.reasoning_effort)


def chat_completion_plan(ctx: ServerContext, body: ChatCompletionRequest, namespace: str) -> RequestPlan:
    """A chat's plan, with the breakpoints its cache fields ask for (server/core/prompt_cache.py)."""
    policy = cache_policy(body.prompt_cache_retention, body.prompt_cache_key, body.prompt_cache_options)
    request = chat_request(body)
    if policy.prewarm:
        request = dataclasses.replace(request, params=dataclasses.replace(request.params, max_tokens=0))
    markers = chat_markers(request.messages, policy)

    def render(messages: Sequence[ChatMessage]) -> list[int]:
        return chat_prompt(
            ctx.async_engine,
            ctx.prompt_guard,
            messages,
            namespace,
            False,
            request.tools,
            ctx.chat,
            request.template_kwargs,
            request.reasoning_effort,
        )

    plan = chat_plan(ctx, request, namespace)
    breakpoints = cache_breakpoints(policy, markers, plan.prompts[0].token_ids, render)
    return dataclasses.replace(plan, breakpoints=breakpoints)


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
    plan = plan_prompts(ctx, token_ids, params, namespace)
    prompts = tuple(
        PlannedPrompt(p.checked, given if isinstance(given, str) else tokenizer.decode(p.token_ids, False))
        for given, p in zip(batch, plan.prompts, strict=True)
    )
    return dataclasses.replace(plan, prompts=prompts)
