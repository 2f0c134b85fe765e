"""`kvserve chat`'s /stats is the engine's snapshot as text: the pool by state, the hit counts, and the
shared system prompt as the heaviest prefix."""

from kvserve.cli import cache_stats_text
from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.loader import LoadedModel

SYSTEM = list(range(200, 264))  # 64 tokens: four whole blocks of 16


def test_stats_text_counts_what_the_engine_counted(tiny_model: LoadedModel) -> None:
    engine = Engine.from_config(
        EngineConfig(kv_cache_memory=4 * 2**20, max_model_len=256, weight_dtype="float32"), model=tiny_model
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
