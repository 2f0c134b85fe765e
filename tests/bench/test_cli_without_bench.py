"""`kvserve bench` without the benchmark package installed: one line that says how to install it."""

import sys

import pytest

from kvserve.cli import main


def test_bench_not_installed_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # None in sys.modules makes the import fail as it does where the package is absent.
    monkeypatch.setitem(sys.modules, "kvserve_bench", None)
    monkeypatch.setitem(sys.modules, "kvserve_bench.cli", None)
    assert main(["bench", "multiturn", "--target", "a=http://127.0.0.1:1"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.count("\n") == 1
    assert out.err.startswith("kvserve: error: kvserve bench is not installed")
    assert "pip install -e ./bench" in out.err


def test_other_commands_do_not_need_the_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvserve_bench", None)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
