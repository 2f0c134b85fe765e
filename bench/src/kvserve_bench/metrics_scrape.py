"""The server's own view of the run: its Prometheus counters, read before and after.

The vLLM-compatible prefix-cache counters are read from every target that has them, kvserve or not, so
a peer's hit rate can be compared even when it leaves `cached_tokens` out of its usage. So are the
speculative decoding counters, under vLLM's names (kvserve, vLLM) or llama-server's (`llamacpp:`, with
`--metrics`): drafts verified, draft tokens, accepted tokens.
"""

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

QUERIES = "vllm:prefix_cache_queries"
HITS = "vllm:prefix_cache_hits"
# (drafts, draft tokens, accepted tokens) as each server names them; the first one a server has is read.
SPECULATION_NAMES = (
    (
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
    ),
    (
        "llamacpp:spec_decode_num_drafts",
        "llamacpp:spec_decode_num_draft_tokens",
        "llamacpp:spec_decode_num_accepted_tokens",
    ),
)


@dataclass(frozen=True)
class PrefixCacheDelta:
    """Prompt tokens the server looked up in its prefix cache during the run, and how many it found."""

    queries: float
    hits: float

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


@dataclass(frozen=True)
class SpeculationDelta:
    """What a server drafted during the run: verified drafts (None where only tokens are known), draft
    tokens, and the draft tokens it accepted."""

    drafts: float | None
    draft_tokens: float
    accepted_tokens: float

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over draft tokens; None when nothing was drafted."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Accepted tokens per draft (vLLM's and llama.cpp's logs print 1 + this: they count the token
        every verification yields on its own); None without drafts."""
        return self.accepted_tokens / self.drafts if self.drafts else None


def parse_samples(text: str) -> dict[str, float]:
    """Sample values by name, summed over labels; counters lose their `_total` suffix."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name = sample.name.removesuffix("_total")
            values[name] = values.get(name, 0.0) + sample.value
    return values


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    """The target's /metrics, or None where it has none (or it cannot be parsed)."""
    try:
        response = await client.get(f"{url}/metrics")
        if response.status_code != 200:
            return None
        return parse_samples(response.text)
    except (httpx.HTTPError, ValueError):
        return None


def prefix_cache_delta(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> PrefixCacheDelta | None:
    if before is None or after is None or any(name not in after for name in (QUERIES, HITS)):
        return None
    return PrefixCacheDelta(
        queries=after[QUERIES] - before.get(QUERIES, 0.0), hits=after[HITS] - before.get(HITS, 0.0)
    )


def speculation_delta(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> SpeculationDelta | None:
    """The speculation counters' growth over the run; None where the server exposes none."""
    if before is None or after is None:
        return None
    for names in SPECULATION_NAMES:
        if all(name in after for name in names):
            drafts, drafted, accepted = (after[name] - before.get(name, 0.0) for name in names)
            return SpeculationDelta(drafts, drafted, accepted)
    return None
