"""The OpenMP runtime that torch and the native kernels share: keep one pool of compute threads.

libgomp gives each thread that opens a parallel region its own pool of worker threads, kept until that
thread exits. Once the process holds more OpenMP threads than it has CPUs, libgomp stops spin-waiting
between regions: its workers sleep at once, and every region starts with a futex wake-up. A decode step
opens a few hundred regions (each product and each layer's attention), so the idle pool that the main
thread kept from loading the model cost the server's engine thread a quarter of its speed on 2 cores
(docs/design.md, *Threads*). A thread that hands its compute over to another
(the server's main thread, once the engine thread runs the steps) releases its pool with
`release_thread_pool`.
"""

import ctypes
import functools
import os

# OpenMP 5's omp_pause_soft: release the threads, keep what can be reused.
_OMP_PAUSE_SOFT = 1
_RUNTIMES = ("libgomp", "libomp", "libiomp5")


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime already loaded in this process (torch's own copy), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps}
    except OSError:
        return None
    for path in sorted(paths):
        name = os.path.basename(path)
        if name.startswith(_RUNTIMES) and ".so" in name:
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def release_thread_pool() -> bool:
    """Release the calling thread's OpenMP workers (omp_pause_resource_all); its next parallel region
    starts new ones. Returns whether the runtime did; False where it has no such call."""
    runtime = _runtime()
    pause = getattr(runtime, "omp_pause_resource_all", None) if runtime is not None else None
    if pause is None:
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return bool(pause(_OMP_PAUSE_SOFT) == 0)
