"""The streaming client: one chat request, timed chunk by chunk, and what the server said it cost."""

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvserve_bench.errors import BenchError


@dataclass(frozen=True)
class Target:
    """A server under test: a short name for tables and plots, its base URL, the model it serves."""

    name: str
    url: str
    model: str = ""


@dataclass
class RequestResult:
    """One request's numbers. Times are seconds; `start_s` counts from the start of the run.

    Token counts are the server's own (its final usage chunk) and None when it did not report them.
    `itl_s` holds the gaps between streamed chunks after the first one (a chunk may carry several tokens
    when the server speculates; `tpot_s` divides by tokens). `draft_tokens` and `accepted_tokens` are the
    request's own speculation where the server reports it per request (llama-server's `timings`), and
    `greedy_loop` says whether the reply ends in a loop (`bench/loops.py`), once checked.
    """

    target: str
    conversation: str
    group: int
    turn: int
    start_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    reply: str = ""
    greedy_loop: bool | None = None
    error: str | None = None
    # Attempts beyond the first (`kvserve bench --retries`); the numbers above are the last attempt's.
    retries: int = 0

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (end to end - TTFT) / (tokens - 1); None below 2."""
        tokens = self.completion_tokens
        if self.ttft_s is None or tokens is None or tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (tokens - 1)


def parse_target(spec: str) -> Target:
    """'NAME=URL' or a bare URL (named after its host and port); the URL loses any trailing /v1."""
    name, sep, url = spec.partition("=")
    if not sep:
        name, url = "", spec
    url = url.strip().rstrip("/")
    url = url.removesuffix("/v1")
    if not url.startswith(("http://", "https://")):
        raise BenchError(f"target {spec!r}: the URL must start with http:// or https://")
    return Target(name=name.strip() or url.split("://", 1)[1], url=url)


def connect(client: httpx.Client, target: Target, model: str | None) -> Target:
    """Checks that the target answers and returns it with its model name (the first of /v1/models)."""
    try:
        response = client.get(f"{target.url}/v1/models")
    except httpx.ConnectError as e:
        raise BenchError(f"target {target.name} ({target.url}) refused the connection: is it running?") from e
    except httpx.HTTPError as e:
        raise BenchError(f"target {target.name} ({target.url}) did not answer: {e}") from e
    if model is not None:
        return Target(target.name, target.url, model)
    if response.status_code != 200:
        raise BenchError(
            f"target {target.name}: GET /v1/models answered {response.status_code}; pass --model NAME"
        )
    try:
        return Target(target.name, target.url, str(response.json()["data"][0]["id"]))
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"target {target.name}: /v1/models lists no model; pass --model NAME") from e


async def stream_chat(
    client: httpx.AsyncClient,
    target: Target,
    messages: list[dict[str, Any]],
    max_tokens: int,
    seed: int,
    result: RequestResult,
    ignore_eos: bool = True,
) -> str:
    """Sends one streaming chat request, fills `result` with its numbers, returns the reply text.

    `ignore_eos` asks for exactly `max_tokens`; without it the reply ends where the model ends it.
    Failures do not raise: they land in `result.error`, so that one bad request does not end a run.
    """
    body: dict[str, Any] = {
        "model": target.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Fixed output lengths make the servers' numbers comparable; servers that stop early still work.
        "ignore_eos": ignore_eos,
    }
    parts: list[str] = []
    start = time.perf_counter()
    last_chunk: float | None = None
    try:
        async with client.stream("POST", f"{target.url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = _error_message(response.status_code, (await response.aread()).decode())
                return ""
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if error := chunk.get("error"):
                    # Servers report a failure after the 200 status line as an error event in the stream.
                    message = error.get("message", error) if isinstance(error, dict) else error
                    result.error = f"error in stream: {message}"
                    break
                if chunk.get("usage"):
                    _read_usage(chunk["usage"], result)
                if chunk.get("timings"):
                    _read_timings(chunk["timings"], result)
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or ""
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
                    if text:
                        now = time.perf_counter()
                        if last_chunk is None:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - last_chunk)
                        last_chunk = now
                        parts.append(text)
            if not done and result.error is None:
                # A proxy may close a stream whose upstream died without saying so: the reply is partial.
                result.error = "stream ended before [DONE]"
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        result.error = f"malformed stream: {e}"
    finally:
        result.e2e_s = time.perf_counter() - start
    result.reply = "".join(parts)
    return result.reply


def retryable(error: str) -> bool:
    """A failure that another attempt may not meet: the connection (a replica died, a router found no
    live one), a 5xx, or a stream cut short; a 4xx is the request's own fault."""
    return not error.startswith("HTTP 4")


def _read_usage(usage: dict[str, Any], result: RequestResult) -> None:
    result.prompt_tokens = usage.get("prompt_tokens")
    result.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens")


def _read_timings(timings: dict[str, Any], result: RequestResult) -> None:
    """llama-server's per-request speculation: present only when it drafted for this request."""
    if "draft_n" in timings:
        result.draft_tokens = int(timings["draft_n"])
        result.accepted_tokens = int(timings.get("draft_n_accepted", 0))


def _error_message(status: int, body: str) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200]
    return f"HTTP {status}: {message}"
