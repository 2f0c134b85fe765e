"""Build and load the C kernels of kvserve/model/kernels: one place for every native library.

A kernel is compiled with the system C compiler (`cc`, override with $CC) into `<cache_dir>/kernels/`,
named by a hash of its source, its flags and the CPU's feature flags, so an edited kernel or a different
machine builds its own (the kernels are compiled with -march=native and pick their SIMD path from what
the compiler may use there). The build is written to a temporary name and renamed, so concurrent
processes never load a half-written file. The folder and the libraries are private (0700, 0600, no
symlink, this user's; see private_files.py): a library that is not is rebuilt, never loaded with ctypes.
"""

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib import resources

from kvserve.private_files import private_cached_file

log = logging.getLogger(__name__)

LINK_FLAGS = ["-shared", "-fopenmp"]
LIBS = ["-lmvec", "-lm"]


class KernelUnavailableError(RuntimeError):
    """A native kernel cannot be built or loaded here (no compiler, not a CPU, unsupported dtype)."""


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _build(name: str, source: str, target: str, compiler: str, compile_flags: list[str]) -> None:
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        src = os.path.join(tmp, f"{name}.c")
        obj = os.path.join(tmp, f"{name}.o")
        lib = os.path.join(tmp, f"{name}.so")
        with open(src, "w") as f:
            f.write(source)
        for argv in (
            [compiler, *compile_flags, "-c", src, "-o", obj],
            [compiler, *LINK_FLAGS, obj, "-o", lib, *LIBS],
        ):
            try:
                done = subprocess.run(argv, capture_output=True, text=True, check=False)
            except OSError as e:
                raise KernelUnavailableError(f"cannot run {argv[0]}: {e}") from e
            if done.returncode != 0:
                raise KernelUnavailableError(f"{' '.join(argv)} failed: {done.stderr.strip()[-2000:]}")
        os.chmod(lib, 0o600)
        os.replace(lib, target)


def load_kernel(name: str, cache_dir: str, compile_flags: list[str]) -> ctypes.CDLL:
    """The library of kernels/<name>.c, building it first when this source and machine have none."""
    source = resources.files("kvserve.model.kernels").joinpath(f"{name}.c").read_text()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailableError("no C compiler found (install gcc or set $CC)")
    key = hashlib.sha256(
        "\0".join([source, compiler, *compile_flags, *LINK_FLAGS, *LIBS, cpu_flags()]).encode()
    ).hexdigest()[:16]
    try:
        target, built = private_cached_file(cache_dir, "kernels", f"{name}-{key}.so")
    except OSError as e:
        raise KernelUnavailableError(f"the kernels folder cannot be used: {e}") from e
    if not built:
        log.info("building the native kernel %s into %s", name, target)
        _build(name, source, target, compiler, compile_flags)
    return ctypes.CDLL(target)
