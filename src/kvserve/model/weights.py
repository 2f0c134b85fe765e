"""A model's weights as the forward pass takes them: float tensors, norms and linears by checkpoint name,
each checked against the shape the config implies, and each linear in the engine's weight precision."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvserve.errors import ModelLoadError
from kvserve.model.linear import Linear, make_linear
from kvserve.model.native_build import KernelUnavailableError
from kvserve.model.quant_blocks import QuantizedWeight, concat
from kvserve.model.quant_linear import QuantLinear, make_block_linear


@dataclass(frozen=True)
class Rows:
    """Rows [start, stop) of the weight matrix `name` ([rows, in]); the whole matrix by default. A
    fused checkpoint matrix (Phi-3's gate_up_proj) is served as the products its rows make."""

    name: str
    rows: int
    start: int = 0
    stop: int | None = None

    @property
    def end(self) -> int:
        return self.rows if self.stop is None else self.stop

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end == self.rows


class ModelWeights:
    """Reads tensors from `tensors` (float, by checkpoint name) and the file's quantized `blocks` (by
    the same names, for weight_dtype "gguf"), onto `device` in `dtype`.

    `norm_offset` is added to every norm weight as it loads: Gemma's norms multiply by (1 + w), so
    folding the 1 in once lets every norm be the plain RMSNorm.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        blocks: Mapping[str, QuantizedWeight],
        device: torch.device,
        dtype: torch.dtype,
        weight_dtype: str,
        cache_dir: str,
        int16_activations: bool,
        norm_offset: float = 0.0,
    ) -> None:
        self.tensors = tensors
        self.blocks = blocks
        self.device = device
        self.dtype = dtype
        self.weight_dtype = weight_dtype
        self.cache_dir = cache_dir
        self.int16_activations = int16_activations
        self.norm_offset = norm_offset

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self.tensors:
            raise ModelLoadError(name, "tensor missing from the weight files")
        t = self.tensors[name]
        if shape is not None and tuple(t.shape) != shape:
            raise ModelLoadError(name, f"shape {tuple(t.shape)} does not match the config's {shape}")
        return t.to(device=self.device, dtype=self.dtype)

    def norm(self, name: str, size: int) -> torch.Tensor:
        weight = self.tensor(name, (size,))
        return weight + self.norm_offset if self.norm_offset else weight

    def _blocks(self, part: Rows, in_features: int) -> QuantizedWeight | None:
        """The rows of `part` as the file's own blocks; None where there are none (safetensors, or a type
        the kernels do not read: the product runs on the float weights)."""
        q = self.blocks.get(part.name)
        if q is None:
            return None
        if (q.out_features, q.in_features) != (part.rows, in_features):
            raise ModelLoadError(
                part.name,
                f"shape {(q.out_features, q.in_features)} does not match the config's "
                f"{(part.rows, in_features)}",
            )
        return q if part.whole else QuantizedWeight(q.qtype, q.data[part.start : part.end], q.in_features)

    def _float(self, part: Rows, in_features: int) -> torch.Tensor:
        weight = self.tensor(part.name, (part.rows, in_features))
        return weight if part.whole else weight[part.start : part.end]

    def linear(self, parts: list[Rows], in_features: int, bias: torch.Tensor | None = None) -> Linear:
        """One product over the rows of `parts` stacked (q, k and v as one matmul: parts of different
        types run side by side in one native call, none copied)."""
        found = [self._blocks(p, in_features) for p in parts]
        joined = concat([b for b in found if b is not None]) if all(found) else None
        native = self.weight_dtype == "gguf" and self.device.type == "cpu" and self.dtype == torch.float32
        if native and joined is not None:
            # The float weights are read only for a fallback: not at all where the kernel runs.
            try:
                return QuantLinear(joined, bias, self.cache_dir, self.int16_activations)
            except KernelUnavailableError:
                pass
        floats = [self._float(p, in_features) for p in parts]
        weight = torch.cat(floats) if len(floats) > 1 else floats[0]
        if self.weight_dtype not in ("gguf", "q8_0"):
            return make_linear(weight, bias, self.weight_dtype)
        return make_block_linear(
            weight, bias, joined, self.weight_dtype, self.cache_dir, self.int16_activations
        )
