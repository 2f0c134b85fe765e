"""A GGUF's tokenizer and chat template, from its `tokenizer.*` metadata.

transformers builds the tokenizer from a GGUF's metadata; it is handed a small GGUF of the tokenizer's
fields alone (written from the values this file's checks have read, under the architecture transformers
reads them as: `Family.gguf_tokenizer_as`, or the file's own), never the model file. The result is saved
once as a tokenizer folder (a few megabytes, no weights) in the cache under a hash of those fields, the
architecture and transformers' version: every file with the same tokenizer shares it, a changed
tokenizer gets its own, and later starts load the folder.

The metadata is hostile input: its token and merge counts and its bytes are bounded before transformers
reads any of it (conversion costs about 2.5 kB a token: 2M extra tokens took it past 5 GB). A folder is
built under `.building-{pid}-*` and moved into place whole; one that a killed process left is removed
by the next build's sweep.
"""

import hashlib
import os
import shutil
import tempfile
import time
from importlib.metadata import version
from typing import Any

from kvserve.errors import ModelLoadError
from kvserve.model.gguf_file import ARRAY, GgufFile
from kvserve.model.spec import MAX_VOCAB_SIZE

# The folder's content; a new version builds every tokenizer again.
_FORMAT_VERSION = "1"
# transformers' model types of the GGUF architectures whose names differ (its load_gguf_checkpoint).
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
TEMPLATE_KEY = "tokenizer.chat_template"
# Bounds of the tokenizer metadata, above any released model's (Llama 3: 128,256 tokens and 280,147
# merges in about 8 MB; Gemma 3: 262,208 tokens).
MAX_MERGES = 1 << 20
MAX_TOKENIZER_BYTES = 64 << 20
# A build folder is stale once its process is gone and it is older than this (a process of another pid
# namespace may share the cache), or older than STALE_ANY_S whoever made it (pids are reused; older
# kvserve versions named none, in `.converting-*` folders).
STALE_ORPHAN_S = 60.0
STALE_ANY_S = 86400.0
_BUILDING = ".building-"
_LEGACY_BUILDING = ".converting-"


def tokenizer_dir(file: GgufFile, architecture: str, cache_dir: str) -> str:
    """The tokenizer folder of `file`'s tokenizer metadata read as `architecture`, built if the cache
    has none."""
    sweep_stale_builds(os.path.join(cache_dir, "tokenizers"))
    # Where older kvserve versions built their float32 conversions of a GGUF.
    sweep_stale_builds(os.path.join(cache_dir, "gguf"))
    fields = sorted(k for k in file.fields if k.startswith("tokenizer."))
    _check_bounds(file, fields)
    digest = hashlib.sha256(f"{_FORMAT_VERSION}|{architecture}|{version('transformers')}|".encode())
    for key in fields:
        digest.update(file.raw(file.fields[key]))
    target = os.path.join(cache_dir, "tokenizers", digest.hexdigest()[:32])
    if os.path.isfile(os.path.join(target, "tokenizer_config.json")):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    prefix = f"{_BUILDING}{os.getpid()}-"
    with tempfile.TemporaryDirectory(prefix=prefix, dir=os.path.dirname(target)) as tmp:
        _build(file, fields, architecture, tmp)
        try:
            os.replace(os.path.join(tmp, "tokenizer"), target)
        except OSError:
            # Another process built the same tokenizer first; its folder is as good as ours.
            if not os.path.isfile(os.path.join(target, "tokenizer_config.json")):
                raise
    return target


def _check_bounds(file: GgufFile, fields: list[str]) -> None:
    """The tokenizer metadata is within MAX_VOCAB_SIZE tokens, MAX_MERGES merges and MAX_TOKENIZER_BYTES."""
    for key, most in (("tokenizer.ggml.tokens", MAX_VOCAB_SIZE), ("tokenizer.ggml.merges", MAX_MERGES)):
        f = file.fields.get(key)
        if f is not None and f.count > most:
            raise ModelLoadError(file.path, f"{key} holds {f.count} entries; kvserve reads at most {most}")
    size = sum(file.fields[key].end - file.fields[key].start for key in fields)
    if size > MAX_TOKENIZER_BYTES:
        most = MAX_TOKENIZER_BYTES
        raise ModelLoadError(
            file.path, f"the tokenizer metadata takes {size} bytes; kvserve reads at most {most}"
        )


def sweep_stale_builds(folder: str) -> None:
    """Remove the build folders in `folder` that no build will finish (see STALE_ORPHAN_S)."""
    try:
        names = [n for n in os.listdir(folder) if n.startswith((_BUILDING, _LEGACY_BUILDING))]
    except OSError:
        return
    now = time.time()
    for name in names:
        path = os.path.join(folder, name)
        try:
            age = now - os.stat(path).st_mtime
        except OSError:
            continue
        if age > STALE_ANY_S or (age > STALE_ORPHAN_S and not _owner_runs(name)):
            shutil.rmtree(path, ignore_errors=True)


def _owner_runs(name: str) -> bool:
    """Whether the process a build folder's name holds runs (False where the name holds none)."""
    pid = name.removeprefix(_BUILDING).split("-", 1)[0] if name.startswith(_BUILDING) else ""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        # Another user's process.
        return True
    return True


def tokenizer_class(architecture: str) -> Any:
    """The tokenizer class transformers' AutoTokenizer takes for a GGUF of `architecture`: the class of the
    model type transformers names the architecture by, or the plain tokenizers backend. Named here
    because AutoTokenizer first reads the whole file again into a model config to find it (through the
    gguf package's reader: most of a first start's time, docs/benchmarks.md)."""
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
