"""The grammar library's token bitmasks as torch tensors, through the library's own entry points.

Not `llguidance.torch`: importing it compiles a masking kernel with `torch.compile`, which loads torch's
compiler stack (about 120 MiB resident in a serving process) for a kernel kvserve never calls.
"""

import llguidance
import torch


def new_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [num_rows, words] with every token allowed (one bit per token, 32 to a word)."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def _check(bitmask: torch.Tensor) -> None:
    # The library writes through a raw pointer: only a contiguous int32 CPU matrix may reach it.
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
        raise ValueError(f"a bitmask is an int32 CPU matrix, not {bitmask.dtype} {tuple(bitmask.shape)}")
    if not bitmask.is_contiguous():
        raise ValueError("a bitmask must be contiguous")


def fill_row(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """Write the tokens `matcher` allows next into `bitmask[row]`."""
    _check(bitmask)
    words = bitmask[row]
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())


def fill_rows(
    executor: llguidance.LLExecutor, matchers: list[tuple[llguidance.LLMatcher, int]], bitmask: torch.Tensor
) -> None:
    """Each (matcher, row)'s allowed tokens into its row, in parallel on the executor's threads."""
    _check(bitmask)
    rows, words = bitmask.shape
    executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, rows)
