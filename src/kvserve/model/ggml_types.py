"""ggml's tensor types as a GGUF names them by code, with each one's block (elements, bytes), so that
loading a GGUF reads its tensor table without importing the gguf package (a tenth of a second of every
start), and the types the package dequantizes (the float path's, `gguf_file.dequantizable`). A code
not here (a type newer than this table) is looked up in the package; tests/model/test_ggml_types.py
holds the table equal to the package's.
"""

from enum import IntEnum


class GgmlType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


GEOMETRY: dict[int, tuple[int, int]] = {
    GgmlType.F32: (1, 4),
    GgmlType.F16: (1, 2),
    GgmlType.Q4_0: (32, 18),
    GgmlType.Q4_1: (32, 20),
    GgmlType.Q5_0: (32, 22),
    GgmlType.Q5_1: (32, 24),
    GgmlType.Q8_0: (32, 34),
    GgmlType.Q8_1: (32, 40),
    GgmlType.Q2_K: (256, 84),
    GgmlType.Q3_K: (256, 110),
    GgmlType.Q4_K: (256, 144),
    GgmlType.Q5_K: (256, 176),
    GgmlType.Q6_K: (256, 210),
    GgmlType.Q8_K: (256, 292),
    GgmlType.IQ2_XXS: (256, 66),
    GgmlType.IQ2_XS: (256, 74),
    GgmlType.IQ3_XXS: (256, 98),
    GgmlType.IQ1_S: (256, 50),
    GgmlType.IQ4_NL: (32, 18),
    GgmlType.IQ3_S: (256, 110),
    GgmlType.IQ2_S: (256, 82),
    GgmlType.IQ4_XS: (256, 136),
    GgmlType.I8: (1, 1),
    GgmlType.I16: (1, 2),
    GgmlType.I32: (1, 4),
    GgmlType.I64: (1, 8),
    GgmlType.F64: (1, 8),
    GgmlType.IQ1_M: (256, 56),
    GgmlType.BF16: (1, 2),
    GgmlType.TQ1_0: (256, 54),
    GgmlType.TQ2_0: (256, 66),
    GgmlType.MXFP4: (32, 17),
}

# The types the gguf package (the pinned 0.19.0) dequantizes to float.
DEQUANTIZED = frozenset(
    t for t in GgmlType if t.name not in ("Q8_1", "Q8_K", "I8", "I16", "I32", "I64", "F64")
)
