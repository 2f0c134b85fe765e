"""Tokenizer: encode, decode and chat templates, on the Rust tokenizers library and jinja2 alone.

The Rust tokenizer and what the Hugging Face tokenizer object adds to it (`TokenizerSpecials`) come
either from transformers (a model folder: `Tokenizer.from_hf`) or from the derived tokenizer file that a
GGUF's metadata makes once (model/tokenizer_cache.py), so that a GGUF serves without importing
transformers. Chat templates render as transformers renders them (model/chat_template.py).

Chat prompts can reuse the exact token ids that the engine generated for earlier replies, so that
re-tokenizing a reply's text can never break the cached prefix of a conversation.
"""

import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from copy import copy
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import DecodeStream

from kvserve.model.chat_template import pick_template, render
from kvserve.model.template_budget import template_budget

# One message of a conversation as the chat template takes it: {"role": ..., "content": ...}, and for a
# template that knows them, "tool_call_id", "name" or "reasoning_content". The server's request model of
# a message is server/openai/protocol.py's ChatMessage.
MessageDict = dict[str, Any]


@dataclass(frozen=True)
class TemplateArgs:
    """What a chat template gets besides the messages: `source`, a template to use instead of the
    tokenizer's own; `tools`, OpenAI's tool list for a template that renders tools; `kwargs`, the
    template's own variables (a request's chat_template_kwargs, e.g. enable_thinking)."""

    source: str | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)


NO_TEMPLATE_ARGS = TemplateArgs()

# What a template raises on data it does not expect, which its callers take as the request's fault; any
# other exception it raises (a division by zero, a recursion too deep) becomes a TemplateError too.
_TEMPLATE_FAULTS = (ValueError, TemplateError, TypeError, AttributeError, LookupError)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each byte as one printable character; this maps them back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_OF_CHAR = _byte_level_alphabet()


@dataclass(frozen=True)
class KnownReply:
    """The ids generated for a reply that an assistant message's content ends: `lead` is the reply's text
    before that content (a think block the client sent apart, as reasoning_content), which `ids` cover
    too; empty when the content is the whole reply. The ids go in where the template renders the lead
    right before the content, as it was generated."""

    ids: Sequence[int]
    lead: str = ""


ReplyLookup = Callable[[str], Sequence[int] | KnownReply | None]


@dataclass(frozen=True)
class TokenizerSpecials:
    """What a Hugging Face tokenizer object holds beside its Rust tokenizer that kvserve reads: its eos
    id, its length (the vocabulary with the added tokens), its special tokens by name (chat templates
    read them) and all of them (decoding drops them), its chat template(s), and the most characters one
    token's name has (`Tokenizer.max_token_chars`)."""

    eos_token_id: int | None
    vocab_size: int
    special_tokens_map: Mapping[str, str | list[str]]
    all_special_tokens: tuple[str, ...]
    chat_template: str | Mapping[str, str] | None
    max_token_chars: int


def specials_of(hf_tokenizer: Any) -> TokenizerSpecials:
    """The specials of a transformers tokenizer."""
    eos = hf_tokenizer.eos_token_id
    template = hf_tokenizer.chat_template
    vocab = hf_tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    return TokenizerSpecials(
        eos_token_id=None if eos is None else int(eos),
        vocab_size=len(hf_tokenizer),
        special_tokens_map={
            str(k): [str(t) for t in v] if isinstance(v, list | tuple) else str(v)
            for k, v in hf_tokenizer.special_tokens_map.items()
        },
        all_special_tokens=tuple(str(t) for t in hf_tokenizer.all_special_tokens),
        chat_template=dict(template) if isinstance(template, Mapping) else template,
        max_token_chars=max((len(name) for name in vocab), default=1),
    )


def grammar_view(tokenizer: RustTokenizer) -> str:
    """The Rust tokenizer serialized without padding and truncation, as the grammar library reads it."""
    plain = copy(tokenizer)
    plain.no_padding()
    plain.no_truncation()
    return str(plain.to_str())


class Tokenizer:
    def __init__(
        self, backend: RustTokenizer, specials: TokenizerSpecials, eos_token_ids: Sequence[int] = ()
    ) -> None:
        self._rust = backend
        self.specials = specials
        eos = list(eos_token_ids)
        if specials.eos_token_id is not None and specials.eos_token_id not in eos:
            eos.append(specials.eos_token_id)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.vocab_size: int = specials.vocab_size
        self._byte_level = type(self._rust.decoder).__name__ == "ByteLevel"

    @classmethod
    def from_hf(cls, hf_tokenizer: Any, eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        """The tokenizer of a transformers tokenizer object."""
        return cls(hf_tokenizer.backend_tokenizer, specials_of(hf_tokenizer), eos_token_ids)

    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (a byte-level token's name has one
        character per byte, at least as many as the text it decodes to)."""
        return self.specials.max_token_chars

    @property
    def backend(self) -> RustTokenizer:
        """The Rust tokenizer underneath (the grammar library builds its own view from it)."""
        return self._rust

    @property
    def has_chat_template(self) -> bool:
        return bool(self.specials.chat_template)

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own chat template's source (the default one when it has several)."""
        template = self.specials.chat_template
        if isinstance(template, Mapping):
            template = template.get("default")
        return template if isinstance(template, str) else None

    @property
    def special_tokens(self) -> frozenset[str]:
        """The texts of the tokens that decoding drops under skip_special_tokens."""
        return frozenset(self.specials.all_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._rust.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._rust.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def decode_stream(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self._rust, skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for on its own (a piece of a multi-byte character may be a token)."""
        piece = self._rust.id_to_token(token_id)
        if self._byte_level and piece is not None and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def token_text(self, token_id: int) -> str:
        """A token's own text, as logprobs show it (an incomplete UTF-8 piece becomes U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def render_chat(
        self,
        messages: Sequence[MessageDict],
        add_generation_prompt: bool = True,
        args: TemplateArgs = NO_TEMPLATE_ARGS,
    ) -> str:
        """The conversation as the template renders it, within the template's deadline
        (model/template_budget.py; past it, TemplateBudgetError). Whatever the template raises is one of
        ValueError, TemplateError, TypeError, AttributeError or LookupError."""
        if args.source is None and not self.has_chat_template:
            raise ValueError("this model has no chat template; use completions with a plain prompt")
        try:
            with template_budget():
                text = render(
                    pick_template(self.specials.chat_template, args.source, args.tools is not None),
                    messages,
                    None if args.tools is None else list(args.tools),
                    add_generation_prompt,
                    {**self.specials.special_tokens_map, **args.kwargs},
                )
        except _TEMPLATE_FAULTS:
            raise
        except Exception as e:
            raise TemplateError(f"{type(e).__name__}: {e}") from e
        return str(text)

    def encode_chat(
        self,
        messages: Sequence[MessageDict],
        add_generation_prompt: bool = True,
        known_reply: ReplyLookup | None = None,
        args: TemplateArgs = NO_TEMPLATE_ARGS,
    ) -> list[int]:
        """Token ids of the rendered conversation.

        Where `known_reply(content)` returns the ids the engine generated for an assistant message, those
        ids are spliced in verbatim, at that message and nowhere else (a user message may quote the
        reply); the text between such replies is tokenized on its own, which is how the original request
        saw it (its prompt ended where the reply began). A reply known with a lead (its think block) is
        spliced with it where the template renders the lead just before the content.
        """
        text = self.render_chat(messages, add_generation_prompt, args)
        replies: dict[int, KnownReply] = {}
        if known_reply is not None:
            for i, message in enumerate(messages):
                content = message.get("content", "")
                if message.get("role") == "assistant" and content and isinstance(content, str):
                    reply = known_reply(content)
                    if reply is not None:
                        replies[i] = reply if isinstance(reply, KnownReply) else KnownReply(reply)
        pieces = self._split_at_replies(messages, replies, add_generation_prompt, text, args)
        if pieces is None:
            return self.encode(text, add_special_tokens=False)
        ids: list[int] = []
        pending = pieces[0]
        for i, after in zip(sorted(replies), pieces[1:], strict=True):
            reply = replies[i]
            if pending.endswith(reply.lead):
                ids += self.encode(pending[: len(pending) - len(reply.lead)], add_special_tokens=False)
                ids += reply.ids
                pending = after
            else:
                # The template did not render the reply's lead (it dropped the think block): the content
                # stays text, tokenized with what surrounds it.
                pending += messages[i]["content"] + after
        return ids + self.encode(pending, add_special_tokens=False)

    def _split_at_replies(
        self,
        messages: Sequence[MessageDict],
        replies: dict[int, KnownReply],
        add_generation_prompt: bool,
        text: str,
        args: TemplateArgs,
    ) -> list[str] | None:
        """The rendered text around each reply's content, found by rendering a unique marker in its place.

        None when there is nothing to splice or the template does not render content verbatim, once,
        in message order (then splicing could misplace ids, and plain tokenization is the safe answer).
        """
        if not replies:
            return None
        marker = f"\x00kvserve-reply-{uuid.uuid4().hex}-"
        marked = [{**m, "content": f"{marker}{i}\x00"} if i in replies else m for i, m in enumerate(messages)]
        parts = re.split(
            re.escape(marker) + r"(\d+)\x00", self.render_chat(marked, add_generation_prompt, args)
        )
        order = [int(i) for i in parts[1::2]]
        pieces = parts[0::2]
        if order != sorted(replies):
            return None
        rebuilt = pieces[0] + "".join(
            messages[i]["content"] + after for i, after in zip(order, pieces[1:], strict=True)
        )
        return pieces if rebuilt == text else None


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas; never emits half of a multi-byte character."""

    def __init__(self, tokenizer: RustTokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer, token_id) or ""
