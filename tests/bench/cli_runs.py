"""`kvserve bench` run in-process, as its command line would run it, against named servers."""

import argparse

from kvserve_bench.cli import add_bench_arguments, run_bench


def bench(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return run_bench(parser.parse_args([*argv, "--no-progress"]))


def targets(servers: dict[str, str], *names: str) -> list[str]:
    return [arg for name in names for arg in ("--target", f"{name}={servers[name]}")]
