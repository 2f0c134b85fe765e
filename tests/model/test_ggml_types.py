"""kvserve's table of ggml types (model/ggml_types.py) is the gguf package's: every code and name, every
block's elements and bytes, and which types it dequantizes; the codes it leaves out are still looked up
in the package."""

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from kvserve.model.ggml_types import DEQUANTIZED, GEOMETRY, GgmlType
from kvserve.model.gguf_file import block_geometry, dequantizable


def test_the_table_is_the_gguf_packages() -> None:
    for t in GgmlType:
        assert GGMLQuantizationType[t.name] == t.value
        assert GEOMETRY[t] == GGML_QUANT_SIZES[GGMLQuantizationType(t.value)]
    assert set(GEOMETRY) == set(GgmlType)


def test_every_code_has_the_packages_geometry() -> None:
    for t in GGMLQuantizationType:
        assert block_geometry(int(t)) == GGML_QUANT_SIZES.get(t)
    assert block_geometry(255) is None


def _package_dequantizes(t: GGMLQuantizationType) -> bool:
    try:
        dequantize(np.zeros(GGML_QUANT_SIZES[t][1], dtype=np.uint8), t)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return True


def test_the_dequantized_types_are_the_packages() -> None:
    for t in GGMLQuantizationType:
        assert dequantizable(int(t)) == _package_dequantizes(t)
        if t.value in GEOMETRY:
            assert (t.value in DEQUANTIZED) == _package_dequantizes(t)
