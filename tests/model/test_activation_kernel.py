"""The native activations (`gelu_tanh_rows`, `silu_rows`, kernels/activation.h) on every float: every path
gives the portable path's bits (the build's widest vectors, AVX2 alone, a build without AVX-512, a build
without FMA whose fmaf is libm's), and every result is within 2 ulp of x of the float64 formula and 3 of
torch's gelu(approximate="tanh") or silu, with torch's NaNs, infinities and signs. A sweep of a million
floats here; all 2^32 with KVSERVE_LONG_TESTS=1 (several minutes)."""

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import default_cache_dir
from kvserve.model.kernel_abi import LINEAR
from kvserve.model.native_build import load_kernel

# The kernels' `portable`: the build's widest path, the portable path, AVX2 without AVX-512.
WIDEST, PORTABLE, AVX2 = 0, 1, 2
# NaN, the infinities, the zeros, subnormals and the largest floats.
SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 3e38, -3e38]
BETA = 0.7978845608028654  # sqrt(2 / pi)
Fn = Callable[[torch.Tensor], torch.Tensor]
# Each kernel, torch's function, and the float64 formula (x * sigmoid(2u) = 0.5 x (1 + tanh(u)), without the
# cancellation for negative x).
ACTIVATIONS: dict[
    str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]
] = {
    "gelu_tanh_rows": (
        lambda x: F.gelu(x, approximate="tanh"),
        lambda x: x * torch.sigmoid(2 * BETA * (x + 0.044715 * x**3)),
    ),
    "silu_rows": (F.silu, lambda x: x * torch.sigmoid(x)),
}
Path = tuple[Any, int]


def small_library(name: str, *flags: str) -> Any:
    """activation.c alone (with the ABI check's abi.c), built with the products' flags plus `flags`."""
    library = dataclasses.replace(
        LINEAR,
        name=name,
        sources=("abi.c", "activation.c"),
        compile_flags=(*LINEAR.compile_flags, *flags),
        functions={fn: LINEAR.functions[fn] for fn in ACTIVATIONS},
    )
    return load_kernel(library, default_cache_dir())


@pytest.fixture(scope="module")
def paths() -> list[Path]:
    """Every (library, path) this machine can run; the first is the portable reference."""
    full = load_kernel(LINEAR, default_cache_dir())
    no_avx512 = small_library("activation_avx2", "-mno-avx512f")
    no_fma = small_library("activation_no_fma", "-mno-avx512f", "-mno-avx2", "-mno-fma")
    return [(full, PORTABLE), (full, WIDEST), (full, AVX2), (no_avx512, WIDEST), (no_fma, WIDEST)]


def run(fn: str, path: Path, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
    lib, portable = path
    out = torch.empty_like(x)
    getattr(lib, fn)(x.data_ptr(), out.data_ptr(), x.numel(), threads, portable)
    return out


def floats(start: int, stop: int, step: int = 1) -> torch.Tensor:
    """The float32s whose bit patterns are 0x80000000 + [start, stop), every step-th (negative floats
    from -0 down, then positive ones from +0 up)."""
    return (torch.arange(start, stop, step, dtype=torch.int64) - 2**31).to(torch.int32).view(torch.float32)


def sweep() -> torch.Tensor:
    """About a million floats of every sign and binade (NaNs and subnormals included), and the specials."""
    return torch.cat([floats(0, 2**32, 4093), torch.tensor(SPECIALS)])


def assert_same_bits(fn: str, paths: list[Path], x: torch.Tensor) -> None:
    reference = run(fn, paths[0], x).view(torch.int32)
    for i, path in enumerate(paths[1:], 1):
        differ = run(fn, path, x).view(torch.int32) != reference
        assert not differ.any(), (fn, i, int(differ.sum()), x[differ][:4].tolist())


def assert_close_to_torch(fn: str, ours: torch.Tensor, x: torch.Tensor) -> None:
    torch_fn, formula = ACTIVATIONS[fn]
    theirs = torch_fn(x)
    assert torch.equal(ours.isnan(), theirs.isnan())
    finite = ~ours.isnan()
    assert torch.equal(ours[finite].signbit(), theirs[finite].signbit())
    assert torch.equal(ours[finite].isinf(), theirs[finite].isinf())
    assert torch.equal(ours[ours.isinf()], theirs[ours.isinf()])
    at = finite & ~ours.isinf()
    ulp = torch.nextafter(x[at].abs(), torch.tensor(float("inf"))).double() - x[at].abs().double()
    # Each is within about 1.6 ulp of x of the exact value, so the two within 3.
    assert ((ours[at].double() - formula(x[at].double())).abs() <= 2 * ulp).all()
    assert ((ours[at].double() - theirs[at].double()).abs() <= 3 * ulp).all()


@pytest.mark.parametrize("fn", ACTIVATIONS)
def test_every_path_gives_the_portable_bits_on_a_sweep_of_every_float(fn: str, paths: list[Path]) -> None:
    assert_same_bits(fn, paths, sweep())


@pytest.mark.parametrize("fn", ACTIVATIONS)
def test_every_length_and_offset_gives_the_same_bits(fn: str, paths: list[Path]) -> None:
    """Lengths 0 to 40 at every offset of a vector: the vector loops' tails (8 and 16 lanes) and
    unaligned starts; in place too; two threads split a long buffer without a seam."""
    x = torch.randn(80) * 4
    for offset in range(16):
        for n in range(41):
            assert_same_bits(fn, paths, x[offset : offset + n])
    long = torch.randn(70_001) * 6
    alone = run(fn, paths[0], long)
    for lib, portable in paths[1:]:
        assert torch.equal(run(fn, (lib, portable), long, threads=2), alone)
        place = long.clone()
        getattr(lib, fn)(place.data_ptr(), place.data_ptr(), place.numel(), 2, portable)
        assert torch.equal(place, alone)


@pytest.mark.parametrize("fn", ACTIVATIONS)
def test_close_to_float64_and_torch_on_a_sweep_of_every_float(fn: str, paths: list[Path]) -> None:
    x = sweep()
    assert_close_to_torch(fn, run(fn, paths[1], x), x)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.floats(width=32), min_size=1, max_size=40))
def test_any_floats_give_the_same_bits_on_every_path_close_to_torch(
    paths: list[Path], values: list[float]
) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    for fn in ACTIVATIONS:
        assert_same_bits(fn, paths, x)
        assert_close_to_torch(fn, run(fn, paths[1], x), x)


@pytest.mark.timeout(3600)
@pytest.mark.skipif(os.environ.get("KVSERVE_LONG_TESTS") != "1", reason="slow: KVSERVE_LONG_TESTS=1")
@pytest.mark.parametrize("fn", ACTIVATIONS)
def test_every_float_gives_the_same_bits_on_every_path_close_to_torch(fn: str, paths: list[Path]) -> None:
    """All 2^32 floats on every path; every 16th against torch and float64 (whose reference is slow)."""
    chunk = 2**26
    for start in range(0, 2**32, chunk):
        x = floats(start, start + chunk)
        assert_same_bits(fn, paths, x)
        sample = x[::16].contiguous()
        assert_close_to_torch(fn, run(fn, paths[1], sample), sample)
