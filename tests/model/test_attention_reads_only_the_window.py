"""A sliding-window layer's attention, on either backend, equals attention over each token's window and
never reads a block wholly before it: those blocks hold NaNs here, which any read would spread."""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import default_cache_dir
from kvserve.model.attention import AttentionBackend
from kvserve.model.native_attention import NativeAttention, PagedAttentionKernel
from kvserve.model.torch_attention import TorchAttention

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class Chunk:
    token_ids: list[int]
    start: int
    block_table: list[int]


def _backend(name: str, block_size: int, group: int) -> AttentionBackend:
    if name == "torch":
        return TorchAttention(block_size, group, torch.device("cpu"))
    kernel = PagedAttentionKernel.load(default_cache_dir(), torch.device("cpu"), torch.float64)
    return NativeAttention(kernel, block_size)


@settings(max_examples=60, deadline=None)
@given(
    backend=st.sampled_from(["torch", "native"]),
    block_size=st.sampled_from([1, 2, 4, 16]),
    window=st.sampled_from([1, 2, 3, 5, 16, 40]),
    length=st.integers(1, 120),
    chunk=st.integers(1, 9),
    heads=st.sampled_from([(2, 1), (4, 2), (3, 3)]),
    seed=st.integers(0, 2**16),
)
def test_a_window_reads_only_its_own_blocks(
    backend: str, block_size: int, window: int, length: int, chunk: int, heads: tuple[int, int], seed: int
) -> None:
    """One sequence of `length` positions whose last `chunk` tokens are this step's (a decode when
    `chunk` is 1, else a chunk after cached context): every block wholly before the window of the
    step's first token points at a block of NaNs."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, dim = heads[0], heads[1], 8
    chunk = min(chunk, length)
    start = length - chunk
    width = -(-length // block_size)
    slots = (width + 1) * block_size
    k_cache = torch.randn(slots, hkv, dim, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(slots, hkv, dim, generator=gen, dtype=torch.float64)
    k_cache[width * block_size :] = v_cache[width * block_size :] = float("nan")
    table = list(range(width))
    for b in range(max(0, start - window + 1) // block_size):
        table[b] = width
    attend = _backend(backend, block_size, hq // hkv)
    step = Chunk([0] * chunk, start, table)
    meta = attend.prepare([step], []) if chunk == 1 and start else attend.prepare([], [step])
    slot = [table[p // block_size] * block_size + p % block_size for p in range(start, length)]
    # The step writes its own K/V first: the values already there, so the cache stays as drawn.
    q = torch.randn(chunk, hq, dim, generator=gen, dtype=torch.float64)
    out = attend.forward(q, k_cache[slot], v_cache[slot], k_cache, v_cache, meta, dim**-0.5, window)
    for i, p in enumerate(range(start, length)):
        keys = [
            table[j // block_size] * block_size + j % block_size for j in range(max(0, p - window + 1), p + 1)
        ]
        k = k_cache[keys].transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        v = v_cache[keys].transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        want = F.scaled_dot_product_attention(q[i].unsqueeze(1), k, v, scale=dim**-0.5).squeeze(1)
        torch.testing.assert_close(out[i], want, atol=1e-10, rtol=1e-10)
