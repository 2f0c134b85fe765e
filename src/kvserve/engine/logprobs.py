"""Log probabilities of chosen tokens and the top-k alternatives, from a step's raw logits.

Computed in float32 by log_softmax of the model's logits, before temperature, penalties, biases and
filters (vLLM's default, "raw" logprobs): what the model believes, whatever the request samples with.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One position: the token there, its log probability and rank (1 = most likely), and the `k` most
    likely tokens at that position as (token id, log probability), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> list[TokenLogprob]:
    """logits [n, vocab] at n positions and the token chosen at each -> one TokenLogprob per row."""
    logprobs = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long).unsqueeze(1)
    chosen = logprobs.gather(1, ids)
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_ids: list[list[int]] = [[] for _ in token_ids]
    top_values: list[list[float]] = [[] for _ in token_ids]
    if k > 0:
        top = logprobs.topk(k, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return [
        TokenLogprob(token, value, rank, tuple(zip(tid, tval, strict=True)))
        for token, value, rank, tid, tval in zip(
            token_ids, chosen.squeeze(1).tolist(), ranks.tolist(), top_ids, top_values, strict=True
        )
    ]
