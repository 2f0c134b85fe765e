"""The derived tokenizer file of a GGUF: its tokenizer as the Rust tokenizers library serializes it, and
the specials transformers adds (`TokenizerSpecials`), written once, so that later starts parse one file
in Rust and never import transformers (which took 2.5 s of a 262k-token Gemma 3's start).

The file sits in the tokenizer folder that the metadata makes (model/gguf_tokenizer.py), which is named by
a hash of the metadata's tokenizer fields: its key is that name, the model type the folder is read as and
the tokenizers library's version. It is hostile input like any file: a line with the SHA-256 of the rest,
a line of JSON (the format, the key, the specials), then the serialized tokenizer. One that is truncated,
altered, of another format or key, or holding values of the wrong types or out of bounds is rebuilt from
the folder (a warning says why), never used; it is written under a temporary name and moved into place
whole.
"""

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import tokenizers
from tokenizers import Tokenizer as RustTokenizer

from kvserve.model.spec import MAX_VOCAB_SIZE
from kvserve.model.tokenizer import Tokenizer, TokenizerSpecials

log = logging.getLogger("kvserve.model")

FILE_NAME = "kvserve-tokenizer"
# The file's layout; a new one rebuilds every file.
FORMAT = 1
# What the file may hold: the tokenizer folder's own bound (gguf_tokenizer.MAX_TOKENIZER_BYTES) grows
# about fourfold as JSON.
MAX_FILE_BYTES = 256 << 20


class DamagedCache(ValueError):
    """The derived file is not one this key wrote."""


def cached_tokenizer(
    folder: str, key: str, build: Callable[[], Tokenizer]
) -> tuple[RustTokenizer, TokenizerSpecials]:
    """The tokenizer of `folder` under `key`: read from the derived file, else `build()` (transformers)
    and written there. The tokenizers library's version is part of the key: another one may read the
    serialization otherwise."""
    key = f"{key}|tokenizers {tokenizers.__version__}"
    path = os.path.join(folder, FILE_NAME)
    try:
        return read(path, key)
    except FileNotFoundError:
        pass
    except (DamagedCache, OSError) as e:
        log.warning("the tokenizer file %s is damaged (%s); building it again", path, e)
    tokenizer = build()
    try:
        write(path, key, tokenizer.backend, tokenizer.specials)
    except OSError as e:
        # A cache it cannot write to costs the next start a build, nothing else.
        log.warning("the tokenizer file %s cannot be written (%s)", path, e)
    return tokenizer.backend, tokenizer.specials


def write(path: str, key: str, backend: RustTokenizer, specials: TokenizerSpecials) -> None:
    head = json.dumps({"format": FORMAT, "key": key, "specials": _specials_json(specials)}).encode()
    body = head + b"\n" + str(backend.to_str()).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{FILE_NAME}-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read(path: str, key: str) -> tuple[RustTokenizer, TokenizerSpecials]:
    """The tokenizer the file at `path` holds under `key`; DamagedCache where it holds no such thing."""
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise DamagedCache(f"more than {MAX_FILE_BYTES} bytes")
    digest, _, body = data.partition(b"\n")
    if digest != hashlib.sha256(body).hexdigest().encode():
        raise DamagedCache("its checksum does not match its content")
    head_bytes, _, serialized = body.partition(b"\n")
    try:
        head = json.loads(head_bytes)
    except ValueError as e:
        raise DamagedCache(f"its header is not JSON ({e})") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("key") != key:
        raise DamagedCache("it is of another format or tokenizer")
    specials = _specials(head.get("specials"))
    try:
        backend = RustTokenizer.from_str(serialized.decode())
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        # The tokenizers library's panics are BaseExceptions.
        raise DamagedCache(f"the tokenizer does not parse ({e})") from None
    if backend.get_vocab_size(with_added_tokens=True) > specials.vocab_size:
        raise DamagedCache("the tokenizer holds more tokens than its header says")
    return backend, specials


def _specials_json(s: TokenizerSpecials) -> dict[str, Any]:
    return {
        "eos_token_id": s.eos_token_id,
        "vocab_size": s.vocab_size,
        "special_tokens_map": dict(s.special_tokens_map),
        "all_special_tokens": list(s.all_special_tokens),
        "chat_template": dict(s.chat_template) if isinstance(s.chat_template, Mapping) else s.chat_template,
        "max_token_chars": s.max_token_chars,
    }


def _specials(raw: object) -> TokenizerSpecials:
    """The specials a header holds, each of its type and within bounds."""
    if not isinstance(raw, dict):
        raise DamagedCache("its header holds no specials")
    vocab, eos, chars = raw.get("vocab_size"), raw.get("eos_token_id"), raw.get("max_token_chars")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 0 < vocab <= MAX_VOCAB_SIZE:
        raise DamagedCache("its vocabulary size is out of bounds")
    if eos is not None and (not isinstance(eos, int) or isinstance(eos, bool) or not 0 <= eos < vocab):
        raise DamagedCache("its eos id is out of bounds")
    if not isinstance(chars, int) or isinstance(chars, bool) or chars < 1:
        raise DamagedCache("its longest token is out of bounds")
    names = raw.get("special_tokens_map")
    if not isinstance(names, dict) or not all(_is_str_or_strs(v) for v in names.values()):
        raise DamagedCache("its special tokens by name are not strings")
    every = raw.get("all_special_tokens")
    if not isinstance(every, list) or not all(isinstance(t, str) for t in every):
        raise DamagedCache("its special tokens are not strings")
    template = raw.get("chat_template")
    if not (
        template is None
        or isinstance(template, str)
        or (isinstance(template, dict) and all(isinstance(v, str) for v in template.values()))
    ):
        raise DamagedCache("its chat template is not a string")
    return TokenizerSpecials(eos, vocab, names, tuple(every), template, chars)


def _is_str_or_strs(value: object) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(t, str) for t in value))
