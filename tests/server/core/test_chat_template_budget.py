"""A chat template renders each request under its deadline: a chat that makes the
template loop (10**10 iterations of nested loops) is a 400 naming the budget, one that makes it divide by
zero a 400 naming that (before: the loop held a preparation thread for hours, the division was a 500
with a traceback), and the server serves the next chat and its health as before."""

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.model import template_budget
from kvserve.options import ServerOptions
from kvserve.server.app import create_app

TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.content == 'loop' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif m.content == 'divide' %}{{ 1 / 0 }}"
    "{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_past_its_budget_is_a_400_and_the_server_stays_healthy(
    make_engine: Callable[..., Engine],
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(template_budget, "TEMPLATE_SECONDS", 0.5)
    path = tmp_path / "chat_template.jinja"
    path.write_text(TEMPLATE)
    async_engine = AsyncEngine(make_engine(kv_cache_memory=64 * 2**20, max_model_len=1024))
    options = ServerOptions(served_model_name="m", chat_template=str(path))
    with (
        serve_app(create_app(async_engine, options)) as url,
        httpx.Client(base_url=url, timeout=120) as client,
    ):

        def chat(content: str) -> httpx.Response:
            body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
            return client.post("/v1/chat/completions", json=body)

        for content, message in (
            ("loop", "ran past its budget of 0.5 seconds"),
            ("divide", "ZeroDivisionError"),
        ):
            r = chat(content)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert message in error["message"] and error["param"] == "messages"
        r = chat("hello")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
        assert client.get("/health").status_code == 200
