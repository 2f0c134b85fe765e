"""The kernels' C/Python interface is checked at load (kvserve.model.kernel_abi): a library whose ABI
version, struct sizes or symbols are not what the ctypes declarations say is refused with a KernelAbiError
before any of its functions is called."""

import ctypes
import dataclasses

import pytest

from kvserve.config import default_cache_dir
from kvserve.errors import KernelAbiError
from kvserve.model import kernel_abi
from kvserve.model.kernel_abi import ATTENTION, LINEAR, KernelLibrary
from kvserve.model.native_build import load_kernel


@pytest.mark.parametrize("library", [LINEAR, ATTENTION], ids=lambda library: library.name)
def test_both_libraries_match_the_ctypes_declarations(library: KernelLibrary) -> None:
    lib = load_kernel(library, default_cache_dir())
    kernel_abi.check_abi(lib, library.name)
    assert lib.kvserve_abi_version() == kernel_abi.ABI_VERSION


@pytest.mark.parametrize("library", [LINEAR, ATTENTION], ids=lambda library: library.name)
def test_another_abi_version_is_refused(library: KernelLibrary, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = kernel_abi.ABI_VERSION + 1
    monkeypatch.setattr(kernel_abi, "ABI_VERSION", expected)
    with pytest.raises(
        KernelAbiError,
        match=f"the {library.name} kernel library has ABI version {expected - 1}, "
        f"kvserve expects {expected}: kernels/kvserve.h and model/kernel_abi.py disagree",
    ):
        load_kernel(library, default_cache_dir())


def test_a_struct_of_another_size_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class Longer(ctypes.Structure):
        _fields_ = [*kernel_abi.DecoderStruct._fields_, ("extra", ctypes.c_int64)]

    size = ctypes.sizeof(kernel_abi.DecoderStruct)
    monkeypatch.setattr(kernel_abi, "STRUCTS", (*kernel_abi.STRUCTS[:-1], ("decoder", Longer)))
    with pytest.raises(
        KernelAbiError,
        match=f"the quant_linear kernel library's struct decoder is {size} bytes, kvserve's {size + 8}: "
        "kernels/kvserve.h and model/kernel_abi.py disagree",
    ):
        load_kernel(LINEAR, default_cache_dir())


def test_a_missing_function_is_refused() -> None:
    functions = dict(LINEAR.functions, quant_linear_gone=kernel_abi.Function(ctypes.c_int, []))
    library = dataclasses.replace(LINEAR, functions=functions)
    with pytest.raises(KernelAbiError, match="the quant_linear kernel library exports no quant_linear_gone"):
        load_kernel(library, default_cache_dir())
