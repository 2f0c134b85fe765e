"""The model fingerprint: what KV computed by one model and setting must never be read by another."""

import hashlib
import os

import torch

from kvserve.model.gguf_weights import GgufWeights
from kvserve.model.loader import LoadedModel

# What a GGUF's bytes mean to kvserve's loader; a new version gives every GGUF model new keys.
_GGUF_READING = b"gguf-in-place-1"


def model_fingerprint(
    model: LoadedModel,
    weight_dtype: str,
    activations: str,
    block_size: int,
    kv_dtype: str,
    cache_dir: str | None = None,
) -> bytes:
    """A digest of the weights, the architecture, the weight precision, the products' activations,
    the block size and the KV dtype: any change to one of them changes every cache key.

    The weights, because two checkpoints with the same config would otherwise share keys and serve each
    other's KV: a GGUF's file bytes (its metadata and its tensors as stored; `file_digest`, recorded in
    `cache_dir` where given); a folder's tensors (names, shapes, dtypes, bytes; about a second for a
    135M-parameter model).
    """
    h = hashlib.blake2b(digest_size=32)
    h.update(repr(model.config).encode())
    h.update(f"|{weight_dtype}|{activations}|{block_size}|{kv_dtype}|".encode())
    if isinstance(model.weights, GgufWeights):
        h.update(_GGUF_READING)
        h.update(file_digest(model.weights.file.path, cache_dir))
        return h.digest()
    for name in sorted(model.weights):
        tensor = model.weights[name].detach().contiguous().cpu()
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


def file_digest(path: str, cache_dir: str | None = None) -> bytes:
    """blake2b of the file's bytes (seconds for a large model: docs/benchmarks.md). With `cache_dir`,
    recorded there under the file's identity and state (real path, device, inode, size, modification and
    change times): a later start reads the record instead. Any write to the file, or resetting its
    modification time, changes its change time (which no call sets back), so a changed file is hashed
    again."""
    before = _identity(path)
    record = None
    if cache_dir is not None:
        name = hashlib.sha256(before.encode()).hexdigest()[:32]
        record = os.path.join(cache_dir, "fingerprints", name)
        try:
            with open(record) as f:
                recorded = bytes.fromhex(f.read(64))
            if len(recorded) == 32:
                return recorded
        except (OSError, ValueError):
            pass
    digest = _hash_file(path)
    if record is not None and _identity(path) == before:
        _write_record(record, digest.hex())
    return digest


def _identity(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.realpath(path)}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def _hash_file(path: str) -> bytes:
    """Read through the page cache, not the model's mapping (whose pages would stay resident)."""
    h = hashlib.blake2b(digest_size=32)
    view = memoryview(bytearray(1 << 22))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.digest()


def _write_record(record: str, text: str) -> None:
    """Best effort: a cache that cannot be written means hashing again next time."""
    try:
        os.makedirs(os.path.dirname(record), exist_ok=True)
        tmp = f"{record}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, record)
    except OSError:
        pass
