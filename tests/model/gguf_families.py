"""GGUF files of tiny Hugging Face models, written the way llama.cpp's converter writes them: its tensor
names (gguf-py's own name map), its metadata keys, q/k rows interleaved for the llama-rope architectures,
Gemma's norms stored as (1 + w), Phi-3's rope factors and Llama 3's rope scaling as tensors; weight
matrices in F32, or Q8_0 with the down projections in Q6_K (a K-quant), as a mixed quantization writes
them."""

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tests.helpers import save_tiny_model

ARCHES = {
    "llama": MODEL_ARCH.LLAMA,
    "qwen2": MODEL_ARCH.QWEN2,
    "qwen3": MODEL_ARCH.QWEN3,
    "smollm3": MODEL_ARCH.SMOLLM3,
    "phi3": MODEL_ARCH.PHI3,
    "gemma3": MODEL_ARCH.GEMMA3,
    "qwen3_moe": MODEL_ARCH.QWEN3MOE,
    "lfm2": MODEL_ARCH.LFM2,
}
# Tiny tokenizers of a few hundred tokens, so that the files and their conversion stay small and fast:
# a byte-level BPE (Qwen, SmolLM and Phi-4's kind) and, for Gemma, a sentencepiece vocabulary with byte
# fallback (Gemma's kind).
_MERGES = [
    ("Ġ", "t"),
    ("h", "e"),
    ("i", "n"),
    ("e", "r"),
    ("a", "n"),
    ("o", "n"),
    ("Ġ", "a"),
    ("r", "e"),
    ("Ġt", "he"),
    ("e", "n"),
    ("o", "r"),
    ("Ġ", "s"),
    ("e", "s"),
    ("Ġ", "w"),
    ("Ġ", "o"),
    ("l", "l"),
    ("H", "e"),
    ("He", "ll"),
    ("Hell", "o"),
    ("Ġw", "or"),
    ("Ġwor", "l"),
    ("Ġworl", "d"),
    ("Ġ", "h"),
    ("o", "w"),
    ("Ġh", "ow"),
    ("a", "r"),
    ("Ġa", "re"),
    ("Ġ", "y"),
    ("o", "u"),
    ("Ġy", "ou"),
]
_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_PIECES = [
    *"▁abcdefghijklmnopqrstuvwxyzHW,?!",
    *["▁h", "▁w", "▁y", "▁a", "ll", "He", "Hell", "Hello", "ow", "▁how", "or", "▁wor", "▁world", "ou"],
    *["▁you", "re", "▁are", "ld", "▁the", "in", "er", "an", "on", "en"],
]


@dataclass(frozen=True)
class Vocabulary:
    model: str  # tokenizer.ggml.model
    tokens: list[str]
    types: list[int]  # 1 normal, 2 unknown, 3 control, 6 byte
    merges: list[str]
    scores: list[float]
    bos: int
    eos: int
    unk: int | None = None
    pad: int | None = None

    def __len__(self) -> int:
        return len(self.tokens)


def tiny_vocabulary(family: str) -> Vocabulary:
    if family == "gemma3":
        tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)), *_PIECES]
        types = [3, 3, 3, 2] + [6] * 256 + [1] * len(_PIECES)
        return Vocabulary("llama", tokens, types, [], [-float(i) for i in range(len(tokens))], 2, 1, 3, 0)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()  # type: ignore[no-untyped-call]
    tokens = [spelling[b] for b in range(256)] + [a + b for a, b in _MERGES] + _CONTROL
    types = [1] * (len(tokens) - len(_CONTROL)) + [3] * len(_CONTROL)
    eos = len(tokens) - len(_CONTROL)
    return Vocabulary("gpt2", tokens, types, [f"{a} {b}" for a, b in _MERGES], [0.0] * len(tokens), eos, eos)


def save_tiny_llama(path: str, **overrides: Any) -> str:
    """A tiny random Llama folder at `path` on the tiny tokenizer's vocabulary, so that write_family_gguf
    can write it as a GGUF; `overrides` change its config."""
    vocabulary = tiny_vocabulary("llama")
    return save_tiny_model(
        path,
        "llama",
        intermediate_size=256,
        vocab_size=len(vocabulary),
        bos_token_id=vocabulary.bos,
        eos_token_id=vocabulary.eos,
        pad_token_id=vocabulary.eos,
        **overrides,
    )


# The architectures whose q and k rows llama.cpp's converter interleaves (its LlamaModel.permute).
PERMUTED = ("llama", "smollm3")


def q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks of the rows of w [rows, n] (n a multiple of 256): per 16 weights an int8 scale of
    a float16 d, 6-bit quants, laid out as ggml's block_q6_K (ql, qh, scales, d)."""
    rows = w.shape[0]
    x = w.reshape(-1, 16, 16).astype(np.float32)
    n = x.shape[0]
    sub = np.abs(x).max(-1) / 31
    d16 = (sub.max(-1, keepdims=True) / 127).astype(np.float16)
    d = d16.astype(np.float32)
    sc = np.round(np.divide(sub, d, out=np.zeros_like(sub), where=d > 0)).clip(-128, 127).astype(np.int8)
    step = (d * sc)[..., None]
    q = np.round(np.divide(x, step, out=np.zeros_like(x), where=step > 0)).clip(-32, 31).astype(np.int32) + 32
    levels = q.reshape(n, 2, 128).astype(np.uint8)
    ql = (levels[:, :, :64] & 0xF) | ((levels[:, :, 64:] & 0xF) << 4)
    hi = (levels >> 4) & 3
    qh = hi[:, :, :32] | (hi[:, :, 32:64] << 2) | (hi[:, :, 64:96] << 4) | (hi[:, :, 96:] << 6)
    blocks = np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d16.view(np.uint8)], axis=1
    )
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def _permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's interleaving of q/k rows (works on float rows and on rows of quantized blocks)."""
    return (
        rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def _encode(
    name: str, w: np.ndarray, quantized: bool
) -> tuple[np.ndarray, GGMLQuantizationType | None, np.ndarray]:
    """The tensor as the file stores it, its quantization type (None: F32), and its dequantized values."""
    if not quantized or w.ndim != 2 or "norm" in name:
        return w, None, w
    if name.endswith("mlp.down_proj.weight") and w.shape[1] % 256 == 0:
        kind = GGMLQuantizationType.Q6_K
        data = q6_k(w)
    elif w.shape[1] % 32 == 0:
        kind = GGMLQuantizationType.Q8_0
        data = quantize(w, kind)
    else:
        return w, None, w
    values = np.asarray(dequantize(data, kind), dtype=np.float32).reshape(w.shape)
    return data, kind, values


def write_hparams(writer: gguf.GGUFWriter, family: str, config: dict[str, Any]) -> None:
    """The model's hyperparameters under llama.cpp's keys, from its Hugging Face config.json fields (as
    transformers 5 writes them: rope under `rope_parameters`, Gemma 3's by layer type)."""
    hidden, n_head = int(config["hidden_size"]), int(config["num_attention_heads"])
    n_kv = int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or hidden // n_head)
    n_layers = int(config["num_hidden_layers"])
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(hidden)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(n_head)
    if family == "lfm2":
        # llama.cpp's hybrid form: a count per layer, 0 where the layer is a convolution.
        writer.add_head_count_kv([n_kv if t == "full_attention" else 0 for t in config["layer_types"]])
        writer.add_shortconv_l_cache(int(config["conv_L_cache"]))
    else:
        writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    rope = config.get("rope_parameters") or {}
    if family == "gemma3":
        writer.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
        writer.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
        writer.add_sliding_window(int(config["sliding_window"]))
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
        if rope["full_attention"].get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["full_attention"]["factor"]))
    else:
        writer.add_rope_freq_base(float(rope["rope_theta"]))
    if "head_dim" in config:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if config.get("num_experts"):
        writer.add_expert_count(int(config["num_experts"]))
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    if family == "phi3":
        original = int(config["original_max_position_embeddings"])
        writer.add_rope_dimension_count(int(config["partial_rotary_factor"] * hidden) // n_head)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(int(config.get("sliding_window") or 0))
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for length in ("long", "short"):
            writer.add_tensor(
                f"rope_factors_{length}.weight", np.array(rope[f"{length}_factor"], dtype=np.float32)
            )


def llama3_rope_freqs(config: dict[str, Any], head_dim: int) -> np.ndarray:
    """Llama 3's rope scaling as llama.cpp's converter writes it: for each rotated pair, the divisor of
    its frequency (1 above the high-frequency band, `factor` below the low one, the reciprocal of the
    smoothed multiplier between), its arithmetic in float32 as the converter's. The converter reads the
    pretraining context from the config's top level (8192 where absent), not from the rope parameters."""
    rope = config["rope_parameters"]
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    frequencies = 1.0 / (float(rope["rope_theta"]) ** exponents)
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    context = config.get("original_max_position_embeddings", 8192)
    factors: list[float] = []
    for frequency in frequencies:
        wavelength = 2 * math.pi / frequency
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(float(1 / ((1 - smooth) / factor + smooth)))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def write_tiny_vocabulary(writer: gguf.GGUFWriter, family: str) -> None:
    """The family's tiny tokenizer under llama.cpp's `tokenizer.*` keys."""
    vocabulary = tiny_vocabulary(family)
    writer.add_tokenizer_model(vocabulary.model)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.types)
    writer.add_token_scores(vocabulary.scores)
    if vocabulary.merges:
        writer.add_token_merges(vocabulary.merges)
    writer.add_bos_token_id(vocabulary.bos)
    writer.add_eos_token_id(vocabulary.eos)
    if vocabulary.unk is not None:
        writer.add_unk_token_id(vocabulary.unk)
    if vocabulary.pad is not None:
        writer.add_pad_token_id(vocabulary.pad)


Tamper = Callable[[str, np.ndarray], np.ndarray | None]


def write_family_gguf(
    hf_dir: str,
    path: str,
    family: str,
    quantized: bool,
    tamper: Tamper | None = None,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Write `hf_dir`'s model as a GGUF at `path`; returns the Hugging Face weights whose values the file
    holds (the dequantized ones where quantized), for a reference model. `tamper` sees each weight by its
    Hugging Face name and returns what to write instead (None: leave the tensor out), and `extra` adds
    metadata of its own, for bad files."""
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        config: dict[str, Any] = json.load(f)
    weights = load_file(os.path.join(hf_dir, "model.safetensors"))
    arch = ARCHES[family]
    n_layers = int(config["num_hidden_layers"])
    names = gguf.get_tensor_name_map(arch, n_layers)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    write_hparams(writer, family, config)
    if config.get("rope_parameters", {}).get("rope_type") == "llama3":
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(config, head_dim))
    n_head, n_kv = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    write_tiny_vocabulary(writer, family)
    if extra is not None:
        extra(writer)
    reference: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if tamper is not None:
            changed = tamper(name, w)
            if changed is None:
                continue
            w = changed
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if family == "lfm2" and name.endswith("conv.conv.weight"):
            # llama.cpp's converter writes the depthwise kernel as [hidden, L].
            writer.add_tensor(gguf_name, w.reshape(w.shape[0], w.shape[-1]))
            reference[name] = torch.from_numpy(w)
            continue
        stored = w + 1 if family == "gemma3" and name.endswith("norm.weight") else w
        data, kind, values = _encode(name, stored, quantized)
        if family in PERMUTED and name.endswith(
            ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
        ):
            data = _permute(data, n_head if "q_proj" in name else n_kv)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
        reference[name] = torch.from_numpy(values - 1 if stored is not w else values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference
