"""Pick each request's next token from its logits row.

Greedy rows take the argmax. Random rows are filtered (top-k, top-p, min-p) together without sorting
the vocabulary: thresholds come from a partial top-k, and only a row whose nucleus is wider than that
falls back to a full sort. Each row then draws by inverse CDF with one uniform number from its own
request's generator, so a seeded request samples the same tokens whatever else is in the batch.

Penalties, logit biases and min_tokens change the logits of the rows that ask for them, and only those:
a batch where no request asks pays nothing for them. Greedy rows see them too, as in vLLM.

A request with structured outputs has its row masked to the tokens its grammar allows next, after
penalties and biases and before min_tokens, temperature and the filters; every step is per row, so a
constrained row never changes another row's token. The masks are computed while the forward pass runs
(engine/masks.py) and joined here.
"""

from collections.abc import Sequence

import torch

from kvserve.engine.masks import StepMasks, compute_masks
from kvserve.engine.request import Request

# Candidates examined before a top-p row falls back to sorting its whole row.
_NUCLEUS_CANDIDATES = 1024
# The argmax's chunk: torch's argmax over a row is a scalar loop (0.2 ms for 262,144 logits), its amax a
# vector one.
_ARGMAX_CHUNK = 1024


def _top_k_threshold(probs: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per row, the k-th largest probability (rows with k >= vocab get 0)."""
    vocab = probs.shape[-1]
    values = probs.topk(int(k.clamp(max=vocab).max()), dim=-1).values
    return values.gather(1, (k.clamp(max=vocab) - 1).unsqueeze(1)).squeeze(1).where(k < vocab, 0.0)


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability inside the nucleus: the fewest tokens whose mass reaches top_p."""
    k = min(_NUCLEUS_CANDIDATES, probs.shape[-1])
    values = probs.topk(k, dim=-1).values
    before = values.cumsum(dim=-1) - values
    inside = before < top_p.unsqueeze(1)
    thresholds = values.masked_fill(~inside, float("inf")).min(dim=-1).values
    for row in (inside[:, -1] & (top_p < 1.0)).nonzero().flatten().tolist():
        full = probs[row].sort(descending=True).values
        keep = (full.cumsum(0) - full) < top_p[row]
        thresholds[row] = full[keep].min()
    return thresholds.where(top_p < 1.0, 0.0)


def _filtered_probs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    params = [r.params for r in requests]
    temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    probs = (logits / temperature).softmax(dim=-1)
    top = probs.max(dim=-1).values
    vocab = probs.shape[-1]
    threshold = torch.zeros(len(params))
    if any(0 < p.top_k < vocab for p in params):
        # Clamped before the tensor is built: validation bounds top_k by the vocabulary, and this keeps
        # a value past int64 from ever reaching torch.
        k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params])
        threshold = torch.maximum(threshold, _top_k_threshold(probs, k))
    if any(p.top_p < 1.0 for p in params):
        threshold = torch.maximum(threshold, _top_p_threshold(probs, torch.tensor([p.top_p for p in params])))
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params])
        threshold = torch.maximum(threshold, min_p * top)
    # The most likely token always survives, whatever the thresholds.
    threshold = torch.minimum(threshold, top)
    return probs.masked_fill(probs < threshold.unsqueeze(1), 0.0)


def _holds_back(request: Request) -> bool:
    """Whether min_tokens still forbids this request its stop tokens."""
    return request.num_output_tokens < request.params.min_tokens


def _held_back_ids(request: Request, eos_token_ids: Sequence[int]) -> torch.Tensor:
    """The stop tokens min_tokens forbids, built once per request."""
    if request.held_back_ids is None:
        p = request.params
        ids = sorted({*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)})
        request.held_back_ids = torch.tensor(ids, dtype=torch.long)
    return request.held_back_ids


def _needs_processing(request: Request) -> bool:
    p = request.params
    return bool(p.has_penalties or p.logit_bias or request.grammar is not None or _holds_back(request))


def _padded(rows: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' token ids as [len(rows), width], each padded with a token it already holds (0 if it
    holds none), and a 1/0 mask of the real entries. Penalties touch only these columns: dense
    [rows, vocab] passes cost milliseconds per step, these cost microseconds."""
    width = max(1, *(len(r) for r in rows))
    ids = torch.tensor([r + [r[0] if r else 0] * (width - len(r)) for r in rows])
    valid = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
    return ids, valid


def _grammar_masked(
    sub: torch.Tensor, chosen: Sequence[Request], eos_token_ids: Sequence[int], masks: StepMasks | None
) -> torch.Tensor:
    """Rows of constrained requests keep only the tokens their grammar allows next: from `masks`, the
    step's masks computed while the forward pass ran, or computed now when those are not these rows'."""
    rows = [j for j, r in enumerate(chosen) if r.grammar is not None]
    if not rows:
        return sub
    states = [chosen[j].grammar for j in rows]
    if masks is None or not masks.covers([s for s in states if s is not None]):
        masks = compute_masks([chosen[j] for j in rows])
    assert masks is not None
    allowed = masks.allowed(sub.shape[-1])
    # A grammar that leaves no token of this model's vocabulary (a model smaller than its tokenizer), or
    # whose matcher failed (its request then ends, see Request.append), gets the end of sequence, which
    # ends the request, instead of a row of -inf.
    dead = ~allowed.any(dim=1)
    if bool(dead.any()):
        for k in dead.nonzero().flatten().tolist():
            state = masks.states[k]
            state.forced_end = state.failure is None
        eos = [t for t in eos_token_ids if t < sub.shape[-1]]
        allowed[dead.nonzero().flatten().unsqueeze(1), torch.tensor(eos, dtype=torch.long)] = True
    index = torch.tensor(rows)
    return sub.index_copy(0, index, sub[index].masked_fill(~allowed, float("-inf")))


def _process(
    logits: torch.Tensor,
    requests: Sequence[Request],
    eos_token_ids: Sequence[int],
    masks: StepMasks | None = None,
) -> torch.Tensor:
    """The rows' logits after penalties, logit biases, grammars and min_tokens (rows that ask none are
    skipped)."""
    rows = [i for i, r in enumerate(requests) if _needs_processing(r)]
    if not rows:
        return logits
    chosen = [requests[i] for i in rows]
    params = [r.params for r in chosen]
    vocab = logits.shape[-1]
    # A copy: the caller's logits stay as the model gave them (logprobs are computed from them).
    sub = logits[rows]
    # Scattering the same value to a repeated column is deterministic, so repeats need no dedup.
    if any(p.repetition_penalty != 1.0 for p in params):
        ids, _ = _padded([r.token_ids for r in chosen])
        penalty = torch.tensor([p.repetition_penalty for p in params]).unsqueeze(1)
        seen = sub.gather(1, ids)
        sub.scatter_(1, ids, torch.where(seen > 0, seen / penalty, seen * penalty))
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        ids, valid = _padded([r.output_token_ids for r in chosen])
        frequency = torch.tensor([p.frequency_penalty for p in params]).unsqueeze(1)
        sub.scatter_add_(1, ids, -frequency * valid)
        present = torch.tensor(
            [p.presence_penalty if r.num_output_tokens else 0.0 for p, r in zip(params, chosen, strict=True)]
        )
        sub.scatter_(1, ids, sub.gather(1, ids) - present.unsqueeze(1))
    # Each request's bias tensors were built once, when it was validated; a step only concatenates them.
    biased = [(j, t) for j, p in enumerate(params) if (t := p.logit_bias_tensors) is not None]
    if biased:
        row = torch.cat([torch.full_like(ids, j) for j, (ids, _) in biased])
        token = torch.cat([ids for _, (ids, _) in biased])
        value = torch.cat([values for _, (_, values) in biased]).to(sub.dtype)
        keep = token < vocab
        sub = sub.index_put((row[keep], token[keep]), value[keep], accumulate=True)
    sub = _grammar_masked(sub, chosen, eos_token_ids, masks)
    banned = [(j, _held_back_ids(r, eos_token_ids)) for j, r in enumerate(chosen) if _holds_back(r)]
    if banned:
        row = torch.cat([torch.full_like(ids, j) for j, ids in banned])
        token = torch.cat([ids for _, ids in banned])
        keep = token < vocab
        held = sub.index_put((row[keep], token[keep]), torch.tensor(float("-inf"), dtype=sub.dtype))
        # A row whose every token is held back keeps its logits: a stop token sampled before min_tokens
        # is no stop (see Request.append), while a row of -inf would sample from NaN. So a grammar that
        # can only end ends, min_tokens or not.
        sub = torch.where(held.isneginf().all(dim=1, keepdim=True), sub, held)
    return logits.index_copy(0, torch.tensor(rows), sub)


def argmax(logits: torch.Tensor) -> list[int]:
    """Each row's `logits.argmax(dim=-1)` (its first greatest value, its first NaN where it has one), from
    the rows' chunk maxima: the first chunk whose maximum is the row's holds that index. Comparisons only,
    so the index is torch's whatever the chunking."""
    rows, vocab = logits.shape
    chunks = vocab // _ARGMAX_CHUNK
    whole = chunks * _ARGMAX_CHUNK
    maxima = logits[:, :whole].reshape(rows, chunks, _ARGMAX_CHUNK).amax(dim=-1)
    if whole < vocab:
        maxima = torch.cat((maxima, logits[:, whole:].amax(dim=-1, keepdim=True)), dim=1)
    tokens = []
    for row, chunk in enumerate(maxima.argmax(dim=-1).tolist()):
        start = chunk * _ARGMAX_CHUNK
        tokens.append(start + int(logits[row, start : start + _ARGMAX_CHUNK].argmax()))
    return tokens


def sample(
    logits: torch.Tensor,
    requests: Sequence[Request],
    eos_token_ids: Sequence[int] = (),
    masks: StepMasks | None = None,
) -> list[int]:
    """logits [len(requests), vocab] float32 -> one token id per request; `logits` is not changed.

    `eos_token_ids` are the tokens that min_tokens holds back (with each request's stop_token_ids).
    `masks` are the constrained rows' token masks begun before the forward pass (engine/masks.py);
    without them they are computed here."""
    logits = _process(logits, requests, eos_token_ids, masks)
    tokens = argmax(logits)
    rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if not rows:
        return tokens
    chosen = [requests[i] for i in rows]
    cdf = _filtered_probs(logits[rows], chosen).cumsum(dim=-1)
    # One uniform in (0, 1] per row, from the request's own generator.
    u = torch.cat([1.0 - torch.rand(1, generator=r.generator) for r in chosen])
    picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1)
    for i, token in zip(rows, picked.clamp(max=logits.shape[-1] - 1).tolist(), strict=True):
        tokens[i] = token
    return [int(t) for t in tokens]
