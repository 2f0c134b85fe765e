"""A GGUF's tensors under Hugging Face names, read in place from the mapped file, and their checks
against the metadata.

`GgufWeights` answers every name with float32 values; `GgufBlocks` answers the weight matrices' names
with the file's own blocks (`QuantizedWeight`, of whatever ggml type the file holds: the model layer
decides which it runs natively). Both are views into the mapping: nothing is dequantized or copied at
load. One exception when read: the llama-rope architectures' q and k rows (and biases), which llama.cpp
stores interleaved for its rotary kernel (`Family.gguf_permuted_qk`), are copied into Hugging Face's
row order; whole rows of blocks move, so the copy is exact, and it is not kept (the product built from
it keeps its own). A name's float values are read when asked for: a view for
F32, dequantized (by the gguf package) on each request otherwise, and not kept. llama.cpp's 3-D expert
tensors ([experts, rows, in]) answer the checkpoint's per-expert names; a fused `ffn_gate_up_exps`
(newer converters' form of transformers' `gate_up_proj`) answers the gate's with its first half of
rows and the up projection's with its second.
"""

import logging
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvserve.errors import ModelLoadError
from kvserve.model.families.base import Family, GgufMetadata
from kvserve.model.gguf_file import F32, GgufFile, TensorInfo, dequantizable, dequantize, type_name
from kvserve.model.quant_blocks import BLOCK_SIZES, QuantizedWeight, row_unit
from kvserve.model.rope import llama3_of_divisors
from kvserve.model.spec import ROPE_FACTOR_RANGE, ModelConfig

log = logging.getLogger(__name__)
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(0|[1-9]\d*)(\..+)")
_LAYER = re.compile(r"blk\.(0|[1-9]\d*)\.")
_PERMUTED = ("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")
# The experts' gate and up projections in one tensor, the gate's rows first, and the names of each.
FUSED_GATE_UP = "ffn_gate_up_exps.weight"
_FUSED_PARTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight")


@dataclass(frozen=True)
class Entry:
    """A tensor and its data, a view into the mapping: float32 values for F32, uint8 rows of blocks
    [..., rows, row bytes] otherwise. `heads`: the rows are llama.cpp's interleaving of q or k rows for
    that many heads, read in Hugging Face's order (0: as stored)."""

    tensor: TensorInfo
    data: np.ndarray
    heads: int = 0
    # Which half of a fused tensor's rows this name reads (0: the first), or None: all of them.
    half: int | None = None

    def rows(self, expert: int | None) -> np.ndarray:
        """The data in Hugging Face's row order (an expert's slice of a 3-D tensor, a fused tensor's
        half): a view, or for interleaved q/k rows a copy (not kept: the one product that reads it
        keeps its own)."""
        data = self.data if expert is None else self.data[expert]
        if self.half is not None:
            n = data.shape[0] // 2
            data = data[self.half * n : (self.half + 1) * n]
        if not self.heads:
            return data
        n = data.shape[0]
        per_head = data.reshape(self.heads, n // self.heads // 2, 2, *data.shape[1:])
        return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(data.shape))


class GgufTensors:
    """The file's tensors by Hugging Face name; a name holding `{expert}` stands for a 3-D tensor's
    experts. `heads`: the query and key-value head counts (q and k rows are put back per head)."""

    def __init__(self, file: GgufFile, family: Family, heads: tuple[int, int]) -> None:
        self.file = file
        self._plain: dict[str, Entry] = {}
        self._experts: dict[str, Entry] = {}
        for t in file.tensors.values():
            if t.name.endswith("." + FUSED_GATE_UP):
                self._add_fused(file, family, t)
                continue
            name = hf_name(family, t.name)
            if name is None:
                continue
            if not dequantizable(t.qtype):
                raise ModelLoadError(
                    file.path,
                    f"tensor {t.name} is of {type_name(t.qtype)}, which neither kvserve's kernels nor its "
                    "float path reads",
                )
            data, n_heads = file.array(t), 0
            if family.gguf_permuted_qk and t.name.endswith(_PERMUTED):
                n_heads = heads[0] if "attn_q" in t.name else heads[1]
                if n_heads < 1 or data.shape[0] % (2 * n_heads):
                    raise ModelLoadError(
                        file.path,
                        f"tensor {t.name}'s {data.shape[0]} rows are not two halves of {n_heads} heads",
                    )
            if "{expert}" in name:
                # An expert's matrix is [experts, rows, in]; its bias (gpt-oss) [experts, rows].
                dims = 2 if name.endswith(".bias") else 3
                if len(t.dims) != dims:
                    raise ModelLoadError(
                        file.path,
                        f"tensor {t.name} holds experts, so needs {dims} dimensions "
                        f"{'[experts, rows]' if dims == 2 else '[experts, rows, in]'}, not {len(t.dims)}",
                    )
                self._experts[name] = Entry(t, data, n_heads)
            else:
                self._plain[name] = Entry(t, data, n_heads)

    def _add_fused(self, file: GgufFile, family: Family, t: TensorInfo) -> None:
        """A fused gate-and-up expert tensor, as the family's gate and up expert tensors (its halves)."""
        prefix = t.name[: -len(FUSED_GATE_UP)]
        names = [hf_name(family, prefix + part) for part in _FUSED_PARTS]
        if any(n is None or "{expert}" not in n for n in names):
            return
        if len(t.dims) != 3 or t.dims[1] % 2:
            raise ModelLoadError(
                file.path,
                f"tensor {t.name} holds experts' gate and up rows, so needs 3 dimensions "
                f"[experts, rows, in] with an even count of rows, not {list(t.shape)}",
            )
        if not dequantizable(t.qtype):
            raise ModelLoadError(
                file.path, f"tensor {t.name} is of {type_name(t.qtype)}, which kvserve does not read"
            )
        data = file.array(t)
        for half, name in enumerate(names):
            self._experts[str(name)] = Entry(t, data, half=half)

    def find(self, name: str) -> tuple[Entry, int | None] | None:
        """The entry holding `name` and, for an expert's matrix, the expert's index."""
        entry = self._plain.get(name)
        if entry is not None:
            return entry, None
        m = _EXPERT.fullmatch(name)
        if m is None:
            return None
        entry = self._experts.get(m[1] + "{expert}" + m[3])
        expert = int(m[2])
        if entry is None or expert >= entry.tensor.dims[-1]:
            return None
        return entry, expert

    def names(self) -> Iterator[str]:
        yield from self._plain
        for template, entry in self._experts.items():
            for e in range(entry.tensor.dims[-1]):
                yield template.format(expert=e)

    def __len__(self) -> int:
        return len(self._plain) + sum(e.tensor.dims[-1] for e in self._experts.values())


class GgufWeights(Mapping[str, torch.Tensor]):
    """Every tensor's float32 values by Hugging Face name, read when asked for (see the module)."""

    def __init__(self, tensors: GgufTensors) -> None:
        self.tensors = tensors
        self.file = tensors.file

    def __getitem__(self, name: str) -> torch.Tensor:
        found = self.tensors.find(name)
        if found is None:
            raise KeyError(name)
        data, qtype = found[0].rows(found[1]), found[0].tensor.qtype
        return torch.from_numpy(data if qtype == F32 else dequantize(data, qtype))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.tensors.find(name) is not None

    def __iter__(self) -> Iterator[str]:
        return self.tensors.names()

    def __len__(self) -> int:
        return len(self.tensors)


class GgufBlocks(Mapping[str, QuantizedWeight]):
    """The weight matrices the native kernels read, as the file's blocks with their ggml type, by Hugging
    Face name (each expert's matrix of a 3-D tensor apart). A matrix of a type they do not read (IQ1, IQ2,
    IQ3, TQ, NVFP4) is left out, with a warning naming it: its product runs on its float values, which
    the gguf package dequantizes."""

    def __init__(self, tensors: GgufTensors) -> None:
        self.tensors = tensors
        self._warned: set[str] = set()

    def _matrix(self, name: str) -> tuple[Entry, int | None] | None:
        found = self.tensors.find(name)
        if found is None:
            return None
        entry, expert = found
        t = entry.tensor
        if len(t.dims) != (3 if expert is not None else 2):
            return None
        if t.qtype not in BLOCK_SIZES or t.dims[0] % row_unit(t.qtype):
            if t.name not in self._warned and t.qtype not in (F32, *BLOCK_SIZES):
                self._warned.add(t.name)
                log.warning(
                    "%s: the native kernels do not read %s; its product runs on float weights",
                    t.name,
                    type_name(t.qtype),
                )
            return None
        return found

    def __getitem__(self, name: str) -> QuantizedWeight:
        found = self._matrix(name)
        if found is None:
            raise KeyError(name)
        t = found[0].tensor
        # An F32 matrix's entry holds its values: the kernels read its bytes.
        rows = found[0].rows(found[1]).view(np.uint8)
        return QuantizedWeight(t.qtype, torch.from_numpy(rows), t.dims[0])

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._matrix(name) is not None

    def __iter__(self) -> Iterator[str]:
        return (name for name in self.tensors.names() if self._matrix(name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def hf_name(family: Family, gguf_name: str) -> str | None:
    if gguf_name in family.gguf_global:
        return family.gguf_global[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in family.gguf_layer:
        return f"model.layers.{parts[1]}.{family.gguf_layer[parts[2]]}"
    return None


def check_layers(file: GgufFile, meta: GgufMetadata) -> None:
    """`{arch}.block_count` is the layers the tensors hold: every index below it, none at or past it.
    Checked before the config is built, which sizes per-layer tables by the count."""
    key = f"{meta.arch}.block_count"
    count = meta.get("{arch}.block_count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ModelLoadError(file.path, f"{key} must be a positive integer, not {count!r}")
    present = {int(m[1]) for name in file.tensors if (m := _LAYER.match(name)) is not None}
    beyond = max(present, default=-1)
    if beyond >= count:
        raise ModelLoadError(file.path, f"{key} is {count} but the file holds tensors of layer {beyond}")
    if len(present) < count:
        missing = next(i for i in range(count) if i not in present)
        raise ModelLoadError(file.path, f"{key} is {count} but the file holds no tensor of layer {missing}")


def check_against_config(file: GgufFile, meta: GgufMetadata, config: ModelConfig) -> None:
    """The tensors the metadata sizes agree with it: the embedding (and output) with the hidden size and
    the vocabulary, the vocabulary with the tokenizer, the attention products with the head counts.
    (`ModelWeights` checks every tensor's shape again as the model is built.)"""
    c = config
    path = file.path

    def expect(name: str, dims: tuple[int, int], what: str) -> None:
        t = file.tensors.get(name)
        if t is not None and t.dims != dims:
            raise ModelLoadError(path, f"tensor {name} is {_shape(t.dims)} but {what} make it {_shape(dims)}")

    if "token_embd.weight" not in file.tensors:
        raise ModelLoadError(path, "no token_embd.weight tensor: the file is incomplete")
    tokens = meta.count("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError(path, "the metadata holds no tokenizer (tokenizer.ggml.tokens)")
    if tokens != c.vocab_size:
        raise ModelLoadError(
            path, f"the tokenizer has {tokens} tokens but {meta.arch}.vocab_size is {c.vocab_size}"
        )
    for key in file.fields:
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            token = file.value(key)
            if isinstance(token, int) and not 0 <= token < c.vocab_size:
                raise ModelLoadError(path, f"{key} {token} is not one of the tokenizer's {c.vocab_size}")
    vocab = (c.hidden_size, c.vocab_size)
    sizes = f"{meta.arch}.embedding_length {c.hidden_size} and the vocabulary of {c.vocab_size}"
    expect("token_embd.weight", vocab, sizes)
    expect("output.weight", vocab, sizes)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    heads = (
        f"head_count {c.num_heads}, head_count_kv {c.num_kv_heads}, head_dim {c.head_dim} and "
        f"embedding_length {c.hidden_size}"
    )
    # A gated attention's q rows hold the gate's too; a Gated DeltaNet layer's attn_qkv is its own q, k, v.
    q_rows = 2 * q if c.attention_output_gate else q
    dn = c.deltanet
    for i in range(c.num_layers):
        p = f"blk.{i}."
        expect(p + "attn_q.weight", (c.hidden_size, q_rows), heads)
        expect(p + "attn_k.weight", (c.hidden_size, kv), heads)
        expect(p + "attn_v.weight", (c.hidden_size, kv), heads)
        if dn is not None and dn.layers[i]:
            expect(p + "attn_qkv.weight", (c.hidden_size, dn.conv_dim), "the ssm.* sizes")
        else:
            expect(p + "attn_qkv.weight", (c.hidden_size, q + 2 * kv), heads)
        expect(p + "attn_output.weight", (q, c.hidden_size), heads)


ROPE_FREQS = "rope_freqs.weight"


def with_rope_freqs(file: GgufFile, family: Family, config: ModelConfig) -> ModelConfig:
    """`config` with the file's rope frequency factors (`ROPE_FREQS`, one per rotated pair, each within
    ROPE_FACTOR_RANGE) where it has them: as the llama3 scaling they are exactly the converter's form of
    (rope.llama3_of_divisors), else as `rope_freq_factors`. A family that reads none refuses the tensor,
    since serving without it would rotate otherwise than the file means."""
    t = file.tensors.get(ROPE_FREQS)
    if t is None:
        return config
    if not family.gguf_rope_freqs:
        raise ModelLoadError(file.path, f"tensor {ROPE_FREQS}: the {family.name} family takes no factors")
    pairs = config.rotary_dim // 2
    if t.dims != (pairs,):
        raise ModelLoadError(
            file.path, f"tensor {ROPE_FREQS} is {_shape(t.dims)} but the rotary dimension makes it [{pairs}]"
        )
    factors = file.floats(t).astype(np.float64)
    low, high = ROPE_FACTOR_RANGE
    bad = [f for f in factors if not low <= f <= high]  # NaN fails both comparisons
    if bad:
        raise ModelLoadError(
            file.path, f"tensor {ROPE_FREQS} holds the factor {bad[0]}, outside [2**-16, 2**16]"
        )
    divisors = tuple(float(f) for f in factors)
    llama3 = None if config.rope_scaling else llama3_of_divisors(config, divisors)
    if llama3 is not None:
        # Llama 3.x's own scaling, written by llama.cpp's converter: served as its checkpoint's.
        return replace(config, rope_scaling=tuple(sorted(llama3.items())))
    return replace(config, rope_freq_factors=divisors)


def _shape(dims: tuple[int, ...]) -> str:
    """Dimensions as Hugging Face orders them ([rows, row length])."""
    return str(list(reversed(dims)))
