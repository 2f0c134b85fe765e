"""Every option is defined once, as a dataclass field: the command line's defaults are the fields',
and a flag reaches its field."""

import argparse
import dataclasses
import math
from typing import Any

import pytest

import kvserve.server.app
from kvserve.cli import build_parser, engine_config, main
from kvserve.cluster.launch import ClusterConfig
from kvserve.config import EngineConfig
from kvserve.errors import ConfigError
from kvserve.flags import flag_name, flagged_fields, from_flags, to_argv
from kvserve.options import ServerOptions
from kvserve_bench.cli import add_bench_arguments
from kvserve_bench.workloads import (
    AgentLoopSpec,
    CodeEditSpec,
    MultiturnSpec,
    RepeatSpec,
    SharedPrefixSpec,
    SharegptSpec,
)

ENV_DEFAULTS = ("KVSERVE_API_KEY", "KVSERVE_ADMIN_KEY", "KVSERVE_TENANT_SECRET_FILE")


@pytest.fixture(autouse=True)
def no_environment_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_DEFAULTS:
        monkeypatch.delenv(name, raising=False)


def test_serve_parses_to_the_dataclasses_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    config, options = engine_config(args), from_flags(ServerOptions, args)
    # Field by field, so that a drifting default names itself.
    assert dataclasses.asdict(config) == dataclasses.asdict(EngineConfig())
    assert dataclasses.asdict(options) == dataclasses.asdict(ServerOptions())


@pytest.mark.parametrize("command", [["chat"], ["generate", "a prompt"]])
def test_the_model_commands_parse_to_the_engines_defaults(command: list[str]) -> None:
    args = build_parser().parse_args(command)
    assert dataclasses.asdict(engine_config(args)) == dataclasses.asdict(EngineConfig())


def test_cluster_parses_to_its_configs_defaults() -> None:
    args = build_parser().parse_args(["cluster"])
    assert from_flags(ClusterConfig, args, serve_args=args.serve_args) == ClusterConfig()
    args = build_parser().parse_args(["cluster", "--no-redis", "--replicas", "3", "--", "--block-size", "32"])
    config = from_flags(ClusterConfig, args, serve_args=args.serve_args[1:])
    assert config == ClusterConfig(redis=False, replicas=3, serve_args=["--block-size", "32"])


def test_serve_has_a_flag_for_every_option() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve: argparse.ArgumentParser = commands.choices["serve"]
    flags = {s for action in serve._actions for s in action.option_strings}
    for cls in (EngineConfig, ServerOptions):
        for f in flagged_fields(cls):
            assert flag_name(f) in flags, f.name


def test_flags_reach_the_options() -> None:
    argv = [
        "serve",
        "--port",
        "8123",
        "--max-in-flight-per-tenant",
        "7",
        "--max-request-bytes",
        "1KiB",
        "--allowed-origins",
        "https://a.example, https://b.example",
        "--dashboard-show-text",
        "--served-model-name",
        "tiny",
        "--max-waiting",
        "9",
        "--single-token-threads",
        "0",
        "--no-prefix-cache",
        "--kv-cache-memory",
        "1GiB",
        "--attention",
        "torch",
    ]
    args = build_parser().parse_args(argv)
    options = from_flags(ServerOptions, args)
    assert options == ServerOptions(
        port=8123,
        max_in_flight_per_tenant=7,
        max_request_bytes=1024,
        allowed_origins=("https://a.example", "https://b.example"),
        dashboard_show_text=True,
        served_model_name="tiny",
    )
    config = engine_config(args)
    assert config == EngineConfig(
        max_waiting=9,
        single_token_threads=None,
        enable_prefix_caching=False,
        kv_cache_memory=2**30,
        attention="torch",
    )


def test_kvserve_serve_hands_its_options_to_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[EngineConfig, ServerOptions]] = []

    def serve(config: EngineConfig, options: ServerOptions) -> int:
        seen.append((config, options))
        return 0

    monkeypatch.setattr(kvserve.server.app, "serve", serve)
    monkeypatch.setenv("KVSERVE_API_KEY", "key-from-env")
    assert main(["serve", "--admin-key", "admin-key-1", "--max-waiting", "3", "--block-size", "32"]) == 0
    [(config, options)] = seen
    assert options == ServerOptions(api_key="key-from-env", admin_key="admin-key-1")
    assert config == EngineConfig(max_waiting=3, block_size=32)


def test_the_shutdown_grace_is_an_option() -> None:
    args = build_parser().parse_args(["serve", "--shutdown-grace", "600"])
    assert from_flags(ServerOptions, args).shutdown_grace_s == 600
    assert ServerOptions().shutdown_grace_s == 30
    with pytest.raises(ConfigError, match="--shutdown-grace"):
        ServerOptions(shutdown_grace_s=-1)


def test_origins_are_a_json_list_or_a_comma_list(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    assert parse(["serve", "--allowed-origins", '["https://a.example"]']).allowed_origins == (
        "https://a.example",
    )
    assert parse(["serve", "--allowed-origins", "*"]).allowed_origins == ("*",)
    with pytest.raises(SystemExit) as exit_:
        parse(["serve", "--allowed-origins", '["https://a.example", 1]'])
    assert exit_.value.code == 2
    assert "must be a JSON list of strings" in capsys.readouterr().err


def test_a_bad_size_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--kv-cache-memory", "2XB"])
    assert exit_.value.code == 2
    assert "invalid size '2XB'" in capsys.readouterr().err


def test_server_options_are_validated_and_keep_keys_out_of_the_repr() -> None:
    with pytest.raises(ConfigError, match="--kv-remote needs --tenant-secret-file"):
        ServerOptions(kv_remote="redis://127.0.0.1:6379/0")
    with pytest.raises(ConfigError, match="max_in_flight_per_tenant"):
        ServerOptions(max_in_flight_per_tenant=0)
    with pytest.raises(ConfigError, match="max_request_bytes"):
        ServerOptions(max_request_bytes=0)
    with pytest.raises(ConfigError, match="port"):
        ServerOptions(port=70000)
    with pytest.raises(ConfigError, match="not one string"):
        ServerOptions(allowed_origins="https://a.example")  # type: ignore[arg-type]
    options = ServerOptions(api_key="user-key-1", admin_key="admin-key-1", allowed_origins=["*"])
    assert options.allowed_origins == ("*",)
    assert "user-key-1" not in repr(options) and "admin-key-1" not in repr(options)


def _bench(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("workload", "spec"),
    [
        ("multiturn", MultiturnSpec),
        ("shared-prefix", SharedPrefixSpec),
        ("sharegpt", SharegptSpec),
        ("repeat", RepeatSpec),
        ("code-edit", CodeEditSpec),
        ("agent-loop", AgentLoopSpec),
    ],
)
def test_bench_workloads_parse_to_their_specs_defaults(workload: str, spec: Any) -> None:
    args = _bench([workload, "--target", "http://127.0.0.1:1"])
    assert from_flags(spec, args) == spec()


def test_bench_flags_reach_the_specs() -> None:
    args = _bench(["multiturn", "--target", "x=http://h:1", "--unique-system", "--turns", "3", "--seed", "5"])
    assert from_flags(MultiturnSpec, args) == MultiturnSpec(shared_system=False, turns=3, seed=5)
    args = _bench(["shared-prefix", "--target", "http://h:1", "--request-rate", "2.5"])
    assert from_flags(SharedPrefixSpec, args).request_rate == 2.5
    assert math.isinf(SharedPrefixSpec().request_rate)


def test_bench_compare_passes_the_server_flags_on() -> None:
    names = ("model", "kv_cache_memory")
    default = str(EngineConfig().kv_cache_memory)
    assert to_argv(EngineConfig, _bench(["compare"]), names) == ["--kv-cache-memory", default]
    args = _bench(["compare", "--kv-cache-memory", "1GiB", "--model", "m.gguf"])
    assert to_argv(EngineConfig, args, names) == ["--model", "m.gguf", "--kv-cache-memory", str(2**30)]
