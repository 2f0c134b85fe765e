"""OpenAI API completeness through the official client on the default model: chat logprobs (whole and
streamed), n samples sharing one prefill, batched prompts, vLLM's extra sampling fields, refused fields,
and the server options (admin key and cache reset, X-Request-Id, served model name, CORS, key from env)."""

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from kvserve.cli import build_parser
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from tests.server.live import Server, assert_no_leak

NAME = "served-name"
CHAT: Any = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def server(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Server]:
    async_engine = AsyncEngine(make_engine(kv_cache_memory=64 * 2**20, max_model_len=1024))
    app = create_app(
        async_engine, ServerOptions(served_model_name=NAME, allowed_origins=["https://ui.example"])
    )
    with serve_app(app) as url:
        yield Server(url, async_engine)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    kwargs: Any = {"model": NAME, "messages": CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True}
    whole = client.chat.completions.create(top_logprobs=3, **kwargs)
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert whole.usage is not None and len(content) == whole.usage.completion_tokens
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == 3
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert entry.token == top[0].token and entry.logprob == top[0].logprob
        assert entry.bytes is not None and bytes(entry.bytes).decode(errors="replace") == entry.token
    assert "".join(e.token for e in content) == choice.message.content

    streamed = [
        e
        for chunk in client.chat.completions.create(stream=True, top_logprobs=3, **kwargs)
        for c in chunk.choices
        if c.logprobs is not None and c.logprobs.content
        for e in c.logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    # The second request reads the prompt's KV from the cache: the same numbers, bit for bit (a prompt
    # token is the attention kernel's row as a decode is; they differed by up to 3.5e-4 while prefills
    # attended through SDPA).
    assert [e.logprob for e in streamed] == [e.logprob for e in content]
    # logprobs without top_logprobs: the tokens' own, no alternatives.
    bare = client.chat.completions.create(**kwargs).choices[0].logprobs
    assert bare is not None and bare.content and all(e.top_logprobs == [] for e in bare.content)


def test_n_samples_share_one_prefill_and_seeds_reproduce(server: Server, client: openai.OpenAI) -> None:
    prompt = list(range(1000, 1000 + 16 * 6 + 1))  # six full blocks plus the token that samples
    before = server.call(lambda e: e.stats())
    kwargs: Any = {"model": NAME, "prompt": prompt, "max_tokens": 12, "n": 4, "seed": 11, "temperature": 1.0}
    first = client.completions.create(**kwargs)
    after = server.call(lambda e: e.stats())
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    # The first sample prefills the prompt; the other three read it from the cache and run only its last
    # token, whose logits they sample from, as a one-token prefill chunk (a prompt token runs as a prefill
    # row whatever the cache held, so the four samples start from the same logits).
    assert after.prefill_tokens_computed - before.prefill_tokens_computed == len(prompt) + 3
    assert first.usage is not None and first.usage.prompt_tokens == len(prompt)
    texts = [c.text for c in first.choices]
    assert len(set(texts)) > 1, "four seeded samples should differ"
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == texts
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1
    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, n=2, seed=1)
    assert [c.index for c in chat.choices] == [0, 1]
    assert_no_leak(server.wait_idle())


def test_batched_prompts_keep_their_order(client: openai.OpenAI) -> None:
    prompts = ["The capital of France is", "One, two, three,", "Roses are red,"]
    alone = [
        client.completions.create(model=NAME, prompt=p, max_tokens=5, temperature=0).choices[0].text
        for p in prompts
    ]
    batch = client.completions.create(model=NAME, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [t for t in alone for _ in range(2)]
    tokenized = [httpx_tokens(client, p) for p in prompts]
    by_ids = client.completions.create(model=NAME, prompt=tokenized, max_tokens=5, temperature=0)
    assert [c.text for c in by_ids.choices] == alone
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == sum(len(t) for t in tokenized)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(
        model=NAME, prompt=prompts, max_tokens=5, temperature=0, stream=True
    ):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == alone


def httpx_tokens(client: openai.OpenAI, text: str) -> list[int]:
    url = str(client.base_url).removesuffix("/v1/")
    tokens: list[int] = httpx.post(f"{url}/tokenize", json={"prompt": text}).json()["tokens"]
    return tokens


def _complete(client: openai.OpenAI, prompt: str = "Once upon a time", **extra: Any) -> Any:
    return client.completions.create(
        model=NAME, prompt=prompt, max_tokens=extra.pop("max_tokens", 12), temperature=0, extra_body=extra
    ).choices[0]


def _eos(server: Server) -> int:
    eos: int = server.async_engine.tokenizer.eos_token_ids[0]
    return eos


def test_min_tokens_ignore_eos_and_logit_bias(server: Server, client: openai.OpenAI) -> None:
    eos = _eos(server)
    forced = client.completions.create(
        model=NAME, prompt="Hi", max_tokens=12, temperature=0, logit_bias={str(eos): 100}
    ).choices[0]
    assert forced.text == "" and forced.finish_reason == "stop"
    held = _complete(client, "Hi", logit_bias={str(eos): 100}, min_tokens=5)
    assert held.finish_reason == "stop"
    assert len(httpx_tokens(client, held.text)) >= 4
    ignored = client.completions.create(
        model=NAME,
        prompt="Hi",
        max_tokens=6,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"ignore_eos": True},
    )
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.usage is not None and ignored.usage.completion_tokens == 6
    token = httpx_tokens(client, " banana")[0]
    biased = client.completions.create(
        model=NAME, prompt="Hi", max_tokens=4, temperature=0, logit_bias={str(token): 100}
    )
    assert biased.choices[0].text == " banana" * 4


def test_stop_token_ids_and_include_stop_str_in_output(client: openai.OpenAI) -> None:
    plain = _complete(client)
    ids = httpx_tokens(client, plain.text)
    stopped = _complete(client, stop_token_ids=[ids[3]])
    assert stopped.finish_reason == "stop" and plain.text.startswith(stopped.text)
    assert len(stopped.text) < len(plain.text)
    stop = plain.text[len(plain.text) // 2 :][:3]
    cut = client.completions.create(
        model=NAME, prompt="Once upon a time", max_tokens=12, temperature=0, stop=[stop]
    )
    kept = client.completions.create(
        model=NAME,
        prompt="Once upon a time",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )
    assert not cut.choices[0].text.endswith(stop)
    assert kept.choices[0].text == cut.choices[0].text + stop


def test_skip_special_tokens(server: Server, client: openai.OpenAI) -> None:
    eos = _eos(server)
    special = server.async_engine.tokenizer.decode([eos], skip_special_tokens=False)
    common: dict[str, Any] = {"logit_bias": {str(eos): 100}, "ignore_eos": True, "max_tokens": 2}
    assert _complete(client, "Hi", **common).text == ""
    assert _complete(client, "Hi", skip_special_tokens=False, **common).text == special * 2


def test_penalties_change_a_repetitive_reply(client: openai.OpenAI) -> None:
    prompt = "dog dog dog dog dog dog dog dog dog dog"
    plain = _complete(client, prompt, max_tokens=10)
    counts = Counter(httpx_tokens(client, plain.text))
    for extra in ({"repetition_penalty": 1.8}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        penalized = _complete(client, prompt, max_tokens=10, **extra)
        assert penalized.text != plain.text, extra
        assert max(Counter(httpx_tokens(client, penalized.text)).values()) <= max(counts.values()), extra


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0]"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            "messages[0].content[0]",
        ),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_unsupported_chat_fields_are_refused_by_name(
    server: Server, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": CHAT, **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param.split("[")[0] in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": 6}, "logprobs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_unsupported_completion_fields_are_refused_by_name(
    server: Server, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_harmless_fields_are_accepted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=NAME,
        messages=CHAT,
        max_tokens=2,
        user="u",
        store=False,
        metadata={"k": "v"},
        response_format={"type": "text"},
        tool_choice="none",
        parallel_tool_calls=False,
        service_tier="auto",
    )
    assert reply.choices[0].message.content is not None


def test_request_id_header_and_log_line(
    server: Server, client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvserve.server"):
        raw = client.completions.with_raw_response.create(
            model=NAME, prompt="Hi", max_tokens=2, extra_headers={"X-Request-Id": "trace-42"}
        )
    assert raw.headers["x-request-id"] == "trace-42"
    assert any(r.getMessage().startswith("trace-42: prompt") for r in caplog.records)
    made = httpx.get(f"{server.url}/v1/models").headers["x-request-id"]
    assert len(made) == 32 and made != httpx.get(f"{server.url}/v1/models").headers["x-request-id"]


def test_served_model_name_and_cors(server: Server, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    assert server.async_engine.engine.model.name != NAME
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=server.async_engine.engine.model.name, prompt="Hi", max_tokens=1)
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(f"{server.url}/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"
    other = httpx.options(
        f"{server.url}/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}
    )
    assert "access-control-allow-origin" not in other.headers


def test_reset_prefix_cache_is_open_without_keys(server: Server, client: openai.OpenAI) -> None:
    _complete(client, "A prompt to cache " * 4, max_tokens=2)
    assert server.wait_idle().cache.num_cached > 0
    r = httpx.post(f"{server.url}/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["freed_blocks"] > 0
    assert server.wait_idle().cache.num_cached == 0


def test_reset_prefix_cache_needs_the_admin_key_once_keys_are_set(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> None:
    engine = AsyncEngine(make_engine(kv_cache_memory=16 * 2**20, max_model_len=256))
    with serve_app(create_app(engine, ServerOptions(api_key="user-key", admin_key="admin-key"))) as url:
        for headers, status in [
            ({}, 401),
            ({"Authorization": "Bearer user-key"}, 401),
            ({"Authorization": "Bearer admin-key"}, 200),
        ]:
            assert httpx.post(f"{url}/reset_prefix_cache", headers=headers).status_code == status
        admin = openai.OpenAI(base_url=f"{url}/v1", api_key="admin-key", max_retries=0)
        assert admin.models.list().data
    engine = AsyncEngine(make_engine(kv_cache_memory=16 * 2**20, max_model_len=256))
    with serve_app(create_app(engine, ServerOptions(api_key="user-key"))) as url:
        r = httpx.post(f"{url}/reset_prefix_cache", headers={"Authorization": "Bearer user-key"})
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]


def test_keys_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    monkeypatch.setenv("KVSERVE_ADMIN_KEY", "admin-from-env")
    args = build_parser().parse_args(["serve"])
    assert args.api_key == "from-env" and args.admin_key == "admin-from-env"
    assert build_parser().parse_args(["serve", "--api-key", "argv"]).api_key == "argv"
    monkeypatch.delenv("KVSERVE_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None
