"""A GGUF's tokenizer and chat template, from its `tokenizer.*` metadata.

transformers builds the tokenizer from a GGUF's metadata; it is handed a small GGUF of the tokenizer's
fields alone (written from the values this file's checks have read, under the architecture transformers
reads them as: `Family.gguf_tokenizer_as`, or the file's own), never the model file. The result is saved
once as a tokenizer folder (a few megabytes, no weights) in the cache under a hash of those fields, the
architecture and transformers' version: every file with the same tokenizer shares it, a changed
tokenizer gets its own, and later starts load the folder.
"""

import hashlib
import os
import tempfile
from typing import Any

from kvserve.errors import ModelLoadError
from kvserve.model.gguf_file import ARRAY, GgufFile

# The folder's content; a new version builds every tokenizer again.
_FORMAT_VERSION = "1"
# transformers' model types of the GGUF architectures whose names differ (its load_gguf_checkpoint).
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
TEMPLATE_KEY = "tokenizer.chat_template"


def tokenizer_dir(file: GgufFile, architecture: str, cache_dir: str) -> str:
    """The tokenizer folder of `file`'s tokenizer metadata read as `architecture`, built if the cache
    has none."""
    import transformers

    fields = sorted(k for k in file.fields if k.startswith("tokenizer."))
    digest = hashlib.sha256(f"{_FORMAT_VERSION}|{architecture}|{transformers.__version__}|".encode())
    for key in fields:
        digest.update(file.raw(file.fields[key]))
    target = os.path.join(cache_dir, "tokenizers", digest.hexdigest()[:32])
    if os.path.isfile(os.path.join(target, "tokenizer_config.json")):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".building-", dir=os.path.dirname(target)) as tmp:
        _build(file, fields, architecture, tmp)
        try:
            os.replace(os.path.join(tmp, "tokenizer"), target)
        except OSError:
            # Another process built the same tokenizer first; its folder is as good as ours.
            if not os.path.isfile(os.path.join(target, "tokenizer_config.json")):
                raise
    return target


def tokenizer_class(architecture: str) -> Any:
    """The tokenizer class transformers' AutoTokenizer takes for a GGUF of `architecture`: the class of the
    model type transformers names the architecture by, or the plain tokenizers backend. Named here
    because AutoTokenizer first reads the whole file again into a model config to find it (through the
    gguf package's reader: 10 of the 12 s a first start took for the default model's tokenizer)."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    model_type = _MODEL_TYPES.get(architecture, architecture)
    return tokenizer_class_from_name(TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend")


def _build(file: GgufFile, fields: list[str], architecture: str, tmp: str) -> None:
    """Write the tokenizer folder of `fields` into `tmp`/tokenizer."""
    import gguf

    try:
        writer = gguf.GGUFWriter(os.path.join(tmp, "tokenizer.gguf"), architecture)
        for key in fields:
            f = file.fields[key]
            sub = gguf.GGUFValueType(f.item_type) if f.type == ARRAY else None
            writer.add_key_value(key, file.value(key), gguf.GGUFValueType(f.type), sub_type=sub)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tok = tokenizer_class(architecture).from_pretrained(tmp, gguf_file="tokenizer.gguf")
    except (ModelLoadError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        # Whatever the metadata makes the builders raise, the tokenizers library's panics included
        # (BaseExceptions).
        raise ModelLoadError(file.path, f"the tokenizer in the GGUF metadata cannot be read ({e})") from None
    template = file.value(TEMPLATE_KEY)
    if isinstance(template, str) and not tok.chat_template:
        tok.chat_template = template
    tok.save_pretrained(os.path.join(tmp, "tokenizer"))
