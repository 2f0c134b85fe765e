"""Convert a GGUF file into a Hugging Face style folder (config.json, model.safetensors, tokenizer files).

The folder lives in the cache directory under the SHA-256 of the source file, so a changed source file
never reuses a stale conversion, and later startups load float32 safetensors by mmap instead of
dequantizing again.
"""

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np
import torch

from kvserve.errors import ModelLoadError
from kvserve.model.quant_blocks import BLOCK_BYTES, K_QUANTS, QK, QK_K, QuantizedWeight, from_k_quant

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_FORMAT_VERSION = "1"


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def converted_dir(gguf_path: str, cache_dir: str) -> str:
    """Return the HF-style folder for `gguf_path`, converting it first if the cache has no copy."""
    if not os.path.isfile(gguf_path):
        raise ModelLoadError(gguf_path, "file not found")
    key = file_sha256(gguf_path)[:24]
    target = os.path.join(cache_dir, "gguf", f"{key}-v{_FORMAT_VERSION}")
    if os.path.isfile(os.path.join(target, "model.safetensors")):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=os.path.dirname(target))
    try:
        _convert(gguf_path, tmp)
        with open(os.path.join(tmp, "source.json"), "w") as f:
            json.dump({"source": os.path.abspath(gguf_path), "sha256_prefix": key}, f)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process converted the same file first; its copy is as good as ours.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its rotary kernel; restore the Hugging Face order."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _convert(gguf_path: str, out_dir: str) -> None:
    import gguf
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:
        raise ModelLoadError(gguf_path, f"not a readable GGUF file ({e})") from None

    def field(name: str, default: Any = None) -> Any:
        f = reader.fields.get(name)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in _HF_ARCHITECTURES:
        raise ModelLoadError(gguf_path, f"unsupported GGUF architecture {arch!r}; supported: llama, qwen2")
    n_head = int(field(f"{arch}.attention.head_count"))
    n_kv = int(field(f"{arch}.attention.head_count_kv", n_head))
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        try:
            w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except Exception as e:
            raise ModelLoadError(gguf_path, f"tensor {t.name} cannot be dequantized ({e})") from None
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _unpermute(w, n_head if "attn_q" in t.name else n_kv)
        tensors[name] = w
    if "model.embed_tokens.weight" not in tensors:
        raise ModelLoadError(gguf_path, "no token_embd.weight tensor: the file is incomplete")
    tokens = field("tokenizer.ggml.tokens") or []
    config = {
        "architectures": [_HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(field(f"{arch}.vocab_size", len(tokens))),
        "hidden_size": int(field(f"{arch}.embedding_length")),
        "intermediate_size": int(field(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(field(f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(field(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if field(f"{arch}.rope.scaling.type") == "linear":
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(field(f"{arch}.rope.scaling.factor")),
        }
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _convert_tokenizer(gguf_path, out_dir, field("tokenizer.chat_template"))


def quantized_tensors(gguf_path: str) -> dict[str, QuantizedWeight]:
    """The file's weight matrices in block types the native kernel reads, by Hugging Face name, as the
    file's own bytes (q and k rows put back in Hugging Face order, as the conversion does); K-quants
    converted to K8 blocks of the same values."""
    import gguf

    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:
        raise ModelLoadError(gguf_path, f"not a readable GGUF file ({e})") from None
    arch_field = reader.fields.get("general.architecture")
    arch = None if arch_field is None else arch_field.contents()
    heads = {}
    for key in ("head_count", "head_count_kv"):
        f = reader.fields.get(f"{arch}.attention.{key}")
        if f is not None:
            heads[key] = int(f.contents())
    out: dict[str, QuantizedWeight] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        qtype = int(t.tensor_type)
        if name is None or qtype not in (*BLOCK_BYTES, *K_QUANTS) or len(t.shape) != 2:
            continue
        n_in, n_out = int(t.shape[0]), int(t.shape[1])
        if n_in % (QK_K if qtype in K_QUANTS else QK):
            continue
        rows = np.frombuffer(np.ascontiguousarray(t.data).tobytes(), dtype=np.uint8).reshape(n_out, -1)
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            n_head = heads.get("head_count", 0)
            rows = _unpermute(rows, n_head if "attn_q" in t.name else heads.get("head_count_kv", n_head))
        if qtype in K_QUANTS:
            out[name] = from_k_quant(rows, qtype, n_in)
        else:
            out[name] = QuantizedWeight(qtype, torch.from_numpy(np.array(rows)), n_in)
    return out


def _convert_tokenizer(gguf_path: str, out_dir: str, chat_template: str | None) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    except Exception as e:
        raise ModelLoadError(gguf_path, f"the tokenizer in the GGUF metadata cannot be read ({e})") from None
    if chat_template and not tok.chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(out_dir)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None
