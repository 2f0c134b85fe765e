"""The tiers of tests/conftest.py: a test is slow by what it reaches (a fixture built on a server, Redis or
the default model, or a server, Redis, SMG or child process started in its body or in the helpers it
calls), and fast otherwise."""

import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from kvserve.cluster.redis_process import RedisProcess
from tests.conftest import is_slow
from tests.helpers import free_port, server_process


@dataclass
class FakeItem:
    """What `is_slow` reads of a collected test."""

    function: Callable[..., Any]
    fixturenames: tuple[str, ...] = ()
    markers: list[str] = field(default_factory=list)

    def get_closest_marker(self, name: str) -> str | None:
        return name if name in self.markers else None


def slow(item: FakeItem) -> bool:
    return is_slow(cast(pytest.Item, item))


def starts_a_server() -> None:
    with server_process(["true"], free_port()):
        pass


def calls_a_helper_that_starts_one() -> None:
    starts_a_server()


def starts_redis_in_a_closure() -> Callable[[], RedisProcess]:
    return lambda: RedisProcess()


def runs_a_child_process() -> None:
    subprocess.run(["true"], check=True)


def asks_for_the_default_model(request: pytest.FixtureRequest) -> None:
    request.getfixturevalue("default_model")


def adds() -> int:
    return free_port() + 1


def test_a_test_is_slow_by_what_it_reaches() -> None:
    assert slow(FakeItem(starts_a_server))
    assert slow(FakeItem(calls_a_helper_that_starts_one))
    assert slow(FakeItem(starts_redis_in_a_closure))
    assert slow(FakeItem(runs_a_child_process))
    assert slow(FakeItem(asks_for_the_default_model))
    assert slow(FakeItem(adds, fixturenames=("make_engine", "default_model")))
    assert slow(FakeItem(adds, markers=["slow"]))


def test_a_test_that_reaches_none_of_them_is_fast() -> None:
    assert not slow(FakeItem(adds, fixturenames=("tiny_model", "tmp_path")))
