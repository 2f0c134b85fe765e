"""Pick each request's next token from its logits row.

Greedy rows take the argmax. Random rows are filtered (top-k, top-p, min-p) together, then each row
draws with its own request's generator, so a seeded request samples the same tokens whatever else is
in the batch.
"""

from collections.abc import Sequence

import torch

from kvserve.engine.request import Request


def _filter(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    params = [r.params for r in requests]
    vocab = logits.shape[-1]
    if all((p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
        return logits
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params]).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
    min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    cumulative = probs.cumsum(dim=-1)
    remove = torch.arange(vocab).unsqueeze(0) >= top_k
    remove |= (cumulative - probs) > top_p
    remove |= probs < min_p * probs[:, :1]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """logits [len(requests), vocab] float32 -> one token id per request."""
    tokens = logits.argmax(dim=-1).tolist()
    rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if not rows:
        return [int(t) for t in tokens]
    chosen = [requests[i] for i in rows]
    temperature = torch.tensor([r.params.temperature for r in chosen]).unsqueeze(1)
    probs = _filter(logits[rows] / temperature, chosen).softmax(dim=-1)
    for row, (i, request) in enumerate(zip(rows, chosen, strict=True)):
        # Exponential races (Gumbel-max in another form) draw from probs with the request's own generator.
        noise = torch.empty_like(probs[row]).exponential_(generator=request.generator)
        tokens[i] = int((probs[row] / noise).argmax())
    return [int(t) for t in tokens]
