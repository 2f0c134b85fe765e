"""Hardening, engine side: one request, pin or tenant can never stop the engine or crowd out another.

Each test is named after the finding it reproduces; each failed on the code before its fix.
"""

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI

from kvserve.cache.pins import PinTable
from kvserve.cache.tier_loads import TierLoads
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.errors import EngineOverloadedError, InvalidRequestError
from kvserve.model.loader import LoadedModel
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.http.tenants import Tenants, load_or_create_secret
from tests.harness import Spec, drive, engine_with_blocks, gate_steps

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
PROMPT = [100 + (i * 7) % 3000 for i in range(12)]


def _run_all(engine: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out.setdefault(delta.request_id, []).extend(delta.token_ids)
        engine.kv.check()
        steps += 1
        assert steps < 1000
    return out


def test_finding_1_a_top_k_beyond_the_vocabulary_is_refused_and_the_batch_beside_it_runs(
    tiny_model: LoadedModel,
) -> None:
    engine = engine_with_blocks(tiny_model, 64, BLOCK)
    engine.add_request("k40", PROMPT, SamplingParams(max_tokens=3, temperature=1.0, top_k=40, seed=1))
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("huge", PROMPT, SamplingParams(max_tokens=3, temperature=1.0, top_k=2**63))
    assert e.value.param == "top_k"
    # The largest top_k accepted is the vocabulary, and it runs beside top_k=40.
    vocab = tiny_model.config.vocab_size
    engine.add_request("vocab", PROMPT, SamplingParams(max_tokens=3, temperature=1.0, top_k=vocab, seed=2))
    out = _run_all(engine)
    assert len(out["k40"]) == 3 and len(out["vocab"]) == 3


def test_finding_3_pinning_token_ids_outside_the_vocabulary_locks_nothing(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    engine = engine_with_blocks(
        tiny_model, 24, BLOCK, max_pinned_tokens=8 * BLOCK, kv_disk=str(tmp_path / "disk")
    )
    drive(engine, [PROMPT], [Spec(base=("system", 0), suffix=[], max_tokens=1)])
    before = engine.kv.usage()
    # The first blocks are cached, so the old code locked them before the disk key packing raised.
    for bad in (2**64, -1, tiny_model.config.vocab_size):
        with pytest.raises(InvalidRequestError):
            engine.pin("", [*PROMPT[:8], bad, *PROMPT[9:]], 60)
        engine.kv.check()
    assert engine.kv.usage().num_locked == before.num_locked == 0
    assert engine.pin("", PROMPT, 60) is not None


def test_finding_3_a_pin_that_fails_after_locking_releases_every_block(
    tiny_model: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_with_blocks(
        tiny_model, 24, BLOCK, max_pinned_tokens=8 * BLOCK, kv_disk=str(tmp_path / "disk")
    )
    drive(engine, [PROMPT], [Spec(base=("system", 0), suffix=[], max_tokens=1)])
    tiers = engine.kv.tiers
    assert isinstance(tiers, TierLoads)
    engine.kv.flush()
    # Only the first block back in memory: the pin locks it, then continues its match on disk and fails
    # there, with one more block allocated for the load.
    engine.reset_prefix_cache()
    drive(engine, [PROMPT[: BLOCK + 1]], [Spec(base=("system", 0), suffix=[], max_tokens=1)])
    assert BLOCK <= engine.kv.cached_prefix_len("", PROMPT) < 2 * BLOCK

    def broken(*args: Any) -> None:
        raise OSError("the disk went away")

    # A load that fails is a miss: the pin finds the prefix not cached, and holds nothing.
    monkeypatch.setattr(tiers.lower, "fetch", broken)
    assert engine.kv.pin("", PROMPT, 60) is None
    engine.kv.check()
    assert engine.kv.usage().num_locked == 0 and not engine.kv.pins("")
    # Whatever else raises once blocks are locked, they are let go.
    monkeypatch.undo()
    monkeypatch.setattr(PinTable, "add", broken)
    with pytest.raises(OSError):
        engine.kv.pin("", PROMPT, 60)
    monkeypatch.undo()
    engine.kv.check()
    assert engine.kv.usage().num_locked == 0 and not engine.kv.pins("")
    # And the same admission that failed to load from disk runs, computing what it could not load.
    monkeypatch.undo()
    monkeypatch.setattr(tiers.lower, "fetch", broken)
    drive(engine, [PROMPT], [Spec(base=("system", 0), suffix=[1], max_tokens=2)])
    engine.kv.check()


def test_finding_4b_logit_bias_is_turned_into_tensors_once_not_every_step(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_with_blocks(tiny_model, 64, BLOCK)
    vocab = tiny_model.config.vocab_size
    bias = {t: (t % 200) / 2 - 50.0 for t in range(vocab)}
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, logit_bias=bias, n=4)
    for i in range(4):
        engine.add_request(f"b{i}", PROMPT, params.for_sample(i))
    real = torch.tensor
    converted = 0

    def counting(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal converted
        t = real(data, *args, **kwargs)
        converted += t.numel()
        return t

    monkeypatch.setattr(torch, "tensor", counting)
    out = _run_all(engine)
    assert all(len(tokens) == 8 for tokens in out.values())
    # 8 steps of 4 rows with a whole-vocabulary bias: the old sampler converted 4 * vocab entries a step.
    assert converted < vocab, f"{converted} values converted to tensors during the steps"


def test_finding_4a_n_samples_share_one_validation(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expanding n samples re-ran the params' checks per sample (a 49,152-entry bias, 128 times)."""
    checks = 0
    real = SamplingParams.__post_init__

    def counting(self: SamplingParams) -> None:
        nonlocal checks
        checks += 1
        real(self)

    monkeypatch.setattr(SamplingParams, "__post_init__", counting)
    params = SamplingParams(max_tokens=2, n=64, logit_bias={1: 1.0})
    samples = [params.for_sample(i) for i in range(64)]
    assert checks == 1
    assert [s.n for s in samples] == [1] * 64
    assert samples[0].logit_bias == {1: 1.0}


def _fill(async_engine: AsyncEngine, tenant: str, n: int, count: int) -> list[Any]:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=n)
    return [
        async_engine.generate(PROMPT, params.for_sample(i), tenant=tenant)
        for _ in range(count)
        for i in range(n)
    ]


def test_finding_5_one_tenant_fanning_out_cannot_turn_another_away(tiny_model: LoadedModel) -> None:
    engine = engine_with_blocks(tiny_model, 64, BLOCK, max_num_seqs=4, max_waiting=12)

    async def scenario() -> tuple[int, int]:
        async_engine = AsyncEngine(engine)
        try:
            # Tenant A's n=8 requests fill the whole queue (16 sequences: 4 running, 12 waiting).
            flood = _fill(async_engine, "a", 8, 2)
            started = [asyncio.ensure_future(anext(g)) for g in flood]
            await asyncio.sleep(0)
            refused_a = 0
            extra = _fill(async_engine, "a", 1, 1)[0]
            try:
                await anext(extra)
            except EngineOverloadedError:
                refused_a += 1
            served_b = 0
            for _ in range(3):
                async for delta in async_engine.generate(PROMPT, _greedy(), tenant="b"):
                    if delta.finished:
                        served_b += 1
            await asyncio.gather(*started, return_exceptions=True)
            for g in flood:
                await g.aclose()
            return refused_a, served_b
        finally:
            async_engine.shutdown()

    refused_a, served_b = asyncio.run(scenario())
    assert refused_a == 1, "the flooding tenant is over its share and over the total"
    assert served_b == 3


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_finding_5_admission_alternates_between_tenants(tiny_model: LoadedModel) -> None:
    """Tenant A queues 6 requests of n=8 first; tenant B's requests each start within a few steps."""
    engine = engine_with_blocks(tiny_model, 128, BLOCK, max_num_seqs=4, max_num_batched_tokens=64)
    fan = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=8)
    for r in range(6):
        for i in range(8):
            engine.add_request(f"a{r}.{i}", [*PROMPT, r], fan.for_sample(i), tenant="a")
    for r in range(3):
        engine.add_request(f"b{r}", [*PROMPT, 50 + r], _greedy(), tenant="b")
    first_token: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.token_ids:
                first_token.setdefault(delta.request_id, step)
        engine.kv.check()
        step += 1
    waits = [first_token[f"b{r}"] for r in range(3)]
    a_done = max(first_token.values())
    # With 4 running slots and A's 48 sequences ahead, first come first served would start B last.
    assert max(waits) < a_done // 3, (waits, a_done)


def test_refused_values_raise_invalid_request_error_only(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    vocab = engine.model.config.vocab_size
    for field, value in [
        ("logit_bias", {vocab: 1.0}),
        ("logit_bias", {1: float("nan")}),
        ("stop_token_ids", [vocab]),
        ("stop_token_ids", [2**70]),
        ("top_k", vocab + 1),
        ("seed", 2**64),
        ("min_tokens", 10**6),
        ("n", 10**9),
        ("temperature", float("inf")),
        ("repetition_penalty", 1e-300),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=4, **{field: value}))  # type: ignore[arg-type]
        assert e.value.param == field, field
    assert not engine.has_unfinished_requests()


def test_finding_5_over_http_a_tenant_is_served_while_another_holds_the_whole_queue(
    tiny_model: LoadedModel,
    tmp_path: Path,
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server passes the caller's tenant to the engine: tenant a's one n=8 stream holds all 8
    sequences the engine takes in flight, and tenant b is still served (the old engine answered 503)."""
    keys = {"a": "key-aaaaaaaa", "b": "key-bbbbbbbb"}
    key_file = tmp_path / "keys"
    key_file.write_text("".join(f"{t}:{k}\n" for t, k in keys.items()))
    tenants = Tenants(load_or_create_secret(str(tmp_path)), key_file=str(key_file))
    engine = engine_with_blocks(tiny_model, 128, BLOCK, max_num_seqs=2, max_waiting=6)
    # The engine's steps wait at a gate, so the flood stays in flight however fast the tiny model is.
    gate = gate_steps(engine, monkeypatch)
    async_engine = AsyncEngine(engine)
    with serve_app(create_app(async_engine, ServerOptions(), tenants)) as url, ThreadPoolExecutor(2) as pool:

        def post(tenant: str, body: dict[str, Any]) -> httpx.Response:
            auth = {"Authorization": f"Bearer {keys[tenant]}"}
            return httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=120)

        def in_flight(count: int, answered: Future[httpx.Response] | None = None) -> None:
            for _ in range(6000):
                if async_engine.num_in_flight == count:
                    return
                if answered is not None and answered.done():
                    raise AssertionError(f"answered before it was queued: {answered.result().text}")
                threading.Event().wait(0.01)
            raise AssertionError(f"{async_engine.num_in_flight} sequences in flight, expected {count}")

        short = {"prompt": PROMPT, "max_tokens": 2}
        flood = pool.submit(post, "a", {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "n": 8})
        in_flight(8)
        refused = post("a", short)
        assert refused.status_code == 503, refused.text
        served = pool.submit(post, "b", short)
        in_flight(9, served)
        gate.set()
        assert served.result().status_code == 200, served.result().text
        assert served.result().json()["usage"]["completion_tokens"] == 2
        assert flood.result().status_code == 200
