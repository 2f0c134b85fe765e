"""bench-peer builds llama-server with its instruction sets named: never native, never AMX (a native build
dies with "Illegal instruction" on the Xeons that report AMX), AVX-512 only where the CPU lists it."""

from benchmarks.bench_peer import isa_flags

HASWELL = {"avx", "avx2", "fma", "f16c", "bmi2"}
XEON_AMX = HASWELL | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"}


def test_the_build_is_never_native_and_never_amx() -> None:
    for cpu in (set(), HASWELL, XEON_AMX):
        flags = isa_flags(cpu)
        assert "-DGGML_NATIVE=OFF" in flags
        assert {f for f in flags if "AMX" in f} == {
            "-DGGML_AMX_TILE=OFF",
            "-DGGML_AMX_INT8=OFF",
            "-DGGML_AMX_BF16=OFF",
        }
        assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"} <= set(flags)


def test_avx512_is_on_only_where_the_cpu_lists_it() -> None:
    assert "-DGGML_AVX512=OFF" in isa_flags(HASWELL)
    xeon = isa_flags(XEON_AMX)
    assert "-DGGML_AVX512=ON" in xeon and "-DGGML_AVX512_VNNI=ON" in xeon
    assert "-DGGML_AVX512_BF16=OFF" in xeon
