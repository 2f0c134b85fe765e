"""`--served-model-name` with several names, as vLLM takes it: the first is the name the server shows,
every one is accepted in a request (agents send their own default model ids), any other is a 404."""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import openai
import pytest
from fastapi import FastAPI
from hypothesis import given
from hypothesis import strategies as st

from kvserve.cli import build_parser
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.errors import ConfigError
from kvserve.flags import from_flags, to_argv
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from tests.server.live import Server, assert_no_leak

NAMES = ("kvserve-tiny", "claude-sonnet-4-6", "gpt-5.5")


@pytest.fixture(scope="module")
def server(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Server]:
    async_engine = AsyncEngine(make_engine(kv_cache_memory=16 * 2**20, max_model_len=256))
    with serve_app(create_app(async_engine, ServerOptions(served_model_name=NAMES))) as url:
        yield Server(url, async_engine)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_shows_the_first_name_only(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [NAMES[0]]


@pytest.mark.parametrize("name", NAMES)
def test_every_name_is_served_and_answers_show_the_first(
    server: Server, client: openai.OpenAI, name: str
) -> None:
    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    completion = client.completions.create(model=name, prompt="Hi", max_tokens=1)
    assert chat.model == completion.model == NAMES[0]
    tokens = httpx.post(f"{server.url}/tokenize", json={"model": name, "prompt": "Hi"})
    assert tokens.status_code == 200
    assert_no_leak(server.wait_idle())


@pytest.mark.parametrize("name", ["claude-opus-4-7", "kvserve", NAMES[0].upper(), f"{NAMES[1]} "])
def test_an_unknown_name_stays_a_404(server: Server, client: openai.OpenAI, name: str) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert raised.value.code == "model_not_found"
    assert NAMES[0] in raised.value.message
    assert_no_leak(server.wait_idle())


def test_the_flag_takes_several_names() -> None:
    args = build_parser().parse_args(["serve", "--served-model-name", *NAMES, "--port", "8123"])
    options = from_flags(ServerOptions, args)
    assert options.served_model_name == NAMES and options.port == 8123
    assert to_argv(ServerOptions, args, ["served_model_name"]) == ["--served-model-name", *NAMES]


def test_one_name_given_as_a_string_is_one_name() -> None:
    assert ServerOptions(served_model_name="tiny").served_model_name == ("tiny",)
    assert ServerOptions(served_model_name=["a", "b"]).served_model_name == ("a", "b")


@pytest.mark.parametrize("argv", [["--served-model-name"], ["--served-model-name", "a", ""]])
def test_a_missing_or_empty_name_is_refused_on_the_command_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *argv])
    assert "--served-model-name" in capsys.readouterr().err


@given(st.text(max_size=12))
def test_a_name_is_accepted_exactly_when_it_is_non_empty_and_unpadded(name: str) -> None:
    if name and name == name.strip():
        assert ServerOptions(served_model_name=("first", name)).served_model_name == ("first", name)
    else:
        with pytest.raises(ConfigError, match="served model name"):
            ServerOptions(served_model_name=("first", name))
