"""A chat template is a program that comes with the model file (or `--chat-template`): it renders under
a deadline, so that one that loops forever, or for 10**10 iterations of nested loops (which jinja's
sandbox allows: it bounds `range` to 100,000 items and counts nothing), ends with one clear error instead
of holding its thread.

A watchdog thread keeps every rendering's deadline. At a deadline it raises TemplateBudgetError in the
rendering thread as CPython's asynchronous exception, which the interpreter delivers between bytecodes: a
template compiles to Python code, so its loops see it within microseconds. Nothing runs per step, so a
rendering costs what it did (a trace function counting the template's lines made long chats render
several times slower: docs/benchmarks.md). A template stuck in one long C call (a huge string repeat)
sees it when the call returns.

A deadline that passes just as the rendering ends leaves the exception pending: leaving the block
clears it, so it is raised inside the block or not at all (`_Watchdog.release`). Until then it is
raised again every REFIRE_S, since Python drops an exception raised in a destructor or a garbage
collector callback, which may run anywhere.
"""

import ctypes
import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from jinja2 import TemplateError

# What one rendering may take: a long chat with tools renders in milliseconds.
TEMPLATE_SECONDS = 2.0
# How often the exception is raised again in a rendering past its deadline.
REFIRE_S = 0.1


class TemplateBudgetError(TemplateError):
    """A chat template ran past its budget of seconds."""


class _OutOfTime(TemplateBudgetError):
    """What the watchdog raises in the rendering thread (an asynchronous exception is raised from its
    class, without arguments)."""

    def __str__(self) -> str:
        return "the chat template ran past its time budget"


@dataclass
class _Watch:
    deadline: float
    thread_id: int
    fired: bool = False


class _Watchdog:
    """Deadlines of renderings in progress, by token. Firing and releasing hold the lock, so a rendering
    that released its token is never sent the exception."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._watches: dict[int, _Watch] = {}
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, seconds: float) -> int:
        with self._lock:
            token = next(self._tokens)
            self._watches[token] = _Watch(time.monotonic() + seconds, threading.get_ident())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="template-watchdog", daemon=True)
                self._thread.start()
            self._lock.notify()
        return token

    def release(self, token: int) -> None:
        """The rendering thread leaves its block: a fired exception not yet delivered is cleared."""
        with self._lock:
            watch = self._watches.pop(token)
        if watch.fired:
            _set_async_exception(watch.thread_id, None)

    def _run(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                for w in self._watches.values():
                    if w.deadline <= now:
                        # Again every REFIRE_S until released: an asynchronous exception delivered where
                        # Python ignores exceptions (a __del__, a garbage collector callback) is lost.
                        w.fired = True
                        w.deadline = now + REFIRE_S
                        _set_async_exception(w.thread_id, _OutOfTime)
                deadlines = [w.deadline for w in self._watches.values()]
                self._lock.wait(min(deadlines) - now if deadlines else None)


def _set_async_exception(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in the thread at its next bytecode (None: clear one not yet raised)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), None if exc is None else ctypes.py_object(exc)
    )


_WATCHDOG = _Watchdog()


@contextmanager
def template_budget(seconds: float | None = None) -> Iterator[None]:
    """Templates rendered by this thread inside the block run for at most `seconds` (TEMPLATE_SECONDS);
    past it, TemplateBudgetError is raised where the template is."""
    limit = TEMPLATE_SECONDS if seconds is None else seconds
    token = _WATCHDOG.watch(limit)
    try:
        yield
    except _OutOfTime:
        raise TemplateBudgetError(f"the chat template ran past its budget of {limit:g} seconds") from None
    finally:
        _WATCHDOG.release(token)
