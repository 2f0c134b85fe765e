"""Random-weight GGUFs at the shapes of checkpoints people run, quantized as llama.cpp's `quantize` writes
Q4_K_M, for measuring kvserve beside llama-server on real shapes without downloading weights.

Each shape is the checkpoint's own config.json fields (hidden, intermediate, layers, heads, KV heads,
head_dim, vocabulary, tied head, rope bases, sliding windows); the hyperparameters go under llama.cpp's
keys as tests/model/gguf_families.py writes them. The type of each matrix follows Q4_K_M's rules
(`q4_k_m_type`): Q6_K for the output head (the token embedding when tied), and for the down projections
and V projections of the layers llama.cpp's `use_more_bits` picks (the first and last eighth, every third
between: about half); Q4_K elsewhere; where a matrix's rows (its input length) are not a multiple of 256,
Q4_K falls back to Q5_0, Q5_K to Q5_1 and Q6_K to Q8_0, as llama.cpp does. In an 8-expert model the K and
V projections are Q8_0 and the attention output Q5_K (llama.cpp's rule for Mixtral-like models). Norms
and the router are F32.

Hybrid and gpt-oss shapes follow the same rules on their own tensors, as llama.cpp's `quantize` does:
Qwen3.5's fused DeltaNet input `attn_qkv` is Q5_K (its rule for fused QKV in Q4_K_M), the V projections'
extra bits are counted over the attention layers only (`i_attention_wv`), and convolution kernels
(`ssm_conv1d`, `shortconv.conv`), `ssm_a`, `ssm_dt` and norms stay F32. gpt-oss is written as llama.cpp
writes OpenAI's checkpoints (its MXFP4_MOE mix): the experts in MXFP4, every other matrix Q8_0; its shape
here is gpt-oss-20b's layer (hidden 2,880, 64 query and 8 KV heads of 64, experts 2,880 wide, 4 chosen, a
128-token window on every other layer, sinks, biases, the real vocabulary and untied head) with 8 layers
and 8 experts instead of 24 and 32 (gpt-oss-20b's 12 GiB would not fit this machine twice over): a token
reads the same bytes per layer as in gpt-oss-20b.

Weights are random blocks: random bytes with each block's float16 scale (and min) fixed so that the
weights have a standard deviation of about 0.02 and a mean of about 0, which keeps activations finite
through every layer. Norms are 1 + N(0, 0.02) as stored. Since the rows are random, the q/k rows are not
interleaved (llama.cpp's permutation of random rows is random rows).

The tokenizer is the default model's (a GPT-2 BPE of 49,152 tokens) with the family's special tokens
and unused tokens appended up to the real vocabulary size, and the family's chat template (gpt-oss's
shape gets a ChatML template: the benchmark times decoding, and a random model writes no harmony).
Random values where a weight has a meaning: DeltaNet decays `ssm_a` = -(1 to 16) as -exp(A_log) spans,
biases and attention sinks about 0, convolution kernels N(0, 0.3).

    python -m benchmarks.peer_models NAME OUT.gguf        (NAME: one of SHAPES; --tiny for the test size)
"""

import argparse
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import gguf
import numpy as np
from gguf import MODEL_ARCH, MODEL_TENSOR, GGMLQuantizationType, GGUFReader, GGUFWriter, TokenType
from tests.model.gguf_families import ARCHES, llama3_rope_freqs, write_hparams
from tests.server.chat_templates import LLAMA3, QWEN3

from kvserve.model.loader import default_model_path

Q = GGMLQuantizationType
QK_K = 256
# The families of tests/model/gguf_families.py and those only written here.
ARCHITECTURES = {**ARCHES, "qwen3_5": MODEL_ARCH.QWEN35, "gpt_oss": MODEL_ARCH.GPT_OSS}
# Matrices llama.cpp's `quantize` leaves as they are (the converter's F32): small convolution kernels.
_UNQUANTIZED = (MODEL_TENSOR.SSM_CONV1D, MODEL_TENSOR.SHORTCONV_CONV, MODEL_TENSOR.FFN_GATE_INP)
WEIGHT_STD = 0.02
# Offsets of the float16 fields of each block type: the scale d first, then the min where there is one.
_HALF_FIELDS = {
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
}
# What a Q4_K_M choice becomes where the rows are not a multiple of 256 (llama.cpp's fallback).
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}

_GEMMA3 = r"""{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set first = messages[0]['content'] + '\n\n' %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set first = '' %}
{%- endif %}
{%- for message in messages %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<start_of_turn>' + role + '\n' + (first if loop.first else '') + message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}
"""
_QWEN25 = r"""{%- if messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


@dataclass(frozen=True)
class Specials:
    """A family's special tokens: those the chat template writes (control tokens, appended after the
    default model's vocabulary unless already there), the BOS and EOS among them, and whether a BOS is
    added to every text."""

    tokens: tuple[str, ...]
    bos: str
    eos: str
    add_bos: bool
    template: str


_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# LFM2's template: ChatML after a BOS of its own.
_LFM2 = r"""{{- bos_token }}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
SPECIALS = {
    "gemma3": Specials(
        ("<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<end_of_turn>", True, _GEMMA3
    ),
    "qwen2": Specials(_CHATML, "<|endoftext|>", "<|im_end|>", False, _QWEN25),
    "qwen3": Specials(_CHATML, "<|endoftext|>", "<|im_end|>", False, QWEN3),
    "qwen3_moe": Specials(_CHATML, "<|endoftext|>", "<|im_end|>", False, QWEN3),
    "qwen3_5": Specials(_CHATML, "<|endoftext|>", "<|im_end|>", False, QWEN3),
    "lfm2": Specials(("<|startoftext|>", *_CHATML), "<|startoftext|>", "<|im_end|>", True, _LFM2),
    "gpt_oss": Specials(_CHATML, "<|endoftext|>", "<|im_end|>", False, QWEN3),
    "llama": Specials(
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|begin_of_text|>",
        "<|eot_id|>",
        True,
        LLAMA3,
    ),
}


@dataclass(frozen=True)
class Shape:
    """A checkpoint's family and config.json fields (transformers 5's: rope under `rope_parameters`)."""

    family: str
    config: dict[str, Any]

    def tiny(self) -> "Shape":
        """The same family, tying and type mix at small sizes: each matrix's input length keeps whether it
        is a multiple of 256, 8 layers (so that `use_more_bits` picks some layers and not others), the
        default model's vocabulary with the specials."""
        c = self.config
        head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
        hidden = 256 if c["hidden_size"] % QK_K == 0 else 384
        q_dim = 256 if c["num_attention_heads"] * head_dim % QK_K == 0 else 384
        heads = max(1, q_dim // head_dim)
        tiny = {
            **c,
            "hidden_size": hidden,
            "intermediate_size": 512,
            "num_hidden_layers": 8,
            "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads * c["num_key_value_heads"] // c["num_attention_heads"]),
            "vocab_size": 0,
            "max_position_embeddings": 4096,
        }
        if "head_dim" in c:
            tiny["head_dim"] = head_dim
        if "moe_intermediate_size" in c:
            tiny["moe_intermediate_size"] = 256
        if self.family == "gemma3":
            tiny["layer_types"] = _gemma_layers(8)
            tiny["sliding_window"] = 32
        elif self.family == "qwen3_5":
            tiny["layer_types"] = _qwen3_5_layers(8)
            tiny |= {"linear_num_key_heads": 2, "linear_num_value_heads": 2}
        elif self.family == "lfm2":
            # Conv and attention layers alike among use_more_bits' picks and the others.
            tiny["layer_types"] = ["full_attention" if i in (2, 5) else "conv" for i in range(8)]
        elif self.family == "gpt_oss":
            tiny |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 512}
            tiny["layer_types"] = _gpt_oss_layers(8)
        return replace(self, config=tiny)


def _gemma_layers(n: int) -> list[str]:
    """Gemma 3's pattern: five sliding-window layers, then a global one."""
    return ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(n)]


def _gemma3(hidden: int, intermediate: int, layers: int) -> Shape:
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    rope["sliding_attention"] = {"rope_type": "default", "rope_theta": 1e4}
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
    }
    config |= {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144}
    config |= {"tie_word_embeddings": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768}
    config |= {"sliding_window": 512, "layer_types": _gemma_layers(layers), "rope_parameters": rope}
    return Shape("gemma3", config)


def _qwen3_5_layers(n: int) -> list[str]:
    """Qwen3.5's pattern: three Gated DeltaNet layers, then a full-attention one."""
    return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]


def _gpt_oss_layers(n: int) -> list[str]:
    """gpt-oss's pattern: a sliding-window layer, then a global one."""
    return ["full_attention" if i % 2 else "sliding_attention" for i in range(n)]


def _lfm2(hidden: int, intermediate: int, heads: int) -> Shape:
    """An LFM2 of 16 layers: attention at layers 2, 5, 8, 10, 12 and 14 (`full_attn_idxs`), short
    convolutions of 3 taps elsewhere. `intermediate` is the MLP's width after transformers' adjustment
    (`block_auto_adjust_ff_dim`: two thirds of `block_ff_dim`, rounded up to 256), the width the GGUF
    holds."""
    attending = (2, 5, 8, 10, 12, 14)
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": 16,
    }
    config |= {"num_attention_heads": heads, "num_key_value_heads": 8, "vocab_size": 65536}
    config |= {"tie_word_embeddings": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 128000}
    config |= {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "conv_L_cache": 3}
    config["layer_types"] = ["full_attention" if i in attending else "conv" for i in range(16)]
    return Shape("lfm2", config)


def _qwen(
    family: str, hidden: int, intermediate: int, layers: int, heads: int, kv: int, **more: Any
) -> Shape:
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
    }
    config |= {"num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": 151936}
    config |= {"tie_word_embeddings": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768}
    config |= {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    return Shape(family, config | more)


# The checkpoints' config.json values. Qwen3-MoE-small is ours: Qwen3-30B-A3B's layer at a small size
# (hidden 1024, 8 experts of width 768, top 2, 12 layers, untied head, as the MoE checkpoints are).
SHAPES: dict[str, Shape] = {
    "gemma3-270m": _gemma3(640, 2048, 18),
    "gemma3-1b": _gemma3(1152, 6912, 26),
    "qwen3-0.6b": _qwen("qwen3", 1024, 3072, 28, 16, 8, head_dim=128),
    "qwen3-1.7b": _qwen("qwen3", 2048, 6144, 28, 16, 8, head_dim=128),
    "qwen2.5-0.5b": _qwen("qwen2", 896, 4864, 24, 14, 2),
    "qwen2.5-1.5b": _qwen("qwen2", 1536, 8960, 28, 12, 2),
    "llama3.2-1b": Shape(
        "llama",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    "qwen3-moe-small": _qwen(
        "qwen3_moe",
        1024,
        3072,
        12,
        16,
        4,
        head_dim=128,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=768,
        tie_word_embeddings=False,
    ),
    # Qwen3.5-0.8B (the smallest released Qwen3.5): 18 Gated DeltaNet layers (16 key and 16 value heads
    # of 128, a 4-tap convolution) and 6 gated attention layers (8 query heads, 2 KV heads of 256, a
    # quarter of each head rotated, imrope sections 11/11/10 that text positions make plain rope).
    "qwen3.5-0.8b": _qwen(
        "qwen3_5",
        1024,
        3584,
        24,
        8,
        2,
        head_dim=256,
        vocab_size=248320,
        max_position_embeddings=262144,
        layer_types=_qwen3_5_layers(24),
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
        },
    ),
    # LFM2-350M: block_ff_dim 6,656 (4,608 adjusted); LFM2-1.2B: 12,288 (8,192).
    "lfm2-350m": _lfm2(1024, 4608, 16),
    "lfm2-1.2b": _lfm2(2048, 8192, 32),
    # gpt-oss-20b's layers, 8 of its 24, 8 of its 32 experts (see the module's docstring).
    "gpt-oss-small": Shape(
        "gpt_oss",
        {
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "moe_intermediate_size": 2880,
            "num_hidden_layers": 8,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "num_experts": 8,
            "num_experts_per_tok": 4,
            "vocab_size": 201088,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
            "sliding_window": 128,
            "layer_types": _gpt_oss_layers(8),
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        },
    ),
}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose down (and V) projections get more bits in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(
    kind: MODEL_TENSOR,
    n_in: int,
    layer: int,
    layers: int,
    experts: int,
    tied: bool,
    v_index: tuple[int, int] | None = None,
) -> Q:
    """The type llama.cpp's `quantize` gives a matrix of `n_in` inputs in a Q4_K_M file. `v_index`: a V
    projection's place among the file's V projections and their count (the layer and the layer count
    unless some layers have no attention)."""
    if kind == MODEL_TENSOR.OUTPUT or (tied and kind == MODEL_TENSOR.TOKEN_EMBD):
        return Q.Q6_K if n_in % QK_K == 0 else Q.Q8_0
    chosen = Q.Q4_K
    if kind == MODEL_TENSOR.ATTN_V:
        more = use_more_bits(*(v_index or (layer, layers)))
        chosen = Q.Q8_0 if experts == 8 else Q.Q6_K if more else Q.Q4_K
    elif kind == MODEL_TENSOR.ATTN_QKV:
        chosen = Q.Q5_K
    elif kind == MODEL_TENSOR.ATTN_K and experts == 8:
        chosen = Q.Q8_0
    elif kind == MODEL_TENSOR.ATTN_OUT and experts == 8:
        chosen = Q.Q5_K
    elif kind in (MODEL_TENSOR.FFN_DOWN, MODEL_TENSOR.FFN_DOWN_EXP) and use_more_bits(layer, layers):
        chosen = Q.Q6_K
    return _FALLBACK.get(chosen, chosen) if n_in % QK_K else chosen


@functools.cache
def _half_values(kind: Q) -> tuple[float, ...]:
    """The float16 fields that give random blocks of `kind` a standard deviation of WEIGHT_STD and a
    mean of about 0: measured on a sample, since the weights are linear in the fields. MXFP4's one
    field is a power-of-two exponent byte (E8M0): the one nearest WEIGHT_STD."""
    rng = np.random.default_rng(0)
    if kind == Q.MXFP4:

        def error(exponent: int) -> float:
            blocks = _random_blocks(rng, kind, 4096, (exponent,))
            return abs(math.log(float(np.std(gguf.quants.dequantize(blocks, kind))) / WEIGHT_STD))

        return (float(min(range(100, 140), key=error)),)
    sample = _random_blocks(rng, kind, 4096, (1.0, 0.0)[: len(_HALF_FIELDS[kind])])
    values = np.asarray(gguf.quants.dequantize(sample, kind), dtype=np.float64)
    scale = 0.0
    if len(_HALF_FIELDS[kind]) == 2:
        offset = np.asarray(gguf.quants.dequantize(_random_blocks(rng, kind, 4096, (0.0, 1.0)), kind))
        scale = -values.mean() / offset.mean()
        values = values + scale * offset
    d = WEIGHT_STD / values.std()
    return (d, scale * d)[: len(_HALF_FIELDS[kind])]


def _random_blocks(
    rng: np.random.Generator, kind: Q, n_weights: int, halves: tuple[float, ...]
) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, size=(n_weights // block, size), dtype=np.uint8)
    if kind == Q.MXFP4:
        data[:, 0] = int(halves[0])
        return data
    for offset, value in zip(_HALF_FIELDS[kind], halves, strict=True):
        data[:, offset : offset + 2] = np.array([value], dtype=np.float16).view(np.uint8)
    return data


@dataclass(frozen=True)
class Tensor:
    """One tensor of the file: its llama.cpp name and kind, its shape ([..., rows, inputs]) and layer."""

    kind: MODEL_TENSOR
    shape: tuple[int, ...]
    layer: int = 0
    bias: bool = False

    def name(self) -> str:
        # ssm_a is the one tensor llama.cpp names without a suffix.
        suffix = "" if self.kind == MODEL_TENSOR.SSM_A else ".bias" if self.bias else ".weight"
        return gguf.TENSOR_NAMES[self.kind].format(bid=self.layer) + suffix


def attention_layers(shape: Shape) -> list[int]:
    """The layers with attention (every layer but a hybrid's recurrent and convolution ones)."""
    c = shape.config
    if shape.family not in ("qwen3_5", "lfm2"):
        return list(range(c["num_hidden_layers"]))
    return [i for i, t in enumerate(c["layer_types"]) if t == "full_attention"]


def tensors(shape: Shape) -> Iterator[Tensor]:
    """The tensors llama.cpp's converter writes for the shape, in its order."""
    c = shape.config
    T = MODEL_TENSOR
    family = shape.family
    hidden, layers = c["hidden_size"], c["num_hidden_layers"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = int(c.get("head_dim") or hidden // heads)
    vocab = vocabulary_size(shape)
    attending = set(attention_layers(shape))
    yield Tensor(T.TOKEN_EMBD, (vocab, hidden))
    if c["rope_parameters"].get("rope_type") == "llama3":
        yield Tensor(T.ROPE_FREQS, (head_dim // 2,))
    for i in range(layers):
        yield Tensor(T.ATTN_NORM, (hidden,), i)
        if i not in attending:
            yield from _recurrent_tensors(shape, i)
        else:
            # Qwen3.5's q_proj is each head's queries and then its output gate.
            q_rows = heads * head_dim * (2 if family == "qwen3_5" else 1)
            for kind, rows in ((T.ATTN_Q, q_rows), (T.ATTN_K, kv * head_dim), (T.ATTN_V, kv * head_dim)):
                yield Tensor(kind, (rows, hidden), i)
                if family in ("qwen2", "gpt_oss"):
                    yield Tensor(kind, (rows,), i, bias=True)
            if family in ("qwen3", "qwen3_moe", "gemma3", "qwen3_5", "lfm2"):
                yield Tensor(T.ATTN_Q_NORM, (head_dim,), i)
                yield Tensor(T.ATTN_K_NORM, (head_dim,), i)
            yield Tensor(T.ATTN_OUT, (hidden, heads * head_dim), i)
            if family == "gpt_oss":
                yield Tensor(T.ATTN_OUT, (hidden,), i, bias=True)
                yield Tensor(T.ATTN_SINKS, (heads,), i)
        if family in ("gemma3", "qwen3_5", "gpt_oss"):
            # Qwen3.5's and gpt-oss's post_attention_layernorm is their norm before the MLP.
            yield Tensor(T.ATTN_POST_NORM, (hidden,), i)
        if family == "gemma3":
            yield Tensor(T.FFN_PRE_NORM, (hidden,), i)
        elif family not in ("qwen3_5", "gpt_oss"):
            yield Tensor(T.FFN_NORM, (hidden,), i)
        if family in ("qwen3_moe", "gpt_oss"):
            experts, width = c["num_experts"], c["moe_intermediate_size"]
            yield Tensor(T.FFN_GATE_INP, (experts, hidden), i)
            if family == "gpt_oss":
                yield Tensor(T.FFN_GATE_INP, (experts,), i, bias=True)
            for kind, rows, n_in in (
                (T.FFN_GATE_EXP, width, hidden),
                (T.FFN_UP_EXP, width, hidden),
                (T.FFN_DOWN_EXP, hidden, width),
            ):
                yield Tensor(kind, (experts, rows, n_in), i)
                if family == "gpt_oss":
                    yield Tensor(kind, (experts, rows), i, bias=True)
        else:
            inter = c["intermediate_size"]
            yield Tensor(T.FFN_GATE, (inter, hidden), i)
            yield Tensor(T.FFN_UP, (inter, hidden), i)
            yield Tensor(T.FFN_DOWN, (hidden, inter), i)
        if family == "gemma3":
            yield Tensor(T.FFN_POST_NORM, (hidden,), i)
    # LFM2's final norm is llama.cpp's token_embd_norm.
    yield Tensor(T.TOKEN_EMBD_NORM if family == "lfm2" else T.OUTPUT_NORM, (hidden,))
    if not c["tie_word_embeddings"]:
        yield Tensor(T.OUTPUT, (vocab, hidden))


def _recurrent_tensors(shape: Shape, i: int) -> Iterator[Tensor]:
    """Layer i's Gated DeltaNet (Qwen3.5) or short convolution (LFM2), as llama.cpp stores them: the
    DeltaNet's q, k and v fused in attn_qkv, its output gate z in attn_gate, a kernel [channels, taps]."""
    c = shape.config
    T = MODEL_TENSOR
    hidden = c["hidden_size"]
    if shape.family == "lfm2":
        yield Tensor(T.SHORTCONV_CONV, (hidden, c["conv_L_cache"]), i)
        yield Tensor(T.SHORTCONV_INPROJ, (3 * hidden, hidden), i)
        yield Tensor(T.SHORTCONV_OUTPROJ, (hidden, hidden), i)
        return
    key = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    v_heads = c["linear_num_value_heads"]
    yield Tensor(T.ATTN_QKV, (2 * key + value, hidden), i)
    yield Tensor(T.ATTN_GATE, (value, hidden), i)
    yield Tensor(T.SSM_CONV1D, (2 * key + value, c["linear_conv_kernel_dim"]), i)
    yield Tensor(T.SSM_DT, (v_heads,), i, bias=True)
    yield Tensor(T.SSM_A, (v_heads,), i)
    yield Tensor(T.SSM_BETA, (v_heads, hidden), i)
    yield Tensor(T.SSM_ALPHA, (v_heads, hidden), i)
    yield Tensor(T.SSM_NORM, (c["linear_value_head_dim"],), i)
    yield Tensor(T.SSM_OUT, (hidden, value), i)


def tensor_type(shape: Shape, t: Tensor) -> Q:
    """F32 for vectors, biases, the router and convolution kernels; gpt-oss's MXFP4_MOE mix (experts
    MXFP4, other matrices Q8_0); else the Q4_K_M type."""
    if len(t.shape) == 1 or t.bias or t.kind in _UNQUANTIZED:
        return Q.F32
    if shape.family == "gpt_oss":
        return Q.MXFP4 if len(t.shape) == 3 else Q.Q8_0
    c = shape.config
    tied = bool(c["tie_word_embeddings"])
    attending = attention_layers(shape)
    v_index = (attending.index(t.layer), len(attending)) if t.kind == MODEL_TENSOR.ATTN_V else None
    experts = c.get("num_experts", 0)
    return q4_k_m_type(t.kind, t.shape[-1], t.layer, c["num_hidden_layers"], experts, tied, v_index)


def tensor_data(rng: np.random.Generator, shape: Shape, t: Tensor, kind: Q) -> np.ndarray:
    if t.kind == MODEL_TENSOR.ROPE_FREQS:
        return llama3_rope_freqs(shape.config, int(shape.config["head_dim"]))
    if t.kind == MODEL_TENSOR.SSM_A:
        return -(1 + 15 * rng.random(t.shape)).astype(np.float32)
    if t.kind in (MODEL_TENSOR.SSM_CONV1D, MODEL_TENSOR.SHORTCONV_CONV):
        return (0.3 * rng.standard_normal(t.shape)).astype(np.float32)
    if kind == Q.F32:
        zero = t.bias or t.kind in (MODEL_TENSOR.FFN_GATE_INP, MODEL_TENSOR.ATTN_SINKS)
        return ((0.0 if zero else 1.0) + WEIGHT_STD * rng.standard_normal(t.shape)).astype(np.float32)
    n_in = t.shape[-1]
    blocks = _random_blocks(rng, kind, math.prod(t.shape), _half_values(kind))
    return blocks.reshape(*t.shape[:-1], n_in // gguf.GGML_QUANT_SIZES[kind][0] * blocks.shape[1])


@dataclass(frozen=True)
class Vocabulary:
    """tokenizer.ggml.* of a file: the model ("gpt2" or "llama", sentencepiece), tokens, types, scores
    and merges."""

    model: str
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str]


@functools.cache
def _base_vocabulary(family: str) -> Vocabulary:
    """The default model's tokenizer with the family's specials, before padding. Gemma's is a
    sentencepiece vocabulary, as Gemma's own is: the BPE tokens that spell whole characters, spaces as
    "▁", in merge order (their scores falling with it), after the specials and 256 byte tokens."""
    reader = GGUFReader(default_model_path())
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    merges = list(reader.fields["tokenizer.ggml.merges"].contents())
    specials = SPECIALS[family].tokens
    if family != "gemma3":
        added = [t for t in specials if t not in tokens]
        return Vocabulary("gpt2", tokens + added, types + [int(TokenType.CONTROL)] * len(added), [], merges)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}  # type: ignore[no-untyped-call]
    spm = ["<pad>", *specials, "<unk>"]
    spm_types = [int(TokenType.CONTROL)] * (len(spm) - 1) + [int(TokenType.UNKNOWN)]
    spm += [f"<0x{b:02X}>" for b in range(256)]
    spm_types += [int(TokenType.BYTE)] * 256
    seen = set(spm)
    for token, kind in zip(tokens, types, strict=True):
        try:
            piece = bytes(byte_of[c] for c in token).decode("utf-8").replace(" ", "\u2581")
        except (KeyError, UnicodeDecodeError):
            continue  # a special of the BPE, or part of a character: the byte tokens spell those
        if kind == TokenType.NORMAL and piece not in seen:
            seen.add(piece)
            spm.append(piece)
            spm_types.append(int(TokenType.NORMAL))
    return Vocabulary("llama", spm, spm_types, [-float(i) for i in range(len(spm))], [])


def vocabulary_size(shape: Shape) -> int:
    """The real size, or for a tiny shape (vocab_size 0) the size of the tokenizer itself."""
    return int(shape.config["vocab_size"]) or len(_base_vocabulary(shape.family).tokens)


def add_tokenizer(writer: GGUFWriter, shape: Shape) -> None:
    base = _base_vocabulary(shape.family)
    specials = SPECIALS[shape.family]
    size = vocabulary_size(shape)
    if size < len(base.tokens):
        raise ValueError(f"a vocabulary of {size} cannot hold the {len(base.tokens)} tokens of the tokenizer")
    # Unused tokens up to the real size: normal tokens that nothing merges into, so neither tokenizer
    # emits them (a random model does).
    padding = size - len(base.tokens)
    tokens = base.tokens + [f"<unused{i}>" for i in range(padding)]
    writer.add_tokenizer_model(base.model)
    if base.model == "gpt2":
        writer.add_tokenizer_pre("smollm")
        writer.add_token_merges(base.merges)
    else:
        low = base.scores[-1] if base.scores else 0.0
        writer.add_token_scores(base.scores + [low - 1 - i for i in range(padding)])
        writer.add_add_space_prefix(False)
        writer.add_unk_token_id(tokens.index("<unk>"))
        writer.add_pad_token_id(tokens.index("<pad>"))
    writer.add_token_list(tokens)
    writer.add_token_types(base.types + [TokenType.NORMAL] * padding)
    writer.add_bos_token_id(tokens.index(specials.bos))
    writer.add_eos_token_id(tokens.index(specials.eos))
    writer.add_add_bos_token(specials.add_bos)
    writer.add_add_eos_token(False)
    writer.add_chat_template(specials.template)


def write_family_hparams(writer: GGUFWriter, shape: Shape) -> None:
    """The keys llama.cpp reads for Qwen3.5's DeltaNet layers and partial imrope, and gpt-oss's window
    and YaRN, beside the common ones (`write_hparams`)."""
    c = shape.config
    rope = c["rope_parameters"]
    if shape.family == "qwen3_5":
        k_heads, v_heads = c["linear_num_key_heads"], c["linear_num_value_heads"]
        writer.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(c["linear_key_head_dim"])
        writer.add_ssm_group_count(k_heads)
        writer.add_ssm_time_step_rank(v_heads)
        writer.add_ssm_inner_size(v_heads * c["linear_value_head_dim"])
        writer.add_full_attention_interval(c["layer_types"].index("full_attention") + 1)
        writer.add_rope_dimension_count(int(c["head_dim"] * rope["partial_rotary_factor"]))
        writer.add_rope_dimension_sections([*rope["mrope_section"], 0])
    elif shape.family == "gpt_oss":
        writer.add_sliding_window(c["sliding_window"])
    if shape.family == "gpt_oss" and rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def write_gguf(shape: Shape, path: str, seed: int = 0) -> dict[str, Q]:
    """Write the shape's random-weight Q4_K_M (gpt-oss: MXFP4_MOE) file at `path`, one tensor at a time;
    returns each tensor's type by name."""
    arch = ARCHITECTURES[shape.family]
    writer = GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_vocab_size(vocabulary_size(shape))
    write_hparams(writer, shape.family, shape.config)
    write_family_hparams(writer, shape)
    mixes = gguf.LlamaFileType
    writer.add_file_type(mixes.MOSTLY_MXFP4_MOE if shape.family == "gpt_oss" else mixes.MOSTLY_Q4_K_M)
    add_tokenizer(writer, shape)
    layout = [(t, tensor_type(shape, t)) for t in tensors(shape)]
    for t, kind in layout:
        if t.kind not in gguf.MODEL_TENSORS[arch]:
            raise ValueError(f"{gguf.MODEL_ARCH_NAMES[arch]} has no tensor {t.name()}")
        if kind == Q.F32:
            writer.add_tensor_info(t.name(), t.shape, np.dtype(np.float32), 4 * math.prod(t.shape))
        else:
            nbytes = math.prod(t.shape) // gguf.GGML_QUANT_SIZES[kind][0] * gguf.GGML_QUANT_SIZES[kind][1]
            byte_shape = (*t.shape[:-1], nbytes // math.prod(t.shape[:-1]))
            writer.add_tensor_info(t.name(), byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for t, kind in layout:
        writer.write_tensor_data(tensor_data(rng, shape, t, kind))
    writer.close()
    return {t.name(): kind for t, kind in layout}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("name", choices=sorted(SHAPES))
    parser.add_argument("out", help="the GGUF file to write")
    parser.add_argument("--tiny", action="store_true", help="the shape's tiny version (the test's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = SHAPES[args.name].tiny() if args.tiny else SHAPES[args.name]
    types = write_gguf(shape, args.out, args.seed)
    counts: dict[str, int] = {}
    for kind in types.values():
        counts[kind.name] = counts.get(kind.name, 0) + 1
    print(
        f"{args.out}: {args.name}, {len(types)} tensors: "
        + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    )


if __name__ == "__main__":
    main()
