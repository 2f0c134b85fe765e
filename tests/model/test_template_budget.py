"""A chat template runs under a budget of steps and seconds: one that loops (here 10**10 iterations of two
nested loops, which jinja's sandbox allows) ends with a TemplateBudgetError, at startup's tool-format
probe as one line that stops the server, and the thread renders the next chat as before. Whatever else
a template raises (a division by zero, a recursion without end) is a TemplateError, never another
exception: at the probe one log line, and the generic tool format."""

import logging
import sys
from types import FrameType
from typing import Any

import pytest
from jinja2 import TemplateError

from kvserve.errors import ConfigError
from kvserve.model import template_budget
from kvserve.model.loader import load_default_tokenizer
from kvserve.model.template_budget import TemplateBudgetError
from kvserve.model.tokenizer import TemplateArgs, Tokenizer
from kvserve.server.chat_setup import chat_setup
from kvserve.server.tool_formats import GENERIC

FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def default_tokenizer() -> Tokenizer:
    return load_default_tokenizer()


def test_a_template_that_loops_forever_ends_at_its_step_budget(default_tokenizer: Tokenizer) -> None:
    with pytest.raises(TemplateBudgetError, match="ran past its budget of 1000000 steps"):
        default_tokenizer.render_chat(CHAT, True, TemplateArgs(source=FOREVER))
    assert "Hi" in default_tokenizer.render_chat(CHAT)


def test_a_template_past_its_seconds_ends(
    default_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deadline already passed: the template's first line ends it (no test waits on the clock)."""
    monkeypatch.setattr(template_budget, "TEMPLATE_SECONDS", -1.0)
    with pytest.raises(TemplateBudgetError, match="ran past its budget of -1 seconds"):
        default_tokenizer.render_chat(CHAT)


def test_the_steps_are_the_templates_own(
    default_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget the default template fits renders it; one step fewer does not."""
    steps = 0
    while True:
        monkeypatch.setattr(template_budget, "TEMPLATE_STEPS", steps)
        try:
            default_tokenizer.render_chat(CHAT)
            break
        except TemplateBudgetError:
            steps += 1
    assert 0 < steps < 100


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError: maximum recursion depth"),
    ],
)
def test_whatever_a_template_raises_is_a_template_error(
    default_tokenizer: Tokenizer, source: str, message: str
) -> None:
    with pytest.raises(TemplateError, match=message):
        default_tokenizer.render_chat(CHAT, True, TemplateArgs(source=source))


def test_the_previous_trace_function_is_put_back(default_tokenizer: Tokenizer) -> None:
    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        return None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        with pytest.raises(TemplateBudgetError):
            default_tokenizer.render_chat(CHAT, True, TemplateArgs(source=FOREVER))
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(previous)


def test_a_template_that_loops_at_the_startup_probe_stops_the_server_with_one_line(
    default_tokenizer: Tokenizer,
) -> None:
    with pytest.raises(
        ConfigError, match=r"cannot render a one-message chat: .* budget of 1000000 steps"
    ) as e:
        chat_setup(default_tokenizer, FOREVER, "auto", "auto")
    assert "\n" not in str(e.value)


def test_a_template_that_raises_at_the_startup_probe_is_one_log_line(
    default_tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    source = "{% if tools %}{{ 1 / 0 }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    with caplog.at_level(logging.WARNING, logger="kvserve.server"):
        setup = chat_setup(default_tokenizer, source, "auto", "auto")
    assert setup.tools == GENERIC
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "ZeroDivisionError" in record.getMessage() and record.exc_info is None
