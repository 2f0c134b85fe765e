"""Engine logprobs (token ids and floats) in OpenAI's two shapes: chat's per-token objects with bytes,
and the legacy completions' parallel lists with character offsets."""

import math
from collections.abc import Sequence

from kvserve.engine.logprobs import TokenLogprob
from kvserve.model.tokenizer import Tokenizer
from kvserve.server.openai.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

# JSON has no -inf; vLLM reports an impossible token with this floor.
_FLOOR = -9999.0


def _finite(value: float) -> float:
    return max(value, _FLOOR) if not math.isnan(value) else _FLOOR


class LogprobRenderer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        raw = self._tokenizer.token_bytes(token_id)
        return TopLogprob(
            token=raw.decode("utf-8", errors="replace"), logprob=_finite(logprob), bytes=list(raw)
        )

    def chat(self, entries: Sequence[TokenLogprob]) -> ChatLogprobs:
        content = []
        for e in entries:
            chosen = self._top(e.token_id, e.logprob)
            top = [self._top(t, v) for t, v in e.top]
            content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)

    def legacy(
        self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """The legacy shape for tokens whose text starts at character `offset`; also returns the offset
        after them (a stream continues from there)."""
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token_id, e in zip(token_ids, entries, strict=True):
            text = self._tokenizer.token_text(token_id)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if e is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(_finite(e.logprob))
                top: dict[str, float] = {}
                for t, v in e.top:
                    # Tokens may share a text (pieces of one UTF-8 character, each U+FFFD): the dict keeps
                    # the likeliest one's logprob, as `top` comes most likely first.
                    top.setdefault(self._tokenizer.token_text(t), _finite(v))
                out.top_logprobs.append(top)
        return out, offset
