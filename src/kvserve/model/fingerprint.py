"""The model fingerprint: what KV computed by one model and setting must never be read by another."""

import hashlib

import torch

from kvserve.model.loader import LoadedModel


def model_fingerprint(
    model: LoadedModel, weight_dtype: str, decode_activations: str, block_size: int, kv_dtype: str
) -> bytes:
    """A digest of the weights (names, shapes, dtypes, bytes), the architecture, the weight precision,
    the decode rows' activations, the block size and the KV dtype: any change to one of them changes
    every cache key.

    Hashes every weight byte (about a second for a 135M-parameter model), because two checkpoints with
    the same config would otherwise share keys and serve each other's KV.
    """
    h = hashlib.blake2b(digest_size=32)
    h.update(repr(model.config).encode())
    h.update(f"|{weight_dtype}|{decode_activations}|{block_size}|{kv_dtype}|".encode())
    for name in sorted(model.weights):
        tensor = model.weights[name].detach().contiguous().cpu()
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        h.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()
