"""`kvserve chat`'s /stats is the engine's snapshot as text: the pool by state, the hit counts,
speculation's acceptance, and the shared system prompt as the heaviest prefix."""

from collections.abc import Sequence
from dataclasses import replace

from kvserve.cli import cache_stats_text, miss_text
from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.loader import LoadedModel

SYSTEM = list(range(200, 264))  # 64 tokens: four whole blocks of 16


def test_stats_text_counts_what_the_engine_counted(tiny_model: LoadedModel) -> None:
    engine = Engine.from_config(
        EngineConfig(kv_cache_memory=4 * 2**20, max_model_len=256, weight_dtype="float32", speculative="off"),
        model=tiny_model,
    )
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for i, user in enumerate(([300, 301, 302], [400, 401])):
        engine.add_request(str(i), [*SYSTEM, *user], params)
        while engine.has_unfinished_requests():
            engine.step()
    stats = engine.stats()
    pool, counts, *branches = cache_stats_text(engine).splitlines()
    assert pool == (
        f"pool: {engine.num_blocks} blocks of 16 tokens: 0 in use, {stats.cache.num_evictable} cached, "
        f"{stats.cache.num_free} free, 0 evicted"
    )
    # The second prompt found the first's four system blocks: 64 of 67 + 66 tokens.
    assert counts == "prefix cache: 48.1% of 133 prompt tokens hit, 64 prefill tokens saved, 69 computed"
    assert branches[0].split()[:5] == ["64", "tokens", "x", "1", "hits"]
    assert branches[0].endswith(repr(engine.tokenizer.decode(SYSTEM[:12])))


class _Replay:
    """Drafts the continuation a run without speculation wrote, from wherever the sequence is."""

    def __init__(self, prompt: list[int], continuation: list[int]) -> None:
        self.prompt, self.continuation = prompt, continuation

    def propose(
        self, key: str, namespace: str, tokens: Sequence[int], limit: int, load: int, tenant: str
    ) -> list[int]:
        done = len(tokens) - len(self.prompt)
        return self.continuation[done : done + limit]

    def verified(self, key: str, drafted: int, accepted: int) -> None:
        pass

    def finished(self, key: str, namespace: str, output: Sequence[int], tenant: str) -> None:
        pass


def test_stats_text_shows_speculation_once_something_was_drafted(tiny_model: LoadedModel) -> None:
    """No speculation line before the first draft; after drafts, the engine's own counters."""
    config = EngineConfig(kv_cache_memory=4 * 2**20, max_model_len=256, weight_dtype="float32")
    prompt = [*SYSTEM, 300, 301]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    plain = Engine.from_config(replace(config, speculative="off"), model=tiny_model)
    plain.add_request("0", prompt, params)
    continuation: list[int] = []
    while plain.has_unfinished_requests():
        continuation += [t for d in plain.step() for t in d.token_ids]
    engine = Engine.from_config(config, model=tiny_model)
    assert not any(line.startswith("speculation") for line in cache_stats_text(engine).splitlines())
    engine.scheduler.drafter = _Replay(prompt, continuation)
    engine.add_request("1", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.spec_drafts > 0 and stats.spec_accepted_tokens > 0
    line = next(x for x in cache_stats_text(engine).splitlines() if x.startswith("speculation"))
    rate = 100 * stats.spec_accepted_tokens / stats.spec_draft_tokens
    assert line == (
        f"speculation: {stats.spec_accepted_tokens} of {stats.spec_draft_tokens} draft tokens accepted "
        f"({rate:.1f}%), {stats.spec_accepted_tokens / stats.spec_drafts:.2f} per draft over "
        f"{stats.spec_drafts} drafts"
    )


def test_stats_text_shows_the_measured_step_cost_with_speculation_on(tiny_model: LoadedModel) -> None:
    config = EngineConfig(kv_cache_memory=4 * 2**20, max_model_len=256, weight_dtype="float32")
    engine = Engine.from_config(config, model=tiny_model)
    costs = engine.stats().step_costs
    assert costs is not None
    (line,) = [x for x in cache_stats_text(engine).splitlines() if x.startswith("step cost")]
    assert f"({costs.draft / costs.fixed:.2f} of the fixed part)" in line
    plain = Engine.from_config(replace(config, speculative="off"), model=tiny_model)
    assert not any(x.startswith("step cost") for x in cache_stats_text(plain).splitlines())


def test_stats_prints_the_last_prompts_miss_reason(tiny_model: LoadedModel) -> None:
    """A prompt whose system part changed at token 8 after one that was computed: diverged there."""
    engine = Engine.from_config(
        EngineConfig(kv_cache_memory=4 * 2**20, max_model_len=256, weight_dtype="float32", speculative="off"),
        model=tiny_model,
    )
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    changed = [*SYSTEM[:8], 999, *SYSTEM[9:]]
    misses = []
    for i, prompt in enumerate(([*SYSTEM, 300, 301], [*changed, 300, 301])):
        engine.add_request(str(i), prompt, params)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                misses.append(delta.cache_miss)
    assert miss_text(misses[0]).startswith("last miss: none")
    assert miss_text(misses[-1]).startswith("last miss: diverged at token 8, ")
