"""validate_request: the one check every request passes before the engine queues anything of it.

It runs once per request, at the door that takes the request in: `AsyncEngine.validate` for the server
(once for all prompts and samples of an HTTP request, as its plan is built), `LLM` for an offline batch,
`Engine.checked_prompt` only for a prompt that comes unchecked; `Engine.pin` runs `validate_token_ids`,
the part that checks token ids. What it returns, a CheckedPrompt, is the proof the later doors accept
without checking again.

It bounds every field to what the engine can hold, so that nothing a client sends can raise on the
engine thread, where any exception stops the engine for everyone:

- the fields of SamplingParams (checked when it is made: types, ranges, finiteness);
- prompts x n at most `max_sequences_per_request` (an EngineConfig setting; `check_sequences`, which
  the server's door also runs before any work, from the body's shape);
- `top_k` at most the vocabulary; `logit_bias` at most the vocabulary's size; every token id a client
  names in the vocabulary (`check_vocabulary`: prompts, `logit_bias`, `stop_token_ids`);
- every prompt non-empty, its token ids integers in the vocabulary, its length and max_tokens within
  the context window and the KV pool; `min_tokens` at most the effective max_tokens;
- `structured_outputs` compiled (engine/grammar.py, cached by namespace and source), on the caller's
  thread: a constraint the grammar library rejects (or that is over the server's grammar limits at its
  first token) is an InvalidRequestError naming the problem, and the engine thread only ever receives
  the request's own matcher, built here.

Its cost is linear in the prompts and bounded before the linear part runs: counts and lengths are checked
first. The samples of one request share one validation (see CheckedPrompt).
"""

import operator
from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields

from kvserve.engine.grammar import GrammarCompiler, RequestGrammar
from kvserve.engine.sampling_params import SamplingParams
from kvserve.errors import InvalidRequestError


@dataclass(frozen=True)
class RequestLimits:
    """What one engine can hold. `max_request_tokens` is the KV one request may use (the pool less what
    pins may hold); `max_sequences_per_request` caps n, and prompts x n."""

    vocab_size: int
    max_model_len: int
    max_request_tokens: int
    max_sequences_per_request: int

    @property
    def max_sequence_len(self) -> int:
        """The longest prompt plus completion: within the context window and the pool alike."""
        return min(self.max_model_len, self.max_request_tokens)


# What a sample of a request shares with it: every field but n and the seed, which no check reads.
_SAMPLE_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.name not in ("n", "seed"))


@dataclass(frozen=True)
class CheckedPrompt:
    """A prompt that `validate_request` accepted with `params`: its token ids, plain ints in the
    vocabulary, and its effective max_tokens. Only validate_request makes one. The doors that queue a
    request (`AsyncEngine.generate`, `Engine.add_request`, through `Engine.checked_prompt`) take it as
    proof and check nothing again when it comes with those params or one of their samples
    (`checked_for`); with any other params it is
    checked again, and then only the checks that cost no more than a constant run: n samples of a long
    prompt scan its ids once."""

    token_ids: list[int]
    max_tokens: int
    params: SamplingParams
    # The request's own matcher of the constraint of `params` (None when they have none).
    grammar: RequestGrammar | None = None

    def checked_for(self, params: SamplingParams) -> bool:
        """Whether `params` are the ones this prompt was checked with, or a sample of them
        (`params.for_sample(i)`, a shallow copy: every other field is the same object)."""
        if params is self.params:
            return True
        return params.n == 1 and all(getattr(params, f) is getattr(self.params, f) for f in _SAMPLE_FIELDS)


class TooManySequencesError(InvalidRequestError):
    """A request of more sequences (prompts x n) than one request may have, or than the engine ever
    holds at once: it can never run as sent, however long the client waits."""

    code = "too_many_sequences"


def check_sequences(limit: int, num_prompts: int, n: int) -> None:
    """The cap on one request's sequences (prompts x n): the work and memory of a request grow with
    them, and its body alone does not bound them. Cheap, so that a door can run it from the body's
    shape before any sequence is built; `param` is `n` when n alone is over, else `prompt`."""
    if num_prompts * n > limit:
        raise TooManySequencesError(
            f"This request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; at "
            f"most {limit} are taken per request (--max-sequences-per-request). Send fewer prompts or a "
            "smaller n.",
            "n" if n > limit else "prompt",
        )


def check_vocabulary(vocab_size: int, token_ids: Collection[int], param: str) -> None:
    """Every token id a client names (prompt ids, logit_bias keys, stop_token_ids, ids to decode) must
    be in [0, vocab_size): no embedding, tokenizer or cache key holds another."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        raise InvalidRequestError(f"{param} must name token ids in [0, {vocab_size})", param)


def validate_token_ids(limits: RequestLimits, token_ids: Sequence[int], param: str = "prompt") -> list[int]:
    """The token ids as plain ints, if each is an integer in the vocabulary and there are fewer than the
    context holds; raises InvalidRequestError otherwise."""
    try:
        length = len(token_ids)
    except TypeError:
        raise InvalidRequestError("token ids must be a list of integers", param) from None
    if isinstance(token_ids, str | bytes):
        raise InvalidRequestError("token ids must be a list of integers", param)
    if length >= limits.max_sequence_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {limits.max_sequence_len} tokens, "
            f"but the prompt has {length} tokens; shorten the prompt.",
            param,
        )
    try:
        ids = [operator.index(t) for t in token_ids]
    except TypeError:
        raise InvalidRequestError("token ids must be integers", param) from None
    check_vocabulary(limits.vocab_size, ids, param)
    return ids


def _check_params(limits: RequestLimits, num_prompts: int, params: SamplingParams) -> None:
    check_sequences(limits.max_sequences_per_request, num_prompts, params.n)
    vocab = limits.vocab_size
    if params.top_k > vocab:
        raise InvalidRequestError(f"top_k must be at most the vocabulary size ({vocab})", "top_k")
    if params.logit_bias is not None and len(params.logit_bias) > vocab:
        raise InvalidRequestError(f"logit_bias may name at most {vocab} tokens", "logit_bias")
    # The cached largest id: a sample's check costs nothing until some id is out of range.
    if params.max_token_id >= vocab:
        check_vocabulary(vocab, params.logit_bias or (), "logit_bias")
        check_vocabulary(vocab, params.stop_token_ids, "stop_token_ids")


def _max_tokens(limits: RequestLimits, num_prompt_tokens: int, params: SamplingParams) -> int:
    n = num_prompt_tokens
    limit = limits.max_sequence_len
    max_tokens = limit - n if params.max_tokens is None else params.max_tokens
    if n + max_tokens > limits.max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). "
            "Reduce the prompt or max_tokens.",
            "max_tokens",
        )
    if n + max_tokens > limit:
        raise InvalidRequestError(
            f"the request needs {n + max_tokens} tokens of KV memory but the whole cache holds {limit}; "
            "reduce max_tokens or start the server with a larger kv_cache_memory",
            "max_tokens",
        )
    if params.min_tokens > max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens"
        )
    return max_tokens


def _compile(
    grammars: GrammarCompiler | None,
    prompts: Sequence[Sequence[int] | CheckedPrompt],
    params: SamplingParams,
    namespace: str,
) -> RequestGrammar | None:
    spec = params.structured_outputs
    if spec is None:
        return None
    for prompt in prompts:
        done = prompt.grammar if isinstance(prompt, CheckedPrompt) else None
        if done is not None and done.key == spec.key:
            return done
    if grammars is None:
        raise InvalidRequestError("this engine has no grammar compiler", "structured_outputs")
    return grammars.compile(spec, namespace)


def validate_request(
    limits: RequestLimits,
    prompts: Sequence[Sequence[int] | CheckedPrompt],
    params: SamplingParams,
    grammars: GrammarCompiler | None = None,
    namespace: str = "",
) -> list[CheckedPrompt]:
    """Check a request of `prompts`, each run `params.n` times, against what the engine can hold; one
    CheckedPrompt per prompt, or InvalidRequestError naming the first bad field. A constraint is
    compiled with `grammars` (cached in the request's cache `namespace`) unless a CheckedPrompt already
    carries it."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params must be a SamplingParams", "params")
    if not prompts:
        raise InvalidRequestError("the prompt is empty", "prompt")
    _check_params(limits, len(prompts), params)
    # Shared by every sample; built here, before the engine thread steps with it.
    _ = params.logit_bias_tensors
    checked = []
    for prompt in prompts:
        ids = prompt.token_ids if isinstance(prompt, CheckedPrompt) else validate_token_ids(limits, prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        checked.append(CheckedPrompt(ids, _max_tokens(limits, len(ids), params), params))
    # Last: the other checks cost less than a compile, and a request they refuse compiles nothing.
    grammar = _compile(grammars, prompts, params, namespace)
    if grammar is not None:
        checked = [CheckedPrompt(c.token_ids, c.max_tokens, params, grammar) for c in checked]
    return checked
