"""A chat template runs under a deadline: one that loops (here 10**10 iterations of two
nested loops, which jinja's sandbox allows) ends with a TemplateBudgetError, at startup's tool-format
probe as one line that stops the server, and the thread renders the next chat as before. Whatever else
a template raises (a division by zero, a recursion without end) is a TemplateError, never another
exception: at the probe one log line, and the generic tool format."""

import logging
import time

import pytest
from jinja2 import TemplateError

from kvserve.errors import ConfigError
from kvserve.model import template_budget
from kvserve.model.loader import load_default_tokenizer
from kvserve.model.template_budget import TemplateBudgetError
from kvserve.model.tokenizer import TemplateArgs, Tokenizer
from kvserve.server.core.chat_setup import chat_setup
from kvserve.server.core.tool_formats import GENERIC

FOREVER = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def default_tokenizer() -> Tokenizer:
    return load_default_tokenizer()


def test_a_template_that_loops_forever_ends_at_its_deadline(
    default_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(template_budget, "TEMPLATE_SECONDS", 0.2)
    with pytest.raises(TemplateBudgetError, match=r"ran past its budget of 0\.2 seconds"):
        default_tokenizer.render_chat(CHAT, True, TemplateArgs(source=FOREVER))
    assert "Hi" in default_tokenizer.render_chat(CHAT)


def test_a_deadline_at_the_end_of_a_rendering_never_fires_after_it(default_tokenizer: Tokenizer) -> None:
    """Deadlines around a rendering's own length, so that some pass as it ends: each rendering returns
    or raises TemplateBudgetError inside its block, and nothing is raised in the thread's code after it
    (a watchdog that fired at a released deadline would raise in the loop below)."""
    chat = [{"role": "user", "content": f"question {i}"} for i in range(3000)]
    start = time.perf_counter()
    default_tokenizer.render_chat(chat)
    took = time.perf_counter() - start
    outcomes = set()
    for i in range(24):
        try:
            with template_budget.template_budget(took * (i % 12) / 6):
                default_tokenizer.render_chat(chat)
            outcomes.add("rendered")
        except TemplateBudgetError:
            outcomes.add("out of time")
        total = 0
        for j in range(20_000):
            total += j
        assert total == 199_990_000
    assert "out of time" in outcomes


def test_an_exception_the_rendering_loses_is_raised_again() -> None:
    """Python drops an exception raised in a destructor or a garbage collector callback: the watchdog
    raises it again until the block ends (here the first is swallowed by hand)."""
    caught = 0
    give_up = time.monotonic() + 10
    with (
        pytest.raises(TemplateBudgetError, match="ran past its budget"),
        template_budget.template_budget(0.05),
    ):
        while time.monotonic() < give_up:
            try:
                while time.monotonic() < give_up:
                    pass
            except TemplateBudgetError:
                caught += 1
                if caught == 2:
                    raise
    assert caught == 2


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


def test_a_template_that_loops_at_the_startup_probe_stops_the_server_with_one_line(
    default_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(template_budget, "TEMPLATE_SECONDS", 0.2)
    budget = r"cannot render a one-message chat: .* budget of 0\.2 seconds"
    with pytest.raises(ConfigError, match=budget) as e:
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
