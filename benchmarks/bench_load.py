"""Load to ready on the default model: `build_parts` loading the GGUF, at a first start (a fresh cache
folder holding only the built kernels) and at a later one, and the bytes the first start writes to the
cache folder besides the kernels. `python -m benchmarks.bench_load [--repeats 3]`; one process per
start, so that nothing of one start is warm in the next but the page cache."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from kvserve.config import default_cache_dir

_START = """
import json, os, time
t = time.monotonic()
from kvserve.config import EngineConfig
from kvserve.engine.factory import build_parts
imported = time.monotonic()
build_parts(EngineConfig(kv_cache_memory=64 * 2**20, cache_dir=os.environ["KVSERVE_CACHE_DIR"]))
print(json.dumps({"import_s": imported - t, "build_parts_s": time.monotonic() - imported}))
"""


def _start(cache: str) -> dict[str, float]:
    env = {**os.environ, "KVSERVE_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", _START], env=env, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _written(cache: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(cache)
        if os.path.relpath(root, cache).split(os.sep)[0] != "kernels"
        for name in names
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    kernels = os.path.join(default_cache_dir(), "kernels")
    _start(default_cache_dir())  # builds the kernels once, if they are not yet
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            shutil.copytree(kernels, os.path.join(cache, "kernels"))
            first = _start(cache)
            written = _written(cache)
            later = _start(cache)
        print(
            f"run {i + 1}: first start build_parts {first['build_parts_s']:.2f} s (imports "
            f"{first['import_s']:.2f} s), {written:,} bytes written besides the kernels; later start "
            f"build_parts {later['build_parts_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
