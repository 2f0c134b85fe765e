"""Running prompts through an engine to the end, and the greedy params they run with."""

from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run(
    engine: Engine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY
) -> dict[str, list[int]]:
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out[delta.request_id] += delta.token_ids
    return out
