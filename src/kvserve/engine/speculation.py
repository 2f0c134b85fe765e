"""Verifying drafts: which of a step's rows each request keeps.

A decode with a draft of k tokens runs as k + 1 decode rows of its sequence (the scheduler's `drafts`):
row j holds the draft's token j (row 0 the last sampled token) at the position after row j - 1, so its
logits are the ones a decode at that position would compute, bit for bit (a row's output depends on its
own tokens only, whatever else the step holds). `verify` samples the rows in order, each exactly as a
decode there would be sampled (the same processing, masks and generator), and goes on to row j + 1 only
while the token sampled at row j is the draft's next token: then row j + 1's input is what the request
really wrote, and its logits are valid.

Greedy requests therefore give the same tokens and logprobs as without speculation. For sampled
requests this is rejection sampling (Leviathan et al. 2023, Chen et al. 2023) with a point draft: with
q putting all its mass on the draft token d, the test "accept with probability min(1, p(d) / q(d))"
accepts with probability p(d), and a rejection resamples from max(0, p - q) normalized, which is p
without d. Drawing x from p and keeping the draft when x = d is the same law, accepted equally often,
and it draws exactly what the request would draw without speculation, so a seed gives the same text with
speculation on or off, whatever else is batched.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvserve.engine.logprobs import TokenLogprob
from kvserve.engine.request import Appended, Request

# Samples rows: (their logits, their requests, whether these are the requests' first rows) -> a token
# for each row and its logprob where the request asked for one.
SampleRows = Callable[[torch.Tensor, list[Request], bool], tuple[list[int], list[TokenLogprob | None]]]


@dataclass
class Taken:
    """What one request took from its rows this step, in row order: each sampled token's Appended (see
    `Request.append`) and logprob; and the prompt's logprobs when these are its first output tokens.
    The number of rows taken is the number of its rows whose KV it keeps."""

    appended: list[Appended]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[TokenLogprob | None] | None


def verify(
    logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[Sequence[int]], sample: SampleRows
) -> list[Taken]:
    """`logits` holds 1 + len(drafts[i]) rows for requests[i], one request after another. Each request
    takes its first row's token, then its next row's while the token just taken is the draft's next
    and the request goes on. Rows are sampled a row index at a time across requests (one `sample` call
    each), so the rows of a step without drafts are sampled in one call."""
    starts = []
    total = 0
    for draft in drafts:
        starts.append(total)
        total += 1 + len(draft)
    assert total == logits.shape[0], "the logits rows are not the requests' rows"
    taken = [
        Taken(
            [],
            [],
            list(r.prompt_logprobs) if r.prompt_logprobs is not None and not r.num_output_tokens else None,
        )
        for r in requests
    ]
    live = list(range(len(requests)))
    j = 0
    while live:
        rows = [starts[i] + j for i in live]
        chosen = [requests[i] for i in live]
        tokens, logprobs = sample(logits if len(rows) == total else logits[rows], chosen, j == 0)
        going = []
        for i, request, token, logprob in zip(live, chosen, tokens, logprobs, strict=True):
            appended = request.append(token)
            taken[i].appended.append(appended)
            taken[i].logprobs.append(logprob)
            if appended.finish_reason is None and j < len(drafts[i]) and token == drafts[i][j]:
                going.append(i)
        live = going
        j += 1
    return taken
