"""Build and load the C kernels of kvserve/model/kernels: one place for every native library.

A library (kernel_abi.py's `KernelLibrary`) is a list of sources compiled with the system C compiler
(`cc`, override with $CC), `-I` the kernels folder, and linked into `<cache_dir>/kernels/`, named by a
hash of its sources, every header of the kernels folder, its flags and the CPU's feature flags, so an
edited kernel or a different machine builds its own (the kernels are compiled with -march=native and pick
their SIMD path from what the compiler may use there). The build is written to a temporary name and
renamed, so concurrent processes never load a half-written file. The folder and the libraries are private
(0700, 0600, no symlink, this user's; see private_files.py): a library that is not is rebuilt, never
loaded with ctypes. A loaded library's ABI is checked against kernel_abi.py before its functions are bound.
"""

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from importlib.resources.abc import Traversable

from kvserve.errors import KVServeError
from kvserve.model.kernel_abi import KernelLibrary, bind
from kvserve.private_files import private_cached_file

log = logging.getLogger(__name__)

LINK_FLAGS = ["-shared", "-fopenmp"]
LIBS = ["-lmvec", "-lm"]


class KernelUnavailableError(KVServeError, RuntimeError):
    """A native kernel cannot be built or loaded here (no compiler, not a CPU, unsupported dtype). With
    `attention="native"` it stops the start, which the command line prints as one line."""


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _headers(folder: Traversable, prefix: str = "") -> dict[str, str]:
    """Every header under `folder`, by its path relative to the kernels folder."""
    found: dict[str, str] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        path = f"{prefix}{entry.name}"
        if entry.is_dir():
            found.update(_headers(entry, f"{path}/"))
        elif entry.name.endswith(".h"):
            found[path] = entry.read_text()
    return found


def _kernel_files(library: KernelLibrary) -> dict[str, str]:
    """The library's sources and every header of the kernels folder, by relative path: what its build
    reads, so what its build key covers."""
    root = resources.files("kvserve.model.kernels")
    files = {path: root.joinpath(path).read_text() for path in library.sources}
    files.update(_headers(root))
    return files


def _run(argv: list[str]) -> subprocess.Popen[str]:
    try:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise KernelUnavailableError(f"cannot run {argv[0]}: {e}") from e


def _failure(argv: list[str], process: subprocess.Popen[str]) -> str | None:
    """Waits for the process; what it said on failure, None on success."""
    _, stderr = process.communicate()
    return f"{' '.join(argv)} failed: {stderr.strip()[-2000:]}" if process.returncode != 0 else None


def _build(library: KernelLibrary, files: dict[str, str], target: str, compiler: str) -> None:
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        for path, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(tmp, path)), exist_ok=True)
            with open(os.path.join(tmp, path), "w") as f:
                f.write(text)
        objects = [os.path.join(tmp, path.replace("/", "_") + ".o") for path in library.sources]
        # The sources compile side by side; every one finishes before the folder is removed.
        compiles = [
            [compiler, *library.compile_flags, f"-I{tmp}", "-c", os.path.join(tmp, path), "-o", obj]
            for path, obj in zip(library.sources, objects, strict=True)
        ]
        processes = [(argv, _run(argv)) for argv in compiles]
        failures = [message for argv, process in processes if (message := _failure(argv, process))]
        if failures:
            raise KernelUnavailableError(failures[0])
        lib = os.path.join(tmp, f"{library.name}.so")
        link = [compiler, *LINK_FLAGS, *objects, "-o", lib, *LIBS]
        if (message := _failure(link, _run(link))) is not None:
            raise KernelUnavailableError(message)
        os.chmod(lib, 0o600)
        os.replace(lib, target)


def load_kernel(library: KernelLibrary, cache_dir: str) -> ctypes.CDLL:
    """The library, building it first when these sources and this machine have none; its ABI checked and
    its functions' signatures set (kernel_abi.bind)."""
    files = _kernel_files(library)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailableError("no C compiler found (install gcc or set $CC)")
    key = hashlib.sha256(
        "\0".join(
            [
                *(f"{path}\0{text}" for path, text in sorted(files.items())),
                compiler,
                *library.compile_flags,
                *LINK_FLAGS,
                *LIBS,
                cpu_flags(),
            ]
        ).encode()
    ).hexdigest()[:16]
    try:
        target, built = private_cached_file(cache_dir, "kernels", f"{library.name}-{key}.so")
    except OSError as e:
        raise KernelUnavailableError(f"the kernels folder cannot be used: {e}") from e
    if not built:
        log.info("building the native kernel %s into %s", library.name, target)
        _build(library, files, target, compiler)
    lib = ctypes.CDLL(target)
    bind(lib, library)
    return lib
