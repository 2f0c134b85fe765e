"""Request and response bodies of the cache's own endpoints: pins and the cache's status."""

from typing import Literal

from pydantic import BaseModel, Field

from kvserve.server.core.messages import ChatMessage, RequestModel

# A pin outliving a week is a configuration, not a cache decision.
MAX_PIN_TTL_S = 7 * 24 * 3600


class PinRequest(RequestModel):
    """A prefix to hold in memory: a text prompt (or token ids) or chat messages, rendered without the
    generation prompt so that every later chat that starts with them shares the pinned blocks."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    ttl_s: float = Field(gt=0, le=MAX_PIN_TTL_S)


class PinInfo(BaseModel):
    id: str
    object: Literal["cache.pin"] = "cache.pin"
    pinned_tokens: int
    expires_at: int
    expires_in_s: float


class PinDeleted(BaseModel):
    id: str
    object: Literal["cache.pin"] = "cache.pin"
    deleted: bool = True


class TierInfo(BaseModel):
    """A cache tier's usage. `blocks` and `bytes_used` are None in a tenant's view of a tier below
    memory (shared by every tenant, not counted per tenant)."""

    name: str
    blocks: int | None
    bytes_used: int | None
    capacity_bytes: int
    pinned_blocks: int | None = None
    max_pinned_blocks: int | None = None
    retained_blocks: int | None = None
    max_retained_blocks: int | None = None


class CacheStatus(BaseModel):
    object: Literal["cache"] = "cache"
    block_size: int
    pins: list[PinInfo]
    tiers: list[TierInfo]
