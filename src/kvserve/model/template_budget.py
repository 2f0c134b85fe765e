"""A chat template is a program that comes with the model file (or `--chat-template`): it renders under
a budget of steps and seconds, so that one that loops forever, or for 10**10 iterations of nested
loops, ends with one clear error instead of holding its thread.

The steps are the lines the template's compiled code runs: every iteration of its loops and every call
of its macros runs at least one. They are counted by a trace function of the rendering thread
(`sys.settrace` traces only the thread that sets it), which follows the template's own frames (jinja
compiles a template from a string under the file name `<template>`) and no others, and reads the clock
at each step. jinja's sandbox already bounds `range` to 100,000 items and refuses unsafe attributes; it
counts nothing. The previous trace function (a debugger's, a coverage tool's) is put back after.
"""

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from jinja2 import TemplateError

# What one rendering may take: a long chat with tools renders in a few thousand steps and milliseconds.
TEMPLATE_STEPS = 1_000_000
TEMPLATE_SECONDS = 2.0
# The file name jinja gives the code of a template compiled from a string.
_TEMPLATE_FILE = "<template>"


class TemplateBudgetError(TemplateError):
    """A chat template ran past its budget of steps or seconds."""


@contextmanager
def template_budget(steps: int | None = None, seconds: float | None = None) -> Iterator[None]:
    """Templates rendered by this thread inside the block run at most `steps` lines (TEMPLATE_STEPS)
    for at most `seconds` (TEMPLATE_SECONDS); past either, the line raises TemplateBudgetError."""
    most = TEMPLATE_STEPS if steps is None else steps
    limit = TEMPLATE_SECONDS if seconds is None else seconds
    deadline = time.monotonic() + limit
    left = most

    def line(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal left
        if event == "line":
            left -= 1
            if left < 0:
                raise TemplateBudgetError(f"the chat template ran past its budget of {most} steps")
            if time.monotonic() > deadline:
                raise TemplateBudgetError(f"the chat template ran past its budget of {limit:g} seconds")
        return line

    def call(frame: FrameType, event: str, arg: Any) -> Any:
        return line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        yield
    finally:
        sys.settrace(previous)
