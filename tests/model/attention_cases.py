"""Random attention cases (rows over paged context) and the SDPA reference each is checked against."""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st


@dataclass
class Case:
    heads: int
    kv_heads: int
    dim: int
    block_size: int
    lens: list[int]
    # Leading positions whose blocks every row shares (a cached prefix), cut to whole blocks.
    shared: int
    seed: int
    # A sliding window (0: none): a row of length n attends to positions [n - window, n) only.
    window: int = 0


def window_start(n: int, window: int) -> int:
    return max(0, n - window) if window else 0


@st.composite
def cases(draw: st.DrawFn) -> Case:
    # Groups of 5 and 8 query heads per KV head take the vector path's heads four at a time.
    heads, kv_heads = draw(st.sampled_from([(1, 1), (4, 2), (6, 3), (9, 3), (4, 4), (5, 1), (8, 1)]))
    return Case(
        heads=heads,
        kv_heads=kv_heads,
        # 64, 128 and 256 take the float rows' vector path (by heads, eight positions at a time), the rest
        # the generic one.
        dim=draw(st.sampled_from([4, 8, 64, 128, 256])),
        block_size=draw(st.sampled_from([1, 2, 4, 16])),
        # Past 128 positions the vector path splits a row into chunks and merges their partials.
        lens=draw(st.lists(st.integers(1, 70) | st.integers(120, 400), min_size=1, max_size=6)),
        # Rows that share a chunk's whole blocks are computed in one task.
        shared=draw(st.sampled_from([0, 0, 200, 400])),
        seed=draw(st.integers(0, 2**16)),
        # Windows inside one block, of one block, of several blocks and of several vector-path chunks.
        window=draw(st.sampled_from([0, 0, 0, 1, 2, 3, 16, 37, 130, 300])),
    )


def inputs(case: Case, dtype: torch.dtype) -> dict[str, Any]:
    """Random caches, each row's blocks scattered over the pool in random order (the first `shared`
    positions' blocks the same for every row), and queries that are a strided view (as the model's q is,
    beside k in one tensor). With a window, a row's blocks wholly before it point at a block of NaNs
    (the last one): a kernel that read them would give NaN."""
    gen = torch.Generator().manual_seed(case.seed)
    bs = case.block_size
    widths = [-(-n // bs) for n in case.lens]
    common = case.shared // bs
    num_blocks = sum(widths) + common + 3
    slots = num_blocks * bs
    k_cache = torch.randn(slots + bs, case.kv_heads, case.dim, generator=gen, dtype=dtype)
    v_cache = torch.randn(slots + bs, case.kv_heads, case.dim, generator=gen, dtype=dtype)
    k_cache[slots:] = v_cache[slots:] = float("nan")
    order = torch.randperm(num_blocks, generator=gen).tolist()
    prefix = [order.pop() for _ in range(common)]
    tables = torch.zeros(len(case.lens), max(widths), dtype=torch.long)
    for r, width in enumerate(widths):
        own = [order.pop() for _ in range(max(0, width - common))]
        tables[r, :width] = torch.tensor((prefix + own)[:width])
        tables[r, : window_start(case.lens[r], case.window) // bs] = num_blocks
    qk = torch.randn(len(case.lens), case.heads + case.kv_heads, case.dim, generator=gen, dtype=dtype)
    return {
        "q": qk[:, : case.heads],
        "k_cache": k_cache,
        "v_cache": v_cache,
        "tables": tables,
        "lens": torch.tensor(case.lens, dtype=torch.long),
        "block_size": bs,
        "scale": case.dim**-0.5,
        "window": case.window or None,
    }


def reference(args: dict[str, Any], case: Case, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's attention in float64 over its gathered context; with `sinks` [heads], each head's sink
    logit joins the softmax's denominator (gpt-oss)."""
    bs, group = case.block_size, case.heads // case.kv_heads
    rows = []
    for r, n in enumerate(case.lens):
        first = window_start(n, case.window)
        slots = torch.tensor([int(args["tables"][r, p // bs]) * bs + p % bs for p in range(first, n)])
        k = args["k_cache"][slots].double().transpose(0, 1).repeat_interleave(group, dim=0)
        v = args["v_cache"][slots].double().transpose(0, 1).repeat_interleave(group, dim=0)
        q = args["q"][r].double().unsqueeze(1)
        if sinks is None:
            rows.append(F.scaled_dot_product_attention(q, k, v, scale=args["scale"]).squeeze(1))
            continue
        scores = torch.cat([(q @ k.transpose(1, 2)) * args["scale"], sinks.double().view(-1, 1, 1)], dim=-1)
        rows.append((torch.softmax(scores, dim=-1)[..., :-1] @ v).squeeze(1))
    return torch.stack(rows)
