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
from kvserve.model.families import family_for_gguf
from kvserve.model.families.base import Family, GgufMetadata
from kvserve.model.quant_blocks import BLOCK_SIZES, QuantizedWeight, row_unit

# The converted folder's content; a new version converts every file again. 2: the families beyond
# Llama and Qwen2, with their tensors in Hugging Face's conventions.
_FORMAT_VERSION = "2"


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

    meta = GgufMetadata(reader)
    try:
        family = family_for_gguf(meta.arch)
        assert family.gguf_config is not None
        config = family.gguf_config(meta)
    except ValueError as e:
        raise ModelLoadError(gguf_path, str(e)) from None
    n_head = int(config["num_attention_heads"])
    n_kv = int(config["num_key_value_heads"])
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(family, t.name)
        if name is None:
            continue
        try:
            w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except Exception as e:
            raise ModelLoadError(gguf_path, f"tensor {t.name} cannot be dequantized ({e})") from None
        if family.gguf_permuted_qk and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _unpermute(w, n_head if "attn_q" in t.name else n_kv)
        if family.norm_offset and name.endswith("norm.weight"):
            # llama.cpp stores (offset + w); the folder keeps the checkpoint's w, as transformers reads it.
            w = (w.astype(np.float64) - family.norm_offset).astype(np.float32)
        try:
            tensors.update(_per_expert(name, w))
        except ValueError as e:
            raise ModelLoadError(gguf_path, f"tensor {t.name}: {e}") from None
    if "model.embed_tokens.weight" not in tensors:
        raise ModelLoadError(gguf_path, "no token_embd.weight tensor: the file is incomplete")
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _convert_tokenizer(gguf_path, out_dir, reader, family)


def quantized_tensors(gguf_path: str) -> dict[str, QuantizedWeight]:
    """The file's weight matrices in block types the native kernel reads, by Hugging Face name, as the
    file's own bytes (q and k rows put back in Hugging Face order, as the conversion does)."""
    import gguf

    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:
        raise ModelLoadError(gguf_path, f"not a readable GGUF file ({e})") from None
    meta = GgufMetadata(reader)
    try:
        family = family_for_gguf(meta.arch)
    except ValueError as e:
        raise ModelLoadError(gguf_path, str(e)) from None
    heads = {}
    for key in ("head_count", "head_count_kv"):
        value = meta.get(f"{{arch}}.attention.{key}")
        if value is not None:
            heads[key] = int(value)
    out: dict[str, QuantizedWeight] = {}
    for t in reader.tensors:
        name = _hf_name(family, t.name)
        qtype = int(t.tensor_type)
        if name is None or qtype not in BLOCK_SIZES:
            continue
        # A matrix, or one per expert ([experts, rows, in]: the conversion refuses other shapes).
        if len(t.shape) != (3 if "{expert}" in name else 2):
            continue
        n_in, n_out = int(t.shape[0]), int(t.shape[1])
        if n_in % row_unit(qtype):
            continue
        raw = np.frombuffer(np.ascontiguousarray(t.data).tobytes(), dtype=np.uint8)
        rows = raw.reshape(n_out, -1) if len(t.shape) == 2 else raw.reshape(int(t.shape[2]), n_out, -1)
        if family.gguf_permuted_qk and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            n_head = heads.get("head_count", 0)
            rows = _unpermute(rows, n_head if "attn_q" in t.name else heads.get("head_count_kv", n_head))
        for part_name, part in _per_expert(name, rows):
            out[part_name] = QuantizedWeight(qtype, torch.from_numpy(np.array(part)), n_in)
    return out


def _per_expert(name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """`w` under its Hugging Face `name`; where the name holds `{expert}` (llama.cpp's 3-D `ffn_*_exps`:
    [experts, rows, in]), one matrix per expert under the checkpoint's per-expert names."""
    if "{expert}" not in name:
        return [(name, w)]
    if w.ndim != 3:
        raise ValueError(f"a tensor of experts needs 3 dimensions [experts, rows, in], not {w.ndim}")
    return [(name.format(expert=e), np.ascontiguousarray(w[e])) for e in range(w.shape[0])]


def copy_tokenizer_fields(reader: Any, writer: Any) -> None:
    """Copy every `tokenizer.*` field of a GGUFReader's file into a GGUFWriter."""
    from gguf import GGUFValueType

    for f in reader.fields.values():
        if f.name.startswith("tokenizer."):
            kind = f.types[0]
            sub = f.types[-1] if kind == GGUFValueType.ARRAY else None
            writer.add_key_value(f.name, f.contents(), kind, sub_type=sub)


def _convert_tokenizer(gguf_path: str, out_dir: str, reader: Any, family: Family) -> None:
    """The tokenizer files from the GGUF's tokenizer metadata, read by transformers. A family whose
    architecture transformers does not read is read as `family.gguf_tokenizer_as`, from a copy of the
    tokenizer fields alone."""
    import gguf
    from transformers import AutoTokenizer

    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    with tempfile.TemporaryDirectory(prefix=".tokenizer-", dir=out_dir) as tmp:
        if family.gguf_tokenizer_as:
            folder, name = tmp, "tokenizer.gguf"
            writer = gguf.GGUFWriter(os.path.join(folder, name), family.gguf_tokenizer_as)
            copy_tokenizer_fields(reader, writer)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
        try:
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except Exception as e:
            raise ModelLoadError(
                gguf_path, f"the tokenizer in the GGUF metadata cannot be read ({e})"
            ) from None
    chat_template = GgufMetadata(reader).get("tokenizer.chat_template")
    if chat_template and not tok.chat_template:
        tok.chat_template = chat_template
    tok.save_pretrained(out_dir)


def _hf_name(family: Family, gguf_name: str) -> str | None:
    if gguf_name in family.gguf_global:
        return family.gguf_global[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in family.gguf_layer:
        return f"model.layers.{parts[1]}.{family.gguf_layer[parts[2]]}"
    return None
